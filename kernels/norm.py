"""RMSNorm in Triton, optionally fused with the residual add that precedes it in every block.

    rms_norm(x, weight, eps)                -> x * rsqrt(mean(x^2) + eps) * weight
    add_rms_norm(x, y, weight, eps)         -> (h, rms_norm(h)) with h = x + y
    head_rms_norm_(qkv, n_q, n_k, ...)      -> Qwen3's q and k heads of qkv normalized in place, one launch

x, y (..., dim) fp32/fp16/bf16 with contiguous rows; weight (dim,). Statistics in fp32, outputs in x's dtype.
One program per row; dim up to 16k fits one block (padded to a power of two, masked).
"""

import torch
import triton
import triton.language as tl

from . import common


@triton.jit
def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, out_ptr, dim, x_stride, y_stride, eps,
                     ADD: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # weights: no kernel writes them
    common.pdl_wait(PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * dim + cols, x.to(h_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    tl.store(out_ptr + row * dim + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, y, weight, eps):
    dim = x.shape[-1]
    x2 = _rows(x)
    y2 = _rows(y) if y is not None else x2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if y is not None else out
    _rms_norm_kernel[(x2.shape[0],)](x2, y2, weight, h, out, dim, x2.stride(0), y2.stride(0), eps,
                                      ADD=y is not None, BLOCK=triton.next_power_of_2(dim), **common.pdl_options(x))
    return h, out


@triton.jit
def _head_rms_norm_kernel(x_ptr, q_w_ptr, k_w_ptr, n_q, heads, head_dim, token_stride, eps,
                          PDL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one head of one token: heads [0, n_q) take q's weight, the next ones k's
    token, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    w_ptr = tl.where(head < n_q, q_w_ptr, k_w_ptr)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # weights: no kernel writes them
    common.pdl_wait(PDL)
    at = x_ptr + token * token_stride + head * head_dim + cols
    x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    tl.store(at, (x * rstd * w).to(x_ptr.dtype.element_ty), mask=mask)


def head_rms_norm_(qkv: torch.Tensor, n_q: int, n_k: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """In place on qkv (B, T, H, D), contiguous: heads [0, n_q) RMS-normalized over D with q_weight (D,), heads
    [n_q, n_q + n_k) with k_weight; the rest (v) untouched. Returns qkv."""
    B, T, H, D = qkv.shape
    _head_rms_norm_kernel[(B * T * (n_q + n_k),)](qkv, q_weight, k_weight, n_q, n_q + n_k, D, H * D, eps,
                                                    BLOCK=triton.next_power_of_2(D), **common.pdl_options(qkv))
    return qkv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., dim) -> x * rsqrt(mean(x^2) + eps) * weight, in x's dtype (fp32 statistics)."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h, rms_norm(h)) with h = x + y: the residual add and the next norm in one pass."""
    return _launch(x, y, weight, eps)
