"""Decode speed of each KV-cache configuration against the full-precision cache, in one run:

    python bench/kv_speed.py [--model smollm2 | --random-weights SHAPE] [--device cpu|cuda] [--dtype auto]
                             [--prompt-tokens 100 2000] [--new-tokens 64] [--repeat 3]
                             [--configs fp32,int8,int4,window:1024,h2o:1024,int4+h2o:1024] [--out FILE.json]

For each prompt length, every configuration decodes the same greedy workload (`llmrun bench`'s: the prompt
prefilled into an empty cache, then --new-tokens decoded), rounds alternating over the configurations so that
drift on the machine spreads evenly; the figure is the median decode tok/s and the ratio to the first
configuration's (the baseline: the model's own dtype, no eviction; named `fp32` or `auto`). Budgets are tokens
(`h2o:1024`). The weights are loaded once per prompt length and every configuration's engine (its own cache, and
on CUDA its own graphs) runs on them: an 8B shape's configurations cost seconds each, not a load each.

Writes the JSON (every run's figures, the environment, the load average) to --out (default
bench/runs/DATE-cpuTHREADS-kv-speed.json, on a GPU bench/results/DATE-GPU-kv-speed.json) and the Markdown table
beside it after every round (round 0, the warm-up, is not counted), with "partial": true until the last; prints
the table each time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
from pathlib import Path

import torch

from llmrun import bench
from llmrun.loading import open_model
from llmrun.workloads import make_workload

HERE = Path(__file__).resolve().parent


def settings_for(config: str, base: bench.Settings) -> bench.Settings:
    """`base` (resolved) with the KV cache format and eviction that `config` names."""
    kv, evict, budget = "auto", None, None
    for part in config.split("+"):
        if ":" in part:
            evict, budget = part.split(":")[0], int(part.split(":")[1])
        elif part not in ("fp32", "auto"):
            kv = part
    return dataclasses.replace(base, kv=kv, kv_evict=evict, kv_budget=budget)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--random-weights", metavar="SHAPE", help="random weights of a shape instead of --model")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    p.add_argument("--dtype", default="auto", help="the compute dtype (default: fp32 on a CPU, bf16 on a GPU)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[100, 2000])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--configs", default="fp32,int8,int4,window:1024,h2o:1024,int4+h2o:1024")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores: the timings will be noisy", file=sys.stderr)
    if args.random_weights:
        from llmrun.shapes import random_model_files

        files = random_model_files(args.random_weights)
    else:
        files = open_model(args.model)
    configs = args.configs.split(",")
    if args.out is None:
        date, where = datetime.date.today().isoformat(), f"cpu{args.threads}"
        if bench.resolve(bench.Settings(args.device, args.dtype, "auto", args.threads, 1), 1).device == "cuda":
            where = torch.cuda.get_device_name().replace(" ", "-")
        args.out = HERE / ("runs" if where.startswith("cpu") else "results") / f"{date}-{where}-kv-speed.json"
    done: list[dict] = []  # the rows of the prompt lengths measured
    doc = {"command": " ".join(sys.argv), "model": files.source.spec, "environment": None, "load_average_start": load,
           "threads": args.threads, "new_tokens": args.new_tokens}
    device = "cpu"
    for n in args.prompt_tokens:
        ctx = n + args.new_tokens + 64
        base = bench.resolve(bench.Settings(args.device, args.dtype, "auto", args.threads, ctx), ctx)
        device = base.device
        workload = make_workload(files.tokenizer, prompt_tokens=n, new_tokens=args.new_tokens, repeat=1, warmup=False,
                                 vocab_size=files.config.vocab_size)
        runs = {c: [] for c in configs}
        with bench.torch_threads(base.threads):
            loaded = bench.load(files, base)
            for round_ in range(args.repeat + 1):  # round 0 warms up (compiles, tunes, captures): not counted
                for c in configs:
                    engine = bench.open_engine(files, settings_for(c, base), loaded)
                    try:
                        figures = bench.measure(engine, workload)
                    finally:
                        del engine
                        bench.release(device)
                    print(f"{n} tokens, {c}: {figures['decode_tok_s']['median']:.1f} tok/s"
                          + (f" (round {round_})" if round_ else " (warm-up round, not counted)")
                          + "".join(f"; {note}" for note in figures["notes"]), file=sys.stderr)
                    if round_:
                        runs[c].append(figures)
                if round_:  # written after every round: a run stopped by a time limit keeps what it measured
                    complete = round_ == args.repeat and n == args.prompt_tokens[-1]
                    doc["environment"] = doc.get("environment") or bench.environment(device)  # (a git call: once)
                    write(args.out, doc, configs, done + rows_of(n, configs, runs), complete)
            del loaded
            bench.release(device)
        done += rows_of(n, configs, runs)


def rows_of(n: int, configs: list[str], runs: dict[str, list[dict]]) -> list[dict]:
    """One prompt length's rows: each configuration's median decode tok/s over its rounds, and its ratio to the
    first configuration's."""
    base_tok_s = statistics.median(f["decode_tok_s"]["median"] for f in runs[configs[0]])
    rows = []
    for c in configs:
        tok_s = statistics.median(f["decode_tok_s"]["median"] for f in runs[c])
        rows.append({"prompt_tokens": n, "config": c, "decode_tok_s": tok_s, "ratio": tok_s / base_tok_s,
                     "rounds": len(runs[c]), "runs": runs[c]})
    return rows


def write(out: Path, doc: dict, configs: list[str], rows: list[dict], complete: bool) -> None:
    """The JSON document (`doc` with the rows so far) and its table; `partial` (true until the last round of the
    last prompt length) tells a resumed lease (`bench/gpu.sh`, GPU_RESUME) to measure it again."""
    table = ["| prompt tokens | config | decode tok/s (median) | vs " + configs[0] + " | rounds |", "|---|---|---|---|---|"]
    table += [f"| {r['prompt_tokens']} | {r['config']} | {r['decode_tok_s']:.1f} | {r['ratio']:.2f}x | {r['rounds']} |"
              for r in rows]
    bench.write_run(out, {**doc, "partial": not complete, "rows": rows}, "\n".join(table) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
