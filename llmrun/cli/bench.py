"""`llmrun bench`: one-off measurements of a configuration; side by side with peers (--compare); a ranked grid
of configurations (--sweep)."""

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from llmrun.catalog import complete_model
from llmrun.errors import LlmrunError, UsageError
from llmrun.loading import DEFAULT_MODEL
from llmrun.shapes import SHAPES
from llmrun.workloads import KINDS

from . import app
from .console import current_context, err, open_files, progress_bar, user_errors, write_out
from .options import DEFAULT_CTX_CAP, SPECULATIVE, RunOptions, check_temperature, run_options

WORKLOAD = "Workload"
MAX_PROMPT_TOKENS = 1 << 24  # past any model's context; with --kv-evict (no end) a bound on the prompt built
MODES = "Compare and sweep"
Kind = Enum("Kind", {k.replace("-", "_"): k for k in KINDS}, type=str)
Goal = Enum("Goal", {g: g for g in ("latency", "memory", "quality")}, type=str)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


@app.command()
@user_errors
@run_options(sampling=False, speculative=True)
def bench(
    model: Annotated[Optional[str], typer.Argument(help=f"Model, as for the other commands (default '{DEFAULT_MODEL}'); not with --random-weights.", show_default=False, autocompletion=complete_model)] = None,
    kind: Annotated[Optional[Kind], typer.Option(help="Built-in prompt: open (open-ended question), code-edit (rename in a ~330-token file: copy heavy), summarize (~390-token passage). Default: open.", rich_help_panel=WORKLOAD, show_default=False)] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="Use the text of this file as the prompt instead of a built-in kind.", rich_help_panel=WORKLOAD, show_default=False)] = None,
    prompt_tokens: Annotated[Optional[int], typer.Option(min=1, max=MAX_PROMPT_TOKENS, help="Cut or repeat the prompt to exactly N tokens.", rich_help_panel=WORKLOAD, show_default=False)] = None,
    new_tokens: Annotated[int, typer.Option(min=2, help="Tokens decoded per run (greedy, never stopping early; at least 2: the first comes from the prefill).", rich_help_panel=WORKLOAD)] = 128,
    repeat: Annotated[int, typer.Option(min=1, help="Timed runs; figures are their median (decode also min and max).", rich_help_panel=WORKLOAD)] = 3,
    warmup: Annotated[bool, typer.Option(help="One untimed run first.", rich_help_panel=WORKLOAD)] = True,
    batch: Annotated[int, typer.Option(min=1, help="Sequences decoded together (only 1 today).", rich_help_panel=WORKLOAD)] = 1,
    random_weights: Annotated[Optional[str], typer.Option(metavar="SHAPE", help=f"Random weights in a real model's shape instead of MODEL: {', '.join(SHAPES)}.", rich_help_panel=WORKLOAD, show_default=False, autocompletion=lambda incomplete: [s for s in SHAPES if s.startswith(incomplete)])] = None,
    compare: Annotated[bool, typer.Option("--compare", help="Also run llmrun's eager path (--weights dequant), llama.cpp and transformers (when installed) on the same model, prompt and threads.", rich_help_panel=MODES)] = False,
    sweep: Annotated[bool, typer.Option("--sweep", help="Measure a grid of configurations (dtype x weights by default) and recommend one for --goal.", rich_help_panel=MODES)] = False,
    axis: Annotated[Optional[list[str]], typer.Option(metavar="NAME=V1,V2", help="Sweep these values of an axis (dtype, weights, threads, kv); one --axis per axis.", rich_help_panel=MODES, show_default=False)] = None,
    goal: Annotated[Optional[Goal], typer.Option(help="What the sweep ranks by: latency (decode tok/s), memory (peak), quality (KL to fp32). Default: latency.", rich_help_panel=MODES, show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option(metavar="FILE.png", help="Draw the sweep (needs matplotlib: pip install 'llmrun\\[plot]').", rich_help_panel=MODES, show_default=False)] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the runs with --ngram/--draft (0: greedy; above 0: the default top-k, top-p and min-p, timed run i with seed i).", rich_help_panel=SPECULATIVE)] = 0.0,
    json_out: Annotated[bool, typer.Option("--json", help="Also print one JSON object on stdout (the table goes to stderr either way).")] = False,
    *,
    opts,
):
    """Measure a configuration: time to first token, prefill and decode tok/s, memory, achieved bandwidth.

    Each run prefills the whole prompt into an empty KV cache and decodes exactly --new-tokens tokens greedily.
    With --ngram or --draft, the same workload is decoded plainly and speculatively, runs alternating, and the
    speedup, acceptance rate and tokens per step are reported.
    The table goes to stderr; --json also prints one JSON document on stdout.
    """
    from llmrun import bench as lib
    from llmrun import shapes
    from llmrun.workloads import make_workload, read_prompt_file

    _check_options(model, kind, prompt_file, batch, random_weights, compare, sweep, axis, goal, plot)
    if opts.eviction is not None and opts.ctx is not None:  # as chat and generate: the budget is the cache's size
        raise UsageError(f"--ctx {opts.ctx} with --kv-evict: an evicting cache holds --kv-budget tokens; drop --ctx")
    drafting = _drafting(opts, temperature, random_weights, compare, sweep)
    sweep_axes = _sweep_axes(axis) if sweep else None
    text = read_prompt_file(prompt_file) if prompt_file else None
    files = shapes.random_model_files(random_weights) if random_weights else open_files(model or DEFAULT_MODEL)
    for warning in files.tokenizer.warnings:
        err.print(Text(f"warning: {warning}", style="yellow"))
    trained = files.config.max_seq_len
    if opts.ctx is not None and opts.ctx > trained:
        raise UsageError(f"--ctx {opts.ctx} exceeds the model's context of {trained} tokens")
    ev = opts.eviction
    settings = lib.resolve(lib.Settings(opts.device, opts.dtype, opts.weights, opts.threads, opts.ctx, opts.kv or "auto",
                                        ev and ev.policy, ev and ev.budget, ev.sinks if ev else 4),
                           default_ctx=min(trained, DEFAULT_CTX_CAP))
    if sweep_axes is not None:  # an axis whose option is given stays at its value
        from llmrun.sweep import AXES

        sweep_axes.update({name: (getattr(settings, AXES[name].field),) for name in _given_axes()})
    if ev is None and prompt_tokens is not None:  # before the prompt is built: 10^8 tokens took 2 GB to refuse
        lib.check_fits_context(prompt_tokens, new_tokens, settings.ctx, trained)
    workload = make_workload(
        files.tokenizer, kind=(kind or Kind.open).value, text=text,
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeat=repeat, warmup=warmup,
        vocab_size=files.config.vocab_size if random_weights else None,
    )
    if ev is None:  # an evicting cache has no end
        lib.check_fits_context(len(workload.prompt), new_tokens, settings.ctx, trained)
    name = files.source.spec
    with progress_bar(f"bench {name}") as update:
        doc = lib.benchmark(files, settings, workload, model=name, compare=compare, sweep_axes=sweep_axes,
                            goal=(goal or Goal.latency).value, drafting=drafting, progress=update)
    if plot is not None:
        from llmrun.sweep import plot as draw

        draw(doc["sweep"], doc["recommended"], plot, f"{name}: {workload.kind} prompt, {len(workload.prompt)} + {new_tokens} tokens")
    _render(doc)
    if json_out:
        write_out(json.dumps(doc) + "\n")
    if plot is not None:
        err.print(Text(f"plot: {plot}", style="dim"))


