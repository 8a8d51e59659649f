"""Every Triton kernel llmrun launches, compiled ahead of time for NVIDIA GPUs on a machine without one: sm_80
(A100), sm_89 (RTX 4090, L4, L40: 99 KiB of shared memory a block, as an RTX 3090's sm_86) and sm_90 (H100, H200),
through Triton's own compiler down to a cubin.

The other kernel tests run the kernels' Python under TRITON_INTERPRET=1, which never sees what only the compiler
does: tl.dot's minimum tile sizes, dtype mismatches in the IR, ops a target lacks, more shared memory than the GPU
has. Compiling proves that each launch builds for sm_89 and sm_90 (and sm_80 at its shared-memory edge: `COVERED`)
and that its shared memory fits; it says nothing of numerics (the interpreter tests) or speed.

Which launches: the ops of `llmrun.kernels` are called as `models/llama.py` calls them (q a slice of the fused qkv
projection, K/V read back from a `KVCache` of each format, H2O's mass buffer, `QuantLinear`'s packed planes), for
the named shapes of `llmrun.shapes` plus head_dim 80, 96 and 256, in bf16, fp16 and fp32, at first-forward,
decode and verify lengths, on small CPU tensors. Meanwhile tensors report `is_cuda` and the GEMV's split-K reads
an H100's SM count, so the wrappers take their CUDA branches (autotuning, split-K, CUDA block sizes); each launch is
recorded instead of run (once per autotune config) and bound by Triton's own launcher code as on the GPU (`*bf16`,
`i32`, an int equal to 1 made a constant, 16-byte alignment).

That gives ~12,000 distinct specializations, and a compile takes seconds (the attention kernel over an INT4 cache
~6 s), so a greedy cover picks per kernel the few that show every value of every parameter at least once (each
dtype, constexpr, autotune setting, alignment, constant 1) and every pair of constexpr values and dtypes, plus its
largest tile. The attention split kernel's
autotuner drops the configs whose estimated shared memory does not fit before compiling them: the launches
estimated closest to each target's limit, on either side, compile too, and the estimate is held against the
compiler's figures. These compile in a subprocess without TRITON_INTERPRET (under it `triton.jit` gives nothing to
compile), in parallel, into a temporary cache.
LLMRUN_COMPILE_ALL=1 compiles every recorded specialization instead (hours).
"""

import dataclasses
import functools
import importlib
import itertools
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time

import pytest
import torch

pytestmark = pytest.mark.slow  # recording takes seconds, compiling a minute

# target -> (compute capability, shared memory one block may use: the opt-in maximum); A100, H100 and H200
TARGETS = {"sm_80": (80, 163 * 1024), "sm_89": (89, 99 * 1024), "sm_90": (90, 227 * 1024)}
# The targets every chosen launch compiles for. sm_80 compiles the launches sm_89 does (neither has programmatic
# dependent launch) through the same lowering (mma.sync, cp.async; no kernel uses sm_89's fp8), with more shared
# memory than sm_89's: only its own shared-memory edge (`_at_the_limit`) can tell it apart, and compiles for it.
COVERED = ("sm_89", "sm_90")
H100_SMS = 132  # the GEMV's split-K follows the SM count; an A100's 108 make splits of the same kinds
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Llama-family geometries beyond llmrun.shapes (whose heads are all 64 or 128 wide), for the other head sizes
# the kernels take: (dim, n_heads, n_kv_heads, head_dim, ffn_dim, sliding_window, vocab_size)
EXTRA_SHAPES = {
    "head80-gqa2": (2560, 32, 16, 80, 6912, None, 32000),
    "head96-gqa5-window": (3840, 40, 8, 96, 10240, 2048, 32000),
    "head256-gqa8": (2048, 8, 1, 256, 16384, None, 32000),
}
# (S, T): the cache holds S positions after writing the T newest; T tokens attend. A first forward (S == T),
# decode steps and speculative verification (T 3, 6, 16: one row block of 16 or several, with GQA) over caches of
# 1 to 17 splits (one: the split kernel writes the output itself).
ATTENTION_STATES = [(1, 1), (9, 9), (200, 1), (400, 3), (600, 1), (600, 6), (600, 16), (4200, 1)]


# --- recording the launches ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One specialization of a kernel, as Triton's launcher binds it (JITFunction.run's binder): hashable."""

    module: str
    name: str
    # ((param, kind, value), ...) in parameter order: kind "*bf16", "i32", "fp32"... with value "D" (known
    # divisible by 16) or "" or None; or kind "constexpr" (a tl.constexpr, or an int equal to 1) with its value
    params: tuple
    options: tuple  # (("num_warps", 4), ...): launch options, sorted
    tuned: tuple = ()  # names an autotune config sets; () for a fixed launch

    @property
    def kernel(self):
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"

    def untuned(self):
        """What the launch itself decides: everything but the settings of its autotune config."""
        return frozenset(x for x in self.params + self.options if x[0] not in self.tuned)

    @property
    def constexprs(self):
        """{param: value} of its constexpr params."""
        return {p: v for p, kind, v in self.params if kind == "constexpr"}

    def describe(self):
        ptrs = {p: kind for p, kind, _ in self.params if kind.startswith("*")}
        return f"{self.kernel} {self.constexprs} {dict(self.options)} {ptrs}"

    def compile_args(self):
        """(signature, constexprs, attrs) for ASTSource, as JITFunction._pack_args makes them (flat params)."""
        signature = {param: kind for param, kind, _ in self.params}
        constexprs = {(i,): value for i, (_, kind, value) in enumerate(self.params) if kind == "constexpr"}
        attrs = {(i,): value for i, (_, kind, value) in enumerate(self.params) if kind != "constexpr" and value}
        return signature, constexprs, attrs


