"""Plain-torch definitions of every op the models call: the specification the fast kernels are tested against.

Shapes: B batch, T new tokens, S cached positions (keys), Hq query heads, Hkv key/value heads, D head_dim.
Activations are token-major, (B, T, H, D); the KV cache is head-major, (B, Hkv, S, D).
"""

from collections.abc import Iterator
from dataclasses import dataclass

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


def attention_mask(T: int, S: int, window: int | None, device, length: torch.Tensor | None = None) -> torch.Tensor | None:
    """(T, S) bool, True where query t (at key position S - T + t) may see key s; None when all may.
    length: an int32 (1,) tensor: only keys [0, length) are in use and query t sits at length - T + t; the slots
    past them are masked, so the shape does not depend on it."""
    if length is None and T == 1 and (window is None or S <= window):
        return None
    i = (S if length is None else length) - T + torch.arange(T, device=device)[:, None]  # (T, 1) the queries' keys
    j = torch.arange(S, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask &= i - j < window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
              length: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention with grouped-query heads.

    q (B, T, Hq, D): the last T of S positions; k, v (B, Hkv, S, D) with Hq % Hkv == 0 (query head h reads kv
    head h // (Hq/Hkv)). Query t sits at position S - T + t and sees keys up to it, the last `window` only
    when a sliding window is given. Returns (B, T, Hq, D).
    length: an int32 (1,) tensor: only keys [0, length) are in use and the queries are their last T; the slots
    past them are masked, so shapes do not depend on it (a compiled static decode step).
    """
    mask = attention_mask(q.shape[1], k.shape[2], window, q.device, length)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[1])
    return y.transpose(1, 2)


def grid_error(wg: torch.Tensor, e: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, top: int) -> torch.Tensor:
    """AWQ's weighted rounding error (`llmrun.awq`'s grid search) of the groups wg (out, G, g) on the grids scale,
    zero (out, G, 1), the channels' energies e (1, G, g) -> (out, G): sum over each group of e * (scale * (codes -
    zero) - w)^2, codes = clamp(round(w / scale) + zero, 0, top). In place in one buffer: codes - zero is round(w /
    scale) clamped to [-zero, top - zero], the same integers."""
    q = torch.div(wg, scale).round_()
    q = torch.clamp(q, min=-zero, max=top - zero, out=q).mul_(scale).sub_(wg)
    return q.mul_(q).mul_(e).sum(-1)


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


# --- the quantized KV cache -----------------------------------------------------------------------------------------
# INT8: symmetric, per token, one fp16 scale per group of `group` channels (32, or 16 when head_dim needs it).
# INT4 (KIVI, Liu et al. 2024): values per token, asymmetric (fp16 scale and minimum per group of channels); keys
# per channel, asymmetric over groups of KEY_GROUP consecutive positions. A key group is quantized once it is full;
# until then its keys are read in full precision, and so are its values (KIVI's full-precision residual), from the
# rings `k_recent` and `v_recent` of R slots (position s at slot s % R). Its last RECENT positions (or all of them,
# when it holds fewer) are read exact from the rings: enough that every row of a prompt chunk of up to PREFILL_ROWS
# tokens finds the exact keys and values it reads, and that a rollback re-fills a partial group bit for bit. The
# rings have ROLLBACK slots more (R = RING): a write rolled back (a speculative block's rejected drafts, pipelined
# decoding's step fed past a reply's end) has then overwritten none of the RECENT positions before it.
# Two 4-bit codes share a byte: channel 2i in the low nibble, 2i + 1 in the high one.
# Which positions a query reads as codes depends on its position (`QuantizedKV.row_quantized`): each row of a block
# of queries reads what it would have read had the tokens been fed one at a time, so a speculative block verifies
# exactly what plain decoding computes, and a prompt's rows read what decoding reads.

KEY_GROUP = 32  # positions per INT4 key scale
PREFILL_ROWS = 512  # a prompt chunk (llmrun.generate.PREFILL_CHUNK): the rings hold it and the groups before it
RECENT = PREFILL_ROWS + 2 * KEY_GROUP  # the positions INT4's rings hold exact (at most)
# the most tokens a write rolled back may have added: a block's drafts, its first token kept (MAX_DRAFT_TOKENS)
ROLLBACK = KEY_GROUP
RING = RECENT + ROLLBACK  # the rings' slots (at most)


def ring_window(ring: int) -> int:
    """The positions rings of `ring` slots hold exact: RECENT, or all of them for a cache of at most RECENT."""
    return min(ring, RECENT)


def kv_group(head_dim: int) -> int:
    """Channels per scale of a per-token quantized head: 32, or 16 for a head_dim that 32 does not divide."""
    for g in (32, 16):
        if head_dim % g == 0:
            return g
    raise ValueError(f"a quantized KV cache needs head_dim divisible by 16, not {head_dim}")


def quantize_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> codes int8 (..., D), scales fp16 (..., D/group): x ~ code * scale, scale = max|x| / 127."""
    blocks = x.float().unflatten(-1, (-1, group))
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    inverse = torch.where(scale > 0, 1 / scale.float(), 0)
    codes = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)
    return codes.flatten(-2), scale[..., 0]


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes int8 (..., D), scales (..., D/group) -> x (..., D) fp32."""
    return (codes.float().unflatten(-1, (scale.shape[-1], -1)) * scale.float()[..., None]).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """codes 0..15 (..., D) -> uint8 (..., D/2): channel 2i in the low nibble, 2i + 1 in the high."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., D/2) -> codes (..., D) int16."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int16)


