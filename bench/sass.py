"""The SASS of the split attention kernel's loops, counted on a machine without a GPU.

What GPU_NOTES.md says of a kernel's instructions a step comes from here: the decode launch of
`kernels.attention` / `kernels.quantized_attention` over a cache of the chosen format is recorded as a GPU would
make it (the recording of tests/test_triton_compile.py: tensors report is_cuda, launches are bound but not run),
compiled by Triton for sm_{arch} in a fresh Python without TRITON_INTERPRET, disassembled by the nvdisasm Triton
ships, and each loop's instructions (a backward branch and what lies between its target and it) counted by opcode.

    python bench/sass.py --kv int4 --block-n 64 --warps 4     # the loops of the INT4 split kernel, and registers
    python bench/sass.py --kv bf16 --dump /tmp/bf16.sass        # the whole listing too

A count is per thread and step of the loop (BLOCK_N keys); it says what a step issues, not how long it waits.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {128: (4096, 32, 8, 128, 14336, None, 128256), 64: (2048, 32, 8, 64, 8192, None, 128256)}
STATE = (4200, 1)  # (cache length, new tokens): a decode step over 4200 positions, several splits
BITS = {"bf16": 0, "int8": 8, "int4": 4}


def record(args) -> list:
    """The split kernel's Specs (every autotune config) of one decode launch, as a GPU would bind them."""
    import torch

    sys.path.insert(0, ROOT)
    import tests.test_triton_compile as recorder

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    recorder._sweep = lambda: recorder._attention(SHAPES[args.head_dim], dtype)
    recorder.ATTENTION_STATES[:] = [STATE]
    return [s for s in recorder._record(132) if s.name == "_split_kernel"]


def chosen(specs, args):
    for spec in specs:
        consts, options = spec.constexprs, dict(spec.options)
        if (consts["BITS"] == BITS[args.kv] and consts["BLOCK_N"] == args.block_n and not consts["SCORES"]
                and not consts["DEVICE_LEN"] and options["num_warps"] == args.warps
                and options["num_stages"] == args.stages):
            return spec
    raise SystemExit(f"error: no autotune config of the {args.kv} split kernel has BLOCK_N {args.block_n}, "
                     f"{args.warps} warps and {args.stages} stages")


def compile_and_count(spec, arch: int, dump: str | None):
    """Compiles `spec` for sm_{arch} and prints its registers and each loop's instruction counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    signature, constexprs, attrs = spec.compile_args()
    attrs = {path: make_backend(target).parse_attr(value) for path, value in attrs.items()}
    source = ASTSource(getattr(importlib.import_module(spec.module), spec.name), signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=dict(spec.options))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", "-g", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    if dump:
        with open(dump, "w") as f:
            f.write(sass)
    registers = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    print(f"{spec.kernel} {spec.constexprs} {dict(spec.options)}")
    print(f"sm_{arch}: {registers} registers, {stack} bytes of stack, {compiled.metadata.shared} bytes of shared "
          f"memory")
    for start, end, ops in loops(sass):
        histogram = collections.Counter(ops)
        top = ", ".join(f"{op} {n}" for op, n in histogram.most_common(12))
        print(f"loop {start:#x}-{end:#x}: {len(ops)} instructions ({top})")


def loops(sass: str):
    """(start, end, [opcode]) of each loop of 40 instructions or more: a branch back to a label before it."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if found:
            offset = int(found.group(1), 16)
            labels.update((name, offset) for name in pending)
            pending = []
            instructions.append((offset, found.group(2)))
    for offset, text in instructions:
        branch = re.search(r"\bBRA\s+`\((\.L_x_\d+)\)", text)
        if branch and labels.get(branch.group(1), offset) < offset:
            start = labels[branch.group(1)]
            ops = [re.sub(r"^@!?U?P[T\d]+\s+", "", body).split()[0].split(".")[0]
                   for at, body in instructions if start <= at <= offset]
            if len(ops) >= 40:
                yield start, offset, ops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", choices=BITS, default="int4", help="the cache's format (default int4)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="the model's dtype")
    parser.add_argument("--head-dim", type=int, choices=sorted(SHAPES), default=128)
    parser.add_argument("--block-n", type=int, default=64, help="keys a step (an autotune config's BLOCK_N)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--arch", type=int, default=90, help="compute capability (default 90: H100, H200)")
    parser.add_argument("--dump", help="write the whole SASS listing to this file")
    parser.add_argument("--compile", help=argparse.SUPPRESS)  # the second process: a pickled (spec, arch, dump)
    args = parser.parse_args()
    if args.compile:
        sys.path.insert(0, ROOT)
        import tests.test_triton_compile  # noqa: F401 - Spec, to unpickle
        with open(args.compile, "rb") as f:
            compile_and_count(*pickle.load(f))
        return
    os.environ["TRITON_INTERPRET"] = "1"  # recording binds launches without a GPU (before triton is imported)
    spec = chosen(record(args), args)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # under it, nothing compiles
    with tempfile.NamedTemporaryFile(suffix=".pkl") as job:
        pickle.dump((spec, args.arch, args.dump), job)
        job.flush()
        sys.exit(subprocess.run([sys.executable, __file__, "--compile", job.name], env=env).returncode)


if __name__ == "__main__":
    main()
