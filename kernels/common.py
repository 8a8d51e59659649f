"""What the Triton kernels share: programmatic dependent launch, counters of finished programs, and integer codes
turned into floats.

Programmatic dependent launch (PDL; Hopper and later): a kernel launched with it may start while the kernel before
it in the stream is finishing, and waits (`griddepcontrol.wait`) only where it needs that kernel's results. A
decode step is some 200-270 small launches, each paying a ramp at its start (on an H200 a 1B model's kernels
summed to 1.09 ms of a 1.22 ms step, against 0.60 ms of bytes); with PDL the next kernel's launch, and what it
reads that no kernel writes (the GEMV's first tile of weights), overlap the kernel before. Every Triton kernel of
a decode step takes a PDL constexpr and calls `pdl_wait(PDL)` before it reads anything an earlier kernel wrote and
before it writes anything (before it, only weights, which no kernel writes during a forward, may be read); the
wait then lets the next kernel start. Its wrapper launches it with `pdl_options(x)`. Off unless LLMRUN_PDL=1: an
experiment the GPU profiles measure against the plain launches (`bench/gpu.sh`).

Counters (`counters`): a kernel split over programs that must be summed or merged (the GEMV's slices of K, the
attention's splits of the keys) lets the program that finishes last do it, as a device counter tells, instead of
a second launch.

Codes to floats (`exact_float`): a quantized weight or cache value is its integer code times a scale (plus a
minimum). Converting the code with `.to(tl.float32)` compiles to I2F, which Hopper runs at 16 a clock an SM, a
quarter of an integer add's rate and an eighth of a float add's: a W4A16 GEMV converts two codes a byte, ~37 a
clock an SM at an H200's bandwidth, so I2F alone held it under half the bandwidth. The same float comes exactly
from an integer add and a float add. `exact_half` does the same in fp16, two codes an instruction; `half_codes`
makes int8 codes fp16 so, and `nibble_halves` a byte's two 4-bit codes.

fp16 pairs (`h2_*`): the W4A16 GEMV's weights and products two an instruction, on int32s that hold an fp16 pair as
a GPU register does (`kernels.triton_quant_matmul`'s HALF2).
"""

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never enabled
    gdc_launch_dependents = gdc_wait = None