def _bad(option: str, message: str):
    return typer.BadParameter(message, param_hint=f"'{option}'")


def _check_options(model, kind, prompt_file, batch, random_weights, compare, sweep, axis, goal, plot) -> None:
    """Every check that needs no model, so a wrong command fails at once."""
    if batch > 1:
        raise _bad("--batch", "batch > 1 is not supported yet (the engine decodes one sequence at a time); use --batch 1")
    if random_weights is not None:
        if model is not None:
            raise _bad("--random-weights", f"give a MODEL or --random-weights SHAPE, not both (got {model!r} and {random_weights!r})")
        if random_weights not in SHAPES:
            raise _bad("--random-weights", f"unknown shape {random_weights!r}; choose one of {', '.join(SHAPES)}")
    if prompt_file is not None and kind is not None:
        raise _bad("--prompt-file", "--prompt-file replaces the built-in --kind prompts; give one of them")
    if compare and sweep:
        raise _bad("--compare", "--compare and --sweep are separate runs; give one of them")
    for option, given in (("--axis", axis), ("--goal", goal), ("--plot", plot)):
        if given and not sweep:
            raise _bad(option, f"{option} applies to a sweep; add --sweep")
    if plot is not None:
        if plot.suffix.lower() not in PLOT_SUFFIXES:
            raise _bad("--plot", f"{plot}: the file name must end in {', '.join(PLOT_SUFFIXES)}")
        if not plot.parent.is_dir():
            raise _bad("--plot", f"{plot}: the folder {plot.parent} does not exist")
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise LlmrunError("--plot needs matplotlib; install it with: pip install 'llmrun[plot]'")


