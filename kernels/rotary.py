"""RoPE in Triton, in place: pairs (i, i + D/2) of each head rotate by the angles of their token ("rotate half").

    rope_(x, cos, sin) -> x
    rope_write_(qkv, n_heads, cos, sin, k_out, v_out, slots)

x (B, T, H, D) with each token's heads packed (strides (., ., D, 1)); tokens may be further apart (a slice
of a fused q/k/v tensor). cos, sin (T, D) in any float dtype, read as fp32 (the model rounds them to its own
dtype once a forward: converting them here instead, a copy a layer, cost two launches a layer). One program per
(b, t) rotates all H heads of that token.

`rope_write_` is a decode step's RoPE and its write into a float KV cache in one launch (a launch fewer a layer
than `rope_` and `kv_write.write_dense`, with their bits): qkv (B, T, Hq + 2 Hkv, D) the fused projection, its q and
k heads rotated in place, the rotated k and the v heads stored into k_out, v_out (B, Hkv, C, D) at the consecutive
slots from slots[0] (int64 on the device: a CUDA graph's step at any position), cast to the cache's dtype.
"""

import torch
import triton
import triton.language as tl

from . import common


@triton.jit
def _rope_in_place(x_ptr, cos_ptr, sin_ptr, token, t, H, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the first H heads of the token at x_ptr + token by token t's angles, in place (the products in fp32)
    -> their two halves (y1, y2) (BLOCK_H, BLOCK_HALF) as stored, in x's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < half)
    base = x_ptr + token + heads * (2 * half) + cols
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * 2 * half + cols, mask=cols < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * 2 * half + cols, mask=cols < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * 2 * half + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * 2 * half + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    # One fused multiply-add each, named: left to the compiler, which product it fuses follows the layout (Triton 3.6
    # fused the other one for some rows of `_rope_kernel` than of `_rope_write_kernel` at head_dim 80, and an H100's
    # fp32 test of the two saw one bit differ, 2026-11-27)
    y1 = tl.fma(x1, c1, -(x2 * s1)).to(x_ptr.dtype.element_ty)
    y2 = tl.fma(x2, c2, x1 * s2).to(x_ptr.dtype.element_ty)
    tl.store(base, y1, mask=mask)
    tl.store(base + half, y2, mask=mask)
    return y1, y2


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, T, H, half, b_stride, t_stride,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    common.pdl_wait(PDL)  # the tables too are a step's own (the positions' rows)
    pid = tl.program_id(0)
    b, t = pid // T, pid % T
    _rope_in_place(x_ptr, cos_ptr, sin_ptr, b * b_stride + t * t_stride, t, H, half, BLOCK_H, BLOCK_HALF)


@triton.jit
def _rope_write_kernel(x_ptr, cos_ptr, sin_ptr, KOut, VOut, Slots, T, HQ, HKV, half, b_stride, t_stride,
                       stride_ob, stride_oh, stride_os, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (b, t): token t's q and k heads (the first HQ + HKV) rotated in place, as `_rope_kernel`; its k heads
    so rotated and its v heads (the last HKV) stored at slot slots[0] + t of KOut, VOut."""
    common.pdl_wait(PDL)
    pid = tl.program_id(0)
    b, t = pid // T, pid % T
    token = b * b_stride + t * t_stride
    y1, y2 = _rope_in_place(x_ptr, cos_ptr, sin_ptr, token, t, HQ + HKV, half, BLOCK_H, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)[:, None]  # y1's and y2's rows and columns
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    slot = tl.load(Slots) + t
    is_k = (heads >= HQ) & (heads < HQ + HKV) & (cols < half)
    k_at = b * stride_ob + tl.where(is_k, heads - HQ, 0) * stride_oh + slot * stride_os + cols
    tl.store(KOut + k_at, y1.to(KOut.dtype.element_ty), mask=is_k)
    tl.store(KOut + k_at + half, y2.to(KOut.dtype.element_ty), mask=is_k)
    is_v = (heads < HKV) & (cols < half)  # v head j sits at head HQ + HKV + j of the token
    v = token + (HQ + HKV + heads) * (2 * half) + cols
    v_at = b * stride_ob + heads * stride_oh + slot * stride_os + cols
    tl.store(VOut + v_at, tl.load(x_ptr + v, mask=is_v).to(VOut.dtype.element_ty), mask=is_v)
    tl.store(VOut + v_at + half, tl.load(x_ptr + v + half, mask=is_v).to(VOut.dtype.element_ty), mask=is_v)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) in place by cos/sin (T, D), any float dtype (the products in fp32); returns x."""
    B, T, H, D = x.shape
    assert x.stride(3) == 1 and x.stride(2) == D, "each token's heads must be packed"
    cos, sin = cos.contiguous(), sin.contiguous()  # (as the model hands them: no copy)
    _rope_kernel[(B * T,)](x, cos, sin, T, H, D // 2, x.stride(0), x.stride(1),
                           BLOCK_H=triton.next_power_of_2(H), BLOCK_HALF=triton.next_power_of_2(D // 2),
                           **common.pdl_options(x))
    return x


def rope_write_(qkv: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor, k_out: torch.Tensor,
                v_out: torch.Tensor, slots: torch.Tensor) -> None:
    """qkv (B, T, n_heads + 2 Hkv, D): rotate its q and k heads in place by cos/sin (T, D) and store the rotated k
    and the v heads into k_out, v_out (B, Hkv, C, D) at the consecutive slots from slots[0] (int64, on the
    device): `rope_` then `kv_write.write_dense`, bit for bit, in one launch."""
    B, T, H, D = qkv.shape
    Hkv = (H - n_heads) // 2
    assert qkv.stride(3) == 1 and qkv.stride(2) == D, "each token's heads must be packed"
    assert k_out.shape[1] == Hkv and k_out.stride() == v_out.stride() and k_out.stride(3) == 1, \
        "K's and V's buffers alike"
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_write_kernel[(B * T,)](qkv, cos, sin, k_out, v_out, slots, T, n_heads, Hkv, D // 2, qkv.stride(0),
                                 qkv.stride(1), k_out.stride(0), k_out.stride(1), k_out.stride(2),
                                 BLOCK_H=triton.next_power_of_2(n_heads + Hkv),
                                 BLOCK_HALF=triton.next_power_of_2(D // 2), **common.pdl_options(qkv))
