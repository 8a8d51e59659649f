"""Kernels for the model's hot ops. `kernels.ref` is the specification; the names exported here are the one
dispatch point the models call: Triton kernels for CUDA tensors (imported on first use, so a machine without
Triton still runs), the C kernels of `kernels.cpu` for fp32 tensors on the CPU when they could be built, and
the reference ops elsewhere."""

import dataclasses
import functools
import os
import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import cpu, ref

# Inside `reference_ops()`, every op below is the plain-torch reference: the "plain PyTorch" baseline. A plain
# global, not a ContextVar: torch.compile traces a global's value (and guards on it), where a ContextVar's get()
# breaks the graph (the compiled baseline, `llmrun.compiled`). Models run on one thread.
_reference = False


@contextmanager
def reference_ops(on: bool = True):
    """Within this block (when `on`), run the reference op of `kernels.ref` for every op, on every device."""
    global _reference
    before, _reference = _reference, on
    try:
        yield
    finally:
        _reference = before

__all__ = ["reference_ops", "add_rms_norm", "apply_rope", "attention", "cpu_kernels_serve", "dequantized_int8", "failed",
           "grid_error", "head_rms_norm_", "int4_attention", "linear", "quant_matmul", "quant_rows",
           "quantized_attention", "rms_norm", "rope_write_dense", "rope_write_int8", "silu_mul", "triton_serves",
           "write_dense", "write_int4", "write_int8_pair"]


def _use_cpu_kernels(x: torch.Tensor, dtype=None) -> bool:
    """Whether the C kernels serve x (or, with `dtype`, a result of that dtype computed on x's device)."""
    return (x.device.type == "cpu" and (dtype or x.dtype) == torch.float32 and not _reference
            and cpu.available())


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and not _reference


_failed: set[str] = set()  # Triton kernels that failed to build here: their reference op serves instead


def failed() -> list[str]:
    """The GPU kernels (Triton's, or a fused PyTorch path) that failed here so far, whose PyTorch reference ops run
    instead (a benchmark's note)."""
    return sorted(_failed)


def _triton(name: str, run, fallback):
    """run() the Triton kernel `name` (or a PyTorch fused path); if it cannot be compiled or run on this machine (a
    Triton or driver version it was never built on), say so once and use the reference op from then on."""
    if name not in _failed:
        try:
            return run()
        except Exception as e:  # noqa: BLE001 - a compiler error of any kind; CUDA faults are not recoverable anyway
            _failed.add(name)
            warnings.warn(f"llmrun: the kernel {name} failed ({type(e).__name__}: {e}); using the reference op",
                          RuntimeWarning, stacklevel=3)
    return fallback()


def rms_norm(x, weight, eps: float):
    """x (..., dim) * rsqrt(mean(x^2) + eps) * weight."""
    if _use_triton(x):
        from .norm import rms_norm as triton_rms_norm

        return _triton("rms_norm", lambda: triton_rms_norm(x, weight, eps), lambda: ref.rms_norm(x, weight, eps))
    if _use_cpu_kernels(x) and x.is_contiguous() and weight.dtype == torch.float32:
        return cpu.rms_norm(x, weight, eps)
    return ref.rms_norm(x, weight, eps)


def add_rms_norm(x, y, weight, eps: float):
    """(h, rms_norm(h)) with h = x + y: a block's residual add and the norm after it (one pass on CUDA)."""
    if _use_triton(x):
        from .norm import add_rms_norm as triton_add_rms_norm

        return _triton("add_rms_norm", lambda: triton_add_rms_norm(x, y, weight, eps),
                       lambda: (x + y, ref.rms_norm(x + y, weight, eps)))
    h = x + y
    return h, rms_norm(h, weight, eps)


