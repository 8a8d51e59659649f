"""Each decode matmul of a model shape on its own, every way llmrun can run it, against the bytes it must read:

    python bench/gemv.py [--shapes llama3.2-1b llama3-8b] [--rows 1 9] [--matrices qkv,o,gate_up,down,head]
                         [--variants cublas,gemv-float,w4a16,w8a16,w4a16-dot,w8a16-dot,w4a16-regs,w8a16-regs,
                                     w4a16-half2]
                         [--device cuda] [--reps 20]
                         [--out FILE.json]

A decode step's profile lumps a kernel's launches together (`bench/gpu_profile.py`: `_gemv_kernel`, 65 calls);
this takes them apart, one (matrix, row count, variant) at a time, so that a GEMV's distance from its floor, and
whether the GEMV or cuBLAS serves a float matrix better, is read per shape:
  cublas      bf16 weights through F.linear (what a float model runs)
  gemv-float  bf16 weights through the Triton GEMV (`LLMRUN_GEMV_FLOAT=1`)
  w4a16       4-bit weights in blocks of 32 with offsets (GGUF Q4_1's layout, `--weights int4`) through the GEMV
  w8a16       8-bit weights in blocks of 32 through the GEMV
  w4a16-dot, w8a16-dot  the same weights through the tensor-core GEMV (`LLMRUN_GEMV_DOT=1`): 1-16 rows in one
              launch, each step's tile dequantized once and multiplied in an MMA
  w4a16-regs, w8a16-regs  the GEMV on its STAGES 1 configs alone: W's tiles fetched a step ahead in registers, as
              before cp.async copied them further ahead (the autotuner picks among both kinds for w4a16/w8a16)
  w4a16-half2 the 4-bit weights through the GEMV in fp16 pairs (`LLMRUN_GEMV_HALF2=1`): dequantized and multiplied
              two codes an instruction
On a GPU each row names the config the autotuner chose for the call.
Each figure is one call's time: --reps calls captured in a CUDA graph (as a decode step runs them: no launch
overhead from the host), the graph replayed, the median of 10 replays divided by --reps. The floor is the bytes a
call must read (weights, scales and offsets) over a device copy's bandwidth measured in the same run. Rows 9 and
up are a speculative verification block (two GEMV launches, 8 rows and the rest).
On a CPU (with TRITON_INTERPRET=1) the same runs under the Triton interpreter, fp16, timed on the clock without
graphs: a check that the script works, not a measurement. Writes the JSON (every figure, the environment) to --out (default bench/results/DATE-GPU-gemv.json,
on a CPU bench/runs/DATE-cpu-gemv.json) and the table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from llmrun import bench
from llmrun.kernels import triton_quant_matmul as tqm
from llmrun.shapes import shape_config

HERE = Path(__file__).resolve().parent
VARIANTS = ("cublas", "gemv-float", "w4a16", "w8a16", "w4a16-dot", "w8a16-dot", "w4a16-regs", "w8a16-regs",
            "w4a16-half2")


def matrices(name: str) -> dict[str, tuple[int, int]]:
    """A shape's decode matmuls, W (N, K) each."""
    c = shape_config(name)
    return {"qkv": ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), "o": (c.dim, c.n_heads * c.head_dim),
            "gate_up": (2 * c.ffn_dim, c.dim), "down": (c.dim, c.ffn_dim), "head": (c.vocab_size, c.dim)}