def _jit_functions():
    """{name: kernel} of every @triton.jit function defined in llmrun.kernels."""
    import llmrun.kernels as package
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    found = {}
    for path in sorted(os.listdir(os.path.dirname(package.__file__))):
        if path.endswith(".py") and path != "__init__.py":
            module = importlib.import_module(f"{package.__name__}.{path[:-3]}")
            found.update((name, obj) for name, obj in vars(module).items()
                         if isinstance(obj, (InterpretedFunction, JITFunction))
                         and obj.fn.__module__ == module.__name__)
    return found


def _record(sm_count):
    """The distinct Specs of the launches the sweep makes on a GPU with `sm_count` SMs, in the order first made."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from llmrun import kernels
    from llmrun.kernels import common, decode_attention, triton_quant_matmul

    bind, specs = _binder(), {}

    def run(self, *args, grid, warmup, **kwargs):
        specs.setdefault(bind(self, args, kwargs))

    def tuned_run(self, *args, grid=None, warmup=False, **kwargs):
        first = bind(self.fn, args, {**kwargs, **self.configs[0].all_kwargs()})
        for config in self.configs:  # each config sets constexprs and options: the same binding otherwise
            meta = config.all_kwargs()
            params = tuple((p, "constexpr", config.kwargs[p]) if p in config.kwargs else (p, kind, value)
                           for p, kind, value in first.params)
            options = {**dict(first.options), **{k: v for k, v in meta.items() if k not in config.kwargs}}
            specs.setdefault(dataclasses.replace(first, params=params, options=tuple(sorted(options.items())),
                                                 tuned=tuple(meta)))

    with pytest.MonkeyPatch.context() as mp:
        for cls in (InterpretedFunction, JITFunction):
            mp.setattr(cls, "run", run)
        mp.setattr(Autotuner, "run", tuned_run)
        # the CUDA branches: the wrappers ask tensor.is_cuda, then count SMs
        mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        mp.setattr(triton_quant_matmul, "_sm_count", lambda index: sm_count)
        mp.setattr(kernels, "_triton", lambda name, run, fallback: run())  # no silent fallback to PyTorch
        mp.setenv("LLMRUN_GEMV_FLOAT", "1")  # float linears through the GEMV too (an experiment GPU profiles run)
        mp.setenv("LLMRUN_PDL", "1")  # and programmatic dependent launch (another): as sm_90 launches them,
        mp.setattr(common, "_capable", lambda index: True)  # an sm_80 launch without it (`_on_target`)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: threads only contend
        try:
            with torch.no_grad():
                _sweep()
        finally:
            torch.set_num_threads(threads)
    return list(specs)


def _shapes():
    """(dim, n_heads, n_kv_heads, head_dim, ffn_dim, sliding_window, vocab_size) of every shape swept."""
    from llmrun.shapes import SHAPES

    shapes = [(s["dim"], s["n_heads"], s["n_kv_heads"], s["head_dim"], s["ffn_dim"], s.get("sliding_window"),
               s["vocab_size"]) for s in SHAPES.values()]
    return list(dict.fromkeys(shapes)) + list(EXTRA_SHAPES.values())  # llama3-8b and 3.1-8b are one shape here


def _sweep():
    for shape in _shapes():
        for dtype in DTYPES:
            _small_ops(shape, dtype)
            _attention(shape, dtype)
            _quant_matmul(shape, dtype)


def _small_ops(shape, dtype):
    """RMSNorm (with and without the residual add), Qwen3's head norms and RoPE on the q and k heads of the fused
    qkv (and with a float or INT8 cache's write), the SiLU gate."""
    from llmrun import kernels
    from llmrun.kernels import ref

    dim, Hq, Hkv, D, F = shape[:5]
    weight = torch.empty(dim, dtype=dtype)
    for T in (1, 7):
        x, y = torch.empty(1, T, dim, dtype=dtype), torch.empty(1, T, dim, dtype=dtype)
        kernels.rms_norm(x, weight, 1e-5)
        kernels.add_rms_norm(x, y, weight, 1e-5)
        qkv = torch.empty(1, T, Hq + 2 * Hkv, D, dtype=dtype)
        kernels.apply_rope(qkv[:, :, : Hq + Hkv], torch.empty(T, D), torch.empty(T, D))
        kernels.head_rms_norm_(qkv, Hq, Hkv, torch.empty(D, dtype=dtype), torch.empty(D, dtype=dtype), 1e-6)  # Qwen3
        k_out, v_out = torch.empty(2, 1, Hkv, 64, D, dtype=dtype).unbind(0)  # a CUDA graph's step: with the write
        kernels.rope_write_dense(qkv, Hq, torch.empty(T, D, dtype=dtype), torch.empty(T, D, dtype=dtype), k_out, v_out,
                                 torch.arange(3, 3 + T))
        codes = torch.zeros(2, 1, Hkv, 64, D, dtype=torch.int8)  # and with an INT8 cache's
        scales = torch.zeros(2, 1, Hkv, 64, D // ref.kv_group(D), dtype=torch.float16)
        kernels.rope_write_int8(qkv.normal_(), Hq, torch.zeros(T, D, dtype=dtype), torch.ones(T, D, dtype=dtype), codes,
                                scales, torch.arange(3, 3 + T))
        gate_up = torch.empty(1, T, 2 * F, dtype=dtype)
        kernels.silu_mul(gate_up[..., :F], gate_up[..., F:])


def _attention(shape, dtype):
    """Attention as `models/llama.py` calls it: over the second layer of a KVCache of each format (with H2O's mass
    where eviction is allowed), and without a cache over the forward's own keys."""
    from llmrun import kernels
    from llmrun.kv_cache import DeviceStep, Eviction, KVCache

    _, Hq, Hkv, D, _, window = shape[:6]

    def qkv(T):  # q, k, v (1, T, H, D): views of the fused projection
        x = torch.randn(1, T, Hq + 2 * Hkv, D).to(dtype)
        return x[:, :, :Hq], x[:, :, Hq : Hq + Hkv], x[:, :, Hq + Hkv :]

    for kv_format in (None, "int8", "int4"):
        for h2o in (False, True) if window is None else (False,):  # sliding-window models refuse eviction
            # one cache serves every state (a write needs no history); the second layer's views start where the
            # first ends, which these two lengths leave aligned to 16 bytes or not
            max_len = 4208 if h2o else 4203
            cache = KVCache(2, 1, Hkv, max_len, D, dtype, "cpu", kv_format, Eviction("h2o", max_len) if h2o else None)
            prompt = [(600, 17)] if kv_format else []  # a prompt chunk: the cache dequantized in one launch
            for S, T in ATTENTION_STATES + prompt:
                q, k, v = qkv(T)
                k, v, mass = cache.update(1, S - T, k, v)
                if v is None:
                    kernels.quantized_attention(q, k, window, mass=mass)
                else:
                    kernels.attention(q, k, v, window, mass=mass)
    for kv_format in (None, "int8", "int4"):  # a CUDA graph's step: slots and the key count on the device
        for h2o in (False, True) if window is None else (False,):
            cache = KVCache(2, 1, Hkv, 4203, D, dtype, "cpu", kv_format, Eviction("h2o", 4203) if h2o else None)
            for T in (1, 9, 16):
                q, k, v = qkv(T)
                slots = torch.arange(1000, 1000 + T)
                cache.device_step = DeviceStep(slots, slots, (slots[-1:] + 1).to(torch.int32), 2048)
                k, v, mass = cache.update(1, 0, k, v)
                if v is None:
                    kernels.quantized_attention(q, k, window, mass=mass, length=cache.device_step.length)
                else:
                    kernels.attention(q, k, v, window, mass=mass, length=cache.device_step.length)
                cache.device_step = None
    for T in (1, 9, 16):
        q, k, v = qkv(T)
        kernels.attention(q, k.transpose(1, 2), v.transpose(1, 2), window)


def _quant_matmul(shape, dtype):
    """Each linear layer of the model in blocks of 32 (GGUF's Q4_1, Q4_0, Q8_0) for 1 to 16 rows of activations (the
    GEMV kernel, split-K by SM count, 8 rows a launch) and for 17 (W dequantized for torch.matmul), and the
    embedding's rows looked up; AWQ's groups of 64 and 128 through the kernel's own API (the model's layers hold
    blocks of 32); each linear layer through the tensor-core GEMV (LLMRUN_GEMV_DOT=1) for a row and a verification
    block, and in 4 bits through the GEMV in fp16 pairs (LLMRUN_GEMV_HALF2=1); and each linear layer on float
    weights through the GEMV (LLMRUN_GEMV_FLOAT=1). The MLP's gate/up gated
    too (silu(gate) * up, written as the GEMVs write their sums)."""
    from llmrun import kernels
    from llmrun.kernels.triton_quant_matmul import quant_linear

    dim, Hq, Hkv, D, F, _, vocab = shape
    linears = [((Hq + 2 * Hkv) * D, dim), (dim, Hq * D), (2 * F, dim), (dim, F), (vocab, dim)]  # W (N, K)
    prefill = (17,) if dim <= 1024 else ()  # torch.matmul really runs here: on the small shapes only
    for bits, offsets in ((4, True), (4, False), (8, False)):
        for N, K in linears:
            qs, d, m = _planes(N, K, bits, offsets, 32)
            for M in (1, 2, 3, 8, 13) + (prefill if N == dim else ()):  # 13: a launch of 8 rows, then one of 5
                kernels.quant_matmul(torch.zeros(1, M, K, dtype=dtype), qs, d, m, bits)
            if N == 2 * F:  # the MLP's gate/up, gated as it writes its sums
                for M in (1, 3, 13):
                    kernels.quant_matmul(torch.zeros(1, M, K, dtype=dtype), qs, d, m, bits, gated=True)
            if N == vocab:  # the embedding's lookup (a tied head's table), a decode step's and a prompt's
                for T in (1, 17):
                    kernels.quant_rows(torch.zeros(1, T, dtype=torch.long), qs, d, m, bits, dtype)
        for group in (64, 128):
            N, K = min((N, K) for N, K in linears if K % group == 0)
            for M in (1, 8) + prefill:
                quant_linear(torch.zeros(1, M, K, dtype=dtype), *_planes(N, K, bits, offsets, group), bits, group)
    with pytest.MonkeyPatch.context() as mp:  # the tensor-core GEMV (LLMRUN_GEMV_DOT=1): a row, a verification block
        mp.setenv("LLMRUN_GEMV_DOT", "1")
        for bits, offsets in ((4, True), (4, False), (8, False)):
            for N, K in linears:
                qs, d, m = _planes(N, K, bits, offsets, 32)
                for M in (1, 13):
                    kernels.quant_matmul(torch.zeros(1, M, K, dtype=dtype), qs, d, m, bits, gated=N == 2 * F)
    with pytest.MonkeyPatch.context() as mp:  # 4-bit weights in fp16 pairs (LLMRUN_GEMV_HALF2=1): a row, a block
        mp.setenv("LLMRUN_GEMV_HALF2", "1")
        mp.setenv("LLMRUN_GEMV_DOT", "0")
        for offsets in (True, False):
            for N, K in linears:
                qs, d, m = _planes(N, K, 4, offsets, 32)
                for M in (1, 13):
                    kernels.quant_matmul(torch.zeros(1, M, K, dtype=dtype), qs, d, m, 4, gated=N == 2 * F)
    for N, K in linears:  # float weights (LLMRUN_GEMV_FLOAT=1): the GEMV without scales
        w = torch.empty(N, K, dtype=dtype)  # never read: no memory for the vocabulary's rows
        for M in (1, 8, 13):
            kernels.linear(torch.zeros(1, M, K, dtype=dtype), w)
            if N == 2 * F:
                kernels.linear(torch.zeros(1, M, K, dtype=dtype), w, gated=True)


def _planes(N, K, bits, offsets, group):
    """Packed W (N, K), never read (no launch runs): empty, so the vocabulary's rows cost no memory."""
    qs = torch.empty(N, K // 2, dtype=torch.uint8) if bits == 4 else torch.empty(N, K, dtype=torch.int8)
    d = torch.empty(N, K // group, dtype=torch.float16)
    return qs, d, torch.empty_like(d) if offsets else None


def _binder():
    """-> bind(kernel, args, kwargs) -> Spec, by Triton's own launcher code (the binder JITFunction.run calls)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))  # alignment and constant-1 rules are the same on every target
    binders = {}

    def bind(kernel, args, kwargs):
        fn = kernel.fn
        if fn not in binders:
            jit = kernel if isinstance(kernel, JITFunction) else JITFunction(fn)
            binders[fn] = jit, create_function_from_signature(jit.signature, jit.params, backend)
        jit, binder = binders[fn]
        _, specialization, options = binder(*args, **kwargs)
        params = tuple((p.name, kind, value) for p, (kind, value) in zip(jit.params, specialization))
        return Spec(fn.__module__, fn.__name__, params, tuple(sorted(options.items())))

    return bind


# --- choosing what to compile ---------------------------------------------------------------------------------------


def _size(spec, skip=()):
    """A proxy for a spec's tiles, hence its shared memory and compile time: the product of its BLOCK_* constants
    and num_stages, times the bytes of an element of each of its pointers, summed (params in `skip` left out)."""
    size = 1
    for name, kind, value in spec.params:
        if kind == "constexpr" and name.startswith("BLOCK") and name not in skip:
            size *= value
    if "num_stages" not in skip:
        size *= dict(spec.options).get("num_stages", 3)
    return size * sum(_element_bytes(kind) for _, kind, _ in spec.params if kind.startswith("*"))


@functools.cache
def _element_bytes(kind):  # "*bf16" -> 2
    return int(re.sub(r"\D", "", kind) or 8) // 8


def _cover(specs, size, features):
    """A greedy cover: specs until every feature any of them has is shown, each time the one showing the most not
    yet shown per square root of its size (compile time grows with the tiles, more slowly), the first on a tie."""
    features = {s: frozenset(features(s)) for s in specs}
    left, chosen = set().union(*features.values()), []
    while left:
        best = max(specs, key=lambda s: len(features[s] & left) / math.sqrt(size[s]))
        chosen.append(best)
        left -= features[best]
    return chosen


def _shown(spec, tuned=()):
    """What a launch shows: each parameter's type and alignment, or its constant value, and each launch option; and
    each pair of its constants' values and pointers' dtypes (Triton 3.6 compiles a constexpr branch's code past its
    return, so BITS 8 built under 16-bit x and failed under fp32 x, whose codes take another path: pairs show such
    combinations). Parameters an autotune config sets are left out."""
    params = [p for p in spec.params if p[0] not in tuned]
    kinds = [(name, kind if kind.startswith("*") else value) for name, kind, value in params
             if kind == "constexpr" or kind.startswith("*")]
    return {*params, *(o for o in spec.options if o[0] not in tuned), *itertools.combinations(kinds, 2)}


def _choose(specs):
    """specs (in recording order, so that every run chooses the same) -> those to compile.

    Per kernel, a cover of what its launches show (`_shown`) and its largest tile. An autotuned kernel's variety is
    split in two: a cover of its configs' settings (BLOCK_N, num_warps, num_stages) on its smallest launch, and a
    cover of the rest with its smallest config, the one whose shared memory must fit (the split kernel's autotuner drops the configs that do
    not before compiling them: `_at_the_limit` adds those the decision is closest for)."""
    by_kernel = {}
    for spec in specs:
        by_kernel.setdefault(spec.kernel, []).append(spec)
    chosen = {}
    for group in by_kernel.values():
        size = {s: _size(s) for s in group}
        group.sort(key=size.get)
        tuned = group[0].tuned
        if not tuned:
            cover = [*_cover(group, size, _shown), group[-1]]
        else:
            config = {s: frozenset(x for x in s.params + s.options if x[0] in tuned) for s in group}
            tile = {s: _size(s, skip=tuned) for s in group}
            smallest = min(group, key=tile.get)  # the smallest launch with the smallest config (group is sorted)
            with_smallest_config = [s for s in group if config[s] == config[smallest]]
            cover = _cover([s for s in group if s.untuned() == smallest.untuned()], size, config.get)
            cover += [*_cover(with_smallest_config, size, lambda s: _shown(s, tuned)),
                      max(with_smallest_config, key=tile.get)]
        chosen.update(dict.fromkeys(cover))
    return list(chosen)


def _split_estimate(spec, arch):
    """decode_attention.split_shared_memory for a recorded launch of the split kernel, on sm_{arch}."""
    from llmrun.kernels.decode_attention import split_shared_memory

    kinds = {name: kind for name, kind, _ in spec.params}
    consts = spec.constexprs
    sizes = {name: _element_bytes(kinds[name]) for name in ("Q", "K", "V", "KScale", "KMin", "KRecent", "VRecent")}
    options = dict(spec.options)
    return split_shared_memory(arch // 10, sizes, consts["BITS"], consts["GROUP"], consts["SCORES"], consts["BLOCK_M"],
                               consts["BLOCK_D"], consts["BLOCK_N"], options["num_stages"], options["num_warps"])


def _pruned(spec, arch, limit):
    """Whether the split kernel's autotuner, on sm_{arch} with `limit` bytes of shared memory a block, drops this
    launch's config before compiling it: decode_attention's own pruning, given stand-ins of the tensors' dtypes."""
    from llmrun.kernels import decode_attention

    if spec.name != "_split_kernel":
        return False
    dtypes = {1: torch.uint8, 2: torch.float16, 4: torch.float32}
    named = {name: torch.empty(0, dtype=dtypes[_element_bytes(kind)]) for name, kind, _ in spec.params
             if name in ("Q", "K", "V", "KScale", "KMin", "KRecent", "VRecent")}
    consts = spec.constexprs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_attention, "_device_limits", lambda index: (arch // 10, limit))
        kept = decode_attention._configs_that_fit(decode_attention.SPLIT_CONFIGS, named, **consts)
    options = dict(spec.options)
    return all((c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) != (consts["BLOCK_N"], options["num_warps"],
                                                                     options["num_stages"]) for c in kept)


def _at_the_limit(specs, arch, limit):
    """The split kernel's launches whose estimate falls near `limit`, per size of q's elements and cache format: one
    estimated to fit, one not, each within 10% of the limit (else the closest), the smallest tile of those (compile
    time grows with it), then the one with the most arguments aligned (so the most copied ahead). There the
    autotuner's decisions are closest. fp32 only over a dense cache: over a quantized one it compiles for up to a
    minute, and its terms are those of 16-bit q at BLOCK_M < 64 but INT4's two parts of p (the cover's INT4 launches
    with fp32 q check those: all 36 fp32 INT4 configs compiled once, on both targets, with num_stages 2 came within
    128 bytes of the estimate, and with 3 below it)."""
    chosen = {}
    for spec in specs:
        if spec.name != "_split_kernel":
            continue
        q_bytes = _element_bytes(next(kind for name, kind, _ in spec.params if name == "Q"))
        bits = next(value for name, _, value in spec.params if name == "BITS")
        if q_bytes == 4 and bits:
            continue
        estimate = _split_estimate(spec, arch)
        group = (q_bytes, bits, estimate <= limit)
        rank = (max(abs(estimate - limit) / limit, 0.1), _size(spec), -sum(value == "D" for _, _, value in spec.params))
        if group not in chosen or rank < chosen[group][0]:
            chosen[group] = rank, spec
    return [spec for _, spec in chosen.values()]


def _on_target(spec, arch):
    """The launch as it is on sm_{arch}: without programmatic dependent launch before sm_90 (`common.pdl_options`)."""
    if arch >= 90:
        return spec
    params = tuple((name, kind, False if name == "PDL" else value) for name, kind, value in spec.params)
    return dataclasses.replace(spec, params=params, options=tuple(o for o in spec.options if o[0] != "launch_pdl"))


def _device_steps(specs):
    """The split kernel's smallest launch with a device-side key count (a CUDA graph's step) per cache format: the
    cover shows each value of BITS and of DEVICE_LEN, not each pair, and INT4's count its code spans there."""
    chosen = {}
    for spec in sorted((s for s in specs if s.name == "_split_kernel"), key=_size):
        consts = spec.constexprs
        if consts["DEVICE_LEN"]:
            chosen.setdefault(consts["BITS"], spec)
    return list(chosen.values())


# --- compiling, in a subprocess without TRITON_INTERPRET --------------------------------------------------------


# What the tests look for in a launch's PTX: code that compiles, yet computes otherwise than the interpreter does
def _in_loops(ptx: str) -> str:
    """The PTX of every loop: from each branch back to a label, the lines from that label on (not what lies between
    one loop and the next: the GEMV's split-K slices meet at a barrier between its two loops)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\$(\w+):", line))}
    back = [(labels[m.group(1)], i) for i, line in enumerate(lines)
            if (m := re.search(r"\bbra(?:\.uni)?\s+\$(\w+);", line)) and labels.get(m.group(1), i) < i]
    return "\n".join("\n".join(lines[h:i]) for h, i in back)


def _before_wait(ptx: str) -> str | None:
    """The PTX before a kernel's first grid dependency wait (PDL), or None if it has none."""
    at = ptx.find("griddepcontrol.wait")
    return None if at < 0 else ptx[:at]


PTX_FINDINGS = {  # name -> whether a kernel's PTX shows it
    # round half to even by adding and subtracting 1.5 * 2^23 (kv_write's codes): fused into an fma with the product
    # before it, the exact product is rounded rather than its fp32 value, as the reference rounds
    "rounding add fused with a product": re.compile(r"fma\.rn\.f32\s[^;]*,\s*0f4B400000;").search,
    # threads trading values every step of a loop, through shuffles or shared memory they store to (the GEMV's must
    # not: its barriers only guard the shared memory cp.async copies W's tiles ahead into, which no thread stores to)
    "a shuffle or shared-memory store in a loop": lambda ptx: bool(re.search(r"\bshfl\.|\bst\.shared", _in_loops(ptx))),
    # threads trading values anywhere in the kernel: a sum across threads, whose order follows the tile's layout
    "a shuffle or shared-memory store": lambda ptx: bool(re.search(r"\bshfl\.|\bst\.shared", ptx)),
    # copies into shared memory by cp.async, which Triton's pipeliner alone emits: a loop's loads issued steps ahead
    "W copied ahead by cp.async": lambda ptx: "cp.async.commit_group" in ptx,
    # an integer converted to a float (I2F: a quarter of an integer add's rate on Hopper) inside a loop: the GEMV and
    # the attention turn their codes into floats by bit arithmetic instead (common.exact_float)
    "an int-to-float conversion in a loop": lambda ptx: bool(re.search(r"\bcvt\.rn\.f32\.[su]\d+", _in_loops(ptx))),
    # programmatic dependent launch: the kernel may run while the one before finishes, so it must wait before it
    # writes anything, and before it reads anything but weights
    "a grid dependency wait": lambda ptx: _before_wait(ptx) is not None,
    "a write before the grid dependency wait":
        lambda ptx: bool(re.search(r"\b(st|atom|red)\.global", _before_wait(ptx) or "")),
    "a read before the grid dependency wait": lambda ptx: bool(re.search(r"\bld\.global", _before_wait(ptx) or "")),
}


def _compile_one(job):
    """(module, name, (signature, constexprs, attrs), options, arch) -> (shared memory bytes or None, error or None,
    seconds, the PTX_FINDINGS its PTX shows)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    module, name, (signature, constexprs, attrs), options, arch = job
    target = GPUTarget("cuda", arch, 32)
    start = time.perf_counter()
    try:
        attrs = {path: make_backend(target).parse_attr(value) for path, value in attrs.items()}
        source = ASTSource(getattr(importlib.import_module(module), name), signature, constexprs, attrs)
        compiled = triton.compile(source, target=target, options=dict(options))
    except Exception as e:  # noqa: BLE001 - any compiler error is the finding
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - start, ()
    findings = tuple(name for name, shows in PTX_FINDINGS.items() if shows(compiled.asm["ptx"]))
    return compiled.metadata.shared, None, time.perf_counter() - start, findings


def _compile_main(jobs_path, results_path):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import llmrun.kernels  # noqa: F401 - imported once, before the fork
    import triton.compiler  # noqa: F401

    with open(jobs_path, "rb") as f:
        jobs, workers = pickle.load(f)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_compile_one, jobs))
    with open(results_path, "wb") as f:
        pickle.dump(results, f)


def _compile(jobs, cache_dir):
    """[(spec, arch)] -> {(spec, arch): (shared memory, error, seconds, PTX findings)}, compiled in parallel by a
    fresh Python."""
    jobs = sorted(dict.fromkeys(jobs), key=lambda job: -_size(job[0]))  # the long ones first
    raw = [(s.module, s.name, s.compile_args(), s.options, arch) for s, arch in jobs]
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        jobs_path, results_path = os.path.join(tmp, "jobs"), os.path.join(tmp, "results")
        with open(jobs_path, "wb") as f:
            pickle.dump((raw, workers), f)
        done = subprocess.run([sys.executable, __file__, jobs_path, results_path], env=env, capture_output=True,
                              text=True, timeout=1200)
        assert done.returncode == 0, done.stderr[-3000:]
        with open(results_path, "rb") as f:
            return dict(zip(jobs, pickle.load(f)))


# --- the tests -------------------------------------------------------------------------------------------------------


def _nvidia_backend_or_skip():
    pytest.importorskip("triton")
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception as e:  # noqa: BLE001 - no NVIDIA backend in this build, or no ptxas
        pytest.skip(f"this Triton build cannot compile for NVIDIA GPUs: {type(e).__name__}: {e}")
    if not ptxas or not os.access(ptxas, os.X_OK):
        pytest.skip(f"this Triton build has no usable ptxas ({ptxas!r})")


@pytest.fixture(scope="module")
def launched():
    """The distinct specializations of every launch llmrun makes on a GPU."""
    _nvidia_backend_or_skip()
    return _record(H100_SMS)


@pytest.fixture(scope="module")
def compiled(launched, tmp_path_factory):
    """{(spec, arch): (shared memory bytes, error, seconds, PTX findings)} of the chosen specs on both targets, and
    on each target the split kernel's configs at the edge of its shared memory."""
    chosen = launched if os.environ.get("LLMRUN_COMPILE_ALL") == "1" else _choose(launched) + _device_steps(launched)
    jobs = [(_on_target(s, arch), arch) for s in chosen for arch, _ in (TARGETS[t] for t in COVERED)]
    jobs += [(_on_target(s, arch), arch) for arch, limit in TARGETS.values() for s in _at_the_limit(launched, arch, limit)]
    return _compile(jobs, tmp_path_factory.mktemp("triton-cache"))


def test_every_triton_kernel_is_launched(launched):
    """Each @triton.jit function in kernels/ is launched by the sweep above, or called by one that is."""
    kernels = _jit_functions()
    called = {name for fn in kernels.values() for name in fn.fn.__code__.co_names if name in kernels}
    assert set(kernels) - called - {s.name for s in launched} == set()


@pytest.mark.parametrize("target", TARGETS)
def test_kernels_compile_and_fit_shared_memory(target, compiled):
    """No compile error, and every launch fits the target's shared memory but the split kernel's autotune configs
    that its pruning drops before compiling them."""
    arch, limit = TARGETS[target]
    results = {spec: result for (spec, a), result in compiled.items() if a == arch}
    failures = []
    for spec, (shared, error, *_) in sorted(results.items(), key=lambda r: r[0].describe()):
        if error is not None:
            failures.append(f"{spec.describe()}\n    " + error.strip()[-1500:].replace("\n", "\n    "))
        elif shared > limit and not _pruned(spec, arch, limit):
            failures.append(f"{spec.describe()}: {shared} bytes of shared memory, {target} has {limit}")
    assert not failures, f"{len(failures)} of {len(results)} fail on {target}:\n" + "\n".join(failures)


@pytest.mark.parametrize("target", COVERED)
def test_quantized_writes_round_the_fp32_product(target, compiled):
    """The KV writes' codes are round(x * inverse) of the fp32 product, as `ref.write_int8` / `write_int4` round it,
    on the GPU too: no rounding add fused with the product into one fma (it was, and on an H200 their bit-for-bit
    tests failed 14 times on fp16 and bf16 inputs, 2026-11-26). Checked in the PTX of every compiled launch of
    kv_write."""
    arch = TARGETS[target][0]
    writes = {spec: findings for (spec, a), (_, error, _, findings) in compiled.items()
              if a == arch and spec.module.endswith("kv_write") and error is None}
    assert {spec.name for spec in writes} >= {"_int8_rows_kernel", "_int4_values_kernel", "_int4_keys_kernel"}
    fused = [spec.describe() for spec, findings in writes.items() if "rounding add fused with a product" in findings]
    assert not fused, f"{len(fused)} of {len(writes)} launches fuse the rounding add:\n" + "\n".join(fused)


@pytest.mark.parametrize("target", COVERED)
def test_the_gemv_loop_trades_nothing_across_threads(target, compiled):
    """The W4A16/W8A16 GEMV's loop over K: each thread sums its own tile rows, with no shuffle and no store to shared
    memory inside it, for every row count (kernels/triton_quant_matmul.py; its versions that reduced across threads
    in the loop drew ~5% of an H200's bandwidth, 2026-11-26), and past STAGES 1 W's tiles are copied ahead by
    cp.async. Checked in the PTX of every compiled launch of it."""
    arch = TARGETS[target][0]
    gemvs = {spec: findings for (spec, a), (_, error, _, findings) in compiled.items()
             if a == arch and spec.name == "_gemv_kernel" and error is None}
    assert gemvs
    trading = [spec.describe() for spec, findings in gemvs.items()
               if "a shuffle or shared-memory store in a loop" in findings]
    assert not trading, f"{len(trading)} of {len(gemvs)} GEMV launches trade values in the loop:\n" + \
        "\n".join(trading)
    pipelined = {spec: findings for spec, findings in gemvs.items() if spec.constexprs["STAGES"] > 1}
    not_ahead = [spec.describe() for spec, findings in pipelined.items()
                 if "W copied ahead by cp.async" not in findings]
    assert pipelined and not not_ahead, f"{len(not_ahead)} of {len(pipelined)} GEMV launches of STAGES > 1 load W " \
        "in the step:\n" + "\n".join(not_ahead)


@pytest.mark.parametrize("target", COVERED)
def test_the_attention_mass_of_a_key_is_summed_by_one_thread(target, compiled):
    """H2O's mass kernel adds a key's weights row after row in one thread, with no shuffle and no shared memory: a
    sum across threads takes the order of the tile's layout, which follows the alignment Triton sees in the
    arguments, so an eager step over S keys and a CUDA graph's step over the capacity gave a key other bits (an
    H100, 2026-11-27, when the kernel summed a tile of rows with tl.sum). Checked in the PTX of every compiled
    launch of it."""
    arch = TARGETS[target][0]
    masses = {spec: findings for (spec, a), (_, error, _, findings) in compiled.items()
              if a == arch and spec.name == "_mass_kernel" and error is None}
    assert masses
    trading = [spec.describe() for spec, findings in masses.items() if "a shuffle or shared-memory store" in findings]
    assert not trading, f"{len(trading)} of {len(masses)} mass launches sum across threads:\n" + "\n".join(trading)


@pytest.mark.parametrize("target", TARGETS)
def test_split_kernel_shared_memory_estimate(target, compiled):
    """decode_attention.split_shared_memory, by which the autotuner drops the split kernel's configs before
    compiling them, against the compiler's figure: never below it (a config kept fits), and no config dropped fits
    with room to spare (10% of the target's shared memory). Checked on every compiled launch of the kernel, among
    them those whose estimate is closest to the target's limit on either side."""
    arch, limit = TARGETS[target]
    results = {spec: shared for (spec, a), (shared, error, *_) in compiled.items()
               if a == arch and spec.name == "_split_kernel" and error is None}
    wrong = []
    for spec, shared in sorted(results.items(), key=lambda r: r[0].describe()):
        estimate = _split_estimate(spec, arch)
        if estimate < shared or (estimate > limit and shared <= 0.9 * limit):
            wrong.append(f"{spec.describe()}: estimated {estimate} bytes, compiled {shared}; {target} has {limit}")
    assert sum(_split_estimate(spec, arch) > limit for spec in results) >= 3, "too few dropped configs checked"
    assert not wrong, f"{len(wrong)} of {len(results)} estimates are wrong for {target}:\n" + "\n".join(wrong)


if __name__ == "__main__":
    _compile_main(*sys.argv[1:])


def test_pdl_launches_wait_before_they_touch_the_step(compiled):
    """With programmatic dependent launch (LLMRUN_PDL=1, sm_90) a kernel may start while the one before it is still
    writing: every launch so made waits for it (griddepcontrol.wait) before any write, and before any read but the
    weights the GEMV and RMSNorm fetch ahead (nothing writes them during a forward). Without PDL (sm_80) no kernel
    holds the wait. Checked in the PTX of every compiled launch."""
    wrong = []
    for (spec, arch), (_, error, _, findings) in compiled.items():
        consts = spec.constexprs
        if error is not None:
            continue
        if not consts.get("PDL"):
            if "a grid dependency wait" in findings:
                wrong.append(f"sm_{arch} {spec.describe()}: waits, though launched without PDL")
            continue
        if "a grid dependency wait" not in findings or "a write before the grid dependency wait" in findings:
            wrong.append(f"sm_{arch} {spec.describe()}: no wait before its first write")
        elif "a read before the grid dependency wait" in findings and spec.name not in (
                "_gemv_kernel", "_rms_norm_kernel", "_head_rms_norm_kernel"):
            wrong.append(f"sm_{arch} {spec.describe()}: reads before the wait")
    assert {a for s, a in compiled if dict(s.options).get("launch_pdl")} == {90}
    assert not wrong, f"{len(wrong)} launches:\n" + "\n".join(wrong)


@pytest.mark.parametrize("target", COVERED)
def test_no_code_is_converted_by_i2f_in_a_hot_loop(target, compiled):
    """The W4A16/W8A16 GEMV's loop and the attention's loop over an INT8 or INT4 cache turn codes into floats with
    an integer add and a float add (`common.exact_float`), not I2F: at 16 a clock an SM on Hopper it held a W4A16
    GEMV (two codes a byte) under half an H200's bandwidth. Checked in the PTX of every compiled launch."""
    arch = TARGETS[target][0]
    hot = {}
    for (spec, a), (_, error, _, findings) in compiled.items():
        consts = spec.constexprs
        if (a == arch and error is None and spec.name in ("_gemv_kernel", "_gemv_dot_kernel", "_split_kernel")
                and consts["BITS"] in (4, 8)):
            hot[spec] = findings
    assert {spec.name for spec in hot} == {"_gemv_kernel", "_gemv_dot_kernel", "_split_kernel"}
    converting = [spec.describe() for spec, findings in hot.items() if "an int-to-float conversion in a loop" in findings]
    assert not converting, f"{len(converting)} of {len(hot)} launches convert with I2F:\n" + "\n".join(converting)
