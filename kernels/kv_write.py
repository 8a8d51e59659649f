"""Triton writes of new tokens' K/V into a quantized KV cache: the quantization fused with the store, so that a decode
step writes a layer's INT8 cache in one launch and its INT4 cache in two, rather than the twenty-odd small kernels of
the torch code (each a node of the step's CUDA graph); a float cache's K and V go in one launch too, and in a
CUDA graph's step an INT8 cache's write also rotates q and k first (`rope_write_int8_`: RoPE's launch gone).
`kernels.ref.write_int8` and `kernels.ref.write_int4` are the specification, and the arithmetic is theirs bit for
bit: fp32 division rounded to nearest (`div_rn`, where `/` in Triton is an approximation), products rounded to fp32
before they are rounded to codes (`_round_product`: a GPU would fuse the two), fp16 scales rounded to nearest even,
codes rounded half to even as torch.round.

The T new tokens sit at consecutive slots [s, s + T) (s = slots[0], read on the device: one launch serves a CUDA
graph at any position). INT8 and INT4 values: one program per (token, batch x head), a row quantized per group of
channels. INT4 keys (`_int4_keys_kernel`): one program per (batch x head, key group), for every group the new slots
touch (a decode step's one or two, a prompt chunk's 512 / KEY_GROUP and one): the new keys go into the ring, and the
group's KEY_GROUP positions, the new ones from the input and the others from the ring, are quantized per channel
into its codes, scale and minimum. A group is so quantized at every write until the one that fills it; before then
its codes are not read (attention reads a partial group exact from the rings), nor are the positions past the buffer
of a last group that cannot fill (not stored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common, ref, rotary

_KEY_GROUP = tl.constexpr(ref.KEY_GROUP)


@triton.jit
def _round_product(x, y):
    """torch.round(x * y) for |x * y| < 2^22, the product rounded to fp32 first: adding 1.5 * 2^23 leaves no
    fraction bits, so the fp32 add rounds half to even. The product is an fma with 0: a plain one whose only use is
    that add compiles to one fused multiply-add on a GPU (`fma.rn.f32`, the product unrounded), and codes at a
    half differed from torch's (H200, 2026-11-26); LLVM folds an fma with 1 back into that add, so the product's
    fma it is."""
    return (tl.math.fma(x, y, 0.0) + 12582912.0) - 12582912.0


@triton.jit
def _inverse(scale):
    """1 / scale in fp32 (division rounded to nearest), 0 where the scale is 0: as the reference's torch.where."""
    s = scale.to(tl.float32)
    return tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s > 0, s, 1.0)), 0.0)


@triton.jit
def _int8_rows_kernel(X0, X1, Codes, Scales, Slots, stride_xb, stride_xh, stride_xt, stride_cn, stride_cb, stride_ch,
                      stride_cs, stride_sn, stride_sb, stride_sh, stride_ss, H, D, GROUP: tl.constexpr,
                      BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """Row t of (batch x head) bh of input n (program axis 2: X0, or X1 for K and V in one launch): x (D,) -> codes
    int8 and fp16 scales (per GROUP channels) at slot s + t of Codes[n] and Scales[n]."""
    common.pdl_wait(PDL)
    t = tl.program_id(0)
    bh = tl.program_id(1)
    n = tl.program_id(2)
    b, h = bh // H, bh % H
    slot = tl.load(Slots) + t
    g = tl.arange(0, BLOCK_G)  # (BLOCK_G,) channel groups
    d = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (BLOCK_G, GROUP) channels
    ok = d < D
    row = b * stride_xb + h * stride_xh + t * stride_xt + d
    if n == 0:
        x = tl.load(X0 + row, mask=ok, other=0.0).to(tl.float32)
    else:
        x = tl.load(X1 + row, mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), 127.0).to(tl.float16)  # (BLOCK_G,)
    codes = tl.minimum(tl.maximum(_round_product(x, _inverse(scale)[:, None]), -127.0), 127.0)
    tl.store(Codes + n * stride_cn + b * stride_cb + h * stride_ch + slot * stride_cs + d, codes.to(tl.int8), mask=ok)
    tl.store(Scales + n * stride_sn + b * stride_sb + h * stride_sh + slot * stride_ss + g, scale,
             mask=g * GROUP < D)


