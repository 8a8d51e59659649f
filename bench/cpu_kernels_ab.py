"""The CPU kernels of two commits side by side: decode speed of the same model and workloads with
`kernels/cpu_kernels.c` as committed at --old and as it is in the working tree, in one run:

    python bench/cpu_kernels_ab.py --old REV [--model smollm2] [--rounds 3] [--steps 48] [--threads 2]
                                   [--cases 100:1,2000:1,300:8] [--out FILE.json]

Each case PROMPT:T prefills PROMPT random token ids, then times --steps steps: one greedy token each for T = 1
(plain decoding), or a forward of T tokens whose cache is rolled back to one new token for T > 1 (a speculative
verification block, every draft accepted but the last). Every measurement runs in a fresh process, which builds
(once, cached) and loads its kernel source; rounds alternate old and new so that drift on the machine falls on
both. Only the C file differs between the two sides: the Python around it is the working tree's, so --old must
name a commit whose kernels have the same entry points.

Prints the medians and ratios; writes the JSON (every round, the environment) to --out, default
bench/runs/DATE-cpuTHREADS-kernels-ab.json, and the Markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import sys, time
from pathlib import Path
import torch
import llmrun.kernels.cpu as cpu
cpu.SOURCE = Path(sys.argv[1])  # before the library is first built or loaded
from llmrun.generate import Engine
from llmrun.loading import load_model

model, prompt_tokens, T, steps, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
loaded = load_model(model, device="cpu", dtype="fp32")
assert cpu.available() and loaded.weights == "packed", cpu.unavailable_reason()
engine = Engine(loaded, prompt_tokens + steps + T + 8)
vocab = loaded.model.config.vocab_size
ids = torch.randint(100, vocab - 100, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
token = int(engine.prefill(ids)[0].argmax())
start = time.perf_counter()
for _ in range(steps):
    if T == 1:
        token = int(engine.decode(token).argmax())
    else:
        length = len(engine.tokens)
        engine.forward([token] * T, last_only=False)
        engine.rollback(length + 1)
print(steps / (time.perf_counter() - start))
"""


def measure(source: Path, model: str, prompt_tokens: int, T: int, steps: int, threads: int) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, str(source), model, str(prompt_tokens), str(T), str(steps),
                           str(threads)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {done.stderr.strip().splitlines()[-1:]}")
    return float(done.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the commit whose kernels/cpu_kernels.c is the baseline")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="100:1,2000:1,300:8", help="PROMPT:T,... (T > 1: verification blocks)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from llmrun import bench

    old_text = subprocess.run(["git", "show", f"{args.old}:kernels/cpu_kernels.c"], capture_output=True, text=True,
                              cwd=HERE.parent)
    if old_text.returncode:
        sys.exit(f"cannot read kernels/cpu_kernels.c at {args.old}: {old_text.stderr.strip()}")
    old = Path(tempfile.mkdtemp(prefix="llmrun-ab-")) / "cpu_kernels.c"
    old.write_text(old_text.stdout)
    sides = {"old": old, "new": HERE.parent / "kernels" / "cpu_kernels.c"}
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    runs = {(n, T, side): [] for n, T in cases for side in sides}
    for round_ in range(args.rounds):
        for n, T in cases:
            for side, source in sides.items():
                runs[n, T, side].append(measure(source, args.model, n, T, args.steps, args.threads))
                print(f"round {round_ + 1}: prompt {n}, T {T}, {side}: {runs[n, T, side][-1]:.1f} steps/s",
                      file=sys.stderr)
    old_rev = subprocess.run(["git", "rev-parse", "--short", args.old], capture_output=True, text=True,
                             cwd=HERE.parent).stdout.strip()
    table = [f"| context | tokens a step | old ({old_rev}) steps/s | new steps/s | new / old |", "|---|---|---|---|---|"]
    rows = []
    for n, T in cases:
        o, w = statistics.median(runs[n, T, "old"]), statistics.median(runs[n, T, "new"])
        rows.append({"prompt_tokens": n, "T": T, "old": runs[n, T, "old"], "new": runs[n, T, "new"],
                     "old_median": o, "new_median": w, "ratio": w / o})
        table.append(f"| {n} | {T} | {o:.1f} | {w:.1f} | {w / o:.2f}x |")
    doc = {"command": " ".join(["python", "bench/cpu_kernels_ab.py", *sys.argv[1:]]), "old": old_rev,
           "environment": bench.environment("cpu"), "model": args.model, "steps": args.steps,
           "threads": args.threads, "rows": rows}
    out = args.out or HERE / "runs" / f"{datetime.date.today().isoformat()}-cpu{args.threads}-kernels-ab.json"
    bench.write_run(out, doc, "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
