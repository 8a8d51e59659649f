"""Plain-torch definitions of every op the models call: the specification the fast kernels are tested against.

Shapes: B batch, T new tokens, S cached positions (keys), Hq query heads, Hkv key/value heads, D head_dim.
Activations are token-major, (B, T, H, D); the KV cache is head-major, (B, Hkv, S, D).
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., dim) * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (B, T, H, D) by the angles whose cos/sin (T, D) are given (HF "rotate half")."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: silu(gate) * up, both (..., ffn_dim)."""
    return F.silu(gate) * up


def attention_mask(T: int, S: int, window: int | None, device) -> torch.Tensor | None:
    """(T, S) bool, True where query t (at key position S - T + t) may see key s; None when all may."""
    if T == 1 and (window is None or S <= window):
        return None
    i = torch.arange(S - T, S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask &= i - j < window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal softmax attention with grouped-query heads.

    q (B, T, Hq, D): the last T of S positions; k, v (B, Hkv, S, D) with Hq % Hkv == 0 (query head h reads kv
    head h // (Hq/Hkv)). Query t sits at position S - T + t and sees keys up to it, the last `window` only
    when a sliding window is given. Returns (B, T, Hq, D).
    """
    mask = attention_mask(q.shape[1], k.shape[2], window, q.device)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[1])
    return y.transpose(1, 2)


def dequantize_blocks(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                      group: int = 32) -> torch.Tensor:
    """Weights stored in blocks of 32 along K, with a scale (and offset) per group of G columns -> W (N, K) fp32.

    4-bit: qs uint8 (N, K/2), byte j of each 16-byte block holding q_j (low nibble) and q_{j+16} (high);
    w = d * q + m, or d * (q - 8) when m is None. 8-bit: qs int8 (N, K); w = d * q. d, m: fp16 (N, K/G), G a
    multiple of 32 (32: GGUF's Q4_0/Q4_1/Q8_0; 128: AWQ's, whose zero-point z is m = -d * z).
    """
    N = qs.shape[0]
    if bits == 4:
        packed = qs.view(N, -1, 16)
        q = torch.cat((packed & 0xF, packed >> 4), dim=-1).reshape(N, -1, group).float()  # (N, K/G, G)
        scale = d.float()[..., None]
        w = scale * q + (m.float()[..., None] if m is not None else -8.0 * scale)
    else:
        w = d.float()[..., None] * qs.view(N, -1, group).float()
    return w.reshape(N, -1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) fp32 rounded as the quantized matmul sees it: per block of 32, int8 with scale max|x| / 127."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, 0)  # multiply by the reciprocal, as the kernel does
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


def quant_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int) -> torch.Tensor:
    """x (..., K) @ W^T -> (..., N) fp32 for W in blocks (see `dequantize_blocks`), activations rounded to int8
    per block of 32 first (`quantize_activations`), as the CPU kernel and llama.cpp do."""
    return quantize_activations(x) @ dequantize_blocks(qs, d, m, bits).T