@triton.jit
def _rope_write_int8_kernel(X, Cos, Sin, Codes, Scales, Slots, T, HQ, HKV, half, stride_xb, stride_xt, stride_cn,
                            stride_cb, stride_ch, stride_cs, stride_sn, stride_sb, stride_sh, stride_ss,
                            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """Program (b, t) of a fused projection X (B, T, HQ + 2 HKV, 2 half): token t's q and k heads rotated in place
    (`rotary._rope_kernel`'s code), then its HKV key and HKV value rows quantized as `_int8_rows_kernel` quantizes
    them, into Codes[0], Scales[0] (keys) and Codes[1], Scales[1] (values) at slot slots[0] + t. The keys are read
    back from X after a barrier: the bits `rope_` stored, whatever the compiler fuses."""
    common.pdl_wait(PDL)
    pid = tl.program_id(0)
    b, t = pid // T, pid % T
    token = b * stride_xb + t * stride_xt
    rotary._rope_in_place(X, Cos, Sin, token, t, HQ + HKV, half, BLOCK_H, BLOCK_HALF)
    tl.debug_barrier()  # this program's rotated keys, stored by its threads, are read back by others below
    slot = tl.load(Slots) + t
    r = tl.arange(0, BLOCK_R)[:, None, None]  # rows: keys 0..HKV-1, then values; row r is head HQ + r of X
    g = tl.arange(0, BLOCK_G)[None, :, None]  # channel groups
    d = g * GROUP + tl.arange(0, GROUP)[None, None, :]  # (1, BLOCK_G, GROUP) channels
    ok = (r < 2 * HKV) & (d < 2 * half)
    x = tl.load(X + token + (HQ + r) * (2 * half) + d, mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), 2), 127.0).to(tl.float16)  # (BLOCK_R, BLOCK_G)
    codes = tl.minimum(tl.maximum(_round_product(x, _inverse(scale)[:, :, None]), -127.0), 127.0)
    n, h = r // HKV, r % HKV
    tl.store(Codes + n * stride_cn + b * stride_cb + h * stride_ch + slot * stride_cs + d, codes.to(tl.int8), mask=ok)
    r, g = tl.arange(0, BLOCK_R)[:, None], tl.arange(0, BLOCK_G)[None, :]  # scale's (BLOCK_R, BLOCK_G)
    n, h = r // HKV, r % HKV
    tl.store(Scales + n * stride_sn + b * stride_sb + h * stride_sh + slot * stride_ss + g, scale,
             mask=(r < 2 * HKV) & (g * GROUP < 2 * half))