def head_rms_norm_(qkv, n_q: int, n_k: int, q_weight, k_weight, eps: float):
    """In place: heads [0, n_q) of qkv (B, T, H, D) RMS-normalized over D with q_weight, the next n_k with k_weight
    (Qwen3's q/k norms, before RoPE). One launch on CUDA; elsewhere `rms_norm` of each part (the C kernel's bits on
    a CPU, which its whole-stack call reproduces). Returns qkv."""
    def parts():
        q, k = qkv[:, :, :n_q], qkv[:, :, n_q : n_q + n_k]
        q.copy_(rms_norm(q.contiguous(), q_weight, eps))
        k.copy_(rms_norm(k.contiguous(), k_weight, eps))
        return qkv

    if _use_triton(qkv) and qkv.is_contiguous():
        from .norm import head_rms_norm_ as triton_head_rms_norm_

        return _triton("head_rms_norm_", lambda: triton_head_rms_norm_(qkv, n_q, n_k, q_weight, k_weight, eps), parts)
    return parts()


def _heads_contiguous(x) -> bool:  # (1, T, H, D) whose heads are packed within each token
    return x.shape[0] == 1 and x.stride(3) == 1 and x.stride(2) == x.shape[3]


def apply_rope(x, cos, sin):
    """x (B, T, H, D) rotated by cos/sin (T, D) ("rotate half"). May rotate x in place and return it."""
    if _use_triton(x) and x.stride(3) == 1 and x.stride(2) == x.shape[3]:
        from .rotary import rope_ as triton_rope_

        return _triton("rope", lambda: triton_rope_(x, cos, sin), lambda: ref.apply_rope(x, cos, sin))
    if _use_cpu_kernels(x) and _heads_contiguous(x) and cos.is_contiguous() and sin.is_contiguous():
        return cpu.rope_(x, cos, sin)
    return ref.apply_rope(x, cos, sin)


def silu_mul(gate, up):
    """silu(gate) * up, both (..., ffn_dim)."""
    if _use_triton(gate) and gate.stride(-1) == 1 and up.stride(-1) == 1 and gate.stride() == up.stride():
        from .activation import silu_mul as triton_silu_mul

        return _triton("silu_mul", lambda: triton_silu_mul(gate, up), lambda: ref.silu_mul(gate, up))
    if _use_cpu_kernels(gate) and gate.dim() == 3 and gate.shape[0] == 1 and gate.stride(-1) == 1 \
            and gate.stride() == up.stride():
        return cpu.silu_mul(gate, up)
    return ref.silu_mul(gate, up)


def attention(q, k, v, window: int | None = None, mass=None, length=None):
    """Causal GQA attention: q (B, T, Hq, D), k/v (B, Hkv, S, D) -> (B, T, Hq, D) (see `ref.attention`).
    On CUDA, decoding and verification (T <= 16) run the split-K Triton kernel; prefill stays on SDPA.
    mass: if given, fp32 (B, Hkv, S) to which each key's attention weight is added (`ref.attention_mass`).
    length: if given, an int32 (1,) device tensor: only keys [0, length) are in use (the queries are the last T of
    them) and S is the buffer's capacity; the Triton kernel reads it on the device (a step in a CUDA graph), the
    plain-PyTorch path masks the unused slots (static shapes, no host sync: what torch.compile graphs)."""
    triton = _use_triton(q) and q.shape[1] <= 16 and k.stride(-1) == 1 and v.stride(-1) == 1
    if length is not None and _reference and mass is None:
        return ref.attention(q, k, v, window, length=length)
    if length is not None and not triton:  # read the count here (a host sync: no CUDA graph runs this path)
        n = int(length)
        k, v, mass, length = k[:, :, :n], v[:, :, :n], None if mass is None else mass[:, :, :n], None
    if triton:
        from .decode_attention import decode_attention

        def fallback():
            if mass is not None:
                mass.add_(ref.attention_mass(q, k, window))
            return ref.attention(q, k, v, window)

        if length is not None:  # a CUDA graph's step: no fallback could run inside the capture
            return decode_attention(q, k, v, window, mass=mass, length=length)
        return _triton("decode_attention", lambda: decode_attention(q, k, v, window, mass=mass), fallback)
    if _use_cpu_kernels(q) and _heads_contiguous(q) and _cache_rows(k) and k.stride() == v.stride() \
            and (mass is None or mass.stride(-1) == 1):
        return cpu.attention(q, k, v, window, mass)
    if _use_triton(q) and window is None and mass is None and q.dtype in (torch.float16, torch.bfloat16):
        return _triton("SDPA causal_lower_right", lambda: _chunk_attention(q, k, v), lambda: ref.attention(q, k, v))
    y = ref.attention(q, k, v, window)
    if mass is not None:
        mass.add_(ref.attention_mass(q, k, window))
    return y