def _int4_round(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit over `dim` of x (fp32): (codes, scale fp16, minimum fp16) with x ~ code * scale + min."""
    lo, hi = x.amin(dim, keepdim=True).half(), x.amax(dim, keepdim=True)
    scale = ((hi - lo.float()) / 15).half()
    inverse = torch.where(scale > 0, 1 / scale.float(), 0)
    codes = torch.round((x - lo.float()) * inverse).clamp(0, 15)
    return codes, scale, lo


def quantize_int4_tokens(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values: x (..., D) -> codes uint8 (..., D/2), scale and min fp16 (..., D/group), per token and group."""
    codes, scale, lo = _int4_round(x.float().unflatten(-1, (-1, group)), -1)
    return pack_int4(codes.flatten(-2)), scale[..., 0], lo[..., 0]


def dequantize_int4_tokens(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    q = unpack_int4(codes).float().unflatten(-1, (scale.shape[-1], -1))
    return (q * scale.float()[..., None] + lo.float()[..., None]).flatten(-2)


def quantize_int4_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys: x (..., n * KEY_GROUP, D) -> codes uint8 (..., n * KEY_GROUP, D/2), scale and min fp16 (..., n, D):
    per channel, over each group of KEY_GROUP consecutive positions."""
    codes, scale, lo = _int4_round(x.float().unflatten(-2, (-1, KEY_GROUP)), -2)
    return pack_int4(codes.flatten(-3, -2)), scale[..., 0, :], lo[..., 0, :]


def dequantize_int4_channels(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """codes (..., S, D/2) with S <= n * KEY_GROUP, scale/min (..., n, D) -> (..., S, D) fp32."""
    S = codes.shape[-2]
    groups = -(-S // KEY_GROUP)  # the groups the codes use, not the planes' whole capacity, are expanded
    scale = scale[..., :groups, :].float().repeat_interleave(KEY_GROUP, dim=-2)[..., :S, :]
    lo = lo[..., :groups, :].float().repeat_interleave(KEY_GROUP, dim=-2)[..., :S, :]
    return unpack_int4(codes).float() * scale + lo


def int4_decoded_state(length: int, ring: int = RING) -> tuple[int, int]:
    """(n_quantized, first_exact) of an INT4 cache of `length` positions as decoding writes it: every full key group
    is codes, and rings of `ring` slots hold the exact keys and values of the last `ring_window(ring)` positions,
    read from a group's start on. What a device step's cache holds (`write_int4`), whose attention counts it from
    the length."""
    n_quantized = length // KEY_GROUP * KEY_GROUP
    return n_quantized, min(n_quantized, max(0, -(-(length - ring_window(ring)) // KEY_GROUP) * KEY_GROUP))


def write_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """x (B, H, T, D) quantized per token (`quantize_int8`) into codes int8 (B, H, C, D) and scales fp16
    (B, H, C, D / group) at slots (T,) int64 (on their device: nothing is read on the host)."""
    c, scale = quantize_int8(x, x.shape[-1] // scales.shape[-1])
    codes.index_copy_(2, slots, c)
    scales.index_copy_(2, slots, scale)


def write_int4(k: torch.Tensor, v: torch.Tensor, k_codes, v_codes, k_scale, k_min, v_scale, v_min, k_recent, v_recent,
               slots: torch.Tensor) -> None:
    """An INT4 write (`QuantizedKV`'s layout, each tensor over the whole buffer of C positions, rings of R): k, v
    (B, H, T, D) of T <= R - slots[0] % KEY_GROUP tokens (a decode step's, a prompt chunk's) at the consecutive slots
    (T,) int64 on the device, right after the positions in use, with no host value read. The values' codes per token;
    keys and values into the rings at slot % R (the new keys overwrite no older key of the first group); then every
    key group from the first slot's to the last slot's quantized per channel from the ring. A group is
    quantized so at every write until the one that fills it, whose codes are final; before then they are not read
    (a partial group is read exact from the rings). Positions past the buffer, in a last group that cannot fill,
    are clamped to its last slot (they are never read either)."""
    C, R = k_codes.shape[2], k_recent.shape[2]
    codes, scale, lo = quantize_int4_tokens(v, v.shape[-1] // v_scale.shape[-1])
    v_codes.index_copy_(2, slots, codes)
    v_scale.index_copy_(2, slots, scale)
    v_min.index_copy_(2, slots, lo)
    k_recent.index_copy_(2, slots % R, k.to(k_recent.dtype))
    v_recent.index_copy_(2, slots % R, v.to(v_recent.dtype))
    # (n,): the groups from the first slot's on, those past the last slot's clamped to it (written twice, alike)
    first = slots[0] // KEY_GROUP + torch.arange(int4_write_groups(slots.numel()), device=slots.device)
    groups = torch.minimum(first, slots[-1] // KEY_GROUP)
    positions = (groups[:, None] * KEY_GROUP + torch.arange(KEY_GROUP, device=slots.device)).flatten()  # (nG,)
    codes, scale, lo = quantize_int4_channels(k_recent[:, :, positions % R])
    k_codes.index_copy_(2, positions.clamp(max=C - 1), codes)
    k_scale.index_copy_(2, groups, scale)
    k_min.index_copy_(2, groups, lo)


def int4_write_groups(T: int) -> int:
    """The most key groups T >= 1 consecutive positions touch (wherever the first sits in its group)."""
    return (T + KEY_GROUP - 2) // KEY_GROUP + 1


@dataclass
class QuantizedKV:
    """One layer's quantized cache as attention reads it: S positions of B sequences, Hkv heads, head_dim D.

    int8: k, v int8 (B, Hkv, S, D); k_scale, v_scale fp16 (B, Hkv, S, D/group).
    int4: v uint8 (B, Hkv, S, D/2) with v_scale, v_min fp16 (B, Hkv, S, D/group) (every position's value has
          codes); k uint8 (B, Hkv, S, D/2) whose first `n_quantized` positions (a multiple of KEY_GROUP) are codes,
          with k_scale, k_min fp16 (B, Hkv, >= n_quantized / KEY_GROUP, D); k_recent and v_recent (B, Hkv, R, D)
          (the model's dtype) hold the exact keys and values [first_exact, S), position s at s % R, with
          first_exact <= n_quantized a multiple of KEY_GROUP and S - first_exact <= R (None: n_quantized).
          A query reads the positions before its `row_quantized` as codes, keys and values alike, the rest exact.
    Position, head and batch strides are free (views of a larger buffer); the last dimension is contiguous.
    """

    bits: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_min: torch.Tensor | None = None
    v_min: torch.Tensor | None = None
    k_recent: torch.Tensor | None = None
    v_recent: torch.Tensor | None = None
    n_quantized: int = 0
    first_exact: int | None = None

    def __post_init__(self):
        if self.first_exact is None:
            self.first_exact = self.n_quantized

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.v_scale.shape[-1] * self.group

    @property
    def group(self) -> int:
        return (self.v.shape[-1] * (2 if self.bits == 4 else 1)) // self.v_scale.shape[-1]

    def row_quantized(self, T: int) -> list[int]:
        """INT4: how many positions, from 0, each query of the T newest positions reads as codes (the rest it reads
        exact from the rings). Row r sits at position p = S - T + r; when one-token decoding ran it, the full key
        groups were those ending at or before p + 1: floor((p + 1) / KEY_GROUP) * KEY_GROUP positions, here clamped
        to [first_exact, n_quantized]. T = 1 reads n_quantized. In a cache written in blocks of at most
        RECENT - KEY_GROUP + 1 tokens (PREFILL_ROWS and more), rolled back by at most RECENT - KEY_GROUP, the clamp
        never bites, so every row reads what a one-token step read; a longer block's early rows read codes where the
        rings have lost their exact keys and values."""
        S, G = self.length, KEY_GROUP
        return [min(max((S - T + r + 1) // G * G, self.first_exact), self.n_quantized) for r in range(T)]


def dequantize_kv(kv: QuantizedKV, n_quantized: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values (B, Hkv, S, D) fp32 that a quantized cache stands for. INT4: positions [0, n_quantized)
    from their codes, the rest exact from the rings; by default kv.n_quantized (what the newest position's query
    reads), at least kv.first_exact."""
    if kv.bits == 8:
        return dequantize_int8(kv.k, kv.k_scale), dequantize_int8(kv.v, kv.v_scale)
    S = kv.length
    nq = kv.n_quantized if n_quantized is None else n_quantized
    assert kv.first_exact <= nq <= kv.n_quantized, (kv.first_exact, nq, kv.n_quantized)
    recent = torch.arange(nq, S, device=kv.k.device) % kv.k_recent.shape[2]
    k_old = dequantize_int4_channels(kv.k[:, :, :nq], kv.k_scale, kv.k_min)
    v_old = dequantize_int4_tokens(kv.v[:, :, :nq], kv.v_scale[:, :, :nq], kv.v_min[:, :, :nq])
    k = torch.cat((k_old, kv.k_recent[:, :, recent].float()), dim=2)
    v = torch.cat((v_old, kv.v_recent[:, :, recent].float()), dim=2)
    return k, v


def quantized_row_blocks(kv: QuantizedKV, T: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """The T newest positions' queries cut into runs of rows that read the same keys: yields (r0, r1, k, v), rows
    [r0, r1) attending k, v fp32 (B, Hkv, S - T + r1, D), the positions up to the run's last row (INT8: one run)."""
    S = kv.length
    nq = kv.row_quantized(T) if kv.bits == 4 else [None] * T
    cuts = [r for r in range(1, T) if nq[r] != nq[r - 1]]
    for r0, r1 in zip([0, *cuts], [*cuts, T]):  # T = 0: one run of no rows
        k, v = dequantize_kv(kv, nq[r0] if r0 < T else None)
        yield r0, r1, k[:, :, : S - T + r1], v[:, :, : S - T + r1]


def quantized_attention(q: torch.Tensor, kv: QuantizedKV, window: int | None = None) -> torch.Tensor:
    """`attention` over a quantized cache: dequantize (to fp32), then attend, each query row reading the keys
    `QuantizedKV.row_quantized` gives it. Returns (B, T, Hq, D) in q's dtype."""
    parts = [attention(q[:, r0:r1].float(), k, v, window) for r0, r1, k, v in quantized_row_blocks(kv, q.shape[1])]
    return torch.cat(parts, dim=1).to(q.dtype)


def quantized_attention_mass(q: torch.Tensor, kv: QuantizedKV, window: int | None = None) -> torch.Tensor:
    """`attention_mass` over a quantized cache, each query row with its own keys: q (B, T, Hq, D) -> (B, Hkv, S)."""
    B, T = q.shape[:2]
    mass = torch.zeros(B, kv.k.shape[1], kv.length, device=q.device)
    for r0, r1, k, _ in quantized_row_blocks(kv, T):
        mass[:, :, : k.shape[2]] += attention_mass(q[:, r0:r1], k, window)
    return mass


def attention_mass(q: torch.Tensor, k: torch.Tensor, window: int | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """The attention weight each key receives, summed over the T queries and the query heads sharing its kv head:
    q (B, T, Hq, D), k (B, Hkv, S, D) -> (B, Hkv, S) fp32 (one step's share of H2O's accumulated attention).
    mask: a (T, S) bool mask of the keys each query sees, instead of the causal one (and window's)."""
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.float().view(B, T, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, T, D)
    scores = torch.einsum("bhgtd,bhsd->bhgts", qg, k.float()) / D**0.5  # (B, Hkv, G, T, S)
    if mask is None:
        mask = attention_mask(T, S, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).sum((2, 3))
