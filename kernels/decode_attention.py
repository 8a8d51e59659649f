"""Triton attention over the KV cache for decoding: one new token, or a short block of T tokens (speculative
verification), against the S cached positions. `kernels.ref.attention` is the specification.

FlashDecoding: the keys a step can see are cut into splits along S; one program per (batch, kv head, split,
row block) runs an online softmax over its keys and writes a partial result (its output normalised by its own
sum, and the log2-sum-exp of its scores); `_combine_kernel` then merges the splits of each (batch, token,
query head). With one split the first kernel writes the output directly.

GQA: the G = Hq / Hkv query heads that share a kv head, times the T tokens, are the T * G rows of one program's
score tile (padded to a power of two and masked), so each K/V tile is loaded once for all of them.
head_dim is padded to a power of two (80, 96 -> 128) and masked.

On CUDA the split kernel is autotuned; elsewhere (the Triton interpreter in the tests) it runs with fixed
settings. Nothing here queries a device at import.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

SPLIT_ALIGN = 128  # split boundaries fall on multiples of this many keys (every BLOCK_N divides it)
MAX_TILE = 64 * 128  # rows (tokens x grouped heads) x padded head_dim per program, to bound the fp32
                     # accumulator's registers; more rows become another grid dimension
MAX_SPLITS = 64


@triton.jit
def _load_kv(base, offs_n, offs_d, stride_s, mask):
    """One (BLOCK_N, BLOCK_D) tile of K or V as the dot product consumes it.

    Every K/V read goes through here: a quantized cache (INT8/INT4 with per-row or per-group scales) becomes
    a change to this function (load the packed codes and scales, return the dequantized tile) plus the
    pointers it needs, without touching the softmax."""
    return tl.load(base + offs_n[:, None] * stride_s + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _split_kernel(
    Q, K, V, Out, MidO, MidLse,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_ot, stride_oh,
    T, S, Hkv, G, D, lo, split_len, window, qk_scale,
    HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(0)  # b * Hkv + kv head
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)  # b * stride_kb passes 2^31 elements in a large batched cache
    kvh = pid_bh % Hkv

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = t * G + g
    t = rows // G
    h = kvh * G + rows % G  # query head
    row_ok = rows < T * G
    pos = S - T + t  # key position of each row's token
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    q_ptrs = Q + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    start = lo + split * split_len
    end = tl.minimum(start + split_len, S)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _load_kv(k_base, offs_n, offs_d, stride_ks, kv_mask)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - offs_n[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(v_base, offs_n, offs_d, stride_vs, kv_mask)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if DIRECT:
        o_ptrs = Out + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # MidO (B, T, Hq, n_splits, BLOCK_D) and MidLse (B, T, Hq, n_splits), both contiguous fp32
        n_splits = tl.num_programs(1)
        Hq = Hkv * G
        mid = ((b * T + t) * Hq + h) * n_splits + split  # (BLOCK_M,)
        tl.store(MidO + mid[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(MidLse + mid, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    MidO, MidLse, Out,
    stride_ob, stride_ot, stride_oh,
    T, Hq, n_splits, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # (b * T + t) * Hq + h
    b = row // (T * Hq)
    t = (row // Hq) % T
    h = row % Hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    lse = tl.load(MidLse + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    o = tl.load(MidO + (row * n_splits + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # a split that saw no key weighs 0
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < D)


@cache
def _split_launcher(cuda: bool):
    """(kernel, fixed launch settings): autotuned over BLOCK_N, warps and stages on CUDA, fixed otherwise."""
    if not cuda:
        return _split_kernel, {"BLOCK_N": 64, "num_warps": 4}
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
               for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    return triton.autotune(configs, key=["BLOCK_M", "BLOCK_D", "HAS_WINDOW", "DIRECT", "PRECISION"])(_split_kernel), {}


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_splits(keys: int, programs: int, device: torch.device) -> int:
    """Enough splits to give every SM ~2 programs, each split at least SPLIT_ALIGN keys."""
    if device.type == "cuda":
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(keys, SPLIT_ALIGN), MAX_SPLITS))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, *,
                     num_splits: int | None = None) -> torch.Tensor:
    """Causal GQA attention of the T newest tokens over a KV cache, as `ref.attention` defines it.

    q: (B, T, Hq, D) token-major, the queries of the last T of S positions (T small: 1 for decode, up to ~16
       to verify a speculation); any strides with q.stride(-1) == 1 (else it is copied).
    k, v: (B, Hkv, S, D) head-major views of the cache buffer, typically `buf[:, :, :S]` of a (B, Hkv, max_len, D)
       buffer; any batch/head/position strides, last dim contiguous. Hq % Hkv == 0: query head h reads kv
       head h // (Hq / Hkv).
    window: if given, query t (at position S - T + t) sees only keys in (pos - window, pos]; else [0, pos].
    num_splits: how many pieces the keys are cut into (FlashDecoding); by default enough to fill the GPU.
    q, k, v share one dtype (fp32, fp16 or bf16) and device; D any size (tested 64-256).
    Returns (B, T, Hq, D) contiguous in q's dtype; scores use scale 1/sqrt(D) and an fp32 softmax.
    """
    B, T, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    assert k.shape == v.shape == (B, Hkv, S, D) and Hq % Hkv == 0 and 1 <= T <= S, (q.shape, k.shape, v.shape)
    assert k.dtype == v.dtype == q.dtype and k.stride(-1) == 1 and v.stride(-1) == 1, "K/V rows must be contiguous"
    if q.stride(-1) != 1:
        q = q.contiguous()
    G = Hq // Hkv
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_M = min(max(16, triton.next_power_of_2(T * G)), MAX_TILE // BLOCK_D)  # tl.dot wants >= 16 rows
    m_blocks = triton.cdiv(T * G, BLOCK_M)

    lo = 0 if window is None else max(0, S - T + 1 - window)  # the earliest key any query sees
    keys = S - lo
    if num_splits is None:
        num_splits = _num_splits(keys, B * Hkv * m_blocks, q.device)
    split_len = triton.cdiv(triton.cdiv(keys, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    num_splits = triton.cdiv(keys, split_len)  # no empty split after rounding up
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(B, T, Hq, num_splits, BLOCK_D, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, T, Hq, num_splits, dtype=torch.float32, device=q.device)

    kernel, settings = _split_launcher(q.device.type == "cuda")
    kernel[(B * Hkv, num_splits, m_blocks)](
        q, k, v, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        T, S, Hkv, G, D, lo, split_len, window or 0, math.log2(math.e) / math.sqrt(D),
        HAS_WINDOW=window is not None, DIRECT=direct, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, **settings,
    )
    if not direct:
        _combine_kernel[(B * T * Hq,)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), out.stride(2), T, Hq, num_splits, D,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=BLOCK_D,
        )
    return out
