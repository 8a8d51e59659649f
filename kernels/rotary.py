"""RoPE in Triton, in place: pairs (i, i + D/2) of each head rotate by the angles of their token ("rotate half").

    rope_(x, cos, sin) -> x

x (B, T, H, D) with each token's heads packed (strides (., ., D, 1)); tokens may be further apart (a slice
of a fused q/k/v tensor). cos, sin (T, D) in any float dtype, read as fp32 (the model rounds them to its own
dtype once a forward: converting them here instead, a copy a layer, cost two launches a layer). One program per
(b, t) rotates all H heads of that token.
"""

import torch
import triton
import triton.language as tl

from . import common


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, T, H, half, b_stride, t_stride,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    common.pdl_wait(PDL)  # the tables too are a step's own (the positions' rows)
    pid = tl.program_id(0)
    b, t = pid // T, pid % T
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < half)
    base = x_ptr + b * b_stride + t * t_stride + heads * (2 * half) + cols
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * 2 * half + cols, mask=cols < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * 2 * half + cols, mask=cols < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * 2 * half + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * 2 * half + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c1 - x2 * s1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + half, (x2 * c2 + x1 * s2).to(x_ptr.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) in place by cos/sin (T, D), any float dtype (the products in fp32); returns x."""
    B, T, H, D = x.shape
    assert x.stride(3) == 1 and x.stride(2) == D, "each token's heads must be packed"
    cos, sin = cos.contiguous(), sin.contiguous()  # (as the model hands them: no copy)
    _rope_kernel[(B * T,)](x, cos, sin, T, H, D // 2, x.stride(0), x.stride(1),
                           BLOCK_H=triton.next_power_of_2(H), BLOCK_HALF=triton.next_power_of_2(D // 2),
                           **common.pdl_options(x))
    return x
