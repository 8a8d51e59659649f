"""Layers whose weights stay quantized: 4- or 8-bit integers in blocks of 32 along the input dimension, with
fp16 scales (and offsets), the layout of `kernels.ref.dequantize_blocks`. GGUF's Q4_0, Q4_1 and Q8_0 tensors
load into them without changing a bit; the loader swaps them in for `nn.Linear` / `nn.Embedding`."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmrun import kernels


class _Blocks(nn.Module):
    def __init__(self, rows: int, cols: int, bits: int, offsets: bool):
        super().__init__()
        if cols % 32:
            raise ValueError(f"quantized blocks need a multiple of 32 columns, got {cols}")
        self.bits = bits
        qs = torch.empty(rows, cols // 2, dtype=torch.uint8) if bits == 4 else torch.empty(rows, cols, dtype=torch.int8)
        self.register_buffer("qs", qs)  # (rows, cols/2) nibbles or (rows, cols) int8
        self.register_buffer("d", torch.empty(rows, cols // 32, dtype=torch.float16))  # scale per block
        # offset per block (asymmetric 4-bit); None: symmetric, w = d * (q - 8)
        self.register_buffer("m", torch.empty(rows, cols // 32, dtype=torch.float16) if offsets else None)


class QuantLinear(_Blocks):
    """y = x @ W^T (+ bias) with W (out_features, in_features) in blocks."""

    def __init__(self, in_features: int, out_features: int, bits: int, offsets: bool, bias: bool):
        super().__init__(out_features, in_features, bits, offsets)
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x, gated: bool = False):
        return kernels.quant_matmul(x, self.qs, self.d, self.m, self.bits, self.bias, gated)


class QuantEmbedding(_Blocks):
    """Rows of W (num_embeddings, embedding_dim) in blocks; `project` is the tied output layer x @ W^T."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, offsets: bool, dtype=torch.float32):
        super().__init__(num_embeddings, embedding_dim, bits, offsets)
        self.dtype = dtype  # of the looked-up rows: the model's compute dtype

    def forward(self, ids):
        return kernels.quant_rows(ids, self.qs, self.d, self.m, self.bits, self.dtype)

    def project(self, x):
        return kernels.quant_matmul(x, self.qs, self.d, self.m, self.bits)


def rtn_blocks(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit blocks of 32 (GGUF Q4_1's scheme) for w (N, K):
    -> qs (N, K/2) uint8 in GGML nibble order, d and m (N, K/32) fp16, with w ~ d * q + m, q in 0..15.
    Done `rows` rows at a time, so the fp32 temporaries stay small beside an output head's matrix."""
    if w.shape[0] > rows:
        parts = [_rtn_blocks(w[i : i + rows]) for i in range(0, w.shape[0], rows)]
        return tuple(torch.cat(p) for p in zip(*parts))
    return _rtn_blocks(w)


def _rtn_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, K = w.shape
    blocks = w.float().reshape(N, K // 32, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    scale = d.float().clamp(min=torch.finfo(torch.float16).tiny)  # quantize against the stored fp16 values
    q = ((blocks - m.float()[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return pack_nibbles(q.reshape(N, K)), d, m


def q8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric 8-bit blocks of 32 (GGUF Q8_0's scheme) for w (N, K):
    -> qs (N, K) int8 and d (N, K/32) fp16, with w ~ d * q."""
    N, K = w.shape
    blocks = w.float().reshape(N, K // 32, 32)
    d = (blocks.abs().amax(-1) / 127).half()
    scale = d.float().clamp(min=torch.finfo(torch.float16).tiny)
    q = (blocks / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(N, K), d


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes q (N, K) with values 0..15 -> (N, K/2) uint8 in GGML nibble order: in each block of 32,
    byte j holds elements j (low nibble) and j + 16 (high)."""
    N, K = q.shape
    blocks = q.to(torch.uint8).reshape(N, K // 32, 32)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(N, K // 2)


def int4_linear(layer: nn.Module) -> QuantLinear:
    """A 4-bit RTN copy of the matrix of an `nn.Linear`, `nn.Embedding` or quantized layer, as a linear layer
    (the bias shared); a linear layer already in 4-bit blocks is returned as it is."""
    if isinstance(layer, QuantLinear) and layer.bits == 4:
        return layer
    if isinstance(layer, _Blocks):
        from llmrun.kernels import ref

        w = ref.dequantize_blocks(layer.qs, layer.d, layer.m, layer.bits)
    else:
        w = layer.weight
    out = QuantLinear(w.shape[1], w.shape[0], 4, True, bias=False)
    out.qs, out.d, out.m = (t.to(w.device) for t in rtn_blocks(w.detach()))
    out.bias = getattr(layer, "bias", None)
    return out
