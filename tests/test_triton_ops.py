"""The small Triton kernels (RMSNorm with the fused residual add, Qwen3's per-head q/k norms, RoPE in place, with a
float cache's write too, SiLU gate) against kernels/ref.py.

On a machine without CUDA they run under the Triton interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1); bf16 runs only on a GPU. Tolerance: within 2 x torch's own error in the same dtype
(against fp32) + atol.
"""

import pytest
import torch
import triton
import triton.language as tl

from llmrun.kernels import common, ref
from llmrun.kernels.norm import add_rms_norm, head_rms_norm_, rms_norm
from llmrun.kernels.kv_write import write_dense
from llmrun.kernels.rotary import rope_, rope_write_
from llmrun.kernels.activation import silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def assert_within_torch_error(got, want_fp32, torch_same_dtype, atol=1e-5):
    """|got - ref| <= 2 |torch in this dtype - ref| + atol, elementwise at the maximum."""
    limit = 2 * (torch_same_dtype.float() - want_fp32).abs().max().item() + atol
    assert (got.float() - want_fp32).abs().max().item() <= limit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, n_q, n_k, D", [(1, 1, 16, 8, 128), (1, 5, 9, 3, 64), (2, 3, 7, 1, 80), (1, 2, 4, 4, 96)])
def test_head_rms_norm_in_place(dtype, B, T, n_q, n_k, D):
    """Qwen3's q and k heads of qkv (B, T, n_q + 2 n_k, D) normalized in place, each with its own weight; the v heads
    untouched, bit for bit; head sizes that are not powers of two (80, 96) masked."""
    qkv = (torch.randn(B, T, n_q + 2 * n_k, D, device=DEVICE) * 3).to(dtype).float()
    q_w, k_w = (torch.randn(D, device=DEVICE).to(dtype).float() for _ in range(2))
    want = qkv.clone()
    want[:, :, :n_q] = ref.rms_norm(qkv[:, :, :n_q], q_w, 1e-6)
    want[:, :, n_q : n_q + n_k] = ref.rms_norm(qkv[:, :, n_q : n_q + n_k], k_w, 1e-6)
    same = qkv.to(dtype).clone()
    same[:, :, :n_q] = ref.rms_norm(same[:, :, :n_q], q_w.to(dtype), 1e-6)
    same[:, :, n_q : n_q + n_k] = ref.rms_norm(same[:, :, n_q : n_q + n_k], k_w.to(dtype), 1e-6)
    got = qkv.to(dtype)
    assert head_rms_norm_(got, n_q, n_k, q_w.to(dtype), k_w.to(dtype), 1e-6) is got
    assert_within_torch_error(got, want, same)
    assert torch.equal(got[:, :, n_q + n_k :], qkv.to(dtype)[:, :, n_q + n_k :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 100), (3, 4096)])
