"""The CPU kernels of two commits side by side: decode speed of the same model and workloads with
`kernels/cpu_kernels.c` as committed at --old and as it is in the working tree, in one run:

    python bench/cpu_kernels_ab.py --old REV [--model smollm2] [--rounds 15] [--steps 8] [--threads 2]
                                   [--cases 100:1,2000:1,300:8,2000:1:int4] [--march native] [--out FILE.json]

Each case PROMPT:T[:KV] runs in a process of its own, which loads the model, builds (once, cached) and loads both
kernel libraries, and prefills PROMPT random token ids into a KV cache of format KV (fp32, the default; int8;
int4). Then --rounds rounds each time --steps forwards of T tokens with the old library and --steps with the new
one, in alternating order (old-new, new-old, ...); every forward's cache is rolled back afterwards, so each one
sees the same context: T = 1 is a decoding step, T > 1 a speculative verification block. Swapping the library
between short runs within one process puts the machine's drift (on a shared VM, tens of percent within a minute)
on both sides alike, which separate processes did not. A side's figure is the median over rounds of steps/s.
--march builds both libraries for another target than this CPU's own: `--march x86-64-v3` measures the AVX2
kernels on a CPU that would otherwise build the AVX-512 VNNI ones.
Only the C file differs between the two sides: the Python around it is the working tree's, so --old must name a
commit whose kernels have the same entry points.

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
import json, sys, time
from pathlib import Path
import torch
import llmrun.kernels.cpu as cpu
from llmrun.generate import Engine
from llmrun.loading import load_model

old, new, model = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
prompt_tokens, T, steps, rounds, threads = (int(a) for a in sys.argv[4:9])
kv = None if sys.argv[9] == "fp32" else sys.argv[9]
cpu.FLAGS = [f"-march={sys.argv[10]}" if f.startswith("-march=") else f for f in cpu.FLAGS]
libs = {}
for side, source in (("old", old), ("new", new)):
    cpu.SOURCE = source
    cpu._lib.cache_clear()
    libs[side] = cpu._lib()
    assert libs[side] is not None, cpu.unavailable_reason()
torch.set_num_threads(threads)
loaded = load_model(model, device="cpu", dtype="fp32")
assert loaded.weights == "packed"
engine = Engine(loaded, prompt_tokens + T + 8, kv_format=kv)
vocab = loaded.model.config.vocab_size
ids = torch.randint(100, vocab - 100, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
token = int(engine.prefill(ids)[0].argmax())
length = len(engine.tokens)

def run(side):
    cpu._lib = lambda: libs[side]  # every call in kernels/cpu.py looks the library up through _lib
    start = time.perf_counter()
    for _ in range(steps):
        engine.forward([token] * T, last_only=T == 1)
        engine.rollback(length)
    return steps / (time.perf_counter() - start)

run("old"), run("new")  # warm-up
rates = {"old": [], "new": []}
for r in range(rounds):
    for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
        rates[side].append(run(side))
print(json.dumps(rates))
"""


def measure(old: Path, new: Path, model: str, prompt_tokens: int, T: int, kv: str, steps: int, rounds: int,
            threads: int, march: str) -> dict[str, list[float]]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(old), str(new), model, str(prompt_tokens), str(T),
                           str(steps), str(rounds), str(threads), kv, march], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the commit whose kernels/cpu_kernels.c is the baseline")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=8, help="forwards per side and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="100:1,2000:1,300:8",
                   help="PROMPT:T[:KV],... (T > 1: verification blocks; KV: fp32, int8 or int4)")
    p.add_argument("--march", default="native", help="the -march both libraries are built for")
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
    new = HERE.parent / "kernels" / "cpu_kernels.c"
    cases = []
    for case in args.cases.split(","):
        n, T, kv = (case.split(":") + ["fp32"])[:3]
        if kv not in ("fp32", "int8", "int4"):
            sys.exit(f"unknown KV format {kv!r} in case {case!r}: fp32, int8 or int4")
        cases.append((int(n), int(T), kv))
    old_rev = subprocess.run(["git", "rev-parse", "--short", args.old], capture_output=True, text=True,
                             cwd=HERE.parent).stdout.strip()
    table = [f"| context | tokens a step | KV cache | old ({old_rev}) steps/s | new steps/s | new / old |",
             "|---|---|---|---|---|---|"]
    rows = []
    for n, T, kv in cases:
        rates = measure(old, new, args.model, n, T, kv, args.steps, args.rounds, args.threads, args.march)
        o, w = statistics.median(rates["old"]), statistics.median(rates["new"])
        rows.append({"prompt_tokens": n, "T": T, "kv": kv, "old": rates["old"], "new": rates["new"],
                     "old_median": o, "new_median": w, "ratio": w / o})
        table.append(f"| {n} | {T} | {kv} | {o:.1f} | {w:.1f} | {w / o:.2f}x |")
        print(table[-1], file=sys.stderr)
    doc = {"command": " ".join(["python", "bench/cpu_kernels_ab.py", *sys.argv[1:]]), "old": old_rev,
           "environment": bench.environment("cpu"), "model": args.model, "steps": args.steps,
           "rounds": args.rounds, "threads": args.threads, "march": args.march, "rows": rows}
    out = args.out or HERE / "runs" / f"{datetime.date.today().isoformat()}-cpu{args.threads}-kernels-ab.json"
    bench.write_run(out, doc, "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