COUNTERS = 1 << 16  # int32 counters a device holds for the kernels that finish their work in the program that ends
# last: the split GEMV (one a column block) and the split attention (one a batch, kv head and row block)
_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's COUNTERS int32 counters, all 0 between launches: a kernel's programs count themselves done on
    them, and the last one sets back each it used. One buffer a device, allocated on first use (before any CUDA
    graph captures a step: warm-up steps run eagerly first), shared by every kernel: they run one after another on
    one stream (with PDL too: a kernel touches them only after its wait)."""
    if device not in _counters:
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(x: torch.Tensor) -> dict:
    """A kernel's launch settings for PDL on x's device: {"PDL": False}, or with LLMRUN_PDL=1 on a GPU that has it
    {"PDL": True, "launch_pdl": True} (the kernel waits, and is launched to overlap the one before)."""
    if (x.is_cuda and gdc_wait is not None and os.environ.get("LLMRUN_PDL") == "1"
            and _capable(x.device.index or 0)):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the kernels before this one have finished and their writes are visible, then let the
    next kernel start (it waits in turn before it touches what this one writes)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def exact_float(codes):
    """Integer codes (any integer dtype, values in [-2^22, 2^22)) as fp32, exactly as `.to(tl.float32)` gives
    them, without the conversion instruction: 0x4B400000 is the bit pattern of 1.5 * 2^23, where floats are one
    apart, so adding the code to the pattern gives the float 1.5 * 2^23 + code, and subtracting 1.5 * 2^23 leaves
    the code (both exact)."""
    return (codes.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def exact_half(u, ZERO: tl.constexpr):
    """Unsigned integer codes u (0 to 1023, any unsigned dtype) as the fp16 u - ZERO, exactly: u OR'ed into 0x6400's
    bits (fp16 1024, where fp16 are one apart) is 1024 + u, and one fp16 subtraction leaves u - ZERO (paired on a
    GPU: two codes an instruction)."""
    return (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + ZERO)


@triton.jit
def half_codes(codes, ASM: tl.constexpr):
    """int8 codes as fp16, exactly: a code's byte with its sign bit flipped is c + 128 (0 to 255), `exact_half`'s
    u with ZERO 128. With ASM (a CUDA GPU; the interpreter runs no PTX), four codes a 32-bit register take one XOR,
    two byte permutes and two paired subtractions, where Triton's own unpacking of the same takes ~4 instructions
    a code (an INT8 attention step, 128 codes a thread: its sm_90 loop 1024 -> 922 instructions)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 x, lo, hi, bias;
            mov.b32 bias, 0x64806480;
            lop3.b32 x, $2, 0x80808080, 0, 0x3c;
            prmt.b32 lo, x, 0x64646464, 0x4140;
            prmt.b32 hi, x, 0x64646464, 0x4342;
            sub.f16x2 $0, lo, bias;
            sub.f16x2 $1, hi, bias;
            }""",
            constraints="=r,=r,r", args=[codes], dtype=tl.float16, is_pure=True, pack=4)
    return exact_half(codes.to(tl.uint8, bitcast=True) ^ 0x80, 128)


@triton.jit
def nibble_halves(packed, ASM: tl.constexpr):
    """uint8 bytes -> (low nibbles, high nibbles) as exact fp16 (0 to 15), `exact_half`'s with ZERO 0. With ASM (a
    CUDA GPU), four bytes a 32-bit register take two byte permutes (bytes 0 and 1, and 2 and 3, each to the low
    half of a 16-bit lane), two shifts, four LOP3 (a nibble OR'ed into fp16 1024's bits) and four paired
    subtractions: 12 instructions for 8 codes, where Triton's unpacking took ~28 (each byte extracted twice, masked,
    shifted, OR'ed and the halves paired: an INT4 attention step's sm_90 loop spent ~450 of its 1103 there)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 b01, b23, h01, h23, bias;
            mov.b32 bias, 0x64006400;
            prmt.b32 b01, $4, 0, 0x4140;
            prmt.b32 b23, $4, 0, 0x4342;
            shr.b32 h01, b01, 4;
            shr.b32 h23, b23, 4;
            lop3.b32 b01, b01, 0x000f000f, bias, 0xea;
            lop3.b32 b23, b23, 0x000f000f, bias, 0xea;
            lop3.b32 h01, h01, 0x000f000f, bias, 0xea;
            lop3.b32 h23, h23, 0x000f000f, bias, 0xea;
            sub.f16x2 $0, b01, bias;
            sub.f16x2 $1, b23, bias;
            sub.f16x2 $2, h01, bias;
            sub.f16x2 $3, h23, bias;
            }""",
            constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return exact_half(packed & 0xF, 0), exact_half(packed >> 4, 0)


# --- fp16 pairs: the W4A16 GEMV's HALF2 (LLMRUN_GEMV_HALF2=1) ------------------------------------------------------
# A half2 is an int32 holding two fp16, the first in the low half, as a GPU register holds a pair for its paired
# instructions (HFMA2: two fused multiply-adds an instruction). On a GPU (ASM) the functions below are PTX on such
# registers; under the interpreter, which runs no PTX, the same values from plain Triton (`h2_pack`/`h2_unpack`),
# an fp32 fma rounded to fp16 standing for the paired one (the same but where the fp32 sum itself rounded: rarely).


@triton.jit
def h2_pack(lo, hi):
    """fp32 lo, hi -> the half2 of the two rounded to fp16."""
    low = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return low | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def h2_unpack(v):
    """A half2 -> its (first, second) fp16 as fp32."""
    lo = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def h2_fma(a, b, c):
    """fma.rn.f16x2 of three half2, as the interpreter has it."""
    a_lo, a_hi = h2_unpack(a)
    b_lo, b_hi = h2_unpack(b)
    c_lo, c_hi = h2_unpack(c)
    return h2_pack(a_lo * b_lo + c_lo, a_hi * b_hi + c_hi)


@triton.jit
def h2_twice(v, ASM: tl.constexpr):
    """fp16 v -> the half2 (v, v)."""
    if ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, {$1, $1};", "=r,h", [v], dtype=tl.int32, is_pure=True, pack=1)
    return h2_pack(v.to(tl.float32), v.to(tl.float32))


@triton.jit
def h2_weights(words, scale, offset, ASM: tl.constexpr):
    """int32 words of 4-bit codes (byte j of a word: the low nibble column j of its 4, the high one column 16 + j)
    and each word's scale and offset as half2 -> its 8 weights scale * q + offset as four half2: (a, b, c, d) the
    low nibbles of bytes 0 and 2, their high nibbles, the low nibbles of bytes 1 and 3, their high nibbles.

    A nibble masked into fp16 1024's bits (0x6400) is 1024 + q, one masked in place four bits up into fp16 64's
    (0x5400: there fp16 are 1/16 apart) is 64 + q: one LOP3 a pair of codes, a shift for bytes 1 and 3, then the
    paired subtraction (exact) and the paired fma, the weight rounded once to fp16. 13 instructions for 8 codes."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, a, b, c, d, k0, k1;
            mov.b32 k0, 0x64006400;
            mov.b32 k1, 0x54005400;
            shr.b32 t, $4, 8;
            lop3.b32 a, $4, 0x000f000f, k0, 0xea;
            lop3.b32 b, $4, 0x00f000f0, k1, 0xea;
            lop3.b32 c, t, 0x000f000f, k0, 0xea;
            lop3.b32 d, t, 0x00f000f0, k1, 0xea;
            sub.f16x2 a, a, k0;
            sub.f16x2 b, b, k1;
            sub.f16x2 c, c, k0;
            sub.f16x2 d, d, k1;
            fma.rn.f16x2 $0, a, $5, $6;
            fma.rn.f16x2 $1, b, $5, $6;
            fma.rn.f16x2 $2, c, $5, $6;
            fma.rn.f16x2 $3, d, $5, $6;
            }""",
            constraints="=r,=r,=r,=r,r,r,r", args=[words, scale, offset],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return (_h2_nibbles(words, 0, scale, offset), _h2_nibbles(words, 4, scale, offset),
            _h2_nibbles(words, 8, scale, offset), _h2_nibbles(words, 12, scale, offset))


@triton.jit
def _h2_nibbles(words, shift, scale, offset):
    """`h2_weights`' half2 of the nibbles at bits shift and shift + 16, as the interpreter has it."""
    s_lo, s_hi = h2_unpack(scale)
    m_lo, m_hi = h2_unpack(offset)
    lo = exact_float((words >> shift) & 0xF)
    return h2_pack(lo * s_lo + m_lo, exact_float((words >> (shift + 16)) & 0xF) * s_hi + m_hi)