def test_rms_norm_and_fused_residual(dtype, rows, dim):
    x = torch.randn(rows, dim, device=DEVICE) * 2
    y = torch.randn(rows, dim, device=DEVICE)
    w = torch.randn(dim, device=DEVICE)
    x, y, w = (t.to(dtype).float() for t in (x, y, w))  # the fp32 reference sees the inputs the kernel sees
    want = ref.rms_norm(x, w, 1e-5)
    same = ref.rms_norm(x.to(dtype), w.to(dtype), 1e-5)
    assert_within_torch_error(rms_norm(x.to(dtype), w.to(dtype), 1e-5), want, same)
    h, normed = add_rms_norm(x.to(dtype), y.to(dtype), w.to(dtype), 1e-5)
    hd = x.to(dtype) + y.to(dtype)
    assert_within_torch_error(h, x + y, hd)
    assert_within_torch_error(normed, ref.rms_norm(x + y, w, 1e-5), ref.rms_norm(hd, w.to(dtype), 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, H, D", [(1, 1, 12, 64), (2, 5, 3, 80), (1, 3, 7, 128)])
def test_rope_in_place_on_a_slice_of_fused_heads(dtype, B, T, H, D):
    fused = torch.randn(B, T, H + 2, D, device=DEVICE).to(dtype)  # rotate the first H heads only
    angles = torch.randn(T, D // 2, device=DEVICE)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want = ref.apply_rope(fused[:, :, :H].float(), cos, sin)
    same = ref.apply_rope(fused[:, :, :H], cos.to(dtype), sin.to(dtype))
    rest = fused[:, :, H:].clone()
    got = rope_(fused[:, :, :H], cos, sin)
    assert got.data_ptr() == fused.data_ptr()
    assert_within_torch_error(got, want, same)
    assert torch.equal(fused[:, :, H:], rest)
    # tables in x's dtype, as the model hands them, read as their fp32 values: the bits of the upcast tables
    x = torch.randn(B, T, H, D, device=DEVICE).to(dtype)
    rounded = rope_(x.clone(), cos.to(dtype), sin.to(dtype))
    assert torch.equal(rounded, rope_(x.clone(), cos.to(dtype).float(), sin.to(dtype).float()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, Hq, Hkv, D, slot, C", [(1, 1, 9, 3, 64, 0, 40), (2, 5, 4, 4, 80, 7, 33),
                                                       (1, 16, 32, 8, 128, 1000, 1100), (1, 3, 14, 2, 96, 30, 64)])
def test_rope_and_the_cache_write_in_one_launch_are_the_two_launches(dtype, B, T, Hq, Hkv, D, slot, C):
    """A decode step's RoPE and float cache write in one launch: bit for bit `rope_` on the q and k heads and
    `write_dense` of the rotated k and the v heads, nothing else of the cache touched (GQA ratios 3, 1, 4, 7)."""
    g = torch.Generator().manual_seed(slot)
    qkv = torch.randn(B, T, Hq + 2 * Hkv, D, generator=g).to(dtype).to(DEVICE)
    angles = torch.randn(T, D // 2, generator=g)
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    k_out, v_out = torch.randn(2, B, Hkv, C, D, generator=g).to(dtype).to(DEVICE).unbind(0)
    slots = torch.arange(slot, slot + T, device=DEVICE)
    want, want_k, want_v = qkv.clone(), k_out.clone(), v_out.clone()
    rope_(want[:, :, : Hq + Hkv], cos, sin)
    write_dense(want[:, :, Hq : Hq + Hkv].transpose(1, 2), want[:, :, Hq + Hkv :].transpose(1, 2), want_k, want_v,
                slots)
    rope_write_(qkv, Hq, cos, sin, k_out, v_out, slots)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for got, expected in [(qkv, want), (k_out, want_k), (v_out, want_v)]:
        assert torch.equal(got.view(bits), expected.view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, F", [(1, 1536), (4, 100), (2, 3000)])
def test_silu_mul_on_the_halves_of_one_tensor(dtype, rows, F):
    gate_up = (torch.randn(rows, 2 * F, device=DEVICE) * 3).to(dtype)
    g, u = gate_up[:, :F], gate_up[:, F:]
    want = ref.silu_mul(g.float(), u.float())
    assert_within_torch_error(silu_mul(g, u), want, ref.silu_mul(g, u))


def test_a_triton_kernel_that_fails_to_build_falls_back_to_pytorch_once(monkeypatch):
    import llmrun.kernels as kernels

    monkeypatch.setattr(kernels, "_failed", set())
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("PTX not supported")

    with pytest.warns(RuntimeWarning, match="rms_norm failed"):
        assert kernels._triton("rms_norm", broken, lambda: "reference") == "reference"
    assert kernels._triton("rms_norm", broken, lambda: "reference") == "reference"  # not tried again
    assert calls == [1]


@triton.jit
def _convert(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, common.exact_float(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_codes_become_the_same_floats_without_a_conversion(dtype):
    """common.exact_float, the quantized kernels' code-to-float (an integer add and a float add, no I2F): every
    int8 and uint8 value, and int16 / int32 values across [-2^22, 2^22), give `.to(float32)`'s float bit for bit."""
    if dtype in (torch.int8, torch.uint8):
        x = torch.arange(256, dtype=torch.int32).to(dtype)  # wraps: every value of the type
    else:
        lo, hi = (-(2**15), 2**15) if dtype == torch.int16 else (-(2**22), 2**22)
        x = torch.cat([torch.arange(-300, 300), torch.tensor([lo, hi - 1]),
                       torch.randint(lo, hi, (4000,), generator=torch.Generator().manual_seed(0))]).to(dtype)
    x = x.to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.float32, device=DEVICE)
    _convert[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out, x.float())


@triton.jit
def _halves(x_ptr, out_ptr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, common.half_codes(tl.load(x_ptr + i), ASM))


@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_int8_codes_become_exact_halves(asm):
    """common.half_codes, INT8 attention's code-to-fp16: every int8 value, in every place of the 32-bit registers
    the PTX form packs four codes into (each value at each of the four offsets), gives `.to(float16)`'s bits."""
    x = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    x = torch.stack([x.roll(shift) for shift in range(4)], dim=1).flatten().to(DEVICE)  # 1024 codes
    out = torch.empty(x.shape, dtype=torch.float16, device=DEVICE)
    _halves[(1,)](x, out, ASM=asm, BLOCK=x.numel())
    assert torch.equal(out, x.half())


@triton.jit
def _nibbles(x_ptr, low_ptr, high_ptr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    low, high = common.nibble_halves(tl.load(x_ptr + i), ASM)
    tl.store(low_ptr + i, low)
    tl.store(high_ptr + i, high)


@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_int4_codes_become_exact_halves(asm):
    """common.nibble_halves, INT4 attention's code-to-fp16: every byte, at each of the four places of the 32-bit
    register the PTX form packs four bytes into, gives its low and high nibble as fp16, exactly."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = torch.stack([x.roll(shift) for shift in range(4)], dim=1).flatten().to(DEVICE)  # 1024 bytes
    low, high = (torch.empty(x.shape, dtype=torch.float16, device=DEVICE) for _ in range(2))
    _nibbles[(1,)](x, low, high, ASM=asm, BLOCK=x.numel())
    assert torch.equal(low, (x & 15).half()) and torch.equal(high, (x >> 4).half())
