"""Weight-only quantized matmul in Triton (W4A16, W8A16): y = x @ W^T with W kept packed, activations not rounded.

W (N, K) is cut along K in groups of G (32, 64 or 128) sharing one fp16 scale d (and offset m):
  4-bit  qs uint8 (N, K/2): within each block of 32 along K, byte i holds q_i (low nibble) and q_{i+16} (high
         nibble), GGML's order; w = d * q + m, or m = -8 d when m is None. G = 32 is GGUF's Q4_0/Q4_1; G = 128
         is AWQ's, whose zero point z maps to m = -d * z.
  8-bit  qs int8 (N, K); w = d * q.
  d, m   fp16 (N, K/G).
`ref.dequantize_blocks` is the plain-torch definition for any G; G = 32 is also the CPU kernels' layout.

Three paths, chosen by the number of activation rows M:
- decode (and on a GPU under 16-bit x, M < 3; any M <= 16 under fp32 x): `_gemv_kernel`, one program per BLOCK_N output
  columns and per slice of K, for up to 8 rows a launch (a block of 9-16 takes two). It dequantizes W's tiles in
  registers to fp32, never materialized, once for all the rows; the rows of x take turns over each tile, so that each
  row's sums are the same code whatever the rows beside it. When N alone gives too few programs, K is split: each slice
  writes an fp32 partial sum (split_k, M, N) and counts itself done on its columns' counter; the slice that counts last
  adds all the partials up in slice order and rounds to x's dtype, then sets the counter back to 0 for the next launch.
  One launch however K is split (a second launch to sum the slices cost an H200 48 launches and ~0.1 ms of a 1B model's
  1.9 ms step), and the sum does not depend on which slice finishes last.
  LLMRUN_GEMV_HALF2=1 (an experiment for the GPU profiles, `bench/gpu.sh`): its 4-bit weights under 16-bit x
  dequantized and multiplied in fp16 pairs, two codes an instruction (`common.h2_*`; the weights and a
  word's 8 products rounded to fp16, x past fp16's range an infinity).
- verification on a GPU (3 <= M <= 16 rows of 16-bit x): `_gemv_dot_kernel`, all rows in one launch, the
  dequantized tile rounded to x's dtype and multiplied on the tensor cores, split K alike. On an H100 9 rows cost
  it 1.0-1.07x one row's time, the FFMA GEMV 3.5-6.5x (`_takes_dot`). LLMRUN_GEMV_DOT=0 keeps every M on the FFMA
  GEMV (a block's rows then have one-token steps' bits), =1 puts every M on the tensor cores.
- prefill (M > 16): `_dequantize_kernel` writes W (N, K) in x's dtype and torch.matmul (cuBLAS) does the GEMM.
  Compute-bound at these M, the extra N*K*2 bytes of traffic are small next to the matmul; a fused tiled
  `tl.dot` kernel is the next step if profiles say otherwise.

The 4-bit kernels never interleave nibbles: the low nibbles of a tile's bytes are the first 16 of each block of
32 along K and the high nibbles the last 16, so the kernels gather x (small, cached) at those two index sets.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from . import common, ref

DECODE_ROWS = 8  # rows of x one GEMV launch serves
DOT_ROWS = 3  # from this many rows of 16-bit x on a GPU, the tensor-core GEMV (`_takes_dot`)
_ONE = 0x3F800000  # 1.0's bits: `_gemv_kernel`'s argument ONE (`_code_weights`)
VERIFY_ROWS = 16  # up to this many rows (a speculative verification block) run as GEMVs, W kept packed (on the
# FFMA GEMV DECODE_ROWS a launch): reading the packed W twice costs far less than writing and reading it dequantized
# (and inside a CUDA graph that copy of W would stay allocated in the graph's pool)


# The plain-torch definition of the layout, for any group size: kernels.ref.dequantize_blocks.
dequantize_groups = ref.dequantize_blocks


@triton.jit
def _block_values(ptr, n, n_ok, k0, k_end, stride_dn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, WIDTH: tl.constexpr):
    """The fp16 scales (or offsets) of columns k0 .. k0 + BLOCK_K of W's rows n as fp32, one load a (row, block of
    32) spread over the block's WIDTH entries in registers -> (BLOCK_N, BLOCK_K // 32 * WIDTH)."""
    NB: tl.constexpr = BLOCK_K // 32
    blocks = k0 // 32 + tl.arange(0, NB)
    ok = n_ok[:, None] & (blocks * 32 < k_end)[None, :]
    v = tl.load(ptr + n[:, None] * stride_dn + (blocks // (GROUP // 32))[None, :], mask=ok, other=0.0)
    return tl.reshape(tl.broadcast_to(v.to(tl.float32)[:, :, None], (n.shape[0], NB, WIDTH)), (n.shape[0], NB * WIDTH))


@triton.jit
def _w4_codes(qs_ptr, d_ptr, m_ptr, offs_n, n_mask, k0, k_end, stride_qn, stride_dn,
              GROUP: tl.constexpr, HAS_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of 4-bit W for rows offs_n, as stored -> (q, scale, offset, k_lo, k_ok): q
    (BLOCK_N, BLOCK_K/2) the bytes, whose low nibbles are columns k_lo and high ones k_lo + 16, scale and offset
    each byte's in fp32 (-8 scale without offsets), k_ok (BLOCK_K/2,) where k_lo < k_end."""
    j = tl.arange(0, BLOCK_K // 2)  # byte within the tile
    k_lo = k0 + (j // 16) * 32 + j % 16  # column of the low nibble; the high one is k_lo + 16
    k_ok = k_lo < k_end  # whole blocks of 32: K, k0 and the split points are multiples of 32
    q = tl.load(qs_ptr + offs_n[:, None] * stride_qn + (k0 // 2 + j)[None, :], mask=n_mask[:, None] & k_ok[None, :],
                other=0)
    scale = _block_values(d_ptr, offs_n, n_mask, k0, k_end, stride_dn, GROUP, BLOCK_K, 16)
    if HAS_M:
        offset = _block_values(m_ptr, offs_n, n_mask, k0, k_end, stride_dn, GROUP, BLOCK_K, 16)
    else:
        offset = -8.0 * scale
    return q, scale, offset, k_lo, k_ok


@triton.jit
def _w8_codes(qs_ptr, d_ptr, offs_n, n_mask, k0, k_end, stride_qn, stride_dn,
              GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of 8-bit W for rows offs_n -> (q, scale (fp32, each code's), k, k_ok)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < k_end
    q = tl.load(qs_ptr + offs_n[:, None] * stride_qn + k[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0)
    return q, _block_values(d_ptr, offs_n, n_mask, k0, k_end, stride_dn, GROUP, BLOCK_K, 32), k, k_ok


@triton.jit
def _gemv_codes(qs_ptr, q_row, n_ok, block, k0, k_end, BITS: tl.constexpr, WORDS: tl.constexpr):
    """`_gemv_kernel`'s tile of W's codes for the step at column k0, as stored: with WORDS each tile row's 8 bytes
    as two int32 words (tile, 2) (`_word_weights` takes them apart), else as bytes (tile, 8); or BITS 16 the
    weights (tile, 8). 0 past k_end. Loaded in the loop that uses them, the pipeliner copies them ahead into shared
    memory (cp.async, STAGES - 1 steps ahead: `_gemv_kernel`). WORDS is not for fp32 x, whose 32-byte rows of 8
    values the compiler lays out otherwise than the words' floats: a shuffle in the loop.

    q_row (tile,): where each tile row's codes start in qs at k0 = 0 (4 bits: the byte whose low nibble is the
    chunk's first column, the high one 16 further), in words with WORDS. A step adds one number to it: the loop
    keeps no addresses of its own to recompute."""
    col = tl.multiple_of(k0, 32) + 32 * block
    ok = (n_ok & (col < k_end))[:, None]
    if WORDS:  # 8 bytes, a multiple of 8 from an aligned start
        words = qs_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + k0 // 8 * (BITS // 4)
        return tl.load(words + q_row[:, None] + tl.arange(0, 2)[None, :], mask=ok, other=0)
    else:
        return tl.load(qs_ptr + (k0 // 2 if BITS == 4 else k0) + q_row[:, None] + tl.arange(0, 8)[None, :], mask=ok,
                       other=0)


@triton.jit
def _gemv_scales(d_ptr, m_ptr, d_row, n_ok, block, k0, k_end,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr):
    """Each `_gemv_kernel` tile row's block scale and offset (tile, 1) in fp16 for the step at column k0 (0 where not
    read: BITS 16, no offsets, or past k_end); d_row (tile,) the row of d its scales are in. Two bytes a load, too
    few for cp.async: the kernel loads them a step ahead into registers itself."""
    col = tl.multiple_of(k0, 32) + 32 * block
    ok = (n_ok & (col < k_end))[:, None]
    at = (d_row + (k0 // 32 + block) // (GROUP // 32))[:, None]
    if BITS == 16:
        scale = tl.zeros(at.shape, dtype=tl.float16)
    else:
        scale = tl.load(d_ptr + at, mask=ok, other=0)
    if HAS_M:
        offset = tl.load(m_ptr + at, mask=ok, other=0)
    else:
        offset = tl.zeros(at.shape, dtype=tl.float16)
    return scale, offset


@triton.jit
def _code_weights(moved, high, scale, offset, one, KIND: tl.constexpr):
    """Weights scale * q + offset in fp32 from codes q moved into place in int32s: a nibble (KIND 0 or 1) at bits
    12..15, or 16..19 where `high`; an int8 (KIND 2) at bits 8..15, offset unused (-128 scale is folded in below).
    `one` is 1.0's bits, 0x3F800000 (an argument: in a register, ptxas fuses the mask and the OR into one LOP3).

    Two instructions a code: the code is masked onto 1.0's bits, giving f = 1 + q / 2^e exactly (nibbles at bits
    12..15: e = 11, at 16..19: e = 7; int8s, sign bit flipped to make them q + 128: e = 15); then one FFMA,
    f * (scale 2^e) + (offset - scale 2^e) = scale * q + offset, rounded once. scale 2^e is exact, and so is
    offset - scale 2^e wherever offset's bits and scale 2^e's span at most 24 (always for symmetric codes, -8 scale
    or -128 scale; a Q4_1 minimum far below its scale can round there, by at most 2^-13 of a step): the weight has
    the bits that scale * q + offset's own FFMA gives it."""
    if KIND == 2:
        f = ((moved & 0xFF00) ^ (one | 0x8000)).to(tl.float32, bitcast=True)  # 1 + (q + 128) / 2^15
        big = scale * 32768.0
        return tl.fma(f, big, -128.0 * scale - big)
    else:  # (an else: Triton 3.6 compiles what follows a constexpr if's return, here with high None)
        f = ((moved & tl.where(high, 0xF0000, 0xF000)) | one).to(tl.float32, bitcast=True)  # 1 + q / 2^e
        big = tl.where(high, scale * 128.0, scale * 2048.0)
        return tl.fma(f, big, offset - big)


@triton.jit
def _word_weights(words, scale, offset, one, KIND: tl.constexpr):
    """(tile, 2) int32 words, 8 bytes a tile row (byte 4w + j is bits 8j.. of word w), and each tile row's scale and
    offset (tile, 1) fp32 -> (tile, 8) fp32 weights of the codes: KIND 0 each byte's low nibble, 1 its high nibble,
    2 the byte as an int8 (`_code_weights`). A shift for every other nibble (nibble k of a word, bits 4k.., goes to
    bits 12.. or 16..: k 0 and 1 by 12 up, 2 by 4 up, 3 and 4 where they are, 5 by 4 down, 6 and 7 by 12 down), for
    three int8s of four."""
    j = tl.arange(0, 4)[None, None, :]  # byte of a word
    w = words[:, :, None]
    if KIND == 2:
        moved = tl.where(j == 0, w << 8, tl.where(j == 1, w, tl.where(j == 2, w >> 8, w >> 16)))  # to bits 8..15
    else:
        k = 2 * j + KIND  # the nibble's place in its word: bits 4k..
        moved = tl.where(k < 2, w << 12,
                         tl.where(k == 2, w << 4, tl.where(k < 5, w, tl.where(k == 5, w >> 4, w >> 12))))
    weights = _code_weights(moved, _at_16(j, KIND), scale[:, :, None], offset[:, :, None], one, KIND)
    return tl.reshape(weights, (words.shape[0], 8))


@triton.jit
def _at_16(j, KIND: tl.constexpr):
    """Where `_word_weights` puts the nibble of byte j (of its word) at bits 16..19 rather than 12..15: k 1, 4, 5, 7."""
    return (j == 2) if KIND == 0 else (j != 1)


@triton.jit
def _byte_weights(q, scale, offset, one, KIND: tl.constexpr):
    """`_word_weights` from the bytes themselves, q (tile, 8) uint8 or int8: the same bits (each nibble moved to
    where `_word_weights` puts it, so scaled by the same constants)."""
    b = q.to(tl.int32)
    if KIND == 2:
        return _code_weights(b << 8, None, scale, offset, one, KIND)
    high = _at_16(tl.arange(0, 8)[None, :] % 4, KIND)
    return _code_weights(b << (tl.where(high, 16, 12) - 4 * KIND), high, scale, offset, one, KIND)


@triton.jit
def _bf16_floats(words):
    """(tile, 4) int32 words, each two bf16 values (the first in the low half) -> (tile, 8) fp32: a shift or a mask
    a value (a bf16 `.to` takes two for the high half: a byte permute, then the shift)."""
    even = (words << 16).to(tl.float32, bitcast=True)
    odd = (words & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(even, odd), (words.shape[0], 8))


@triton.jit
def _x_floats(x_row, first, XWORDS: tl.constexpr):
    """x_row[first + 0..7] for each tile row, first (tile,) -> (tile, 8) fp32. XWORDS (bf16 x, 4-byte aligned): read
    as 4 int32 words (`_bf16_floats`)."""
    if XWORDS:
        return _bf16_floats(tl.load(x_row.to(tl.pointer_type(tl.int32), bitcast=True) + (first // 2)[:, None]
                                    + tl.arange(0, 4)[None, :]))
    return tl.load(x_row + first[:, None] + tl.arange(0, 8)[None, :]).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, qs_ptr, d_ptr, m_ptr, bias_ptr, out_ptr, parts_ptr, count_ptr,
    M, N, K, K_SPLIT, SPLIT_K, ONE,  # K_SPLIT: a multiple of 32, the slice of K one program covers; SPLIT_K slices
    stride_xm, stride_qn, stride_dn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    WORDS: tl.constexpr, XWORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, HALF2: tl.constexpr, ASM: tl.constexpr,
):
    """Rows M of x times BLOCK_N columns of W over one slice of K, into out (M, N); with SPLIT (SPLIT_K > 1) each
    slice's fp32 sums go to parts (SPLIT_K, M, N) and the last slice of a column block to finish, as count (one
    int32 a column block, 0 before the launch and after it) tells, sums them into out.

    W's tile is 2-d with a row per (column of W, block of 32 along K, chunk of the block): 8 bytes of W (16
    nibbles: columns first + 0..7 low and first + 16 + 0..7 high; or 8 int8), one 64-bit load, and x's 8 values
    for each half alike, one 128-bit load in 16 bits. BITS 16: W itself in x's dtype (no scales), 8 columns a
    chunk, one 128-bit load in 16 bits (`float_linear`). A thread holds whole tile rows, so a row of x's products is
    summed along the chunk within the thread and added to that row's fp32 sums, (tile, M): nothing crosses
    threads, and nothing waits at a barrier, inside the loop (sm_90 SASS checked here); the sums across the chunks
    of a column come once, after it. (The kernel of 2026-11-25 reduced each step's tile across threads, a barrier
    a step: ~5% of an H200's bandwidth; the next one kept (column, block) rows of 16 bytes, whose fp32 products
    span two threads, and re-read and re-dequantized the tile for every row of x: a 9-row verification block
    cost 5 one-token steps.)

    Its speed is its instruction count and the bytes it keeps in flight. W's codes are copied STAGES - 1 steps
    ahead into shared memory by Triton's pipeliner (cp.async, `tl.range`'s num_stages), or with STAGES 1 a step
    ahead into registers; the scales a step ahead into registers (why: `_GEMV_CONFIGS`). A code costs what it must:
    a mask and an FFMA to become a weight, and a shift for every other one (`_code_weights`; ONE is 1.0's bits,
    0x3F800000), one FFMA in a row's product; a thread's tile rows are columns of one block and chunk, so its x is
    loaded and made fp32 once for all of them (unmasked: `x_first`), and W's addresses are one add a step
    (`_gemv_codes`). sm_90 SASS of the 64x128 4-bit config under Triton 3.6, one row of x: 370 instructions a
    thread for 64 codes with STAGES 1 (~5.8 a code; the kernel before this one took ~9.7: an I2F trick's float
    subtraction, a sign-extend, two-instruction bf16 conversions, masked loads of x for each tile row, addresses
    recomputed every step), 406 with STAGES 4 (the copies' addresses, their wait and two barriers a step, which
    guard the copies' buffers: no thread's sums cross to another inside the loop, `test_triton_compile` checks it).

    HALF2 (4-bit words, x's rows as int32 words): the tile's weights as fp16 pairs, and each word's 8 products summed
    in an fp16 pair before the row's fp32 sums take them (`common.h2_weights`, `h2_x`, `h2_dot`): sm_90 SASS under
    Triton 3.8, 64x128 config, one row of bf16 x: 282 instructions a thread a step against 385 (STAGES 1), 422
    against 501 (STAGES 4); fp16 x 266 against 390. Measured on a GPU against the fp32 weights before it becomes the
    default; bf16 activations past fp16's range (+-65504) would become infinities there.

    The tile is dequantized once a step; x's rows then take turns over it, the same code for each, so a row's sums
    are taken in one order whatever the rows beside it, as greedy speculative decoding needs. BLOCK_M is always
    DECODE_ROWS (rows from M on skipped at run time): one compiled kernel for every M, whose sums across a column's
    tile rows after the loop follow one layout (a BLOCK_M of M's own could lay them out, and add them, otherwise)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NB: tl.constexpr = BLOCK_K // 32  # blocks of 32 columns a step
    CH: tl.constexpr = 2 if BITS == 4 else 4  # chunks of 8 columns a block: 32 nibbles, or 32 int8 or floats
    tile = tl.arange(0, BLOCK_N * NB * CH)  # tile row: (column of W, block, chunk)
    offs_n, n_ok = _w_rows(pid_n, tile // (NB * CH), N, BLOCK_N, GATED)
    block = (tile // CH) % NB
    chunk = tile % CH
    # where each tile row starts in W's planes at column 0 (`_gemv_codes`): 8 bytes (or floats) a chunk
    if WORDS:
        q_row = tl.multiple_of(offs_n * (stride_qn // 4) + (4 if BITS == 4 else 8) * block + 2 * chunk, 2)
    else:
        q_row = offs_n * stride_qn + (16 if BITS == 4 else 32) * block + 8 * chunk
    d_row = offs_n * stride_dn
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    n, n_exists = _w_rows(pid_n, tl.arange(0, BLOCK_N), N, BLOCK_N, GATED)  # W's rows of the program's sums
    rows = tl.arange(0, BLOCK_M)[None, :]
    acc = tl.zeros((BLOCK_N * NB * CH, BLOCK_M), dtype=tl.float32)  # each row of x's sums, in the tile's layout
    X_F16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16  # (HALF2: x's words as fp16 pairs, or bf16's)
    # W's tiles are fetched ahead: the codes STAGES - 1 steps ahead into shared memory by the pipeliner (cp.async),
    # or with STAGES 1 a step ahead into registers here, as the scales always are (two bytes a load: too few for
    # cp.async)
    if STAGES == 1:
        q = _gemv_codes(qs_ptr, q_row, n_ok, block, k_begin, k_end, BITS, WORDS)
    scale, offset = _gemv_scales(d_ptr, m_ptr, d_row, n_ok, block, k_begin, k_end, BITS, GROUP, HAS_M)
    common.pdl_wait(PDL)  # the first tile is on its way while the kernel before finishes (past STAGES 1, only its
    # scales: the pipeliner issues its first copies just before the loop; a wait inside the loop it would move past
    # x's loads)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        col = tl.multiple_of(k0, 32) + 32 * block  # (tile,) the block's first column
        # x's 8 columns for each tile row: x_first + 0..7 (4 bits: low nibbles; the high ones 16 further). Unmasked:
        # a block past k_end (the slice's last step) reads a block of x that exists, whose weights here are 0
        x_first = tl.minimum(col, K - 32) + 8 * chunk
        if STAGES == 1:
            q_now = q
            q = _gemv_codes(qs_ptr, q_row, n_ok, block, k0 + BLOCK_K, k_end, BITS, WORDS)
        else:
            q_now = _gemv_codes(qs_ptr, q_row, n_ok, block, k0, k_end, BITS, WORDS)
        scale_now, offset_now = scale, offset
        scale, offset = _gemv_scales(d_ptr, m_ptr, d_row, n_ok, block, k0 + BLOCK_K, k_end, BITS, GROUP, HAS_M)
        if BITS == 16:  # float weights, as they are
            w_lo = q_now.to(tl.float32)
        elif HALF2:  # 4-bit words' weights in fp16 pairs: (tile, 2) each of the four half2 (`common.h2_weights`)
            offset_now = offset_now if HAS_M else (scale_now.to(tl.float32) * -8.0).to(tl.float16)  # exact
            scale2 = tl.broadcast_to(common.h2_twice(scale_now, ASM), q_now.shape)  # (v, v) for each word
            offset2 = tl.broadcast_to(common.h2_twice(offset_now, ASM), q_now.shape)
            wa, wb, wc, wd = common.h2_weights(q_now, scale2, offset2, ASM)
        else:
            scale_now = scale_now.to(tl.float32)
            if HAS_M:
                offset_now = offset_now.to(tl.float32)
            else:
                offset_now = -8.0 * scale_now
            if BITS == 4 and WORDS:
                w_lo = _word_weights(q_now, scale_now, offset_now, ONE, 0)
                w_hi = _word_weights(q_now, scale_now, offset_now, ONE, 1)
            elif BITS == 4:
                w_lo = _byte_weights(q_now, scale_now, offset_now, ONE, 0)
                w_hi = _byte_weights(q_now, scale_now, offset_now, ONE, 1)
            elif WORDS:
                w_lo = _word_weights(q_now, scale_now, offset_now, ONE, 2)
            else:
                w_lo = _byte_weights(q_now, scale_now, offset_now, ONE, 2)
        # x's rows over the dequantized tile in turn, the same code for each: a row's products summed along the
        # chunk within a thread, then added to the row's own sums alone (the where picks, per register, at compile time)
        for r in tl.static_range(BLOCK_M):
            if r < M and HALF2:
                # x's 16 columns as 8 int32 words (4 for the low nibbles' columns, 4 for the high ones'), word 2w + k
                # of each 4 the k-th of code word w's: paired as its weights are
                x_words = (x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + r * (stride_xm // 2)
                           + x_first[:, None] // 2 + tl.arange(0, 4)[None, :])
                k0, k1 = tl.split(tl.reshape(tl.load(x_words), (x_first.shape[0], 2, 2)))
                xa, xc = common.h2_x(k0, k1, X_F16, ASM)
                k0, k1 = tl.split(tl.reshape(tl.load(x_words + 8), (x_first.shape[0], 2, 2)))
                xb, xd = common.h2_x(k0, k1, X_F16, ASM)
                part = tl.sum(common.h2_lanes(common.h2_dot(wa, xa, wb, xb, wc, xc, wd, xd, ASM), ASM), axis=1)
                acc = tl.where(rows == r, acc + part[:, None], acc)
            elif r < M:
                x_lo = _x_floats(x_ptr + r * stride_xm, x_first, XWORDS)
                if BITS == 4:
                    x_hi = _x_floats(x_ptr + r * stride_xm + 16, x_first, XWORDS)
                    w, xs = tl.join(w_lo, w_hi), tl.join(x_lo, x_hi)  # (tile, 8, 2): one sum of 16 products
                    part = tl.sum(tl.reshape(w * xs, (w.shape[0], 16)), axis=1)
                else:
                    part = tl.sum(w_lo * x_lo, axis=1)
                acc = tl.where(rows == r, acc + part[:, None], acc)  # only row r's sums: no adds of 0
    total = tl.sum(tl.reshape(acc, (BLOCK_N, NB * CH, BLOCK_M)), axis=1)  # (BLOCK_N, BLOCK_M)
    _write_sums(total, n, n_exists, rows, M, N, pid_n, pid_k, SPLIT_K, bias_ptr, out_ptr, parts_ptr, count_ptr,
                stride_om, HAS_BIAS, SPLIT, GATED)


@triton.jit
def _w_rows(pid_n, c, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """-> (W's row, whether it exists) for each column c of program pid_n's BLOCK_N: the block pid_n of W's N rows; or
    with GATED (W = [gate; up], N = 2F rows) gate rows pid_n * BLOCK_N / 2 + c for the first half of the columns
    and the up rows F further for the second, so that a program holds both factors of its outputs (`_write_sums`)."""
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        j = pid_n * HALF + c % HALF
        return j + (c // HALF) * (N // 2), j < N // 2
    else:
        return pid_n * BLOCK_N + c, pid_n * BLOCK_N + c < N


@triton.jit
def _store_out(total, pid_n, rows, M, N, out_ptr, stride_om, GATED: tl.constexpr):
    """A program's final fp32 sums total (BLOCK_N, BLOCK_M) into out (M, N), rounded once to out's dtype; with GATED
    (`_w_rows`' columns, out (M, N / 2)) silu(gate) * up of the rounded sums, as `kernels.activation`'s kernel
    computes it from a gate/up output in out's dtype, rounded again: the same bits as the two launches."""
    BLOCK_N: tl.constexpr = total.shape[0]
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        rounded = total.to(out_ptr.dtype.element_ty).to(tl.float32)
        g, u = tl.split(tl.permute(tl.reshape(rounded, (2, HALF, total.shape[1])), (1, 2, 0)))  # (HALF, BLOCK_M)
        y = g / (1.0 + tl.exp(-g)) * u
        o = pid_n * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + rows * stride_om + o[:, None], y.to(out_ptr.dtype.element_ty),
                 mask=(rows < M) & (o[:, None] < N // 2))
    else:
        o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows * stride_om + o[:, None], total.to(out_ptr.dtype.element_ty),
                 mask=(rows < M) & (o[:, None] < N))


@triton.jit
def _write_sums(total, n, n_ok, rows, M, N, pid_n, pid_k, SPLIT_K, bias_ptr, out_ptr, parts_ptr, count_ptr, stride_om,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, GATED: tl.constexpr):
    """A program's fp32 sums total (BLOCK_N, BLOCK_M), W's rows n (where n_ok) of x's rows `rows` (1, BLOCK_M), into
    out: plus the bias, rounded once (`_store_out`, which GATED combines); with SPLIT through parts (SPLIT_K, M, N)
    and the column block's counter (`_gemv_kernel`)."""
    if HAS_BIAS:  # added once, by the first slice of K, in fp32 before the one rounding
        total += tl.load(bias_ptr + n, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[:, None]
    if SPLIT:
        sums_ok = (rows < M) & n_ok[:, None]
        parts = parts_ptr + rows * N + n[:, None]  # this column block's sums in slice 0
        tl.store(parts + pid_k * M * N, total, mask=sums_ok)
        # Every thread's stores, then one release: a slice that counts after this one sees them (the acquire half)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last slice: the others' sums are written
            total = tl.zeros(total.shape, dtype=tl.float32)
            for s in range(SPLIT_K):  # in slice order, whichever came last
                total += tl.load(parts + s * M * N, mask=sums_ok, other=0.0, cache_modifier=".cg")
            _store_out(total, pid_n, rows, M, N, out_ptr, stride_om, GATED)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # for the next launch
    else:
        _store_out(total, pid_n, rows, M, N, out_ptr, stride_om, GATED)


@triton.jit
def _gemv_dot_kernel(
    x_ptr, qs_ptr, d_ptr, m_ptr, bias_ptr, out_ptr, parts_ptr, count_ptr,
    M, N, K, K_SPLIT, SPLIT_K,
    stride_xm, stride_qn, stride_dn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
):
    """`_gemv_kernel`'s product on the tensor cores (verification blocks on a GPU, `_takes_dot`): up to BLOCK_M (16)
    rows of x in one launch, each step's tile of W dequantized (`_w4_codes`, `_w8_codes`), rounded to x's dtype and
    multiplied by x's rows in a tl.dot (4 bits: the low nibbles' columns and the high ones', two dots), sums in fp32;
    split K and the output as `_gemv_kernel`'s (`_write_sums`). What it trades: the weights rounded to x's dtype before
    their products (as prefill's dequantized matmul does), for a row's products costing an MMA's share instead of an
    FFMA each, so that a verification block of 9-16 rows costs about one row's launch. A row's sums still do not depend
    on the rows beside it (an MMA's element is its own row's dot product)."""
    common.pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n, n_ok = _w_rows(pid_n, tl.arange(0, BLOCK_N), N, BLOCK_N, GATED)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    precision: tl.constexpr = "ieee" if x_ptr.dtype.element_ty == tl.float32 else "tf32"
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rows[:, None] * stride_xm
    for k0 in range(k_begin, k_end, BLOCK_K):
        if BITS == 4:
            q, scale, offset, k_lo, k_ok = _w4_codes(qs_ptr, d_ptr, m_ptr, n, n_ok, k0, k_end, stride_qn, stride_dn,
                                                     GROUP, HAS_M, BLOCK_K)
            # `_code_weights`' form, but a multiply and an add (an FFMA on the GPU; rounded twice by the
            # interpreter, well below x's dtype): Triton moves the tile's conversion to the MMA's operand layout
            # above those, not above tl.fma
            b = q.to(tl.int32)
            big = scale * 2048.0
            w_lo = (((b << 12) & 0xF000) | 0x3F800000).to(tl.float32, bitcast=True) * big + (offset - big)
            w_hi = (((b << 8) & 0xF000) | 0x3F800000).to(tl.float32, bitcast=True) * big + (offset - big)
            ok = row_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(x_rows + k_lo[None, :], mask=ok, other=0.0)
            x_hi = tl.load(x_rows + k_lo[None, :] + 16, mask=ok, other=0.0)
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc, input_precision=precision)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc, input_precision=precision)
        else:
            q, scale, k, k_ok = _w8_codes(qs_ptr, d_ptr, n, n_ok, k0, k_end, stride_qn, stride_dn, GROUP, BLOCK_K)
            w = scale * common.exact_float(q)
            x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=precision)
    _write_sums(tl.trans(acc), n, n_ok, rows[None, :], M, N, pid_n, pid_k, SPLIT_K, bias_ptr, out_ptr, parts_ptr,
                count_ptr, stride_om, HAS_BIAS, SPLIT, GATED)


@triton.jit
def _dequantize_kernel(
    qs_ptr, d_ptr, m_ptr, ids_ptr, w_ptr,
    N, K, stride_qn, stride_dn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr, HAS_IDS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """Row n of the (N, K) output: W's row n, or with HAS_IDS W's row ids[n] (an embedding lookup)."""
    common.pdl_wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    rows = tl.load(ids_ptr + offs_n, mask=n_mask, other=0) if HAS_IDS else offs_n
    w_row = w_ptr + offs_n[:, None] * K  # the output is contiguous (N, K)
    if BITS == 4:
        q, scale, offset, k_lo, k_ok = _w4_codes(qs_ptr, d_ptr, m_ptr, rows, n_mask, k0, K, stride_qn, stride_dn,
                                                 GROUP, HAS_M, BLOCK_K)
        w_lo = scale * common.exact_float(q & 0xF) + offset
        w_hi = scale * common.exact_float(q >> 4) + offset
        mask = n_mask[:, None] & k_ok[None, :]
        tl.store(w_row + k_lo[None, :], w_lo.to(w_ptr.dtype.element_ty), mask=mask)
        tl.store(w_row + k_lo[None, :] + 16, w_hi.to(w_ptr.dtype.element_ty), mask=mask)
    else:
        q, scale, k, k_ok = _w8_codes(qs_ptr, d_ptr, rows, n_mask, k0, K, stride_qn, stride_dn, GROUP, BLOCK_K)
        w = scale * common.exact_float(q)
        tl.store(w_row + k[None, :], w.to(w_ptr.dtype.element_ty), mask=n_mask[:, None] & k_ok[None, :])


# Past STAGES 1, W's codes go through shared memory, STAGES - 1 tiles of them ahead a program (BLOCK_N * BLOCK_K *
# BITS / 8 bytes a tile: 4 to 32 KB), plus at most BLOCK_N * BLOCK_M fp32 to sum across warps after the loop: at
# most 68 KB, within every GPU's limit (sm_89's 99 KB the least). The tiles give each thread one to four 8-byte rows
# of W a step: 80 to 217 registers with the sums of DECODE_ROWS rows of x (sm_90, 4- and 8-bit, no spills), two to
# three programs an SM, as many as the grid gives (about two an SM, `_default_split_k`).
# Why STAGES: an H100 drew 62-74% of its copy bandwidth from the one-row W4A16 GEMV on large matrices when each
# thread fetched its tile rows one step ahead in registers (2026-11-26, STAGES 1 here): ~12 KB in flight an SM,
# where ~3 TB/s over a DRAM latency of ~0.7-0.9 us asks 16-20 KB (W8A16, twice the bytes a thread in flight, drew
# 85%), and its instructions issued on ~half the cycles. Three tiles ahead are ~36 KB in flight, for ~10% more
# instructions a step (the copies, two barriers): STAGES 1 stays among the configs, and the autotuner's timing
# decides between them.
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "STAGES": stages}, num_warps=w)
    for bn, bk, w, stages in [(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (64, 128, 8, 4),
                              (128, 128, 8, 3), (32, 256, 8, 4), (64, 128, 4, 1), (128, 64, 4, 1), (32, 256, 8, 1)]
]
DOT_KEY = ["N", "K", "K_SPLIT", "BITS", "GROUP"]  # what the GEMVs' autotuners tune for (M not: `_gemv_launcher`)
GEMV_KEY = DOT_KEY + ["HALF2"]
# the interpreter costs per program and op, hardly per element (and ignores STAGES)
_INTERPRETER_BLOCKS = {"BLOCK_N": 256, "BLOCK_K": 512, "STAGES": 2}


@functools.cache
def _gemv_launcher(cuda: bool):
    # Autotuning times each config on the GPU. The interpreter has none to time on (Triton 3.6 and 3.8 fail at the
    # first launch, 3.2 already in the decorator), so it gets fixed blocks.
    # M is not in the key: every row count of a weight shape runs the config its first launch chose, so a row's
    # sums are taken in one order whether 1 or 8 rows share a launch (the kernel reduces each row alone), and a
    # speculative block of a new size neither stops to tune nor gives a token other bits than a one-token step.
    if cuda:
        return triton.autotune(_GEMV_CONFIGS, key=GEMV_KEY)(_gemv_kernel), {}
    return _gemv_kernel, _INTERPRETER_BLOCKS


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_split_k(x: torch.Tensor, N: int, K: int) -> int:
    """Slices of K so that roughly LLMRUN_GEMV_PROGRAMS_PER_SM (default 2) programs of 64 columns per SM run, each
    still covering at least LLMRUN_GEMV_MIN_SLICE (default 512) columns of K. The two variables are there for the
    GPU profiles to measure other splits (`bench/gpu.sh`); a weight's split never depends on M."""
    if not x.is_cuda:
        return 1
    per_sm, min_slice = (int(os.environ.get(f"LLMRUN_GEMV_{name}", default))
                         for name, default in (("PROGRAMS_PER_SM", 2), ("MIN_SLICE", 512)))
    programs = triton.cdiv(N, 64)
    split = 1
    while programs * split * 2 <= per_sm * _sm_count(x.device.index or 0) and K // (split * 2) >= min_slice:
        split *= 2
    return split


def _check(x, qs, d, m, bits: int, group: int) -> tuple[int, int]:
    """-> (N, K) after checking that the packed planes describe one W (N, K) for x (..., K)."""
    if bits not in (4, 8):
        raise ValueError(f"quantized weights must have 4 or 8 bits, got {bits}")
    if group % 32:
        raise ValueError(f"the quantization group must be a multiple of 32 columns (32, 64, 128), got {group}")
    N, K = qs.shape[0], x.shape[-1]
    want_qs = (N, K // 2) if bits == 4 else (N, K)
    if K % group or tuple(qs.shape) != want_qs or tuple(d.shape) != (N, K // group):
        raise ValueError(f"packed shapes qs {tuple(qs.shape)}, d {tuple(d.shape)} do not fit x (..., {K}) with "
                         f"{bits}-bit groups of {group}: want qs {want_qs}, d {(N, K // group)}")
    if m is not None and (bits != 4 or m.shape != d.shape):
        raise ValueError("offsets m belong to 4-bit weights and have the shape of d")
    if qs.dtype != (torch.uint8 if bits == 4 else torch.int8):
        raise ValueError(f"{bits}-bit qs must be {'uint8' if bits == 4 else 'int8'}, got {qs.dtype}")
    return N, K


def _split_plan(x2, N: int, split_k: int | None, out: torch.Tensor | None = None, gated: bool = False):
    """A GEMV launch's split of K and buffers for x2 (M, K) and N columns -> (y, parts, count, k_split, split_k):
    the output (`out` if given; gated: N / 2 columns), the slices' fp32 sums and the device's counters (y standing
    in when unsplit), the columns a slice covers (whole blocks of 32) and the slices that makes (split_k None: by
    device)."""
    M, K = x2.shape
    split_k = split_k or _default_split_k(x2, N, K)
    k_split = triton.cdiv(K // 32, split_k) * 32
    split_k = triton.cdiv(K, k_split)
    y = torch.empty((M, N // 2 if gated else N), device=x2.device, dtype=x2.dtype) if out is None else out
    if split_k == 1:
        return y, y, y, k_split, split_k
    if triton.cdiv(N, 32) > common.COUNTERS:  # a counter a column block, the smallest BLOCK_N 32
        raise ValueError(f"a split GEMV takes at most {common.COUNTERS * 32} columns, got {N}")
    parts = torch.empty((split_k, M, N), device=x2.device, dtype=torch.float32)
    return y, parts, common.counters(x2.device), k_split, split_k


def _gemv(x2, qs, d, m, bits: int, group: int, split_k: int | None = None, bias=None,
          out: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x2 (M, K) contiguous, M <= DECODE_ROWS -> (M, N) in x2's dtype, plus bias (N,) if given, written into `out`
    (rows of stride out.stride(0), contiguous within) if given. split_k: slices of K (None: by device). gated: W's
    rows are [gate; up], and the result silu(gate) * up (M, N / 2) (`_store_out`)."""
    M, K = x2.shape
    N = qs.shape[0]
    y, parts, count, k_split, split_k = _split_plan(x2, N, split_k, out, gated)
    kernel, blocks = _gemv_launcher(x2.is_cuda)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), split_k)  # noqa: E731
    # codes as words under 16-bit x (see _gemv_codes), their 64-bit loads aligned
    words = bits != 16 and x2.dtype != torch.float32 and qs.data_ptr() % 8 == 0
    x_words = x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0  # every row of x 4-byte aligned
    kernel[grid](
        x2, qs, d, d if m is None else m, d if bias is None else bias, y, parts, count,
        M, N, K, k_split, split_k, _ONE,
        x2.stride(0), qs.stride(0), d.stride(0), y.stride(0),
        BITS=bits, GROUP=group, HAS_M=m is not None, HAS_BIAS=bias is not None, SPLIT=split_k > 1, WORDS=words,
        XWORDS=x2.dtype == torch.bfloat16 and x_words,  # bf16 x as int32 words (see _x_floats)
        BLOCK_M=DECODE_ROWS, GATED=gated, HALF2=bits == 4 and words and x_words and half2(), ASM=x2.is_cuda,
        **blocks, **common.pdl_options(x2),
    )
    return y


def half2() -> bool:
    """LLMRUN_GEMV_HALF2=1 (an experiment the GPU profiles measure, `bench/gpu.sh`): the GEMV's 4-bit weights under
    16-bit x dequantized and multiplied in fp16 pairs (`_gemv_kernel`)."""
    return os.environ.get("LLMRUN_GEMV_HALF2") == "1"


_DOT_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(64, 128, 4, 3), (128, 128, 4, 3), (64, 256, 4, 2)]  # few: each is compiled a shape
]


@functools.cache
def _dot_launcher(cuda: bool):
    """`_gemv_launcher`'s counterpart for `_gemv_dot_kernel` (M not in the key either)."""
    if cuda:
        return triton.autotune(_DOT_CONFIGS, key=DOT_KEY)(_gemv_dot_kernel), {}
    return _gemv_dot_kernel, {"BLOCK_N": 64, "BLOCK_K": 256}


def _gemv_dot(x2, qs, d, m, bits: int, group: int, split_k: int | None = None, bias=None,
              gated: bool = False) -> torch.Tensor:
    """x2 (M, K) contiguous, M <= VERIFY_ROWS -> (M, N) through `_gemv_dot_kernel`, in one launch; split_k and gated
    as `_gemv`'s."""
    M, K = x2.shape
    N = qs.shape[0]
    y, parts, count, k_split, split_k = _split_plan(x2, N, split_k, gated=gated)
    kernel, blocks = _dot_launcher(x2.is_cuda)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), split_k)  # noqa: E731
    kernel[grid](
        x2, qs, d, d if m is None else m, d if bias is None else bias, y, parts, count,
        M, N, K, k_split, split_k,
        x2.stride(0), qs.stride(0), d.stride(0), y.stride(0),
        BITS=bits, GROUP=group, HAS_M=m is not None, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        BLOCK_M=VERIFY_ROWS, GATED=gated, **blocks, **common.pdl_options(x2),
    )
    return y


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) as (M, K) rows, contiguous along K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _takes_dot(x2, bits: int) -> bool:
    """Whether `_gemv_rows` multiplies quantized W on the tensor cores (`_gemv_dot_kernel`): by default for DOT_ROWS
    or more rows of 16-bit x on a GPU; LLMRUN_GEMV_DOT=0 never, =1 always. Measured on an H100 (2026-11-26,
    `bench/gemv.py`, the 1B shape's matrices): the FFMA GEMV's time grows with the rows (9 rows 3.5-6.5x one row),
    the MMA's hardly (1.0-1.07x); one row is 1.4-1.7x faster on the FFMA GEMV, and they cross between 2 and 3 rows.
    The trade: a block's row takes other bits than the same row alone on the FFMA GEMV (the weights rounded to x's
    dtype before the MMA), so greedy speculation keeps plain greedy's tokens bit for bit only with
    LLMRUN_GEMV_DOT=0. fp32 x stays on the FFMA GEMV (the MMA would round it to tf32)."""
    choice = os.environ.get("LLMRUN_GEMV_DOT")
    if bits == 16 or choice == "0":
        return False
    if choice == "1":
        return True
    return x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16) and x2.shape[0] >= DOT_ROWS


def _gemv_rows(x2, qs, d, m, bits: int, group: int, bias, gated: bool = False) -> torch.Tensor:
    """x2 (M, K), M <= VERIFY_ROWS -> (M, N) (gated: (M, N / 2), `_gemv`): a GEMV launch for each DECODE_ROWS rows,
    each writing its own rows of one output; or (`_takes_dot`) one launch of the tensor-core GEMV for them all."""
    if _takes_dot(x2, bits):
        return _gemv_dot(x2, qs, d, m, bits, group, bias=bias, gated=gated)
    y = x2.new_empty(x2.shape[0], qs.shape[0] // 2 if gated else qs.shape[0])
    for r0 in range(0, x2.shape[0], DECODE_ROWS):
        _gemv(x2[r0 : r0 + DECODE_ROWS], qs, d, m, bits, group, bias=bias, out=y[r0 : r0 + DECODE_ROWS], gated=gated)
    return y


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 gated: bool = False) -> torch.Tensor:
    """y = x @ weight^T (+ bias) for up to VERIFY_ROWS rows of x, weight (N, K) in x's dtype (fp16 or bf16: a tile
    row of 8 fp32 weights would span two threads), K a multiple of 32: the GEMV above on float weights (BITS 16),
    fp32 sums rounded once, bias added in them; gated (weight's rows [gate; up]): silu(gate) * up (..., N / 2), as
    `quant_linear`. Measured against cuBLAS's M = 1 matmuls in `bench/GPU_NOTES.md` (hypothesis 2); `kernels.linear`
    runs it for a decode step's rows."""
    N, K = weight.shape
    if (weight.dtype != x.dtype or x.dtype not in (torch.float16, torch.bfloat16) or K % 32 or x.shape[-1] != K
            or x.numel() // K > VERIFY_ROWS or (gated and N % 2)):
        raise ValueError(f"float_linear takes up to {VERIFY_ROWS} rows of x (..., K) and weight (N, K), both fp16 or "
                         f"bf16, K a multiple of 32 (and N even, gated); got x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    weight = weight.contiguous()  # (BITS 16 reads no scales: the weight stands in for them)
    y = _gemv_rows(_rows(x), weight, weight, None, 16, 32, bias, gated)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dequantize(qs, d, m, bits: int, group: int, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Packed W -> W (N, K) in `dtype`, each weight computed in fp32 then rounded once (`dequantize_groups`); with
    `ids` (int64, any shape), only those rows: (*ids.shape, K), an embedding lookup that reads no other row.
    Runs the Triton kernel; qs, d, m as in `dequantize_groups`, on one device."""
    K = qs.shape[1] * (2 if bits == 4 else 1)
    flat = None if ids is None else ids.reshape(-1).contiguous()
    N = qs.shape[0] if flat is None else flat.numel()
    w = torch.empty((N, K), device=qs.device, dtype=dtype)
    block_n, block_k = (32, 128) if qs.is_cuda else (128, 512)
    if flat is not None and qs.is_cuda:
        block_n = min(block_n, max(1, triton.next_power_of_2(N)))  # a decode step's one row: one block of programs
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    if N:
        _dequantize_kernel[grid](
            qs, d, d if m is None else m, qs if flat is None else flat, w, N, K, qs.stride(0), d.stride(0),
            BITS=bits, GROUP=group, HAS_M=m is not None, HAS_IDS=flat is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            **common.pdl_options(qs),
        )
    return w if ids is None else w.reshape(*ids.shape, K)


def quant_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                 group: int = 32, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """y = x @ W^T (+ bias) for W (N, K) packed in `bits`-bit groups of `group` columns; activations stay as they are.

    x: (..., K) fp16, bf16 or fp32. qs: uint8 (N, K/2) for 4 bits (GGML nibble order within blocks of 32),
    int8 (N, K) for 8 bits. d: fp16 (N, K/group) scales. m: fp16 (N, K/group) offsets, 4-bit only, or None
    (symmetric, m = -8 d). group: 32, 64 or 128 (any multiple of 32 dividing K).
    bias: (N,), added in the GEMV's fp32 sums before they are rounded (a decode step's bias costs no launch).
    Returns (..., N) in x's dtype, accumulated in fp32. Up to VERIFY_ROWS rows of x: the GEMV kernel, DECODE_ROWS
    rows a launch, or from DOT_ROWS rows of 16-bit x on a GPU the tensor-core GEMV (`_takes_dot`), W never
    materialized; more: W dequantized to x's dtype, then torch.matmul.
    gated: W's rows are [gate; up] (a SwiGLU MLP's fused projection) and the result is silu(gate) * up (..., N / 2),
    computed from the rounded product as `kernels.activation.silu_mul` computes it, bit for bit; the GEMVs do it
    as they write their sums, saving that kernel's launch.
    """
    N, K = _check(x, qs, d, m, bits, group)
    if gated and N % 2:
        raise ValueError(f"a gated product takes W's rows as [gate; up]: an even number of them, got {N}")
    x2 = _rows(x)
    qs, d = qs.contiguous(), d.contiguous()
    m = None if m is None else m.contiguous()
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], N // 2 if gated else N)
    if x2.shape[0] <= VERIFY_ROWS:  # a decode step (one launch, no copy) or a verification block
        y = _gemv_rows(x2, qs, d, m, bits, group, bias, gated)
    else:
        y = torch.nn.functional.linear(x2, dequantize(qs, d, m, bits, group, x.dtype), bias)
        if gated:
            from .activation import silu_mul

            y = silu_mul(y[:, : N // 2], y[:, N // 2 :])
    return y.reshape(*x.shape[:-1], y.shape[-1])