def _drafting(opts, temperature: float, random_weights, compare: bool, sweep: bool):
    """The speculative runs' settings (`bench_speculative.Drafting`), or None without --ngram/--draft; checks
    the options that only make sense with, or without, a drafter."""
    check_temperature(temperature)
    if opts.draft is None and opts.ngram is None:
        for option, given in (("--temperature", temperature > 0), ("--draft-tokens", opts.draft_tokens != RunOptions.draft_tokens),
                              ("--fixed-k", opts.adaptive != RunOptions.adaptive)):
            if given:
                raise _bad(option, f"{option} applies to speculative runs; add --ngram or --draft (plain runs are greedy)")
        return None
    for option, given in (("--compare", compare), ("--sweep", sweep)):
        if given:
            raise _bad(option, f"{option} and --ngram/--draft are separate runs (a drafter is measured against plain"
                               " decoding); give one of them")
    if random_weights is not None:
        raise _bad("--random-weights", "random weights write no text worth drafting; measure --ngram/--draft on a real model")
    from llmrun.bench_speculative import Drafting

    return Drafting(opts.draft, opts.ngram, opts.draft_tokens, opts.adaptive, temperature)


def _sweep_axes(specs) -> dict:
    from llmrun.sweep import AXES, parse_axes

    try:
        axes = parse_axes(specs or [])
    except LlmrunError as e:
        raise _bad("--axis", str(e).removeprefix("--axis ")) from None
    for name in _given_axes():
        if name in axes:
            raise _bad("--axis", f"{name} is set by {AXES[name].flag} too; give its values in one place: "
                                 f"--axis {name}=V1,V2, or {AXES[name].flag} alone to keep it fixed")
    return axes


def _given_axes() -> list[str]:
    """The sweep's axes whose option the command line gives (`--dtype bf16`): the sweep keeps them at that value."""
    from llmrun.sweep import AXES

    context = current_context()
    return [name for name, axis in AXES.items()
            if (source := context.get_parameter_source(axis.field)) is not None and source.name != "DEFAULT"]


# --- rendering --------------------------------------------------------------------------------------------------


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def _tok_s(value) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}x"


def _render(doc: dict) -> None:
    from llmrun.memory import human_bytes

    c, w, mem = doc["config"], doc["workload"], doc["memory"]
    decode = doc["decode_tok_s"]
    kv = "" if c["kv"] in ("auto", c["dtype"]) else f" --kv {c['kv']}"
    size = (f"ctx {c['ctx']}" if c["kv_evict"] is None  # an evicting cache holds its budget, whatever --ctx
            else f"--kv-evict {c['kv_evict']} --kv-budget {c['kv_budget']} --kv-sinks {c['kv_sinks']}")
    title = (f"llmrun bench {doc['model']}: {c['device']} {c['dtype']} --weights {c['weights']}{kv}, {_threads(c['threads'])},"
             f" {size} · {w['kind']} prompt, {w['prompt_tokens']} + {w['new_tokens']} tokens,"
             f" {w['repeat']} run{'s' if w['repeat'] > 1 else ''}{'' if w['warmup'] else ', no warm-up'}")
    table = Table(title=title, show_header=False, title_justify="left")
    peak = f"process RSS {human_bytes(mem['process_peak_rss'])}"
    if mem["device_peak_allocated"] is not None:
        peak = (f"GPU allocated {human_bytes(mem['device_peak_allocated'])}, reserved"
                f" {human_bytes(mem['device_peak_reserved'])}; {peak}")
    rows = [
        ("time to first token", f"{doc['ttft_s'] * 1000:,.1f} ms"),
        ("prefill", f"{_tok_s(doc['prefill_tok_s'])} tok/s"),
        ("decode", f"{_tok_s(decode['median'])} tok/s (median; min {_tok_s(decode['min'])}, max {_tok_s(decode['max'])})"),
        ("end to end", f"{_tok_s(doc['e2e_tok_s'])} tok/s"),
        ("weights", f"{human_bytes(doc['weight_bytes'])} ({doc['weights_loaded']})"),
        ("KV cache", f"{human_bytes(doc['kv_bytes_per_token'])}/token; {human_bytes(doc['kv_bytes_in_use'])} in use"
                     f" of {human_bytes(mem['kv_allocated'])}"),
        ("peak memory", peak),
        ("read per token", human_bytes(doc["bytes_per_token"])),
        ("bandwidth", f"{doc['bandwidth_gb_s']:.2f} GB/s = {doc['bandwidth_share']:.0%} of"
                      f" {doc['bandwidth_peak_gb_s']:.1f} GB/s (measured copy)"),
        *_speculative_rows(doc),
    ]
    for key, value in rows:
        table.add_row(key, value)
    err.print(table)
    if doc["compare"] is not None:
        err.print(_compare_table(doc["compare"], doc["config"]))
    if doc["sweep"] is not None:
        err.print(_sweep_table(doc["sweep"]))
        for r in doc["sweep"]:
            if r["error"]:
                err.print(Text(f"#{r['rank']} {r['flags']} failed: {r['error']}", style="red"))
        best = doc["recommended"]
        if best is not None:
            err.print(Text(f"recommended for {best['goal']}: {best['flags']}", style="bold"))
            err.print(Text(f"  e.g. llmrun chat {doc['model']} {best['flags']}" if not doc["model"].startswith("random:")
                           else "  (random weights: for speed only)", style="dim"))
    for note in doc["notes"]:
        err.print(Text(f"note: {note}", style="yellow"))


