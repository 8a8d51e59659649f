"""SwiGLU's gate in Triton: silu(gate) * up.

    silu_mul(gate, up) -> (..., F)

gate, up (..., F) with unit stride along F and the same row stride (they may be the two halves of one fused
gate/up output). Computed in fp32, returned in gate's dtype.
"""

import torch
import triton
import triton.language as tl

from . import common


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, F, row_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    common.pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(g_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * F + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    F = gate.shape[-1]
    g2, u2 = gate.reshape(-1, F), up.reshape(-1, F)
    assert g2.stride(1) == 1 and u2.stride(1) == 1 and g2.stride(0) == u2.stride(0)
    out = torch.empty(*gate.shape[:-1], F, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(F))
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(F, block))](g2, u2, out, F, g2.stride(0), BLOCK=block,
                                                            **common.pdl_options(gate))
    return out
