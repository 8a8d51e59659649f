"""An INT8 KV cache's keys and values dequantized whole in one Triton launch, for prefill: a prompt chunk of more
than 16 tokens attends through SDPA over a float copy of the cache (`kernels.quantized_attention`), which the
reference's torch ops made in five passes over fp32 temporaries a tensor (`ref.dequantize_int8`, then a cast), a
layer and a chunk; an H200's INT8 prefill ran at 0.68x bf16's. Each value is the reference's bit for bit: the code
times its fp16 group scale in fp32, rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common


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