@triton.jit
def _dense_rows_kernel(K, V, KOut, VOut, Slots, stride_xb, stride_xh, stride_xt, stride_ob, stride_oh, stride_os, H,
                       D, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Row t of (batch x head) bh of K (program axis 2: 0) or V (1), stored at slot s + t in the cache's dtype."""
    common.pdl_wait(PDL)
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    slot = tl.load(Slots) + t
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    row, at = b * stride_xb + h * stride_xh + t * stride_xt + d, b * stride_ob + h * stride_oh + slot * stride_os + d
    if tl.program_id(2) == 0:
        tl.store(KOut + at, tl.load(K + row, mask=ok).to(KOut.dtype.element_ty), mask=ok)
    else:
        tl.store(VOut + at, tl.load(V + row, mask=ok).to(VOut.dtype.element_ty), mask=ok)


@triton.jit
def _int4_scale(lo, hi):
    """Asymmetric 4-bit between lo (fp16: rounded first) and hi, as ref._int4_round: (scale fp16, its inverse)."""
    scale = tl.math.div_rn(hi - lo.to(tl.float32), 15.0).to(tl.float16)
    return scale, _inverse(scale)


@triton.jit
def _int4_codes(x, lo, inverse):
    """round((x - lo) * inverse) clamped to [0, 15], as uint8."""
    return tl.minimum(tl.maximum(_round_product(x - lo.to(tl.float32), inverse), 0.0), 15.0).to(tl.uint8)


@triton.jit
def _int4_values_kernel(X, Codes, Scales, Mins, Ring, Slots, stride_xb, stride_xh, stride_xt, stride_cb, stride_ch,
                        stride_cs, stride_sb, stride_sh, stride_ss, stride_rb, stride_rh, stride_rs, H, D, ring,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """Row t of bh: x (D,) -> packed codes (D/2 bytes), fp16 scale and minimum per GROUP channels at slot s + t, and
    x itself into the ring at (s + t) % ring. Channels 2i and 2i + 1 are loaded apart: they share a byte."""
    common.pdl_wait(PDL)
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    slot = tl.load(Slots) + t
    g = tl.arange(0, BLOCK_G)
    pair = g[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]  # (BLOCK_G, GROUP / 2): byte i
    ok = pair * 2 < D
    row = X + b * stride_xb + h * stride_xh + t * stride_xt
    even = tl.load(row + 2 * pair, mask=ok, other=0.0)
    odd = tl.load(row + 2 * pair + 1, mask=ok, other=0.0)
    ring_row = Ring + b * stride_rb + h * stride_rh + (slot % ring) * stride_rs
    tl.store(ring_row + 2 * pair, even.to(Ring.dtype.element_ty), mask=ok)
    tl.store(ring_row + 2 * pair + 1, odd.to(Ring.dtype.element_ty), mask=ok)
    even, odd = even.to(tl.float32), odd.to(tl.float32)
    lo = tl.minimum(tl.min(even, 1), tl.min(odd, 1)).to(tl.float16)  # (BLOCK_G,)
    scale, inverse = _int4_scale(lo, tl.maximum(tl.max(even, 1), tl.max(odd, 1)))
    packed = _int4_codes(even, lo[:, None], inverse[:, None]) | (_int4_codes(odd, lo[:, None], inverse[:, None]) << 4)
    tl.store(Codes + b * stride_cb + h * stride_ch + slot * stride_cs + pair, packed, mask=ok)
    g_ok = g * GROUP < D
    tl.store(Scales + b * stride_sb + h * stride_sh + slot * stride_ss + g, scale, mask=g_ok)
    tl.store(Mins + b * stride_sb + h * stride_sh + slot * stride_ss + g, lo, mask=g_ok)


@triton.jit
def _group_keys(x_at, ring_at, new, fresh, ok):
    """A key group's keys of one channel parity (KEY_GROUP, BLOCK_P) fp32, as the ring holds them (its dtype) once
    this write is done: the `fresh` ones from x (at `x_at`), the group's `new` ones stored into the ring, the others
    from ring slots this write leaves alone (no program reads a slot another one writes)."""
    keys = tl.load(x_at, mask=fresh[:, None] & ok[None, :], other=0.0).to(ring_at.dtype.element_ty)
    tl.store(ring_at, keys, mask=new[:, None] & ok[None, :])
    old = tl.load(ring_at, mask=(~fresh)[:, None] & ok[None, :], other=0.0)
    return tl.where(fresh[:, None], keys, old).to(tl.float32)


@triton.jit
def _int4_keys_kernel(X, Codes, Scales, Mins, Ring, Slots, stride_xb, stride_xh, stride_xt, stride_cb, stride_ch,
                      stride_cs, stride_sb, stride_sh, stride_sg, stride_rb, stride_rh, stride_rs, H, T, D, C, ring,
                      BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """Program (bh, i): the i-th key group from the first new slot's, skipped when it is past the last slot's. Its
    KEY_GROUP positions' keys, the new ones from x (written to the ring too) and the older ones from the ring, are
    quantized per channel: packed codes at the positions below C, fp16 scale and minimum (D,) at the group."""
    common.pdl_wait(PDL)
    bh = tl.program_id(0)
    i = tl.program_id(1)
    b, h = bh // H, bh % H
    first = tl.load(Slots)
    group = first // _KEY_GROUP + i
    if group <= (first + T - 1) // _KEY_GROUP:
        pos = group * _KEY_GROUP + tl.arange(0, _KEY_GROUP)  # (KEY_GROUP,) the group's positions
        new = (pos >= first) & (pos < first + T)
        # The position whose key pos's ring slot holds once the write is done: a new one where it is pos itself, or,
        # past the buffer of a last group that cannot fill, a new position that shares pos's slot in a ring of fewer
        # slots than the positions read (--ctx 100: the group of 96-127 reads slots 0-27, which this write fills).
        # (pos >= first - 31: the dividend is positive, where Triton's % and the interpreter's would disagree)
        src = first + (pos - first + _KEY_GROUP * ring) % ring
        fresh = src < first + T
        pair = tl.arange(0, BLOCK_P)  # byte i holds channels 2i and 2i + 1
        ok = pair < D // 2
        x_at = X + b * stride_xb + h * stride_xh + (src - first)[:, None] * stride_xt + 2 * pair[None, :]
        ring_at = Ring + b * stride_rb + h * stride_rh + (pos % ring)[:, None] * stride_rs + 2 * pair[None, :]
        even = _group_keys(x_at, ring_at, new, fresh, ok)
        odd = _group_keys(x_at + 1, ring_at + 1, new, fresh, ok)
        lo_even, lo_odd = tl.min(even, 0).to(tl.float16), tl.min(odd, 0).to(tl.float16)  # (BLOCK_P,)
        scale_even, inv_even = _int4_scale(lo_even, tl.max(even, 0))
        scale_odd, inv_odd = _int4_scale(lo_odd, tl.max(odd, 0))
        packed = (_int4_codes(even, lo_even[None, :], inv_even[None, :])
                  | (_int4_codes(odd, lo_odd[None, :], inv_odd[None, :]) << 4))
        tl.store(Codes + b * stride_cb + h * stride_ch + pos[:, None] * stride_cs + pair[None, :], packed,
                 mask=(pos < C)[:, None] & ok[None, :])
        at = b * stride_sb + h * stride_sh + group * stride_sg + 2 * pair
        tl.store(Scales + at, scale_even, mask=ok)
        tl.store(Scales + at + 1, scale_odd, mask=ok)
        tl.store(Mins + at, lo_even, mask=ok)
        tl.store(Mins + at + 1, lo_odd, mask=ok)


def _rows(x: torch.Tensor) -> tuple[int, int, int]:
    """x (B, H, n, ...)'s batch, head and position strides (its last dim contiguous)."""
    assert x.stride(-1) == 1, "rows must be contiguous"
    return x.stride(0), x.stride(1), x.stride(2)


def write_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """`ref.write_int8`: x (B, H, T, D) (any float dtype, rows contiguous) quantized per token into codes int8
    (B, H, C, D) and scales fp16 (B, H, C, D / group) at the consecutive slots starting at slots[0] (int64 on the
    device; slots (T,) as the reference takes them)."""
    _write_int8((x,), codes[None], scales[None], slots)


def write_int8_pair(k: torch.Tensor, v: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """`write_int8` of k into codes[0], scales[0] and of v into codes[1], scales[1], in one launch: codes (2, B, H, C,
    D), scales (2, B, H, C, D / group), as an INT8 cache holds a layer's K and V."""
    _write_int8((k, v), codes, scales, slots)


def _write_int8(xs, codes, scales, slots) -> None:
    B, H, T, D = xs[0].shape
    if len(xs) == 2 and xs[1].stride() != xs[0].stride():  # (never for K and V, slices of one projection)
        xs = tuple(x.contiguous() for x in xs)
    group = D // scales.shape[-1]
    _int8_rows_kernel[(T, B * H, len(xs))](xs[0], xs[-1], codes, scales, slots, *_rows(xs[0]), codes.stride(0),
                                           *_rows(codes[0]), scales.stride(0), *_rows(scales[0]), H, D,
                                           GROUP=group, BLOCK_G=triton.next_power_of_2(D // group),
                                           **common.pdl_options(xs[0]))


def rope_write_int8_(qkv: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor, codes: torch.Tensor,
                     scales: torch.Tensor, slots: torch.Tensor) -> None:
    """qkv (B, T, n_heads + 2 Hkv, D): its q and k heads rotated in place by cos/sin (T, D), then the rotated k and the
    v heads written into an INT8 cache's layer (codes (2, B, Hkv, C, D), scales (2, B, Hkv, C, D / group)) at the
    consecutive slots from slots[0]: `rotary.rope_` then `write_int8_pair`, bit for bit, in one launch."""
    B, T, H, D = qkv.shape
    Hkv = (H - n_heads) // 2
    assert qkv.stride(3) == 1 and qkv.stride(2) == D, "each token's heads must be packed"
    group = D // scales.shape[-1]
    cos, sin = cos.contiguous(), sin.contiguous()
    blocks = {"BLOCK_H": n_heads + Hkv, "BLOCK_HALF": D // 2, "BLOCK_R": 2 * Hkv, "BLOCK_G": D // group}
    _rope_write_int8_kernel[(B * T,)](qkv, cos, sin, codes, scales, slots, T, n_heads, Hkv, D // 2, qkv.stride(0),
                                      qkv.stride(1), codes.stride(0), *_rows(codes[0]), scales.stride(0),
                                      *_rows(scales[0]), GROUP=group, **common.pdl_options(qkv),
                                      **{name: triton.next_power_of_2(n) for name, n in blocks.items()})


def write_dense(k: torch.Tensor, v: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                slots: torch.Tensor) -> None:
    """A float cache's write in one launch: k, v (B, H, T, D) (rows contiguous) into k_out, v_out (B, H, C, D), cast
    to their dtype, at the consecutive slots from slots[0] (int64 on the device): `index_copy_` of each, bit for
    bit."""
    B, H, T, D = k.shape
    if v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    assert k_out.stride() == v_out.stride() and k_out.dtype == v_out.dtype, "K's and V's buffers alike"
    _dense_rows_kernel[(T, B * H, 2)](k, v, k_out, v_out, slots, *_rows(k), *_rows(k_out), H, D,
                                      BLOCK_D=triton.next_power_of_2(D), **common.pdl_options(k))


def write_int4(k: torch.Tensor, v: torch.Tensor, k_codes, v_codes, k_scale, k_min, v_scale, v_min, k_recent, v_recent,
               slots: torch.Tensor) -> None:
    """`ref.write_int4`: k, v (B, H, T, D), T <= R - slots[0] % KEY_GROUP, into an INT4 cache's layer
    (`ref.QuantizedKV`'s tensors over the whole buffer: k_codes, v_codes (B, H, C, D/2), k_scale, k_min (B, H,
    ceil(C / KEY_GROUP), D), v_scale, v_min (B, H, C, D / group), rings (B, H, R, D)) at the consecutive slots from
    slots[0]: two launches whatever T (a prompt chunk's too)."""
    B, H, T, D = k.shape
    assert v.shape == k.shape, (k.shape, v.shape)
    group, ring = D // v_scale.shape[-1], k_recent.shape[2]
    assert v_min.stride() == v_scale.stride() and k_min.stride() == k_scale.stride(), "minimums as their scales"
    _int4_values_kernel[(T, B * H)](v, v_codes, v_scale, v_min, v_recent, slots, *_rows(v), *_rows(v_codes),
                                    *_rows(v_scale), *_rows(v_recent), H, D, ring,
                                    GROUP=group, BLOCK_G=triton.next_power_of_2(D // group), **common.pdl_options(v))
    _int4_keys_kernel[(B * H, ref.int4_write_groups(T))](
        k, k_codes, k_scale, k_min, k_recent, slots, *_rows(k), *_rows(k_codes), *_rows(k_scale), *_rows(k_recent), H,
        T, D, k_codes.shape[2], ring, BLOCK_P=triton.next_power_of_2(D // 2), **common.pdl_options(k))
