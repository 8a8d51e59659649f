"""RMSNorm in Triton, optionally fused with the residual add that precedes it in every block.

    rms_norm(x, weight, eps)                -> x * rsqrt(mean(x^2) + eps) * weight
    add_rms_norm(x, y, weight, eps)         -> (h, rms_norm(h)) with h = x + y

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., dim) -> x * rsqrt(mean(x^2) + eps) * weight, in x's dtype (fp32 statistics)."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h, rms_norm(h)) with h = x + y: the residual add and the next norm in one pass."""
    return _launch(x, y, weight, eps)