def _chunk_attention(q, k, v):
    """`ref.attention` of a prompt chunk, the last T of S positions, without a window: the causal mask as PyTorch's
    lower-right causal bias rather than a (T, S) tensor, which lets SDPA run FlashAttention on CUDA (an explicit
    mask rules it out; where flash cannot run, the bias is materialized into that same mask)."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q.shape[1], k.shape[2])
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=bias, enable_gqa=q.shape[2] != k.shape[1])
    return y.transpose(1, 2)


def _cache_rows(x) -> bool:  # (1, Hkv, S, ...) whose rows are contiguous: a view of a KV cache buffer
    return x.shape[0] == 1 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def _cpu_reads(q, kv: ref.QuantizedKV, mass) -> bool:
    """Whether the C kernels can attend over kv's codes directly (batch 1, cache views, fp32 queries)."""
    if not (_use_cpu_kernels(q) and _heads_contiguous(q) and (mass is None or mass.stride(-1) == 1)):
        return False
    if kv.bits == 8:
        return (all(_cache_rows(t) for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)) and kv.k.stride() == kv.v.stride()
                and kv.k_scale.stride() == kv.v_scale.stride())
    return cpu.int4_layout_ok(kv.k, kv.v, kv.k_scale, kv.k_min, kv.v_scale, kv.v_min, kv.k_recent, kv.v_recent)


def quantized_attention(q, kv: ref.QuantizedKV, window: int | None = None, mass=None, length=None):
    """`attention` over a quantized cache (`ref.QuantizedKV`, INT8 or INT4) -> (B, T, Hq, D) in q's dtype.
    On CUDA (T <= 16) the Triton kernel dequantizes tiles in registers, and so do the C kernels on the CPU (fp32);
    elsewhere (a prompt chunk on a GPU, 16-bit on a CPU) the cache is dequantized first, and attended in one call
    (INT4: `int4_attention`). length: as for `attention`; INT4 then reads the key groups full at each row's
    position as codes (`quantized_decode_attention`)."""
    if length is not None and not (_use_triton(q) and q.shape[1] <= 16):  # read the count (a host sync)
        n = int(length)
        kv, mass, length = _in_use(kv, n), None if mass is None else mass[:, :, :n], None

    def dequantized():
        if kv.bits == 4:
            return int4_attention(q, kv, window, mass)
        return attention(q, *dequantized_int8(kv, q.dtype), window, mass)

    if _use_triton(q) and q.shape[1] <= 16:
        from .decode_attention import quantized_decode_attention

        if length is not None:
            return quantized_decode_attention(q, kv, window, mass=mass, length=length)
        return _triton("quantized_decode_attention",
                       lambda: quantized_decode_attention(q, kv, window, mass=mass), dequantized)
    if _cpu_reads(q, kv, mass):
        if kv.bits == 8:
            return cpu.attention_int8(q, kv.k, kv.v, kv.k_scale, kv.v_scale, window, mass)
        return cpu.attention_int4(q, kv, window, mass)
    return dequantized()


