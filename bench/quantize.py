"""Quantization quality, cost and speed on the embedded model, in one command:

    python bench/quantize.py [--group-size 64] [--samples 128] [--seq-len 512] [--max-tokens 8192]
                             [--threads 2] [--out FILE.json] [--keep DIR]

1. `llmrun quantize smollm2` three ways, each in its own process: --rtn and --awq (INT4, the same group size)
   and --int8 (per channel); wall time and the process's peak memory, from its --json.
2. `llmrun eval --ppl canterbury --weights dequant` (alice29, which the default calibration leaves out; the
   first --max-tokens tokens, windows of 512, stride 256) of the original weights (the GGUF's Q4_1/Q8_0 blocks
   dequantized: what every checkpoint was made from) and of each checkpoint, expanded to fp32: the quality of
   what the checkpoint holds.
3. `llmrun bench` of each (decode tok/s on the CPU kernels, packed weights), in --speed-rounds alternating rounds
   (each round benches every row once): a row's speed is the median of its rounds' medians, with their range.

Prints the table and the share of round-to-nearest's perplexity gap that AWQ closes,
(ppl_rtn - ppl_awq) / (ppl_rtn - ppl_original). Writes the JSON (every figure, the commands, the environment)
to --out, default bench/runs/DATE-cpuTHREADS-quantize.json, and the table beside it (.md). On 2 cores: about
20 minutes, half of it AWQ's search.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "smollm2"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def llmrun(*args: str, threads: int) -> dict:
    """Run `llmrun ARGS --json --threads N`; its JSON. A failure stops the benchmark with llmrun's error."""
    command = [sys.executable, "-m", "llmrun", *args, "--json", "--threads", str(threads)]
    log("$ " + " ".join(["llmrun", *command[3:]]))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=None, help="INT4 group size (default: llmrun's, 32 here: the GGUF's blocks)")
    parser.add_argument("--samples", type=int, default=128, help="AWQ calibration windows (default 128)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (default 512)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens of alice29 scored (default 8192)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--speed-rounds", type=int, default=3, help="rounds of `llmrun bench`, each over every "
                        "row in turn (default 3): a row's decode speed is the median of its rounds' medians")
    parser.add_argument("--keep", type=Path, help="write the checkpoints here and keep them (default: a temporary "
                        "directory); checkpoints a run left there are reused with the figures it recorded")
    parser.add_argument("--out", type=Path, help="the JSON file (default bench/runs/DATE-cpuTHREADS-quantize.json)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from llmrun import bench

    today = datetime.date.today().isoformat()
    out = args.out or HERE / "runs" / f"{today}-cpu{args.threads}-quantize.json"
    root = args.keep or Path(tempfile.mkdtemp(prefix="llmrun-bench-quantize-"))
    group = ["--group-size", str(args.group_size)] if args.group_size else []
    calibration = ["--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    rows = {"original": {"model": MODEL}}
    for method, extra in (("rtn", group), ("awq", group + calibration), ("int8", [])):
        path, record = root / method, root / f"{method}.quantize.json"
        if path.is_dir() and record.is_file():  # kept by an earlier run with --keep: its own figures
            log(f"reusing {path} (quantized by an earlier run; {record.name} has its figures)")
            result = json.loads(record.read_text())
        else:
            result = llmrun("quantize", MODEL, f"--{method}", "-o", str(path), *extra, threads=args.threads)
            record.write_text(json.dumps(result) + "\n")
        rows[method] = {"model": str(path), "quantize": result}
    ppl = ["--ppl", "canterbury", "--max-tokens", str(args.max_tokens), "--weights", "dequant"]
    for name, row in rows.items():
        row["eval"] = llmrun("eval", row["model"], *ppl, threads=args.threads)
        (root / "rows.json").write_text(json.dumps(rows) + "\n")  # nothing measured is lost to a later failure
    # Speed in alternating rounds: this VM's speed drifts by tens of percent over minutes, which one run of each,
    # one after the other, would hand to whichever came at a fast moment.
    for _ in range(args.speed_rounds):
        for row in rows.values():
            row.setdefault("bench_rounds", []).append(llmrun("bench", row["model"], threads=args.threads))
            (root / "rows.json").write_text(json.dumps(rows) + "\n")
    for row in rows.values():
        medians = sorted(b["decode_tok_s"]["median"] for b in row["bench_rounds"])
        row["decode_tok_s"] = {"median": statistics.median(medians), "min": medians[0], "max": medians[-1]}
    p = {name: row["eval"]["ppl"] for name, row in rows.items()}
    gap_closed = (p["rtn"] - p["awq"]) / (p["rtn"] - p["original"]) if p["rtn"] != p["original"] else None
    table = markdown(rows, gap_closed)
    doc = {
        "date": today,
        "command": " ".join(["python", "bench/quantize.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args) | {"keep": str(args.keep) if args.keep else None, "out": str(out)},
        "awq_gap_closed": gap_closed,
        "rows": rows,
        "environment": bench.environment("cpu"),
        "load_average_1min_end": round(os.getloadavg()[0], 2),
    }
    bench.write_run(out, doc, table)
    return 0


def markdown(rows: dict, gap_closed: float | None) -> str:
    lines = ["| weights | group | perplexity | Δ vs original | quantize time | peak memory | checkpoint | decode tok/s "
             "(rounds' range) |",
             "|---|---|---|---|---|---|---|---|"]
    base = rows["original"]["eval"]["ppl"]
    names = {"original": "original (Q4_1/Q8_0 GGUF, dequantized)", "rtn": "RTN INT4", "awq": "AWQ INT4",
             "int8": "INT8 per channel"}
    for name, row in rows.items():
        q = row.get("quantize")
        ppl = row["eval"]["ppl"]
        group = "32 (GGUF)" if q is None else ("channel" if q["group_size"] == -1 else str(q["group_size"]))
        size = sum(f.stat().st_size for f in Path(row["model"]).glob("*.safetensors")) if q else None
        lines.append(" | ".join([
            f"| {names[name]}", group, f"{ppl:.3f}", "—" if q is None else f"{ppl - base:+.3f}",
            "—" if q is None else f"{q['seconds']:.0f} s", "—" if q is None else f"{q['peak_memory_bytes'] / 2**30:.2f} GiB",
            "—" if size is None else f"{size / 2**20:.1f} MiB", "{median:.1f} ({min:.0f}–{max:.0f}) |".format(
                **row["decode_tok_s"])]))
    if gap_closed is not None:
        lines.append("")
        lines.append(f"AWQ closes {100 * gap_closed:.0f}% of the perplexity gap between RTN and the original weights.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