def operands(variant: str, N: int, K: int, device, dtype):
    """(the call, bytes it must read): random weights of the variant's format, N x K."""
    g = torch.Generator(device=device).manual_seed(N + K)
    if variant in ("cublas", "gemv-float"):
        w = torch.randn(N, K, generator=g, device=device, dtype=dtype) / K**0.5
        call = (lambda x: torch.nn.functional.linear(x, w)) if variant == "cublas" else (lambda x: tqm.float_linear(x, w))
        return call, w.numel() * w.element_size()
    bits = 4 if variant.startswith("w4a16") else 8
    qs = torch.randint(0, 256, (N, K // 2), generator=g, device=device, dtype=torch.uint8) if bits == 4 else \
        torch.randint(-127, 128, (N, K), generator=g, device=device, dtype=torch.int8)
    d = (torch.rand(N, K // 32, generator=g, device=device) * 0.01).half()
    m = (torch.rand(N, K // 32, generator=g, device=device) * -0.08).half() if bits == 4 else None
    nbytes = qs.numel() + d.numel() * 2 + (0 if m is None else m.numel() * 2)
    if variant.endswith("-dot"):  # the tensor-core GEMV (LLMRUN_GEMV_DOT=1): every row count in one launch
        return (lambda x: tqm._gemv_dot(x, qs, d, m, bits, 32)), nbytes
    if variant.endswith("-regs"):
        return (lambda x: _on_registers(lambda: tqm.quant_linear(x, qs, d, m, bits)) if x.is_cuda
                else tqm.quant_linear(x, qs, d, m, bits)), nbytes
    if variant.endswith("-half2"):
        return (lambda x: _in_half2(lambda: tqm.quant_linear(x, qs, d, m, bits))), nbytes
    return (lambda x: tqm.quant_linear(x, qs, d, m, bits)), nbytes


def _in_half2(call):
    """call() with LLMRUN_GEMV_HALF2=1 (read at each launch: a CUDA graph captures the launches it chose)."""
    before = os.environ.get("LLMRUN_GEMV_HALF2")
    os.environ["LLMRUN_GEMV_HALF2"] = "1"
    try:
        return call()
    finally:
        if before is None:
            del os.environ["LLMRUN_GEMV_HALF2"]
        else:
            os.environ["LLMRUN_GEMV_HALF2"] = before


@functools.cache
def _register_tuner():
    """The GEMV's autotuner over its STAGES 1 configs alone."""
    configs = [c for c in tqm._GEMV_CONFIGS if c.kwargs["STAGES"] == 1]
    return triton.autotune(configs, key=tqm.GEMV_KEY)(tqm._gemv_kernel)


def _on_registers(call):
    """call() with the GEMV's launches on `_register_tuner` (a Python-level swap: a CUDA graph captures the
    launches)."""
    launcher = tqm._gemv_launcher
    tqm._gemv_launcher = lambda cuda: (_register_tuner(), {})
    try:
        return call()
    finally:
        tqm._gemv_launcher = launcher


def tuned_config(variant: str) -> str | None:
    """The config the autotuner chose for the variant's last call (a GPU's), as Triton prints it."""
    if variant == "cublas":
        return None
    tuner = (tqm._dot_launcher(True)[0] if variant.endswith("-dot") else
             _register_tuner() if variant.endswith("-regs") else tqm._gemv_launcher(True)[0])
    best = getattr(tuner, "best_config", None)
    return None if best is None else str(best)


def seconds_per_call(call, x, reps: int) -> float:
    """One call's time: on CUDA, `reps` calls in a CUDA graph, the median of 10 replays; else on the clock."""
    if x.is_cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles and autotunes outside the capture
            for _ in range(3):
                call(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                call(x)
        times = []
        for _ in range(11):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
        del graph
        return statistics.median(times[1:])
    call(x)  # compiles (the interpreter: nothing to compile, but the first call pays imports)
    t0 = time.perf_counter()
    for _ in range(reps):
        call(x)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["llama3.2-1b", "llama3-8b"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 9], help="rows of x: 1 a decode step, 2-16 a block")
    p.add_argument("--matrices", default="qkv,o,gate_up,down,head")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's dots: no bf16
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        sys.exit(f"gemv.py: unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    bandwidth = bench.copy_bandwidth(device.type)
    rows = []
    table = ["| shape | matrix | N x K | rows | variant | us | GB/s | vs floor | config |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        for name, (N, K) in matrices(shape).items():
            if name not in args.matrices.split(","):
                continue
            for variant in variants:
                call, nbytes = operands(variant, N, K, device, dtype)
                for M in args.rows:
                    x = torch.randn(M, K, device=device, dtype=dtype)
                    row = {"shape": shape, "matrix": name, "N": N, "K": K, "rows": M, "variant": variant,
                           "bytes": nbytes, "floor_seconds": nbytes / bandwidth}  # the profiles' floor: a copy's rate
                    try:
                        row["seconds"] = t = seconds_per_call(call, x, args.reps)
                        row["config"] = tuned_config(variant) if device.type == "cuda" else None
                        line = (f"| {shape} | {name} | {N} x {K} | {M} | {variant} | {t * 1e6:.1f} | "
                                f"{nbytes / t / 1e9:.0f} | {t / row['floor_seconds']:.2f}x | {row['config'] or ''} |")
                    except Exception as e:  # noqa: BLE001 - one variant failing (a kernel that does not build) is a finding
                        row["error"] = bench.one_line(e, with_type=True)
                        line = f"| {shape} | {name} | {N} x {K} | {M} | {variant} | failed: {row['error']} | | | |"
                    rows.append(row)
                    table.append(line)
                    print(line, file=sys.stderr)
                del call
                bench.release(device.type)
    env = bench.environment(device.type)
    doc = {"command": " ".join(sys.argv), "environment": env, "copy_bandwidth": bandwidth, "reps": args.reps,
           "rows": rows}
    if args.out is None:
        where = env["device_name"].replace(" ", "-") if device.type == "cuda" else "cpu"
        date = datetime.date.today().isoformat()
        args.out = HERE / ("results" if device.type == "cuda" else "runs") / f"{date}-{where}-gemv.json"
    floor_note = f"\nfloor: the bytes a call reads at {bandwidth / 1e9:.0f} GB/s (a device copy, read + written, this run)\n"
    bench.write_run(args.out, doc, "\n".join(table) + floor_note)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