@triton.jit
def h2_x(a, b, F16: tl.constexpr, ASM: tl.constexpr):
    """Two int32 words of x, a = (x0, x1) and b = (x2, x3), bf16 (or F16 fp16) -> the half2 (x0, x2) and (x1, x3),
    the pairs of x that `h2_weights`' (a, b) and (c, d) multiply. bf16 is rounded to fp16: exact within fp16's
    normal range; past +-65504 an infinity (a model whose activations reach that runs without HALF2)."""
    if ASM and F16:
        return tl.inline_asm_elementwise("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;", "=r,=r,r,r",
                                         [a, b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 x0, x1, x2, x3;
            shl.b32 x0, $2, 16;
            and.b32 x1, $2, 0xffff0000;
            shl.b32 x2, $3, 16;
            and.b32 x3, $3, 0xffff0000;
            cvt.rn.f16x2.f32 $0, x2, x0;
            cvt.rn.f16x2.f32 $1, x3, x1;
            }""",
            constraints="=r,=r,r,r", args=[a, b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    if F16:
        x0, x1 = h2_unpack(a)
        x2, x3 = h2_unpack(b)
    else:
        x0, x1 = (a << 16).to(tl.float32, bitcast=True), (a & -65536).to(tl.float32, bitcast=True)
        x2, x3 = (b << 16).to(tl.float32, bitcast=True), (b & -65536).to(tl.float32, bitcast=True)
    return h2_pack(x0, x2), h2_pack(x1, x3)


@triton.jit
def h2_dot(wa, xa, wb, xb, wc, xc, wd, xd, ASM: tl.constexpr):
    """A word's 8 weights (four half2) times x's 8 (likewise), summed in a half2: each fp16 lane 4 products."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 s;
            mul.rn.f16x2 s, $1, $2;
            fma.rn.f16x2 s, $3, $4, s;
            fma.rn.f16x2 s, $5, $6, s;
            fma.rn.f16x2 $0, $7, $8, s;
            }""",
            constraints="=r,r,r,r,r,r,r,r,r", args=[wa, xa, wb, xb, wc, xc, wd, xd], dtype=tl.int32, is_pure=True,
            pack=1)
    return h2_fma(wd, xd, h2_fma(wc, xc, h2_fma(wb, xb, h2_fma(wa, xa, tl.zeros_like(wa)))))


@triton.jit
def h2_lanes(v, ASM: tl.constexpr):
    """A half2 -> the sum of its two fp16 lanes in fp32."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            .reg .f32 a, b;
            mov.b32 {lo, hi}, $1;
            cvt.f32.f16 a, lo;
            cvt.f32.f16 b, hi;
            add.f32 $0, a, b;
            }""",
            constraints="=f,r", args=[v], dtype=tl.float32, is_pure=True, pack=1)
    lo, hi = h2_unpack(v)
    return lo + hi
