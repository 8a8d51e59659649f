"""Plain-torch definitions of every op the models call: the specification the fast kernels are tested against.

Shapes: B batch, T new tokens, S cached positions (keys), Hq query heads, Hkv key/value heads, D head_dim.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., dim) * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (B, H, T, D) by the angles whose cos/sin (T, D) are given (HF "rotate half")."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: silu(gate) * up, both (..., ffn_dim)."""
    return F.silu(gate) * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with grouped-query heads.

    q (B, Hq, T, D); k, v (B, Hkv, S, D) with Hq % Hkv == 0 (query head h reads kv head h // (Hq/Hkv));
    mask (T, S) bool, True where attending is allowed, or None for "every key" (one new token).
    Returns (B, Hq, T, D).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
