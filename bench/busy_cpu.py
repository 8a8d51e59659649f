"""Decode speed on a CPU that another process keeps busy: `llmrun bench` on the embedded model with the thread
governor (`llmrun.threads`) and without it (LLMRUN_ADAPT_THREADS=0), each alone and beside a competitor that runs
PyTorch matmuls on every core, alternating. Prints a table; --json FILE also writes the figures.

    python bench/busy_cpu.py [--new-tokens 32] [--repeat 2] [--rounds 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

COMPETITOR = """
import sys, time, torch
a = torch.randn(256, 256)
while True:
    for _ in range(100):
        a @ a
"""


def bench(adapt: bool, new_tokens: int, repeat: int) -> dict:
    env = {**os.environ, "LLMRUN_ADAPT_THREADS": "1" if adapt else "0"}
    cmd = [sys.executable, "-m", "llmrun", "bench", "--prompt-tokens", "134", "--new-tokens", str(new_tokens),
           "--repeat", str(repeat), "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"busy_cpu.py: llmrun bench failed: {done.stderr.strip().splitlines()[-1:]}")
    doc = json.loads(done.stdout)
    return {"decode_tok_s": doc["decode_tok_s"]["median"], "prefill_tok_s": doc["prefill_tok_s"],
            "threads": doc["config"].get("threads")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    if min(args.new_tokens, args.repeat, args.rounds) < 1:
        ap.error("--new-tokens, --repeat and --rounds take positive numbers")
    rows = []
    for r in range(args.rounds):
        for busy in (False, True):
            competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if busy else None
            try:
                time.sleep(3 if busy else 0)  # the competitor's PyTorch loaded and running
                for adapt in (True, False):
                    row = {"round": r, "busy": busy, "governor": adapt, **bench(adapt, args.new_tokens, args.repeat)}
                    rows.append(row)
                    print(f"round {r} {'busy' if busy else 'free'} governor {'on ' if adapt else 'off'}: decode "
                          f"{row['decode_tok_s']:.1f} tok/s, prefill {row['prefill_tok_s']:.0f} tok/s", file=sys.stderr)
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    print("| CPU | governor | decode tok/s (median of rounds) | prefill tok/s |")
    print("|---|---|---|---|")
    for busy in (False, True):
        for adapt in (True, False):
            got = [x for x in rows if x["busy"] == busy and x["governor"] == adapt]
            dec = sorted(x["decode_tok_s"] for x in got)
            pre = sorted(x["prefill_tok_s"] for x in got)
            print(f"| {'busy' if busy else 'free'} | {'on' if adapt else 'off (LLMRUN_ADAPT_THREADS=0)'} | "
                  f"{dec[len(dec) // 2]:.1f} ({', '.join(f'{d:.1f}' for d in dec)}) | {pre[len(pre) // 2]:.0f} |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
