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
