"""GGML's block formats in torch: exact dequantization, and conversion to the planes the quantized kernels read.

Planes (`kernels.ref.dequantize_blocks`) hold W (N, K) in blocks of 32 along K: 4-bit qs uint8 (N, K/2) in
Q4_1 nibble order, d and m fp16 (N, K/32), w = d * q + m (m None: w = d * (q - 8)); 8-bit qs int8 (N, K),
d fp16, w = d * q. The GGML types become planes at load time:

| type | planes | what changes |
|---|---|---|
| Q4_0, Q4_1, Q8_0 | 4-bit, 4-bit + m, 8-bit | nothing: the file's fields, split apart |
| Q5_0 | 8-bit, q - 16 with the block's d | nothing |
| Q4_K | 4-bit + m per 32: d * sc and -dmin * mn | the two products are rounded to fp16 |
| Q5_1, Q5_K, Q6_K, and every other block type | 8-bit, requantized per 32 from the exact values | each value by at most half of max|w| / 127 |

Blocks arrive as the file stores them, (rows, bytes per row) uint8; every step is vectorized over blocks, some
on the bytes viewed as little-endian int32/int64 words (GGUF's byte order, and the CPU's).
The dequantizers here give the same fp32 bits as `gguf.quants.dequantize` (same operations, same order); the
types without one here (Q2_K, Q3_K, the IQ and TQ types...) are dequantized by `gguf.quants` itself (numpy: slower).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# GGML type ids (gguf.GGMLQuantizationType), spelled out so this module imports without gguf.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14

# bytes per block and values per block of the types dequantized here
BLOCK = {Q4_0: (18, 32), Q4_1: (20, 32), Q5_0: (22, 32), Q5_1: (24, 32), Q8_0: (34, 32), Q4_K: (144, 256),
         Q5_K: (176, 256), Q6_K: (210, 256)}

# The planes the types converted without requantizing load as: (bits, with offsets m). Every other block type
# loads as 8-bit planes requantized from its exact values (`plane_format`).
PLANE_FORMATS = {Q4_0: (4, False), Q4_1: (4, True), Q5_0: (8, False), Q8_0: (8, False), Q4_K: (4, True)}
REQUANTIZED = (8, False)

_CHUNK_VALUES = 1 << 20  # values converted per step: temporaries stay in cache, and small beside an embedding


def _fp16(b, start):  # (n, bytes) uint8 -> (n, 1) fp32 from the fp16 at byte `start`
    return b[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs):  # (..., 16) packed bytes -> (..., 32): low nibbles are elements 0-15, high ones 16-31
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def _q5_values(qh, qs):  # (n, 4) and (n, 16) bytes -> (n, 32) uint8 q in 0-31 (Q5_0, Q5_1)
    high = (qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # (n, 4, 8): bit j of qh is element j's
    return _nibbles(qs) | (high.reshape(-1, 32) << 4)


def _q5_0_values(b):  # (n, 22) -> (n, 32) int8 q - 16
    return _q5_values(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16


def _q4_k_scales(b):  # (n, 144) -> d * sc, dmin * mn (n, 8) fp32: each sub-block's scale and min
    # 6-bit scales and mins of the 8 sub-blocks packed into 12 bytes, unpacked four at a time as int32 words:
    # bytes 0-3 hold sc 0-3 (+ the top 2 bits of sc 4-7), 4-7 mn 0-3 (+ those of mn 4-7), 8-11 their low 4 bits
    w = b.view(torch.int32)  # (n, 36)
    lo, mid, hi = w[:, 1], w[:, 2], w[:, 3]
    sc = torch.stack((lo & 0x3F3F3F3F, (hi & 0x0F0F0F0F) | ((lo >> 2) & 0x30303030)), -1).view(torch.uint8)
    mn = torch.stack((mid & 0x3F3F3F3F, ((hi >> 4) & 0x0F0F0F0F) | ((mid >> 2) & 0x30303030)), -1).view(torch.uint8)
    d = b.view(torch.float16)[:, :2].float()  # (n, 2): d, dmin
    return d[:, :1] * sc.float(), d[:, 1:] * mn.float()


def _q6_k_values(b):  # (n, 210) -> (n, 256) fp32, as gguf.quants.Q6_K
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 0xF
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    q = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    scale = (_fp16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float())[..., None]  # (n, 16, 1)
    return (scale * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


def _q4_k_nibbles(qs):  # (n, 128) -> (n, 8, 32): 32 bytes per 64 values, low nibbles the first 32, high the next
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat((qs & 0xF, qs >> 4), dim=2).reshape(-1, 8, 32)


def _dequant_q4_k(b):
    scale, offset = _q4_k_scales(b)
    return (scale[..., None] * _q4_k_nibbles(b[:, 16:]).float() - offset[..., None]).reshape(-1, 256)


def _dequant_q5_k(b):  # Q4_K's scales and nibbles, and bit j of each qh byte the fifth bit of sub-block j's value
    scale, offset = _q4_k_scales(b)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # (n, 8, 32)
    q = _q4_k_nibbles(b[:, 48:]) | (high << 4)
    return (scale[..., None] * q.float() - offset[..., None]).reshape(-1, 256)


_DEQUANT = {  # GGML type -> (blocks (n, bytes) -> values (n, block values) fp32)
    Q4_0: lambda b: _fp16(b, 0) * (_nibbles(b[:, 2:]).float() - 8),
    Q4_1: lambda b: _fp16(b, 0) * _nibbles(b[:, 4:]).float() + _fp16(b, 2),
    Q5_0: lambda b: _fp16(b, 0) * _q5_0_values(b).float(),
    Q5_1: lambda b: _fp16(b, 0) * _q5_values(b[:, 4:8], b[:, 8:]).float() + _fp16(b, 2),
    Q8_0: lambda b: _fp16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float(),
    Q4_K: _dequant_q4_k,
    Q5_K: _dequant_q5_k,
    Q6_K: _q6_k_values,
}


@contextmanager
def _one_thread():
    """Run the conversions on one thread: they are thousands of short memory-bound ops, each of which would
    otherwise open an OpenMP parallel region, and on a CPU that another program keeps busy every region waits a
    time slice for its second thread (the 1.5B Q4_K_M model's weights: 4 s on one thread, 150 s on two, on a
    2-core CPU with one core taken). Torch's thread count is process-wide: restored on the way out."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _by_rows(convert, n_rows: int, values_per_row: int) -> tuple:
    """convert(rows slice) -> a tuple of tensors (or None) with one row per row of the slice, over slices small
    enough to stay in cache, written into tensors allocated once (no concatenation: no second copy)."""
    step = max(1, _CHUNK_VALUES // values_per_row)
    out = None
    with _one_thread():
        for i in range(0, n_rows, step):
            parts = convert(slice(i, i + step))
            if out is None:
                out = [None if p is None else p.new_empty(n_rows, *p.shape[1:]) for p in parts]
            for o, p in zip(out, parts):
                if o is not None:
                    o[i : i + step] = p
    return tuple(out)


def dequantize(ggml_type: int, rows: torch.Tensor) -> torch.Tensor:
    """Blocks (N, bytes per row) uint8 of a type in `BLOCK` -> W (N, K) fp32, bit-identical to gguf.quants."""
    nbytes, nvalues = BLOCK[ggml_type]
    K = rows.shape[1] // nbytes * nvalues
    (w,) = _by_rows(lambda i: (_DEQUANT[ggml_type](rows[i].reshape(-1, nbytes)).reshape(-1, K),), rows.shape[0], K)
    return w


def requantize_8bit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N, K) fp32 -> 8-bit planes (qs int8 (N, K), d fp16 (N, K/32)): d = max|w| / 127 per block of 32,
    rounded to fp16 before q = round(w / d), so each value moves by at most d / 2 (plus fp16's rounding at the
    block's largest value, which the clamp to +-127 absorbs)."""
    blocks = w.reshape(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()  # (N, K/32, 1)
    inverse = torch.where(d > 0, 1 / d.float(), 0)
    qs = torch.round(blocks * inverse).clamp_(-127, 127).to(torch.int8)
    return qs.reshape(w.shape), d[..., 0]


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F


def _planes_q4_k(r):  # (n, rows' bytes) -> 4-bit planes with offsets
    n, b = r.shape[0], r.reshape(-1, 144)
    scale, offset = _q4_k_scales(b)
    # Q4_K: 32 bytes per 64 values, low nibbles values 0-31, high ones 32-63. Q4_1 order for values 0-31 is
    # low nibbles of bytes 0-15 | those of bytes 16-31 << 4 (then the same from the high nibbles for 32-63):
    # each 8-byte word with the word two after it, computed for every word of the flat array at once.
    words = b.view(torch.int64)[:, 2:].reshape(-1)  # (n * 16,): 4 words per 64 values
    low, high = words & _LOW_NIBBLES, (words >> 4) & _LOW_NIBBLES
    pairs = torch.empty(2, words.shape[0], dtype=torch.int64)
    torch.bitwise_or(low[:-2], low[2:] << 4, out=pairs[0, :-2])
    torch.bitwise_or(high[:-2], high[2:] << 4, out=pairs[1, :-2])
    qs = pairs.view(2, -1, 4)[..., :2].permute(1, 0, 2)  # (n * 4, [values 0-31, 32-63], 2 words): words 0-1 of 4
    return qs.reshape(n, -1).view(torch.uint8), scale.half().reshape(n, -1), (-offset).half().reshape(n, -1)


def _planes_q5_0(r):  # (n, rows' bytes) -> 8-bit planes, the same d
    n, b = r.shape[0], r.reshape(-1, 22)
    return _q5_0_values(b).reshape(n, -1), b[:, :2].contiguous().view(torch.float16).reshape(n, -1), None


_CONVERT = {Q4_K: _planes_q4_k, Q5_0: _planes_q5_0}  # the types converted without requantizing


def _gguf_type(ggml_type: int):
    """The `gguf` package's type for a block type it can dequantize, else None."""
    from gguf import GGMLQuantizationType, quants
    from gguf.constants import GGML_QUANT_SIZES

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        return None
    dequantizes = getattr(quants, "_type_traits", {}).get(qtype) is not None
    return qtype if dequantizes and GGML_QUANT_SIZES[qtype][0] >= 32 else None  # F16, BF16: blocks of 1


def plane_format(ggml_type: int) -> tuple[int, bool] | None:
    """(bits, with offsets) of the planes a matrix of this type loads as (`planes`); None for a float type or
    one that cannot be dequantized."""
    if ggml_type in PLANE_FORMATS:
        return PLANE_FORMATS[ggml_type]
    return REQUANTIZED if ggml_type in BLOCK or _gguf_type(ggml_type) is not None else None


def _exact_values(ggml_type: int):
    """rows (n, bytes per row) -> W (n, K) fp32, the exact values, here or by `gguf.quants`."""
    if ggml_type in BLOCK:
        return lambda r: _DEQUANT[ggml_type](r.reshape(-1, BLOCK[ggml_type][0])).reshape(r.shape[0], -1)
    import numpy as np
    from gguf import quants

    qtype = _gguf_type(ggml_type)

    def values(r):
        with np.errstate(all="ignore"):  # corrupt scales make inf and NaN, which the model's output check names
            return torch.from_numpy(quants.dequantize(r.numpy(), qtype).astype(np.float32, copy=False))

    return values


def planes(ggml_type: int, rows: torch.Tensor) -> tuple:
    """Blocks (N, bytes per row) uint8 of a type `plane_format` gives planes for -> planes (qs, d, m, bits) of
    W (N, K): the file's own bits for Q4_0/Q4_1/Q8_0, converted for the others as the module docstring says."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    nvalues, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    N, K = rows.shape[0], rows.shape[1] // nbytes * nvalues
    if ggml_type in (Q4_0, Q4_1, Q8_0):
        b = rows.reshape(N, -1, nbytes)  # (N, K/32, bytes)
        d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
        if ggml_type == Q8_0:
            return b[..., 2:].contiguous().view(torch.int8).reshape(N, -1), d, None, 8
        if ggml_type == Q4_1:
            return b[..., 4:].reshape(N, -1).contiguous(), d, b[..., 2:4].contiguous().view(torch.float16)[..., 0], 4
        return b[..., 2:].reshape(N, -1).contiguous(), d, None, 4
    if (convert := _CONVERT.get(ggml_type)) is not None:
        return (*_by_rows(lambda i: convert(rows[i]), N, K), PLANE_FORMATS[ggml_type][0])
    values = _exact_values(ggml_type)
    return (*_by_rows(lambda i: (*requantize_8bit(values(rows[i])), None), N, K), 8)


def convert_planes(qs, d, m, bits: int, to_bits: int, to_offsets: bool) -> tuple:
    """Planes into a wider format, so the parts of a fused projection share one: 4-bit symmetric -> 4-bit with
    offsets (m = -8 d) or 8-bit (q - 8, same d) are exact; 4-bit with offsets -> 8-bit requantizes
    (`requantize_8bit`). Returns (qs, d, m, bits)."""
    if (bits, m is not None) == (to_bits, to_offsets) or (bits == 8 and to_bits == 8):
        return qs, d, m, bits
    if to_bits == 4:
        return qs, d, (-8 * d.float()).half(), 4
    if m is None:
        return (_nibbles(qs.reshape(qs.shape[0], -1, 16)).to(torch.int8) - 8).reshape(qs.shape[0], -1), d, None, 8
    from llmrun.kernels import ref

    return *_by_rows(lambda i: (*requantize_8bit(ref.dequantize_blocks(qs[i], d[i], m[i], 4)),), qs.shape[0],
                     d.shape[1] * 32), None, 8
