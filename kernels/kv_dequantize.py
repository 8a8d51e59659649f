"""A quantized KV cache's keys and values dequantized whole in one Triton launch, for prefill: a prompt chunk of
more than 16 tokens attends through SDPA over a float copy of the cache (`kernels.quantized_attention`).

INT8 (`int8_pair`): the reference's torch ops made it in five passes over fp32 temporaries a tensor
(`ref.dequantize_int8`, then a cast), a layer and a chunk; an H200's INT8 prefill ran at 0.68x bf16's. Each value
is the reference's bit for bit: the code times its fp16 group scale in fp32, rounded once to the output dtype.

INT4 (`int4_pair`): the keys and values `kernels.int4_attention` hands SDPA, positions [0, last) from their codes
and then [first, S) from the rings, with the kv heads repeated for their query heads when asked: some twenty torch
launches a layer and chunk (the two dequantizations' unpacking, expansions, products and casts, the rings'
gathers, the concatenations, the heads' repeats), where an H100's 8000-token INT4 prefill spent most of its time
in the host's launches. Each value is the torch path's bit for bit: a 4-bit code times an fp16 scale is exact in
fp32, so the fma that adds the minimum rounds once, as the torch product and sum do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common, ref


@triton.jit
def _int8_kernel(K, V, KScale, VScale, KOut, VOut, stride_b, stride_h, stride_s, stride_sb, stride_sh, stride_ss,
                 H, S, D, GROUP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Positions [s0, s0 + BLOCK_S) of (batch x head) bh of K (program axis 2 = 0) or V (1): codes (BLOCK_S, D) times
    the scale of their (position, group of GROUP channels), into the contiguous (B, H, S, D) output."""
    common.pdl_wait(PDL)
    bh = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    which = tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    ok = (s < S)[:, None] & (d < D)[None, :]
    at = b.to(tl.int64) * stride_b + h * stride_h + s[:, None] * stride_s + d[None, :]
    scale_at = b.to(tl.int64) * stride_sb + h * stride_sh + s[:, None] * stride_ss + (d // GROUP)[None, :]
    out_at = (bh.to(tl.int64) * S + s[:, None]) * D + d[None, :]
    if which == 0:
        scale = tl.load(KScale + scale_at, mask=ok, other=0).to(tl.float32)
        x = common.exact_float(tl.load(K + at, mask=ok, other=0)) * scale
        tl.store(KOut + out_at, x.to(KOut.dtype.element_ty), mask=ok)
    else:
        scale = tl.load(VScale + scale_at, mask=ok, other=0).to(tl.float32)
        x = common.exact_float(tl.load(V + at, mask=ok, other=0)) * scale
        tl.store(VOut + out_at, x.to(VOut.dtype.element_ty), mask=ok)


def int8_pair(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`ref.dequantize_int8` of the keys and of the values, in `dtype`, one launch: k, v int8 (B, H, S, D) and their
    fp16 scales (B, H, S, D / group), any batch/head/position strides with the last dim contiguous (views of a cache
    buffer), k and v alike, and their scales alike. Returns contiguous (B, H, S, D) tensors."""
    B, H, S, D = k.shape
    group = D // k_scale.shape[-1]
    assert v.shape == k.shape and k_scale.shape == v_scale.shape == (B, H, S, D // group) and D % group == 0, \
        (k.shape, v.shape, k_scale.shape, v_scale.shape)
    assert k.stride() == v.stride() and k_scale.stride() == v_scale.stride(), "K and V (and their scales) share strides"
    assert k.stride(-1) == k_scale.stride(-1) == 1, "rows contiguous"
    k_out = torch.empty(B, H, S, D, dtype=dtype, device=k.device)
    v_out = torch.empty_like(k_out)
    if k_out.numel():
        block_s = 64 if k.is_cuda else 256  # the interpreter pays per program, hardly per element
        _int8_kernel[(B * H, triton.cdiv(S, block_s), 2)](
            k, v, k_scale, v_scale, k_out, v_out, *k.stride()[:3], *k_scale.stride()[:3], H, S, D,
            GROUP=group, BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(D), **common.pdl_options(k),
        )
    return k_out, v_out


@triton.jit
def _int4_kernel(K, V, KScale, KMin, VScale, VMin, KRing, VRing, KOut, VOut,
                 stride_cb, stride_ch, stride_cs, stride_kgb, stride_kgh, stride_kgs,
                 stride_vsb, stride_vsh, stride_vss, stride_rb, stride_rh, stride_rs, H, G, P, last, first, R, D,
                 KEY_GROUP: tl.constexpr, V_GROUP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                 PDL: tl.constexpr):
    """Positions [p0, p0 + BLOCK_S) of the output's P = last + S - first for (batch x output head) bh, of K (program
    axis 2 = 0) or V (1): position p < last from its codes (channel 2i in byte i's low nibble, 2i + 1 in its high;
    keys scaled per (group of KEY_GROUP positions, channel), values per (position, group of V_GROUP channels)), the
    others from the ring (position first + p - last at its slot modulo R). Output head h reads kv head h // G."""
    common.pdl_wait(PDL)
    bh = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    which = tl.program_id(2)
    b, kvh = (bh // H).to(tl.int64), (bh % H) // G
    d = tl.arange(0, BLOCK_D)
    ok = (p < P)[:, None] & (d < D)[None, :]
    coded = ok & (p < last)[:, None]
    exact = ok & (p >= last)[:, None]
    code_at = b * stride_cb + kvh * stride_ch + p[:, None] * stride_cs + (d // 2)[None, :]
    shift = (4 * (d % 2))[None, :]
    slot = (first + p - last) % R
    ring_at = b * stride_rb + kvh * stride_rh + slot[:, None] * stride_rs + d[None, :]
    out_at = (bh.to(tl.int64) * P + p[:, None]) * D + d[None, :]
    if which == 0:  # keys: scaled per (group of KEY_GROUP positions, channel)
        codes, scales, mins, rings, out = K, KScale, KMin, KRing, KOut
        at = b * stride_kgb + kvh * stride_kgh + (p // KEY_GROUP)[:, None] * stride_kgs + d[None, :]
    else:  # values: per (position, group of V_GROUP channels)
        codes, scales, mins, rings, out = V, VScale, VMin, VRing, VOut
        at = b * stride_vsb + kvh * stride_vsh + p[:, None] * stride_vss + (d // V_GROUP)[None, :]
    q = (tl.load(codes + code_at, mask=coded, other=0).to(tl.int32) >> shift) & 0xF
    scale = tl.load(scales + at, mask=coded, other=0).to(tl.float32)
    low = tl.load(mins + at, mask=coded, other=0).to(tl.float32)
    ring = tl.load(rings + ring_at, mask=exact, other=0).to(tl.float32)
    x = tl.where(coded, common.exact_float(q) * scale + low, ring)
    tl.store(out + out_at, x.to(out.dtype.element_ty), mask=ok)


def int4_pair(kv, first: int, last: int, dtype: torch.dtype, repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """An INT4 cache's (`ref.QuantizedKV`) keys and values as `kernels.int4_attention` reads them, in `dtype`:
    positions [0, last) dequantized from their codes (`ref.dequantize_int4_channels` / `_tokens`, rounded once),
    then [first, S) from the rings, each kv head repeated `repeat` times in a row (heads h * repeat .. for kv head
    h, as `repeat_interleave` gives them). Returns contiguous (B, H * repeat, last + S - first, D) tensors."""
    B, H, S, half = kv.k.shape
    D, R = 2 * half, kv.k_recent.shape[2]
    assert kv.k.stride() == kv.v.stride() and kv.k_recent.stride() == kv.v_recent.stride(), "K and V alike"
    assert kv.k_scale.stride() == kv.k_min.stride() and kv.v_scale.stride() == kv.v_min.stride(), "scales alike"
    assert 0 <= first <= last <= S and S - first <= R and last <= kv.k_scale.shape[2] * ref.KEY_GROUP, \
        (first, last, S, R)
    P = last + S - first
    k_out = torch.empty(B, H * repeat, P, D, dtype=dtype, device=kv.k.device)
    v_out = torch.empty_like(k_out)
    if k_out.numel():
        block_s = 64 if kv.k.is_cuda else 256  # the interpreter pays per program, hardly per element
        _int4_kernel[(B * H * repeat, triton.cdiv(P, block_s), 2)](
            kv.k, kv.v, kv.k_scale, kv.k_min, kv.v_scale, kv.v_min, kv.k_recent, kv.v_recent, k_out, v_out,
            *kv.k.stride()[:3], *kv.k_scale.stride()[:3], *kv.v_scale.stride()[:3], *kv.k_recent.stride()[:3],
            H * repeat, repeat, P, last, first, R, D, KEY_GROUP=ref.KEY_GROUP, V_GROUP=kv.group,
            BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(D), **common.pdl_options(kv.k),
        )
    return k_out, v_out
