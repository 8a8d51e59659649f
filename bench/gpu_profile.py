"""Where a decode step's time goes: the step through CUDA graphs and eagerly, against the sum of its kernels' own
times and the bandwidth floor, and the kernels that take it, in one run:

    python bench/gpu_profile.py [--random-weights llama3.2-1b | MODEL] [--weights auto|int4] [--kv KV]
                                [--prompt-tokens 128] [--ctx 8192] [--steps 32] [--prefill] [--speculation]
                                [--out FILE.json]

The step is llmrun's own decode step (`Engine.decode`) at a fixed position: the cache is rolled back after each,
so every timed step attends over the same keys. Timed with device events, median of --steps after a warm-up:
  graph   the step as llmrun runs it (a CUDA graph replayed; eager where graphs are off)
  eager   the same step with graphs off: launch overheads on top of the kernels
  kernels the sum of the step's kernels' own durations (torch.profiler over one step as the graph replays it; over
          an eager step where graphs are off or the profiler sees no kernel inside the replay), and how many
          it launches. An eager step writes the cache by the host path (no fused writes): other kernels.
  floor   the bytes a step must read (weights once, the cache's keys in use) over a device copy's bandwidth
  loop    a reply's decode loop (`Engine.plain_steps`, --steps tokens from the same position, wall time a token,
          median of 3 runs each way, taking turns): greedy pipelined (each step enqueued before the host reads the
          token it feeds), greedy fed from the host (each step waits for the host's round trip), and sampled at
          T 0.8 pipelined (with the share of its steps run twice: draws that left the top-k survivors), against
          the graph step; and one draw at T 0.8 made eagerly, profiled: its kernels' own time and launches
  speculation  (--speculation) a reply decoded with prompt lookup at K = 1, 3, 7, every draft taken (its
          lookups replayed from a reply that copies the prompt): wall time a step against its block's forward
          alone, the rest being the step's verification, lookup and launch on the host while the device waits
graph - kernels is time the GPU spends between kernels (or short of the bandwidth a kernel could draw): what
fusing launches would win; kernels - floor, what faster kernels would. The table of kernels groups them by name.
On a CPU the same runs, with the profiler's operators in place of kernels (a check that the script works).
With --prefill, the prompt's prefill instead (into an empty cache, --steps 3 by default): its wall time against
its kernels' own durations (the gap is the host: Python, small-op launches, syncs), the kernels by time, and the
host operators by their own CPU time (the profiler's self time) - where a prefill that runs far below its
kernels' rate (an INT4 cache's) spends it.
Writes the JSON to --out (default bench/results/DATE-DEVICE-profile-MODEL[-prefill].json) and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from llmrun import bench
from llmrun.bench import copy_bandwidth, weight_bytes_read_per_token
from llmrun.workloads import make_workload

HERE = Path(__file__).resolve().parent


def timed_steps(engine, token: int, steps: int, block: int = 1) -> list[float]:
    """Seconds of `steps` forwards of `block` tokens (a decode step; more: a verification block), each from the same
    cache length (rolled back after it)."""
    length = len(engine.tokens)
    cuda = engine.device.type == "cuda"
    times = []
    for _ in range(steps + 2):  # the first two: warm-up (a graph's capture, autotuning)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine.forward([token] * block, last_only=block == 1)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            engine.forward([token] * block, last_only=block == 1)
            times.append(time.perf_counter() - t0)
        engine.rollback(length)
    return times[2:]


SPECULATION_K = (1, 3, 7)  # draft tokens a block: blocks of 2, 4 and 8 tokens


def timed_speculation(engine, positions: int, tokens: int, steps: int, runs: int = 3) -> dict[int, dict]:
    """What a speculative step costs beyond its forward: for each K of SPECULATION_K, `runs` replies of `tokens`
    tokens decoded with prompt lookup at that K (fixed), after a prompt of `positions` distinct tokens, every lookup
    right (the reply copies the prompt, replayed: `llmrun.replay.ReplayedLookup`, whatever the weights say), so each
    step after the first few verifies a block of K + 1 tokens and takes them all. -> K: {"block_s": wall seconds
    from the start of such a step's forward to the next's (median over the runs' full blocks; not the first steps,
    before the lookup matches, nor the last, cut short by the reply's end), "device_s": the block's forward alone
    (device events, as `timed_steps`, median of `steps`), "tokens_per_step": the reply's, every step counted};
    block_s - device_s is the step's time outside its forward: its verification, the host's lookup and launch,
    the device idle; "kernels" and "launches": the block's forward's kernels as its graph replays them (`profiled`)."""
    from llmrun.replay import Reply, ReplayedLookup
    from llmrun.sampling import SamplingParams
    from llmrun.speculative import DraftLength, Speculator

    vocab = engine.model.config.vocab_size
    prompt = [(100 + i) % vocab for i in range(positions)]
    reply = Reply(tuple(prompt), tuple(prompt[i % positions] for i in range(tokens)), 0.0, -1)
    params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    figures, forward, starts = {}, engine.forward, []

    def timed_forward(ids, last_only=True):
        starts.append((time.perf_counter(), len(ids)))
        return forward(ids, last_only)

    engine.forward = timed_forward
    try:
        for k in SPECULATION_K:
            drafter, block_s = ReplayedLookup(), []
            for i in range(runs + 1):  # the first: warm-up (its blocks' graphs captured)
                engine.speculator = Speculator(drafter, DraftLength(k, adaptive=False), drafter.follow(reply))
                starts.clear()
                try:
                    generation = engine.generate(prompt, params)
                    list(generation)
                finally:
                    engine.speculator = None
                if i:
                    block_s += [b - a for (a, n), (b, _) in zip(starts, starts[1:]) if n == k + 1]
            stats = generation.stats
            engine.prefill(prompt)
            device = timed_steps(engine, prompt[-1], steps, block=k + 1)
            length = len(engine.tokens)  # the block's own kernels, as its graph replays them
            table, launches = profiled(engine, lambda n=k + 1: forward([prompt[-1]] * n, last_only=False))
            engine.rollback(length)
            figures[k] = {"block_s": statistics.median(block_s), "device_s": statistics.median(device),
                          "tokens_per_step": stats.decode_tokens / stats.decode_steps, "kernels": table,
                          "launches": launches}
    finally:
        del engine.forward
    return figures


def block_kernel_lines(table: list[dict], launches: int, speculation: dict, top: int) -> list[str]:
    """A markdown table of the one-token step's kernels beside each speculative block's (`timed_speculation`'s
    "kernels"): microseconds and calls of each kernel name, the step's slowest first, then the blocks' others."""
    blocks = [(k, {r["kernel"]: r for r in v["kernels"]}) for k, v in speculation.items()]
    by_time = [r["kernel"] for _, rows in blocks for r in sorted(rows.values(), key=lambda r: -r["us"])]
    names = list(dict.fromkeys([r["kernel"] for r in table] + by_time))
    step = {r["kernel"]: r for r in table}

    def cell(r):
        return "-" if r is None else f"{r['us']:.1f} ({r['calls']})"

    def total(rows, n):
        return f"{sum(r['us'] for r in rows.values()):.1f} ({n})"

    heads = " | ".join(f"K = {k} ({k + 1} tokens)" for k, _ in blocks)
    return [
        f"| kernel: us (calls) | a step (1 token) | {heads} |",
        "|---|---|" + "---|" * len(blocks),
        f"| all | {total(step, launches)} | "
        + " | ".join(total(rows, speculation[k]["launches"]) for k, rows in blocks) + " |",
        *(f"| `{name[:90]}` | {cell(step.get(name))} | " + " | ".join(cell(rows.get(name)) for _, rows in blocks)
          + " |" for name in names[:top]),
    ]


def timed_loops(engine, token: int, steps: int, runs: int = 3) -> dict[str, float]:
    """Wall seconds a token of a reply's decode loop (`Engine.plain_steps`, `steps` tokens from the cache's length,
    rolled back after): greedy pipelined ("pipelined"), greedy fed from the host ("host_fed") and sampled at T 0.8
    pipelined ("sampled"), each the median over `runs`, the three taking turns after an untimed run each; and
    "sampled_reruns", the share of the sampled runs' steps fed ahead and run again (a draw that left the top-k
    survivors for the whole vocabulary: `sampling.Ahead.read`)."""
    from llmrun.sampling import Randomness, SamplingParams

    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8)
    modes = [("pipelined", True, greedy), ("host_fed", False, greedy), ("sampled", True, sampled)]
    length, was = len(engine.tokens), engine.pipeline
    times, reruns = {name: [] for name, _, _ in modes}, {name: 0 for name, _, _ in modes}
    rollback = engine.rollback
    for i in range(len(modes) * (runs + 1)):
        name, engine.pipeline, params = modes[i % len(modes)]
        _sync(engine)
        # inside the loop, a rollback is a step fed ahead with another token than its draw's
        engine.rollback = lambda n, name=name: (reruns.__setitem__(name, reruns[name] + 1), rollback(n))
        t0 = time.perf_counter()
        try:
            for _ in engine.plain_steps(token, params, Randomness(i), steps):
                pass
            _sync(engine)
        finally:
            del engine.rollback
        if i >= len(modes):
            times[name].append((time.perf_counter() - t0) / steps)
        engine.rollback(length)
    engine.pipeline = was
    figures = {name: statistics.median(v) for name, v in times.items()}
    figures["sampled_reruns"] = reruns["sampled"] / ((runs + 1) * steps)
    return figures


def sampling_table(engine, token: int) -> tuple[list[dict], int]:
    """(rows by kernel name, as `kernel_table`'s; launches) of one draw at T 0.8 from a step's logits (its
    survivors, filters and pick, and the copy of its token) made eagerly: each of its kernels, which the decode loop
    replays from a graph (`cuda_graphs.DrawGraphs`) where graphs are on."""
    from llmrun.sampling import Ahead, Randomness, SamplingParams

    length = len(engine.tokens)
    logits = engine.decode(token)
    engine.rollback(length)
    params = SamplingParams(temperature=0.8)
    Ahead(logits, params, Randomness(0).at(length)).read()  # once untimed: the first call's allocations
    return profiled(engine, lambda: Ahead(logits, params, Randomness(0).at(length)).read())


def timed_prefills(engine, prompt: list[int], runs: int) -> list[float]:
    """Wall seconds of `runs` prefills of `prompt` into an empty cache (after one untimed: compiling, tuning)."""
    times = []
    for _ in range(runs + 1):
        engine.reset()
        _sync(engine)
        t0 = time.perf_counter()
        engine.prefill(prompt)
        _sync(engine)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def prefill_tables(engine, prompt: list[int]) -> tuple[list[dict], int, list[dict]]:
    """One prefill under the profiler: (its device kernels by name, their launches, its host operators by self CPU
    time), slowest first."""
    from torch.profiler import ProfilerActivity, profile

    engine.reset()
    cuda = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        engine.prefill(prompt)
        _sync(engine)
    table, launches = by_name(ev for ev in prof.events() if cuda and ev.device_type.name == "CUDA")
    host = [{"op": e.key, "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1)}
            for e in prof.key_averages() if e.self_cpu_time_total > 0]
    host.sort(key=lambda r: -r["self_cpu_us"])
    return table, launches, host


def prefill_main(args, engine, workload, name: str, settings) -> int:
    """--prefill: the prompt's prefill, its wall time against its kernels' and the host's."""
    with torch.inference_mode():
        wall = statistics.median(timed_prefills(engine, workload.prompt, args.steps or 3))
        table, launches, host = prefill_tables(engine, workload.prompt)
    kernels_s = sum(r["us"] for r in table) / 1e6
    tokens = len(workload.prompt)
    doc = {"model": name, "config": vars(settings) | {"prompt_tokens": tokens}, "mode": "prefill",
           "prefill_s": wall, "prefill_tok_s": tokens / wall, "kernels_s": kernels_s, "launches": launches,
           "kernels": table, "host_ops": host[:40], "environment": bench.environment(engine.device.type),
           "command": " ".join(["python", *sys.argv])}
    lines = [
        f"{name}: {settings.device} {settings.dtype} --weights {settings.weights} --kv {settings.kv}, prefill of "
        f"{tokens} tokens, median of {args.steps or 3}",
        "",
        f"prefill {wall * 1e3:.1f} ms ({tokens / wall:.0f} tok/s); its kernels {kernels_s * 1e3:.1f} ms "
        f"({launches} launches); the rest, {max(wall - kernels_s, 0) * 1e3:.1f} ms, between kernels (the host)"
        if engine.device.type == "cuda" else f"prefill {wall * 1e3:.1f} ms ({tokens / wall:.0f} tok/s) on a CPU: "
        "no device kernels; the host operators below leave out the C kernels' own calls",
        "",
        "| kernel | calls | ms | share |",
        "|---|---|---|---|",
        *(f"| `{r['kernel'][:90]}` | {r['calls']} | {r['us'] / 1e3:.1f} | {r['us'] / 1e6 / max(kernels_s, 1e-12):.0%} |"
          for r in table[: args.top]),
        "",
        "| host operator | calls | self CPU ms |",
        "|---|---|---|",
        *(f"| `{r['op'][:90]}` | {r['calls']} | {r['self_cpu_us'] / 1e3:.1f} |" for r in host[: args.top]),
    ]
    bench.write_run(args.out or _default_out(doc, settings, name, "-prefill"), doc, "\n".join(lines) + "\n")
    return 0


def _default_out(doc, settings, name: str, suffix: str = "") -> Path:
    device = doc["environment"]["device_name"].replace(" ", "-") if settings.device == "cuda" else "cpu"
    safe = name.replace(":", "-").replace("/", "-")
    return HERE / "results" / f"{datetime.date.today()}-{device}-profile-{safe}{suffix}.json"


def kernel_table(engine, token: int) -> tuple[list[dict], int]:
    """(rows by kernel name: calls and microseconds per step, slowest first; kernels a step launches) of one decode
    step as the engine runs it (a graph's replay, or eager). On a CPU, the profiler's top-level operators."""
    length = len(engine.tokens)
    table = profiled(engine, lambda: engine.decode(token))
    engine.rollback(length)
    return table


def profiled(engine, run) -> tuple[list[dict], int]:
    """(rows by kernel name, the events' number) of `run()` under the profiler: its kernels on a GPU, its
    top-level operators on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        _sync(engine)
    return by_name(ev for ev in prof.events()
                   if (ev.device_type.name == "CUDA") == cuda and (cuda or ev.cpu_parent is None))


def by_name(events) -> tuple[list[dict], int]:
    """Profiler events grouped by name -> (rows: calls and microseconds, slowest first; the events' number)."""
    rows: dict[str, list[float]] = {}
    for ev in events:
        rows.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    table = [{"kernel": name, "calls": len(us), "us": round(sum(us), 1)} for name, us in rows.items()]
    table.sort(key=lambda r: -r["us"])
    return table, sum(r["calls"] for r in table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2", help="a model, as for `llmrun bench` (default smollm2)")
    parser.add_argument("--random-weights", metavar="SHAPE", help="random weights of a shape instead of MODEL")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="auto", help="auto | int4 | dequant (default auto)")
    parser.add_argument("--kv", default="auto", help="the KV cache format (default: the compute dtype)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="cache positions each step attends to")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--steps", type=int, help="timed steps each way (default 32; --prefill: 3 prefills)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    parser.add_argument("--prefill", action="store_true", help="profile the prompt's prefill, not a decode step")
    parser.add_argument("--speculation", action="store_true", help="also time speculative steps that take every"
                        " draft, at K = 1, 3, 7, against their forwards")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from llmrun.loading import open_model
    from llmrun.shapes import random_model_files

    files = random_model_files(args.random_weights) if args.random_weights else open_model(args.model)
    settings = bench.resolve(bench.Settings(args.device, args.dtype, args.weights, None, args.ctx, args.kv),
                             default_ctx=args.ctx)
    engine = bench.open_engine(files, settings)
    workload = make_workload(engine.tokenizer, prompt_tokens=args.prompt_tokens, new_tokens=2,
                             vocab_size=files.config.vocab_size)
    name = args.random_weights and f"random:{args.random_weights}" or args.model
    if args.prefill:
        return prefill_main(args, engine, workload, name, settings)
    args.steps = args.steps or 32
    with torch.inference_mode():
        engine.prefill(workload.prompt)
        token = workload.prompt[-1]
        graph = timed_steps(engine, token, args.steps)
        loops = timed_loops(engine, token, args.steps)
        sampling, sampling_launches = sampling_table(engine, token)
        table, launches = kernel_table(engine, token) if engine.graphs is not None else ([], 0)
        kernels_of = "graph replay"
        graphs, engine.graphs = engine.graphs, None
        eager = timed_steps(engine, token, args.steps)
        if not launches:  # graphs off, or kernels inside a replay unseen by this profiler
            table, launches = kernel_table(engine, token)
            kernels_of = "eager step"
        engine.graphs = graphs
        speculation = {}
        if args.speculation:
            speculation = timed_speculation(engine, args.prompt_tokens, max(3 * args.steps, 16), args.steps)
            engine.prefill(workload.prompt)  # the cache the figures below count, as the steps above had it
    kv_per_token = engine.cache.nbytes // engine.cache.max_len
    read = weight_bytes_read_per_token(engine.loaded) + kv_per_token * (len(engine.tokens) + 1)
    bandwidth = copy_bandwidth(engine.device.type)
    figures = {
        "graph_step_s": statistics.median(graph), "eager_step_s": statistics.median(eager),
        "kernels_step_s": sum(r["us"] for r in table) / 1e6, "launches": launches, "kernels_of": kernels_of,
        "bytes_per_step": read, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "floor_step_s": read / bandwidth,
        "loop_pipelined_step_s": loops["pipelined"], "loop_host_fed_step_s": loops["host_fed"],
        "loop_sampled_step_s": loops["sampled"], "loop_sampled_reruns": loops["sampled_reruns"],
        "sampling_s": sum(r["us"] for r in sampling) / 1e6, "sampling_launches": sampling_launches,
        "speculation": {str(k): v for k, v in speculation.items()},
    }
    doc = {"model": name, "config": vars(settings) | {"prompt_tokens": args.prompt_tokens},
           "graphs": graphs is not None and not graphs.failed, **figures, "kernels": table, "sampling": sampling,
           "environment": bench.environment(engine.device.type),
           "command": " ".join(["python", *sys.argv])}
    ms = lambda s: f"{s * 1e3:.3f} ms"  # noqa: E731
    lines = [
        f"{name}: {settings.device} {settings.dtype} --weights {settings.weights} --kv {settings.kv}, "
        f"{len(engine.tokens)} cached positions, median of {args.steps} steps",
        "",
        "| step | time | vs floor |",
        "|---|---|---|",
        *(f"| {label} | {ms(figures[key])} | {figures[key] / figures['floor_step_s']:.2f}x |" for label, key in
          (("graph" if doc["graphs"] else "graph (off: eager)", "graph_step_s"), ("eager", "eager_step_s"),
           (f"kernels ({launches} launches, {kernels_of})", "kernels_step_s"), ("floor", "floor_step_s"),
           ("decode loop, pipelined (a token)", "loop_pipelined_step_s"),
           ("decode loop, fed from the host (a token)", "loop_host_fed_step_s"),
           ("decode loop, pipelined, T 0.8 (a token)", "loop_sampled_step_s"),
           (f"a draw at T 0.8 made eagerly, its kernels ({sampling_launches} launches)", "sampling_s"))),
        "",
        f"T 0.8: {loops['sampled_reruns']:.1%} of the sampled loop's steps fed ahead and run again (a draw over the "
        "whole vocabulary)",
        "",
        f"floor: {read / 1e9:.3f} GB a step at {figures['copy_bandwidth_gb_s']} GB/s (a device copy, this run)",
        "",
        *([] if not speculation else [
        "| speculative step, every draft taken (prompt lookup) | a step | its forward alone | outside it | a step, in"
        " pipelined tokens | speedup |",
        "|---|---|---|---|---|---|",
        *(f"| K = {k} ({k + 1} tokens) | {ms(v['block_s'])} | {ms(v['device_s'])} | {ms(v['block_s'] - v['device_s'])}"
          f" | {v['block_s'] / plain:.2f} | {(k + 1) * plain / v['block_s']:.2f}x |"
          for k, v in speculation.items() for plain in [figures["loop_pipelined_step_s"]]),
        "",
        "(a step: a full block's, from its forward's start to the next's; speedup: its K + 1 tokens against the"
        " pipelined loop's)", "", *block_kernel_lines(table, launches, speculation, args.top), ""]),
        "| kernel | calls | us / step | share |",
        "|---|---|---|---|",
        *(f"| `{r['kernel'][:90]}` | {r['calls']} | {r['us']:.1f} | "
          f"{r['us'] / 1e6 / max(figures['kernels_step_s'], 1e-12):.0%} |" for r in table[: args.top]),
        "",
        "| a draw's kernel (T 0.8, eager) | calls | us | share |",
        "|---|---|---|---|",
        *(f"| `{r['kernel'][:90]}` | {r['calls']} | {r['us']:.1f} | "
          f"{r['us'] / 1e6 / max(figures['sampling_s'], 1e-12):.0%} |" for r in sampling[: args.top]),
    ]
    bench.write_run(args.out or _default_out(doc, settings, name), doc, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