def dequantized_int8(kv: ref.QuantizedKV, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An INT8 cache's keys and values (B, Hkv, S, D) in `dtype`, bit for bit `ref.dequantize_kv`'s rounded once: on
    CUDA one launch for K and V (five torch passes over fp32 each otherwise)."""
    if _use_triton(kv.k) and kv.k.stride() == kv.v.stride() and kv.k_scale.stride() == kv.v_scale.stride():
        from .kv_dequantize import int8_pair

        return _triton("kv_dequantize", lambda: int8_pair(kv.k, kv.v, kv.k_scale, kv.v_scale, dtype),
                       lambda: tuple(x.to(dtype) for x in ref.dequantize_kv(kv)))
    return tuple(x.to(dtype) for x in ref.dequantize_kv(kv))


def int4_attention(q, kv: ref.QuantizedKV, window: int | None = None, mass=None) -> torch.Tensor:
    """`ref.quantized_attention` over an INT4 cache in one SDPA call, whatever the rows read as codes. Row r (at
    position S - T + r) reads positions [0, nq_r) from their codes and the rest exact from the rings
    (`QuantizedKV.row_quantized`), so a prompt chunk's rows come in runs of KEY_GROUP that read different keys;
    the reference attends each run over its own dequantized cache (16 calls over the whole cache for a 512-token
    chunk: an H100's INT4 prefill at 8k ran 1/16 as fast as bf16's). Here the keys are positions [0, nq_last) from
    their codes followed by [nq_first, S) exact, each in q's dtype (computed in fp32, rounded once, as the
    reference's), and row r's mask keeps of each position the copy it reads, up to its own position (and within
    the window): each row attends to the reference's keys and values, in position order. mass: as `attention`'s,
    the two copies of a position summed into it."""
    B, T, Hq, D = q.shape
    S, dtype = kv.length, q.dtype
    nq = kv.row_quantized(T)
    first, last = (nq[0], nq[-1]) if T else (kv.n_quantized, kv.n_quantized)
    ring, mask = _int4_chunk_layout(S, T, tuple(nq), first, last, kv.k_recent.shape[2], window, q.device)
    Hkv = kv.k.shape[1]
    # of CUDA's fused SDPA kernels flash takes no mask, the memory-efficient one no GQA: with both, SDPA would fall
    # back to its math kernel (the (Hq, T, S) scores in memory, several passes over them); there the kv heads are
    # repeated for their query heads instead, which the memory-efficient kernel takes with the mask
    G = Hq // Hkv if q.is_cuda else 1

    def keys_values():
        k_codes = ref.dequantize_int4_channels(kv.k[:, :, :last], kv.k_scale, kv.k_min)
        v_codes = ref.dequantize_int4_tokens(kv.v[:, :, :last], kv.v_scale[:, :, :last], kv.v_min[:, :, :last])
        k = torch.cat((k_codes.to(dtype), kv.k_recent[:, :, ring].to(dtype)), dim=2)
        v = torch.cat((v_codes.to(dtype), kv.v_recent[:, :, ring].to(dtype)), dim=2)
        return (k, v) if G == 1 else (k.repeat_interleave(G, 1), v.repeat_interleave(G, 1))

    if _use_triton(q):  # the same keys and values in one launch (some twenty torch launches a layer and chunk)
        from .kv_dequantize import int4_pair

        k_heads, v_heads = _triton("kv_dequantize_int4", lambda: int4_pair(kv, first, last, dtype, G), keys_values)
    else:
        k_heads, v_heads = keys_values()
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k_heads, v_heads, attn_mask=mask,
                                       enable_gqa=Hq != k_heads.shape[1])
    if mass is not None:
        weights = ref.attention_mass(q, k_heads[:, ::G], mask=mask)  # each kv head's keys (its first copy)
        mass[:, :, :last] += weights[:, :, :last]
        mass[:, :, first:S] += weights[:, :, last:]
    return y.transpose(1, 2)


@functools.lru_cache(maxsize=1)
def _int4_chunk_layout(S: int, T: int, nq: tuple[int, ...], first: int, last: int, R: int, window: int | None,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_attention`'s ring slots (S - first,) of the exact keys [first, S), and its (T, last + S - first) bool
    mask: the same for every layer of a prompt chunk (their caches hold the same positions), so made once a chunk
    rather than a layer (some fifteen small launches and a copy from the host each)."""
    ring = torch.arange(first, S, device=device) % R
    position = torch.cat((torch.arange(last, device=device), torch.arange(first, S, device=device)))
    as_code = torch.arange(position.numel(), device=device) < last
    row = S - T + torch.arange(T, device=device)[:, None]  # (T, 1) each query's position
    cut = torch.tensor(nq, device=device, dtype=torch.long)[:, None]
    mask = (position <= row) & torch.where(as_code, position < cut, position >= cut)
    if window is not None:
        mask &= row - position < window
    return ring, mask


def _in_use(kv: ref.QuantizedKV, n: int) -> ref.QuantizedKV:
    """kv, handed over a buffer's capacity, cut to its first n positions. INT4: its full key groups as codes, and
    the exact keys the rings hold after them, as a device step's cache holds them (`llmrun.kv_cache`)."""
    if kv.bits == 8:
        return dataclasses.replace(kv, k=kv.k[:, :, :n], v=kv.v[:, :, :n], k_scale=kv.k_scale[:, :, :n],
                                   v_scale=kv.v_scale[:, :, :n])
    n_quantized, first_exact = ref.int4_decoded_state(n, kv.k_recent.shape[2])
    return dataclasses.replace(kv, k=kv.k[:, :, :n], v=kv.v[:, :, :n], v_scale=kv.v_scale[:, :, :n],
                               v_min=kv.v_min[:, :, :n], n_quantized=n_quantized, first_exact=first_exact)


def write_int8_pair(k, v, codes, scales, slots) -> None:
    """A quantized cache's INT8 write of a layer's K into codes[0], scales[0] and V into codes[1], scales[1] at the
    consecutive slots from slots[0] (`ref.write_int8` of each): on CUDA one Triton launch for both, the quantization
    fused with the stores."""
    if _use_triton(k):
        from .kv_write import write_int8_pair as triton_write

        return _triton("write_int8_pair", lambda: triton_write(k, v, codes, scales, slots),
                       lambda: _int8_each(k, v, codes, scales, slots))
    _int8_each(k, v, codes, scales, slots)


def _int8_each(k, v, codes, scales, slots) -> None:
    for i, x in enumerate((k, v)):
        ref.write_int8(x, codes[i], scales[i], slots)


def write_dense(k, v, k_out, v_out, slots) -> None:
    """A float cache's write of k, v (B, H, T, D) into k_out, v_out (B, H, C, D) at the consecutive slots (T,) from
    slots[0], cast to the cache's dtype: on CUDA one Triton launch for both, else `index_copy_` of each."""
    if _use_triton(k):
        from .kv_write import write_dense as triton_write

        return _triton("write_dense", lambda: triton_write(k, v, k_out, v_out, slots),
                       lambda: _index_copy(k, v, k_out, v_out, slots))
    _index_copy(k, v, k_out, v_out, slots)


def rope_write_dense(qkv, n_heads: int, cos, sin, k_out, v_out, slots):
    """A decode step's RoPE and float cache write: qkv (B, T, n_heads + 2 Hkv, D), its q and k heads rotated by
    cos/sin (T, D) (`apply_rope`), the rotated k and the v heads written into k_out, v_out (B, Hkv, C, D) at the
    consecutive slots (T,) from slots[0] (`write_dense`); -> the rotated q (B, T, n_heads, D). On CUDA one Triton
    launch for both, rotating qkv in place."""
    def kernel():
        from .rotary import rope_write_
        return rope_write_

    return _rope_write("rope_write", kernel, write_dense, qkv, n_heads, cos, sin, (k_out, v_out), slots)


def rope_write_int8(qkv, n_heads: int, cos, sin, codes, scales, slots):
    """`rope_write_dense` for an INT8 cache's layer (codes (2, B, Hkv, C, D), scales (2, B, Hkv, C, D / group)):
    RoPE, then `write_int8_pair` of the rotated k and the v heads; -> the rotated q. On CUDA one Triton launch."""
    def kernel():
        from .kv_write import rope_write_int8_
        return rope_write_int8_

    return _rope_write("rope_write_int8", kernel, write_int8_pair, qkv, n_heads, cos, sin, (codes, scales), slots)


def _rope_write(name, kernel, write, qkv, n_heads, cos, sin, cache, slots):
    """RoPE of qkv's q and k heads, then write(k, v, *cache, slots) of the rotated k and the v heads -> the rotated
    q; on CUDA kernel() (the Triton function) does both in one launch."""
    def apart():
        Hkv = (qkv.shape[2] - n_heads) // 2
        qk = apply_rope(qkv[:, :, : n_heads + Hkv], cos, sin)
        write(qk[:, :, n_heads:].transpose(1, 2), qkv[:, :, n_heads + Hkv :].transpose(1, 2), *cache, slots)
        return qk[:, :, :n_heads]

    def fused():
        kernel()(qkv, n_heads, cos, sin, *cache, slots)
        return qkv[:, :, :n_heads]

    if _use_triton(qkv) and qkv.stride(3) == 1 and qkv.stride(2) == qkv.shape[3]:
        return _triton(name, fused, apart)
    return apart()


def _index_copy(k, v, k_out, v_out, slots) -> None:
    k_out.index_copy_(2, slots, k.to(k_out.dtype))
    v_out.index_copy_(2, slots, v.to(v_out.dtype))


def write_int4(k, v, *cache, slots) -> None:
    """An INT4 write of consecutive slots (`ref.write_int4`: a decode step's, a prompt chunk's; cache = k_codes,
    v_codes, k_scale, k_min, v_scale, v_min, k_recent, v_recent): on CUDA two Triton launches, values and keys, the
    quantization fused with the stores."""
    if _use_triton(k):
        from .kv_write import write_int4 as triton_write

        return _triton("write_int4", lambda: triton_write(k, v, *cache, slots),
                       lambda: ref.write_int4(k, v, *cache, slots))
    ref.write_int4(k, v, *cache, slots)


def triton_serves(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve x (CUDA, not inside `reference_ops`): where the KV cache takes the fused
    writes for its ordinary steps too, so that they write what a CUDA graph's step writes."""
    return _use_triton(x)


def cpu_kernels_serve(x: torch.Tensor) -> bool:
    """Whether the C kernels serve x (fp32 on the CPU, kernels built, not inside `reference_ops`): where callers
    outside kernels/ (the KV cache's INT4 writes) take their C path."""
    return _use_cpu_kernels(x)


def grid_error(wg, e, scale, zero, top: int) -> torch.Tensor:
    """`ref.grid_error`: in C where the C kernels serve wg (`cpu.grid_error`: the same roundings, a group's sum in
    another order, so to float32 rounding), else the reference."""
    if _use_cpu_kernels(wg) and wg.shape[-1] % 8 == 0:
        from . import cpu

        return cpu.grid_error(wg, e.expand(1, *wg.shape[1:]), scale, zero, top)
    return ref.grid_error(wg, e, scale, zero, top)


def linear(x, weight, bias=None, gated: bool = False):
    """x (..., K) @ weight^T (+ bias) -> (..., N): a float linear layer; gated (weight's rows [gate; up], a SwiGLU
    MLP's fused projection): silu_mul of the two halves, (..., N / 2), in one launch on the GEMV. On CUDA, a decode
    step's rows (fewer than `DOT_ROWS`, 3) in 16 bits run the Triton GEMV (`triton_quant_matmul.float_linear`),
    more rows cuBLAS (F.linear): on an H100 (2026-11-26) the GEMV took the 1B shape's bf16 step from 1.405 to
    1.347 ms, and one row of every 8B matrix but qkv in 0.81-0.98x cuBLAS's time, where a block of 9 rows costs it
    3.4-4.7x one row and cuBLAS ~1x.
    LLMRUN_GEMV_FLOAT=0: cuBLAS for every row count; =1: the GEMV for up to 16 rows, whose row has the same bits
    whatever the rows beside it (greedy speculation bit for bit plain greedy's, as LLMRUN_GEMV_DOT=0 gives packed
    weights). K must divide into blocks of 32, the weight be in x's dtype. Elsewhere, F.linear."""
    if (_use_triton(x) and x.shape[-1] % 32 == 0 and weight.dtype == x.dtype
            and x.dtype in (torch.float16, torch.bfloat16)):
        from .triton_quant_matmul import DOT_ROWS, VERIFY_ROWS, float_linear

        choice = os.environ.get("LLMRUN_GEMV_FLOAT")
        rows = VERIFY_ROWS if choice == "1" else 0 if choice == "0" else DOT_ROWS - 1
        if x.numel() <= rows * x.shape[-1] and not (gated and weight.shape[0] % 2):
            return _triton("float_linear", lambda: float_linear(x, weight, bias, gated),
                           lambda: _gate(F.linear(x, weight, bias), gated))
    return _gate(F.linear(x, weight, bias), gated)


def _gate(y, gated: bool):
    """y, or with gated silu_mul of its two halves along the last dimension."""
    if not gated:
        return y
    half = y.shape[-1] // 2
    return silu_mul(y[..., :half], y[..., half:])


def quant_matmul(x, qs, d, m, bits: int, bias=None, gated: bool = False):
    """x (..., K) @ W^T (+ bias (N,)) -> (..., N) in x's dtype, W (N, K) in 4- or 8-bit blocks
    (`ref.dequantize_blocks`); gated as `linear`'s. On CUDA the Triton kernel keeps activations in 16 bits (W4A16 /
    W8A16), adds the bias in its fp32 sums and gates as it writes them; the CPU kernel rounds activations to 8 bits,
    and the bias is added to its result."""
    if _use_triton(x):
        from .triton_quant_matmul import quant_linear

        return _triton("quant_matmul", lambda: quant_linear(x, qs, d, m, bits, bias=bias, gated=gated),
                       lambda: _gate(_plus(x.float() @ ref.dequantize_blocks(qs, d, m, bits).T, bias).to(x.dtype),
                                     gated))
    if _use_cpu_kernels(x):
        return _gate(_plus(cpu.quant_matmul(x, qs, d, m, bits), bias), gated)
    return _gate(_plus(ref.quant_matmul(x, qs, d, m, bits).to(x.dtype), bias), gated)


def _plus(y, bias):
    return y if bias is None else y + bias


def quant_rows(ids, qs, d, m, bits: int, dtype):
    """Rows `ids` (...) of W (N, K) in blocks -> (..., K) in `dtype`: an embedding lookup (on CUDA one launch)."""
    if _use_triton(ids):
        from .triton_quant_matmul import dequantize

        return _triton("quant_rows", lambda: dequantize(qs, d, m, bits, 32, dtype, ids=ids),
                       lambda: _ref_quant_rows(ids, qs, d, m, bits, dtype))
    if _use_cpu_kernels(ids, dtype):
        return cpu.quant_rows(ids, qs, d, m, bits)
    return _ref_quant_rows(ids, qs, d, m, bits, dtype)


def _ref_quant_rows(ids, qs, d, m, bits: int, dtype):
    flat = ids.reshape(-1)
    w = ref.dequantize_blocks(qs[flat], d[flat], None if m is None else m[flat], bits)
    return w.reshape(*ids.shape, -1).to(dtype)