def _speculative_rows(doc: dict) -> list[tuple[str, str]]:
    s = doc["speculative"]
    if s is None:
        return [("speculative", "off")]
    sampling = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']:g}, seeds {s['seeds'][0]}.."
    rate = "no draft tokens" if doc["acceptance_rate"] is None else f"acceptance {doc['acceptance_rate']:.0%}"
    rows = [
        ("speculative", f"{s['drafter']}, K ≤ {s['max_k']} {'adaptive' if s['adaptive'] else 'fixed'}"
                        f" (final K {s['mean_final_k']:g} on average), {sampling}"),
        ("drafting", f"{rate}, {doc['tokens_per_step']:.2f} tokens/step"),
        ("speedup", f"{s['speedup']:.2f}x: decode {_tok_s(s['speculative_decode_tok_s'])} tok/s vs"
                    f" {_tok_s(s['plain_decode_tok_s'])} plain (medians, same workload)"),
    ]
    if s["draft_weight_bytes"] is not None:
        from llmrun.memory import human_bytes

        rows.append(("draft memory", f"weights {human_bytes(s['draft_weight_bytes'])},"
                                     f" KV cache {human_bytes(s['draft_kv_bytes'])}"))
    return rows


def _compare_table(rows: list[dict], config: dict) -> Table:
    title = (f"side by side: same prompt ids, {config['device']}, {_threads(config['threads'])}, ctx {config['ctx']}"
             " (ratios: speed / llmrun's)")
    table = Table(title=title, title_justify="left")
    for header in ("engine", "config", "TTFT ms", "prefill tok/s", "decode tok/s", "e2e tok/s", "decode", "prefill"):
        table.add_column(header, justify="left" if header in ("engine", "config") else "right")
    for r in rows:
        name = r["name"] + (f" {r['version']}" if r["version"] else "")
        if r["skipped"] is not None:
            table.add_row(name, Text(f"skipped: {r['skipped']}", style="dim"), *[""] * 6)
            continue
        table.add_row(name, r["config"], f"{r['ttft_s'] * 1000:,.1f}", _tok_s(r["prefill_tok_s"]),
                      _tok_s(r["decode_tok_s"]["median"]), _tok_s(r["e2e_tok_s"]), _ratio(r["decode_ratio"]),
                      _ratio(r["prefill_ratio"]))
    return table


def _sweep_table(rows: list[dict]) -> Table:
    from llmrun.memory import human_bytes
    from llmrun.sweep import peak_memory

    table = Table(title="sweep, best first", title_justify="left")
    for header in ("#", "flags", "decode tok/s", "TTFT ms", "prefill tok/s", "peak memory", "weights", "KL", "top-1"):
        table.add_column(header, justify="left" if header == "flags" else "right")
    for r in rows:
        if r["error"]:
            table.add_row(str(r["rank"]), r["flags"], Text("failed", style="red"), *[""] * 6)  # why: below the table
            continue
        table.add_row(
            str(r["rank"]), r["flags"], _tok_s(r["decode_tok_s"]["median"]), f"{r['ttft_s'] * 1000:,.1f}",
            _tok_s(r["prefill_tok_s"]), human_bytes(peak_memory(r)), f"{human_bytes(r['weight_bytes'])} {r['weights_loaded']}",
            "—" if r["kl"] is None else f"{r['kl']:.4f}",
            "—" if r["top1_agreement"] is None else f"{r['top1_agreement']:.0%}",
        )
    return table
