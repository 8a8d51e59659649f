"""Triton attention over the KV cache for decoding: one new token, or a short block of T tokens (speculative
verification), against the S cached positions. `kernels.ref.attention` is the specification.

FlashDecoding: the keys a step can see are cut into splits along S; one program per (batch, kv head, split,
row block) runs an online softmax over its keys and writes a partial result (its output normalised by its own
sum, and the log2-sum-exp of its scores), and the split of a (batch, kv head, row block) that finishes last, as
a device counter tells, merges them for all of its rows at once (`_combine_rows`): one launch a step. With one split the
program writes the output directly.

GQA: the G = Hq / Hkv query heads that share a kv head, times the T tokens, are the T * G rows of the score tiles
(BLOCK_M = 16 rows a program, masked), so each K/V tile is loaded once for up to 16 of them.
head_dim is padded to a power of two (80, 96 -> 128) and masked.

A row's result does not depend on the rows beside it, nor on how many keys follow its own: greedy speculative
decoding needs a verification block's rows to round exactly as one-token steps do. So nothing about the tiling
follows T or S: the splits are cut at multiples of a fixed length (SPLIT_LEN keys), tiles start at multiples of
BLOCK_N within a split, every program has BLOCK_M rows, the autotuner's key holds nothing that T or S changes,
and the combine sums a row's splits in fixed runs numbered from the first key. Keys past a row's own (or before
its window) only ever add exact zeros: a masked tile leaves a row's running sums as they were, and a
split it cannot see weighs 0.

A quantized cache (`ref.QuantizedKV`, INT8 or INT4, `quantized_decode_attention`) is read as codes and scales, and
each tile is dequantized in registers (`_load_kv`) to q's dtype for the dot products, but under 16-bit q: there
the dot products take fp16 operands (bf16 q is converted once, exactly, within fp16's range; an INT4 cache's
rings too, which its fp16 scales already bound), because a code becomes an exact fp16 by bit arithmetic (an int8
code two a 32-bit instruction), scaled by its fp16 scale (INT4: plus its minimum, in one fma) without converting
the scale, the value rounding once, to 11 bits where bf16 keeps 8; bf16 operands would cost fp32 arithmetic a
code. INT4 keys and values switch from codes to the exact rings at a position that depends on the query row
(`ref.QuantizedKV.row_quantized`), between nq_lo (the first row's) and nq_hi (the last row's): a tile of positions
below nq_lo or from nq_hi on reads one version for every row; the one or two tiles that overlap [nq_lo, nq_hi)
load both, score both keys and pick per (row, key), and split each row's probabilities between the two versions
of the values. The tiles below nq_lo, nearly all of a long cache, run first in a loop of their own that loads no
ring (`_attend_tiles`' CODES), the rest after it. Nothing a step loads is waited on within the step: the codes are
copied a stage ahead as dense tiles are, and the per-group scales (and INT4 values' minimums), too narrow for
that, are fetched a tile ahead in the loop (`_attend_tiles`' AHEAD). No load masks a position (a tile's positions
past its split's last key read that key, weighed 0), and a power-of-two head_dim masks no channel (EVEN_D). sm_90
steps of 64 keys (Triton 3.8, head_dim 128, 4 warps, `bench/sass.py`): bf16 297 instructions a thread, INT8 810,
INT4's codes-only loop 779 (359, 910 and 886 with every load masked; under Triton 3.6 404, 944 and 1120, and 2253
for INT4 when every tile also loaded its ring entries, and its packed bytes one at a time).

Attention mass (H2O), when asked for: the split kernel also writes its masked scores to a (B, Hkv, T * G, keys)
scratch buffer, the combine (or, with one split, the split itself) writes each row's log2-sum-exp, and
`_mass_kernel` adds each key's probabilities, summed over the rows of its kv head, to the caller's buffer.

On CUDA the split kernel is autotuned, over the configs whose estimated shared memory (`split_shared_memory`) fits
the device; elsewhere (the Triton interpreter in the tests) it runs with fixed settings. Nothing here queries a
device at import.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

from . import common, ref

SPLIT_LEN = 256  # keys per split: splits start at its multiples (every BLOCK_N divides it)
BLOCK_M = 16  # query rows (tokens x grouped heads) per program, the least tl.dot takes; more rows, more programs
COMBINE_LSE = tl.constexpr(16)  # splits' lse a step of the combine's first pass (their largest) loads


_KEY_GROUP = tl.constexpr(ref.KEY_GROUP)  # positions per INT4 key scale


@triton.jit
def _group_values(base, stride_s, offs_n, offs_d, n_ok, D, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """A quantized tile's fp16 scales (or minimums), (BLOCK_N, BLOCK_D) in fp16: with PER_CHANNEL (INT4 keys) one per
    (group of KEY_GROUP positions, channel); else one per (position, group of GROUP channels), loaded once and
    spread over its group in registers (loaded at every channel, each thread issued as many 16-bit loads as the
    tile has channels: an H200's INT8 attention took 701 us a step at 8k positions against bf16's 396, for half
    the bytes)."""
    if PER_CHANNEL:
        at = offs_n[:, None] // _KEY_GROUP * stride_s + offs_d[None, :]
        x = tl.load(base + at, mask=n_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    else:
        x = _spread(_group_tile(base, stride_s, offs_n, n_ok, D, offs_d.shape[0], GROUP), GROUP)
    return x


@triton.jit
def _group_tile(base, stride_s, offs_n, n_ok, D, BLOCK_D: tl.constexpr, GROUP: tl.constexpr):
    """The fp16 scales (or minimums) of a tile's positions, one per (position, group of GROUP channels):
    (BLOCK_N, BLOCK_D // GROUP)."""
    groups = tl.arange(0, BLOCK_D // GROUP)
    mask = n_ok[:, None] & (groups * GROUP < D)[None, :]
    return tl.load(base + offs_n[:, None] * stride_s + groups[None, :], mask=mask, other=0.0)


@triton.jit
def _spread(per_group, GROUP: tl.constexpr):
    """(BLOCK_N, groups) -> (BLOCK_N, groups * GROUP): each value over its group's channels, in registers."""
    BLOCK_N: tl.constexpr = per_group.shape[0]
    GROUPS: tl.constexpr = per_group.shape[1]
    return tl.reshape(tl.broadcast_to(per_group[:, :, None], (BLOCK_N, GROUPS, GROUP)), (BLOCK_N, GROUPS * GROUP))


@triton.jit
def _load_kv(base, stride_s, scale_base, stride_scale_s, min_base, stride_min_s, offs_n, offs_d, n_ok, D,
             BITS: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, DTYPE: tl.constexpr,
             ASM: tl.constexpr, scales=None, minimums=None):
    """One (BLOCK_N, BLOCK_D) tile of K or V at positions offs_n, as the dot product consumes it (in DTYPE).

    Every K/V read goes through here, and a quantized tile is dequantized here, in registers. BITS 0: a dense cache.
    BITS 8: int8 code * the fp16 scale of its (position, group of GROUP channels), in fp32, or in fp16 when DTYPE is
    (`common.half_codes`, with ASM its PTX form): the same bits, one rounding of the exact product either way.
    BITS 4: bytes holding channels 2i (low nibble) and 2i + 1 (high); code * scale + min, scale and min per
    (position, channel group), or with PER_CHANNEL (INT4 keys) per (group of KEY_GROUP positions, channel); in fp32
    (each byte loaded for both its channels), or in fp16, rounded once (each byte loaded once, its nibbles joined).
    scales, minimums: the tile's per-group values (`_group_tile`) if the caller fetched them ahead, else None."""
    mask = n_ok[:, None] & (offs_d < D)[None, :]  # positions n_ok, channels below D
    if BITS == 0:
        x = tl.load(base + offs_n[:, None] * stride_s + offs_d[None, :], mask=mask, other=0.0)
    else:
        if scales is None:
            scale = _group_values(scale_base, stride_scale_s, offs_n, offs_d, n_ok, D, GROUP, PER_CHANNEL)
        else:
            scale = _spread(scales, GROUP)
        if BITS == 8:
            codes = tl.load(base + offs_n[:, None] * stride_s + offs_d[None, :], mask=mask, other=0)
            if DTYPE == tl.float16:
                x = common.half_codes(codes, ASM) * scale
            else:
                x = common.exact_float(codes) * scale.to(tl.float32)  # (no I2F: `common`)
        else:
            if minimums is None:
                lo = _group_values(min_base, stride_min_s, offs_n, offs_d, n_ok, D, GROUP, PER_CHANNEL)
            else:
                lo = _spread(minimums, GROUP)
            if DTYPE == tl.float16:  # each byte loaded once, its two nibbles joined as channels 2i and 2i + 1
                # (masked as pairs < D // 2, whose mask Triton sees constant over runs of 8 bytes: the tile is then
                # copied ahead 8 bytes an instruction; masked as 2 * pairs < D, it was loaded a byte at a time)
                BLOCK_N: tl.constexpr = offs_n.shape[0]
                BLOCK_D: tl.constexpr = offs_d.shape[0]
                pairs = tl.arange(0, BLOCK_D // 2)
                packed = tl.load(base + offs_n[:, None] * stride_s + pairs[None, :],
                                 mask=n_ok[:, None] & (pairs < D // 2)[None, :], other=0)
                low, high = common.nibble_halves(packed, ASM)
                x = tl.fma(tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_D)), scale, lo)
            else:
                packed = tl.load(base + offs_n[:, None] * stride_s + (offs_d // 2)[None, :], mask=mask, other=0)
                codes = (packed.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 0xF  # each byte read for both channels
                x = common.exact_float(codes) * scale.to(tl.float32) + lo.to(tl.float32)
    return x.to(DTYPE)


@triton.jit
def _load_tile(base, stride_s, scale_base, stride_scale_s, min_base, stride_min_s, ring_base, stride_ring_s, ring,
               offs_n, offs_d, n_ok, D, n_quantized, BITS: tl.constexpr, GROUP: tl.constexpr,
               PER_CHANNEL: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """A tile of K or V: INT4 positions before n_quantized are codes (PER_CHANNEL: keys' scales), the later ones
    full precision in the ring (of `ring` slots, position s at s % ring)."""
    if BITS == 4:
        old = offs_n < n_quantized  # (BLOCK_N,)
        x = _load_kv(base, stride_s, scale_base, stride_scale_s, min_base, stride_min_s, offs_n, offs_d,
                     n_ok & old, D, BITS, GROUP, PER_CHANNEL, DTYPE, ASM)
        recent = tl.load(ring_base + (offs_n % ring)[:, None] * stride_ring_s + offs_d[None, :],
                         mask=(n_ok & (offs_n >= n_quantized))[:, None] & (offs_d < D)[None, :], other=0.0)
        x = tl.where(old[:, None], x, recent.to(DTYPE))  # (fp16 holds them: the codes' fp16 scales bound them)
    else:
        x = _load_kv(base, stride_s, scale_base, stride_scale_s, min_base, stride_min_s, offs_n, offs_d, n_ok, D,
                     BITS, GROUP, False, DTYPE, ASM)  # INT8 scales are per token
    return x


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, n_from, n_to, end, lo, pos, row_nq, rows, row_ok, bh, n_keys, keys_lo, offs_d, D,
    k_base, ks_base, km_base, kr_base, v_base, vs_base, vm_base, vr_base,
    stride_ks, stride_kss, stride_kms, stride_krs, stride_vs, stride_vss, stride_vms, stride_vrs,
    ring, nq_lo, nq_hi, window, qk_scale, T, G, Scores,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr, SCORES: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, CODES: tl.constexpr,
):
    """The online softmax of `_split_kernel`'s rows over the tiles of keys from n_from to n_to (keys from `end` on
    masked), carried in (acc, m_i, l_i). CODES: every key of these tiles is below nq_lo, so every row reads INT4
    codes and the rings are not loaded: on sm_90 a 64-key step of such tiles takes ~half the instructions of the
    general step, which loads each tile's codes and ring entries and, where the rows disagree, both versions."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    # INT8's scales and INT4's value scales and minimums, one per (position, group of channels), are too narrow for
    # Triton to copy ahead as it copies the codes: fetched a tile ahead here, so no step waits on their loads
    AHEAD: tl.constexpr = BITS == 8 or (BITS == 4 and CODES)
    # No load masks a position: a tile's positions past `end` read the key at end - 1 (in the cache, and weighed
    # 0: `visible` masks them from the scores), so the copies ahead carry no select, nor the tiles predicates
    every = tl.full([BLOCK_N], True, tl.int1)
    if AHEAD:
        offs_a = tl.minimum(n_from + tl.arange(0, BLOCK_N), end - 1)
        vs_next = _group_tile(vs_base, stride_vss, offs_a, every, D, BLOCK_D, GROUP)
        if BITS == 8:
            ks_next = _group_tile(ks_base, stride_kss, offs_a, every, D, BLOCK_D, GROUP)
        else:  # (INT4 keys' scales are per channel: copied ahead with the codes)
            vm_next = _group_tile(vm_base, stride_vms, offs_a, every, D, BLOCK_D, GROUP)
    for n0 in range(n_from, n_to, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if CODES:  # (whole tiles, below nq_lo <= end)
            at = offs_n
        else:
            at = tl.minimum(offs_n, end - 1)  # the positions the loads read
        if AHEAD:
            v_scales = vs_next
            offs_a = tl.minimum(offs_n + BLOCK_N, end - 1)
            vs_next = _group_tile(vs_base, stride_vss, offs_a, every, D, BLOCK_D, GROUP)
            if BITS == 8:
                k_scales = ks_next
                ks_next = _group_tile(ks_base, stride_kss, offs_a, every, D, BLOCK_D, GROUP)
            else:
                v_minimums = vm_next
                vm_next = _group_tile(vm_base, stride_vms, offs_a, every, D, BLOCK_D, GROUP)
        if BITS == 8:
            k = _load_kv(k_base, stride_ks, ks_base, stride_kss, km_base, stride_kms, at, offs_d, every, D,
                         BITS, GROUP, False, q.dtype, ASM, k_scales)
        elif CODES:
            k = _load_kv(k_base, stride_ks, ks_base, stride_kss, km_base, stride_kms, at, offs_d, every, D,
                         BITS, GROUP, True, q.dtype, ASM)
        else:
            k = _load_tile(k_base, stride_ks, ks_base, stride_kss, km_base, stride_kms, kr_base, stride_krs, ring,
                           at, offs_d, every, D, nq_lo, BITS, GROUP, True, q.dtype, ASM)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        if BITS == 4 and not CODES:  # rows disagree on some positions here: codes up to nq_hi are loaded too
            mixed = (n0 < nq_hi) & (n0 + BLOCK_N > nq_lo)
        else:
            mixed = False
        coded = offs_n[None, :] < row_nq[:, None]  # (BLOCK_M, BLOCK_N): what each row reads as codes
        if mixed:
            k_codes = _load_tile(k_base, stride_ks, ks_base, stride_kss, km_base, stride_kms, kr_base, stride_krs,
                                 ring, at, offs_d, every, D, nq_hi, BITS, GROUP, True, q.dtype, ASM)
            s_codes = tl.dot(q, tl.trans(k_codes), input_precision=PRECISION)
            s = tl.where(coded, s_codes, s)
        s = s * qk_scale
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - offs_n[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        if SCORES:  # Scores (B, Hkv, T * G, n_keys) fp32 contiguous, for the attention mass
            tl.store(Scores + (bh * (T * G) + rows)[:, None] * n_keys + (offs_n - keys_lo)[None, :], s,
                     mask=row_ok[:, None] & (n_ok & (offs_n >= lo))[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if BITS == 8:
            v = _load_kv(v_base, stride_vs, vs_base, stride_vss, vm_base, stride_vms, at, offs_d, every, D,
                         BITS, GROUP, False, q.dtype, ASM, v_scales)
        elif CODES:
            v = _load_kv(v_base, stride_vs, vs_base, stride_vss, vm_base, stride_vms, at, offs_d, every, D,
                         BITS, GROUP, False, q.dtype, ASM, v_scales, v_minimums)
        else:
            v = _load_tile(v_base, stride_vs, vs_base, stride_vss, vm_base, stride_vms, vr_base, stride_vrs, ring,
                           at, offs_d, every, D, nq_lo, BITS, GROUP, False, q.dtype, ASM)
        if mixed:
            v_codes = _load_tile(v_base, stride_vs, vs_base, stride_vss, vm_base, stride_vms, vr_base, stride_vrs,
                                 ring, at, offs_d, every, D, nq_hi, BITS, GROUP, False, q.dtype, ASM)
            pv = tl.dot(tl.where(coded, p, 0.0).to(v.dtype), v_codes, input_precision=PRECISION)
            pv += tl.dot(tl.where(coded, 0.0, p).to(v.dtype), v, input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _split_kernel(
    Q, K, V, KScale, KMin, KRecent, VScale, VMin, VRecent, Out, MidO, MidLse, Lse, Scores, SLen, Count,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ksb, stride_ksh, stride_kss,
    stride_kmb, stride_kmh, stride_kms,
    stride_krb, stride_krh, stride_krs,
    stride_vsb, stride_vsh, stride_vss,
    stride_vmb, stride_vmh, stride_vms,
    stride_vrb, stride_vrh, stride_vrs,
    stride_ob, stride_ot, stride_oh,
    T, S, Hkv, G, D, lo, first_split, split_len, window, qk_scale, nq_lo, nq_hi, ring,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
    SCORES: tl.constexpr, PRECISION: tl.constexpr, DEVICE_LEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    common.pdl_wait(PDL)
    if EVEN_D:  # head_dim a power of two: every channel mask is constant true
        D = BLOCK_D
    n_keys, keys_lo = S - lo, lo  # Scores' rows: keys [lo, S) as the host counts them (with DEVICE_LEN all S)
    if DEVICE_LEN:  # a CUDA graph's step: S (the keys in use) is read here; the splits cover the buffer's capacity
        S = tl.load(SLen)
        if BITS == 4:  # and so are the INT4 rows' code spans: the key groups full at each row's position
            nq_lo = (S - T + 1) // _KEY_GROUP * _KEY_GROUP
            nq_hi = S // _KEY_GROUP * _KEY_GROUP
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
    # INT4: positions before row_nq are read as codes, the later ones exact (ref.QuantizedKV.row_quantized)
    row_nq = tl.minimum(tl.maximum((pos + 1) // _KEY_GROUP * _KEY_GROUP, nq_lo), nq_hi)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    q_ptrs = Q + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if BITS != 0 and q.dtype == tl.bfloat16:  # a quantized cache's dot products take fp16 (the module's docstring)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # this (batch, kv head)'s slice of each cache tensor; the ones a format does not use are never read
    k_base = K + b * stride_kb + kvh * stride_kh
    ks_base = KScale + b * stride_ksb + kvh * stride_ksh
    km_base = KMin + b * stride_kmb + kvh * stride_kmh
    kr_base = KRecent + b * stride_krb + kvh * stride_krh
    v_base = V + b * stride_vb + kvh * stride_vh
    vs_base = VScale + b * stride_vsb + kvh * stride_vsh
    vm_base = VMin + b * stride_vmb + kvh * stride_vmh
    vr_base = VRecent + b * stride_vrb + kvh * stride_vrh
    start = (first_split + split) * split_len
    end = tl.minimum(start + split_len, S)
    if DEVICE_LEN and HAS_WINDOW:  # lo is 0 then: the earliest key any row sees
        lo = tl.maximum(S - T + 1 - window, 0)
    start += tl.maximum(lo - start, 0) // BLOCK_N * BLOCK_N  # skip whole tiles before it, keeping the tiles' places

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if BITS == 4:  # the tiles every row reads as codes (all below nq_lo) first, in a loop that loads no ring
        mid = start + tl.maximum(tl.minimum(end, nq_lo) - start, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, start, mid, end, lo, pos, row_nq, rows, row_ok, b * Hkv + kvh, n_keys, keys_lo, offs_d, D,
            k_base, ks_base, km_base, kr_base, v_base, vs_base, vm_base, vr_base,
            stride_ks, stride_kss, stride_kms, stride_krs, stride_vs, stride_vss, stride_vms, stride_vrs,
            ring, nq_lo, nq_hi, window, qk_scale, T, G, Scores,
            BITS, GROUP, HAS_WINDOW, SCORES, PRECISION, BLOCK_N, ASM, True)
    else:
        mid = start
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, mid, end, end, lo, pos, row_nq, rows, row_ok, b * Hkv + kvh, n_keys, keys_lo, offs_d, D,
        k_base, ks_base, km_base, kr_base, v_base, vs_base, vm_base, vr_base,
        stride_ks, stride_kss, stride_kms, stride_krs, stride_vs, stride_vss, stride_vms, stride_vrs,
        ring, nq_lo, nq_hi, window, qk_scale, T, G, Scores,
        BITS, GROUP, HAS_WINDOW, SCORES, PRECISION, BLOCK_N, ASM, False)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    Hq = Hkv * G
    if DIRECT:
        o_ptrs = Out + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if SCORES:  # Lse (B, T, Hq) fp32 contiguous
            tl.store(Lse + (b * T + t) * Hq + h, lse, mask=row_ok)
    else:
        # MidO (B, T, Hq, n_splits, BLOCK_D) and MidLse (B, T, Hq, n_splits), both contiguous fp32, split i there
        # being split first_split + i of the keys
        n_splits = tl.num_programs(1)
        row_base = ((b * T + t) * Hq + h) * n_splits  # (BLOCK_M,): each row's entry of split first_split
        mid = row_base + split
        tl.store(MidO + mid[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])
        tl.store(MidLse + mid, lse, mask=row_ok)
        # The split of this (batch, kv head, row block) that finishes last combines them all, every row at once: no
        # launch of its own. Every thread's stores, then one release; the last split's acquire sees every split's
        # results
        tl.debug_barrier()
        counter = Count + pid_bh * tl.num_programs(2) + pid_m  # 0 before the launch, and after it
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
            top, total = _combine_rows(MidO, MidLse, Out, row_base, b, t, h, row_ok, stride_ob, stride_ot,
                                       stride_oh, n_splits, first_split, D, BLOCK_M, BLOCK_D)
            if SCORES:  # Lse (B, T, Hq) fp32 contiguous: each row's log2-sum-exp over all its keys (the log2 out of
                # the loop: libdevice's takes the exponent apart with an I2F)
                tl.store(Lse + (b * T + t) * Hq + h, top + tl.math.log2(total), mask=row_ok)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # for the next launch


@triton.jit
def _weighted_split(MidO, MidLse, base, i, n_splits, row_ok, top, offs_d, BLOCK_D: tl.constexpr):
    """Split i of the launch for each row: (its output x its weight exp2(lse - top), the weight); 0 and 0 outside
    the launch or where a row has no keys."""
    ok = row_ok & (i >= 0) & (i < n_splits)
    w = tl.math.exp2(tl.load(MidLse + base + i, mask=ok, other=float("-inf"), cache_modifier=".cg") - top)
    o = tl.load(MidO + (base + i)[:, None] * BLOCK_D + offs_d[None, :], mask=ok[:, None], other=0.0,
                cache_modifier=".cg")  # an empty split: w 0
    return o * w[:, None], w


@triton.jit
def _combine_rows(MidO, MidLse, Out, base, b, t, h, row_ok, stride_ob, stride_ot, stride_oh, n_splits, first_split,
                  D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The outputs of a program's rows (b, t, h), all at once: the splits' outputs weighted by exp2(their lse - the
    row's largest) -> (the largest lse, the weights' sum) a row, of which the row's lse over all its keys is
    largest + log2(sum). base (BLOCK_M,): each row's MidLse / MidO entry of its first split (split first_split of
    the keys). A step loads 4 splits of every row, four (BLOCK_M, BLOCK_D) tiles in the accumulator's layout, in
    one go, and sums them in a fixed tree within each thread. The steps hold runs of 4 splits numbered from the
    first key, not from the launch's first split, and add up in the keys' order, so a row sums what it sums in any
    launch: the splits it cannot see (before its window, past its own key, past the keys in use, or outside the
    launch) weigh 0 and add exact zeros in the same places.

    Why all rows at once: the combine of 2026-11-27 took a row at a time, each waiting on its loads in turn. On an
    H100 the split kernel with it took 8.6-12.5 us a launch with 3 or 4 rows and 4 splits, where the split kernel
    and a combine launch of its own had taken 6.3-7.3 together; and, by the slope of the embedded model's block
    forwards (2, 4 and 8 tokens), a verification block cost ~1-1.6 us a layer more for each row it added. sm_90
    SASS here (Triton 3.8, bf16, head_dim 128, 4 warps): a step's 4 splits' loads issued before their first use,
    263 instructions a step for all 16 rows. The splits' results come from other programs: read from L2 (.cg),
    after the last split's acquire (`_split_kernel`)."""
    offs_l = tl.arange(0, COMBINE_LSE)
    m = tl.full([BLOCK_M, COMBINE_LSE], float("-inf"), tl.float32)
    for c in range(0, n_splits, COMBINE_LSE):
        i = c + offs_l
        m = tl.maximum(m, tl.load(MidLse + base[:, None] + i[None, :], mask=row_ok[:, None] & (i < n_splits)[None, :],
                                  other=float("-inf"), cache_modifier=".cg"))
    top = tl.max(m, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for c in range(first_split // 4 * 4, first_split + n_splits, 4):  # i: the launch's splits, some maybe outside it
        i = c - first_split
        o0, w0 = _weighted_split(MidO, MidLse, base, i, n_splits, row_ok, top, offs_d, BLOCK_D)
        o1, w1 = _weighted_split(MidO, MidLse, base, i + 1, n_splits, row_ok, top, offs_d, BLOCK_D)
        o2, w2 = _weighted_split(MidO, MidLse, base, i + 2, n_splits, row_ok, top, offs_d, BLOCK_D)
        o3, w3 = _weighted_split(MidO, MidLse, base, i + 3, n_splits, row_ok, top, offs_d, BLOCK_D)
        acc += (o0 + o1) + (o2 + o3)
        total += (w0 + w1) + (w2 + w3)
    out = acc / tl.where(row_ok, total, 1.0)[:, None]
    tl.store(Out + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d < D)[None, :])
    return top, total


@triton.jit
def _mass_kernel(
    Scores, Lse, Mass, SLen, stride_mb, stride_mh,
    T, Hkv, G, keys, lo, window,
    HAS_WINDOW: tl.constexpr, DEVICE_LEN: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """Mass[b, kv head, lo + j] += sum over the T * G rows of the head of exp2(Scores[b, head, row, j] - lse(row)),
    for j < keys; with DEVICE_LEN (lo 0, keys the capacity) for the keys the split kernel scored: those in use
    (SLen) from the earliest any row sees. Each key's weights are added one row at a time, in row order, by the
    thread that holds the key: a sum across threads (tl.sum over a tile of rows) takes the order of the tile's
    layout, which follows the load's alignment, so an eager step over S keys and a CUDA graph's over the capacity
    summed alike only by chance (an H100 saw them differ, 2026-11-27)."""
    common.pdl_wait(PDL)
    pid_bh = tl.program_id(0)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = offs_s < keys
    if DEVICE_LEN:
        S = tl.load(SLen)
        s_ok = s_ok & (offs_s < S)
        if HAS_WINDOW:
            s_ok = s_ok & (offs_s >= S - T + 1 - window)
    R = T * G
    acc = tl.zeros([BLOCK_S], tl.float32)
    for row in range(0, R):  # row = t * G + g
        lse = tl.load(Lse + (b * T + row // G) * (Hkv * G) + kvh * G + row % G)
        s = tl.load(Scores + (pid_bh.to(tl.int64) * R + row) * keys + offs_s, mask=s_ok, other=float("-inf"))
        acc += tl.math.exp2(s - lse)
    m_ptrs = Mass + b.to(tl.int64) * stride_mb + kvh * stride_mh + lo + offs_s
    tl.store(m_ptrs, tl.load(m_ptrs, mask=s_ok, other=0.0) + acc, mask=s_ok)


SPLIT_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                 for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
# torch < 2.6 does not report a device's opt-in shared memory: assume the least of the GPUs Triton supports (sm_86/89)
SHARED_MEMORY_DEFAULT = 99 * 1024


def split_shared_memory(major: int, sizes: dict[str, int], BITS: int, GROUP: int, SCORES: bool, BLOCK_M: int,
                        BLOCK_D: int, BLOCK_N: int, num_stages: int, num_warps: int) -> int:
    """Bytes of shared memory `_split_kernel` takes on a GPU of compute capability `major`, given the element sizes
    of its tensors Q, K, V, KScale, KMin, KRecent, VRecent in `sizes`: an upper bound on what Triton (3.6 to 3.8)
    allocates, mostly within 1 KB. tests/test_triton_compile.py holds it against the compiler's figure for sm_80 and sm_90.
    - Loaded ahead (software pipelining), num_stages - 1 copies, or num_stages where Hopper's warpgroup MMA reads
      dense K and V straight from shared memory: per key and channel, K and V (dense, INT8's codes), or INT4's key
      scale, min and the two rings' entries, and under 16-bit q INT4's packed codes, half a byte a channel (the
      compilers' figures grow by one tile of them a copy, not two; under fp32 q each byte is gathered for both its
      channels; the per-group scales are gathered too, too narrow to copy ahead).
    - Live through the loop: q (BLOCK_M, BLOCK_D) as a dot operand, and 8 bytes per row for reductions.
    - In turn within a step, the largest counted: the dequantized K tile (BLOCK_N, BLOCK_D) (two, codes and exact,
      for INT4 on Hopper; for INT8 under 16-bit q none, its tiles going from registers into the MMA, but where
      the compilers stage them: scales of 16 channels, or 16 values a thread or fewer in a tile); the
      dequantized V tile with the probabilities p (BLOCK_M, BLOCK_N), which the warpgroup MMA takes from registers (INT4 with fp32 q: both of p's parts, the rows' codes and exact shares,
      staged for the FMA dots side by side); or the fp32 scores (BLOCK_M, BLOCK_N) on their way to the mass buffer.
    """
    q_bytes = sizes["Q"]
    wgmma = major >= 9 and BLOCK_M >= 64 and q_bytes == 2  # Hopper's: 16-bit operands, tiles of 64 rows
    per_key = (sizes["KScale"] + sizes["KMin"] + sizes["KRecent"] + sizes["VRecent"] if BITS == 4
               else sizes["K"] + sizes["V"])
    copies = num_stages if wgmma and BITS == 0 else num_stages - 1
    codes = BLOCK_N * BLOCK_D // 2 * sizes["K"] if BITS == 4 and q_bytes == 2 else 0  # packed, two channels a byte
    # a dequantized K or V tile; INT8's, under 16-bit q, goes from registers into the MMA (its codes read from the
    # copies ahead in the dot's layout, the scales, fetched a tile ahead, spread over their groups in registers),
    # but for the layouts Triton 3.6 and 3.8 stage (the test holds this rule to both, sm_80 to sm_90)
    in_registers = BITS == 8 and q_bytes == 2 and GROUP >= 32 and BLOCK_N * BLOCK_D > 16 * 32 * num_warps
    tile = BLOCK_N * BLOCK_D * q_bytes if BITS and not in_registers else 0
    p = 0 if wgmma else BLOCK_M * BLOCK_N * q_bytes * (2 if BITS == 4 and q_bytes == 4 else 1)
    step = max(tile * (2 if BITS == 4 and wgmma else 1), tile + p, BLOCK_M * BLOCK_N * 4 * SCORES)
    return copies * (BLOCK_N * BLOCK_D * per_key + codes) + BLOCK_M * BLOCK_D * q_bytes + 8 * BLOCK_M + step


@cache
def _device_limits(index: int) -> tuple[int, int]:
    """(compute capability major, bytes of shared memory one block may use: the opt-in maximum) of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    return props.major, getattr(props, "shared_memory_per_block_optin", SHARED_MEMORY_DEFAULT)


def _configs_that_fit(configs, named_args, **kwargs):
    """The autotuner's early_config_prune, called as Triton 3.x does (configs, the positional args by name, the
    keyword args): the configs that fit the device's shared memory, or else the smallest. Triton would compile the
    others, seconds each, only to skip them."""
    major, limit = _device_limits(named_args["Q"].device.index)
    sizes = {name: named_args[name].element_size() for name in ("Q", "K", "V", "KScale", "KMin", "KRecent", "VRecent")}
    need = [split_shared_memory(major, sizes, kwargs["BITS"], kwargs["GROUP"], kwargs["SCORES"], kwargs["BLOCK_M"],
                                kwargs["BLOCK_D"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps) for c in configs]
    return [c for c, n in zip(configs, need) if n <= limit] or [configs[need.index(min(need))]]


@cache
def _unused(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in for a tensor argument the kernel does not read this launch, of the dtype the argument has when it
    is read. Triton's autotuner adds every tensor argument's dtype to its key: a stand-in of another dtype (q's,
    say, for the fp32 split buffers or the int32 key count) would tune a config of its own, by timing, for a
    direct launch, an eager step or a graph's, and their rows would round differently."""
    return torch.empty(1, dtype=dtype, device=device)


@cache
def _split_launcher(cuda: bool):
    """(kernel, fixed launch settings): autotuned over BLOCK_N, warps and stages on CUDA, fixed otherwise."""
    if not cuda:
        return _split_kernel, {"BLOCK_N": 64, "num_warps": 4}
    # Nothing that T or S changes: one config serves a model's one-token steps and verification blocks, eager or
    # in a CUDA graph, with one split or more (DIRECT), so their rows round alike.
    key = ["BLOCK_D", "EVEN_D", "BITS", "GROUP", "HAS_WINDOW", "SCORES", "PRECISION"]
    prune = {"early_config_prune": _configs_that_fit}
    return triton.autotune(SPLIT_CONFIGS, key=key, prune_configs_by=prune)(_split_kernel), {}


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, *,
                     split_len: int | None = None, mass: torch.Tensor | None = None,
                     length: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of the T newest tokens over a KV cache, as `ref.attention` defines it.

    q: (B, T, Hq, D) token-major, the queries of the last T of S positions (T small: 1 for decode, up to ~16
       to verify a speculation); any strides with q.stride(-1) == 1 (else it is copied).
    k, v: (B, Hkv, S, D) head-major views of the cache buffer, typically `buf[:, :, :S]` of a (B, Hkv, max_len, D)
       buffer; any batch/head/position strides, last dim contiguous. Hq % Hkv == 0: query head h reads kv
       head h // (Hq / Hkv).
    window: if given, query t (at position S - T + t) sees only keys in (pos - window, pos]; else [0, pos].
    split_len: the keys are cut into splits at its multiples (FlashDecoding); default SPLIT_LEN. A row's result
       depends on it, never on T or S.
    mass: if given, fp32 (B, Hkv, S) with position stride 1 (a view of a longer buffer is fine): each key's
       softmax weight, summed over the T queries and the G query heads of its kv head, is added to it
       (`ref.attention_mass`: H2O's accumulated attention). Costs a (B, Hkv, T * G, S) fp32 scratch buffer.
    length: if given, int32 (1,) on q's device: only the first `length` of the S keys are in use (the T queries
       are the last of them), read by the kernel itself, so nothing here depends on it (a step a CUDA graph
       replays at any position). k, v (and mass) then span the buffer's capacity; the splits cover all of it.
    q, k, v share one dtype (fp32, fp16 or bf16) and device; D any size (tested 64-256).
    Returns (B, T, Hq, D) contiguous in q's dtype; scores use scale 1/sqrt(D) and an fp32 softmax.
    """
    B, T, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    assert k.shape == v.shape == (B, Hkv, S, D), (q.shape, k.shape, v.shape)
    assert k.dtype == v.dtype == q.dtype and k.stride(-1) == 1 and v.stride(-1) == 1, "K/V rows must be contiguous"
    return _attend(q, (k, v, k, k, k, k, k, k), 0, 1, (0, 0, 1), S, window, split_len, mass, length)


def quantized_decode_attention(q: torch.Tensor, kv: ref.QuantizedKV, window: int | None = None, *,
                               split_len: int | None = None, mass: torch.Tensor | None = None,
                               length: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention` over a quantized cache, as `ref.quantized_attention` defines it: each K/V tile is
    dequantized in registers, to q's dtype (fp16 under bf16 q: the module's docstring); no full-precision copy of
    the cache is made.

    kv: INT8 or INT4 (layouts in `ref.QuantizedKV`) of B sequences, Hkv heads, S positions, head_dim D = kv.head_dim
       (a multiple of 16); every tensor any batch/head/position strides, last dim contiguous. INT4's rings k_recent
       and v_recent (B, Hkv, R, D) may be of any float dtype.
    q (B, T, Hq, D) fp32, fp16 or bf16; window, split_len, mass, length as for `decode_attention` (kv then spans
    the buffer's capacity). INT4 with `length`: kv.n_quantized and kv.first_exact are not read; each row reads as
    codes the key groups full at its position, the rest exact from the rings (what `ref.QuantizedKV.row_quantized`
    gives a cache that decoding wrote, as `llmrun.kv_cache`'s device steps write it: its rings hold the positions
    [length - R, length) exact).
    Returns (B, T, Hq, D) contiguous in q's dtype.
    """
    B, T, Hq, D = q.shape
    Hkv, S = kv.k.shape[1], kv.length
    group = kv.group
    assert kv.bits in (4, 8) and kv.head_dim == D, (kv.bits, kv.head_dim, q.shape)
    packed = D // 2 if kv.bits == 4 else D
    assert kv.k.shape == kv.v.shape == (B, Hkv, S, packed) and kv.v_scale.shape == (B, Hkv, S, D // group), \
        (q.shape, kv.k.shape, kv.v.shape, kv.v_scale.shape)
    if kv.bits == 8:
        assert kv.k_scale.shape == kv.v_scale.shape, (kv.k_scale.shape, kv.v_scale.shape)
        cache = (kv.k, kv.v, kv.k_scale, kv.k_scale, kv.k_scale, kv.v_scale, kv.v_scale, kv.v_scale)  # (unused repeat)
        ring = 1
    else:
        ring = kv.k_recent.shape[2]
        # the key groups the rows read as codes (with `length`, counted by the kernel: every full group in use)
        n_groups = triton.cdiv(min(kv.n_quantized, S) if length is None else S, ref.KEY_GROUP)
        if length is None:
            assert kv.n_quantized % ref.KEY_GROUP == 0 and kv.first_exact % ref.KEY_GROUP == 0, \
                (kv.n_quantized, kv.first_exact)
            assert kv.first_exact <= kv.n_quantized and S - kv.first_exact <= ring, (kv.first_exact, S, ring)
        assert kv.k_recent.shape == kv.v_recent.shape == (B, Hkv, ring, D) and kv.v_min.shape == kv.v_scale.shape, \
            (kv.k_recent.shape, kv.v_recent.shape, kv.v_min.shape)
        assert kv.k_scale.shape[2] >= n_groups and kv.k_scale.shape[3] == D and kv.k_min.shape == kv.k_scale.shape, \
            (kv.k_scale.shape, kv.k_min.shape, n_groups)
        cache = (kv.k, kv.v, kv.k_scale, kv.k_min, kv.k_recent, kv.v_scale, kv.v_min, kv.v_recent)
    assert all(x.stride(-1) == 1 for x in cache), "every tensor of the cache needs a contiguous last dim"
    nq = kv.row_quantized(T) if kv.bits == 4 and length is None else [0]  # with `length`: the kernel's to count
    return _attend(q, cache, kv.bits, group, (nq[0], nq[-1], ring), S, window, split_len, mass, length)


def _attend(q, cache, bits, group, int4_rows, S, window, split_len, mass, length=None):
    """Launch the kernels on cache = (k, v, k_scale, k_min, k_recent, v_scale, v_min, v_recent), the tensors a format
    does not use standing in for any (they are never read); int4_rows = (nq_lo, nq_hi, ring): INT4 rows read the
    positions below nq_lo to nq_hi as codes, the rest from rings of `ring` slots.
    With `length` (a device tensor), S is the capacity and the kernel reads how many keys are in use."""
    B, T, Hq, D = q.shape
    Hkv = cache[0].shape[1]
    assert Hq % Hkv == 0 and 1 <= T <= S, (q.shape, cache[0].shape)
    if q.stride(-1) != 1:
        q = q.contiguous()
    G = Hq // Hkv
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    m_blocks = triton.cdiv(T * G, BLOCK_M)

    assert length is None or (length.dtype == torch.int32 and length.device == q.device), \
        "a device-side length: int32 on q's device"
    # the earliest key any query sees (with a device-side length, the kernel skips the rest itself)
    lo = 0 if window is None or length is not None else max(0, S - T + 1 - window)
    keys = S - lo
    split_len = split_len or SPLIT_LEN
    first_split = lo // split_len  # the splits holding keys [lo, S), numbered from key 0
    num_splits = triton.cdiv(S, split_len) - first_split
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = _unused(q.device, torch.float32)
    else:
        mid_o = torch.empty(B, T, Hq, num_splits, BLOCK_D, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, T, Hq, num_splits, dtype=torch.float32, device=q.device)
    if mass is None:
        lse = scores = _unused(q.device, torch.float32)
    else:
        assert mass.shape == (B, Hkv, S) and mass.dtype == torch.float32 and mass.stride(-1) == 1, \
            (mass.shape, mass.dtype, mass.stride())
        lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)  # each row's log2-sum-exp
        scores = torch.empty(B, Hkv, T * G, keys, dtype=torch.float32, device=q.device)  # log2 units, keys [lo, S)

    count = _unused(q.device, torch.int32) if length is None else length
    assert B * Hkv * m_blocks <= common.COUNTERS, (B, Hkv, m_blocks)
    pdl = common.pdl_options(q)  # the same for the step's one or two launches
    kernel, settings = _split_launcher(q.is_cuda)
    kernel[(B * Hkv, num_splits, m_blocks)](
        q, *cache, out, mid_o, mid_lse, lse, scores, count, common.counters(q.device),
        q.stride(0), q.stride(1), q.stride(2),
        *(stride for x in cache for stride in x.stride()[:3]),
        out.stride(0), out.stride(1), out.stride(2),
        T, S, Hkv, G, D, lo, first_split, split_len, window or 0, math.log2(math.e) / math.sqrt(D), *int4_rows,
        BITS=bits, GROUP=group, HAS_WINDOW=window is not None, DIRECT=direct, SCORES=mass is not None,
        DEVICE_LEN=length is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
        ASM=q.is_cuda and torch.version.hip is None, EVEN_D=D == BLOCK_D, **settings, **pdl,
    )
    if mass is not None:
        BLOCK_S = 128
        _mass_kernel[(B * Hkv, triton.cdiv(keys, BLOCK_S))](
            scores, lse, mass, count, mass.stride(0), mass.stride(1), T, Hkv, G, keys,
            lo, window or 0, HAS_WINDOW=window is not None, DEVICE_LEN=length is not None, BLOCK_S=BLOCK_S, **pdl,
        )
    return out
