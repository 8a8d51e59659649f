"""Decode / verify attention over the KV cache (kernels/decode_attention.py) against kernels/ref.py in fp32.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so long caches come with few heads; bf16 runs only on a GPU. Tolerance: within
2 x torch's own error in the same dtype (against fp32) + atol.
"""

import pytest
import torch

from llmrun import kernels
from llmrun.kernels import decode_attention as module
from llmrun.kernels import ref
from llmrun.kernels.decode_attention import decode_attention, quantized_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
ATOL = {torch.float32: 1e-5, torch.float16: 3e-4, torch.bfloat16: 1e-2}


def cache_views(B, Hkv, S, D, dtype, spare=29):
    """k, v (B, Hkv, S, D): the first S positions of one layer of a (layers, B, Hkv, max_len, D) buffer each."""
    bufs = torch.randn(2, 3, B, Hkv, S + spare, D, device=DEVICE).to(dtype)
    return bufs[0, 1, :, :, :S], bufs[1, 2, :, :, :S]


def check(B, T, Hq, Hkv, S, D, window, dtype, **kwargs):
    k, v = cache_views(B, Hkv, S, D, dtype)
    q = torch.randn(B, T, Hq + 2 * Hkv, D, device=DEVICE).to(dtype)[:, :, :Hq]  # q of a fused qkv projection
    want = ref.attention(q.float(), k.float(), v.float(), window)
    same = ref.attention(q, k, v, window)
    got = decode_attention(q, k, v, window, **kwargs)
    assert got.shape == (B, T, Hq, D) and got.dtype == dtype
    limit = 2 * (same.float() - want).abs().max().item() + ATOL[dtype]
    assert (got.float() - want).abs().max().item() <= limit


# (B, T, Hq, Hkv, S, D, window): GQA groups 1, 3, 4, 7; every head_dim; T 1, 4, 16; lengths 1, 17, 1000, 4097
SHAPES = [
    (1, 1, 4, 4, 1, 64, None),
    (2, 1, 6, 2, 17, 80, None),
    (1, 4, 8, 2, 17, 96, 5),
    (1, 16, 7, 1, 17, 128, None),  # 112 rows: two row blocks of 64
    (1, 1, 7, 1, 1000, 128, None),
    (2, 4, 3, 1, 1000, 256, 100),
    (1, 16, 4, 1, 1000, 80, 64),
]
SLOW_SHAPES = [
    (1, 1, 2, 2, 4097, 64, None),
    (1, 16, 3, 1, 4097, 96, 300),
    (1, 4, 7, 1, 4097, 256, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, Hq, Hkv, S, D, window", SHAPES)
def test_matches_reference(B, T, Hq, Hkv, S, D, window, dtype):
    check(B, T, Hq, Hkv, S, D, window, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, Hq, Hkv, S, D, window", SLOW_SHAPES)
def test_long_cache_matches_reference(B, T, Hq, Hkv, S, D, window, dtype):
    check(B, T, Hq, Hkv, S, D, window, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_count_does_not_change_the_result(num_splits):
    check(1, 4, 4, 1, 600, 64, None, torch.float32, num_splits=num_splits)


def test_split_that_some_rows_cannot_see(monkeypatch):
    """Splits of 8 keys, window 40, T 16: keys [45, 100) in 7 splits; [45, 53) is all out of query 15's window,
    [93, 100) all in the future of queries 0-8. Those partials must weigh nothing in the combine."""
    monkeypatch.setattr(module, "SPLIT_ALIGN", 8)
    for dtype in (torch.float32, torch.float16):
        check(1, 16, 4, 2, 100, 64, 40, dtype, num_splits=8)


# --- a quantized cache (ref.QuantizedKV), and the attention mass ------------------------------------------------------


def in_buffer(x, spare=3):
    """x (B, Hkv, N, ...) as a cache holds it: the first N positions of one layer of a (layers, B, Hkv, N + spare, ...)
    buffer; every other entry is garbage (NaN, or random codes) that the kernel must not use."""
    shape = (3, x.shape[0], x.shape[1], x.shape[2] + spare, *x.shape[3:])
    if x.dtype.is_floating_point:
        buf = torch.full(shape, float("nan"), dtype=x.dtype, device=DEVICE)
    else:
        buf = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEVICE).view(x.dtype)
    buf[2, :, :, :x.shape[2]] = x
    return buf[2, :, :, :x.shape[2]]


def quantized_cache(bits, B, Hkv, S, D, n_quantized, dtype):
    """A QuantizedKV of random keys (a few outlier channels, x20) and values, every tensor a view of a larger buffer.
    INT4 keys [0, n_quantized) are codes; [n_quantized, S) sit in the ring k_recent, whose other slots are NaN."""
    k = torch.randn(B, Hkv, S, D, device=DEVICE)
    k[..., [1, D // 2, D - 3]] *= 20
    v = torch.randn(B, Hkv, S, D, device=DEVICE)
    group = ref.kv_group(D)
    if bits == 8:
        (k_codes, k_scale), (v_codes, v_scale) = ref.quantize_int8(k, group), ref.quantize_int8(v, group)
        return ref.QuantizedKV(8, in_buffer(k_codes), in_buffer(v_codes), in_buffer(k_scale), in_buffer(v_scale))
    v_codes, v_scale, v_min = ref.quantize_int4_tokens(v, group)
    k_codes = torch.randint(0, 256, (B, Hkv, S, D // 2), dtype=torch.uint8, device=DEVICE)  # garbage past n_quantized
    k_codes[:, :, :n_quantized], k_scale, k_min = ref.quantize_int4_channels(k[:, :, :n_quantized])
    k_recent = torch.full((B, Hkv, ref.RECENT, D), float("nan"), dtype=dtype, device=DEVICE)
    recent = torch.arange(n_quantized, S, device=DEVICE)
    k_recent[:, :, recent % ref.RECENT] = k[:, :, recent].to(dtype)
    return ref.QuantizedKV(4, in_buffer(k_codes), in_buffer(v_codes), in_buffer(k_scale), in_buffer(v_scale),
                           in_buffer(k_min), in_buffer(v_min), in_buffer(k_recent, spare=0), n_quantized)


def check_quantized(bits, B, T, Hq, Hkv, S, D, window, n_quantized, dtype, **kwargs):
    kv = quantized_cache(bits, B, Hkv, S, D, n_quantized, dtype)
    q = torch.randn(B, T, Hq + 2 * Hkv, D, device=DEVICE).to(dtype)[:, :, :Hq]
    want = ref.quantized_attention(q.float(), kv, window)
    k, v = ref.dequantize_kv(kv)
    same = ref.attention(q, k.to(dtype), v.to(dtype), window)
    got = quantized_decode_attention(q, kv, window, **kwargs)
    assert got.shape == (B, T, Hq, D) and got.dtype == dtype
    limit = 2 * (same.float() - want).abs().max().item() + ATOL[dtype]
    assert (got.float() - want).abs().max().item() <= limit


# (B, T, Hq, Hkv, S, D, window, n_quantized): GQA 1, 3, 4; T 1, 4, 16; S 1, 31, 33, 100, 128, 1000; D 64, 80, 128.
# INT4 keys switch from codes to k_recent at n_quantized: 0, inside a 64-key tile (32, 96, 992), at a tile's end
# (64, 960), at S (all codes). INT8 ignores n_quantized. S 1000 runs in 4 splits.
QUANT_SHAPES = [
    (1, 1, 4, 4, 1, 64, None, 0),
    (2, 1, 6, 2, 31, 80, None, 0),
    (1, 4, 8, 2, 33, 128, None, 32),
    (1, 16, 3, 1, 100, 64, 20, 96),
    (2, 4, 4, 1, 128, 80, None, 128),
    (1, 1, 4, 1, 1000, 128, None, 960),
    (1, 4, 4, 1, 1000, 80, 300, 992),
    (1, 16, 3, 3, 100, 64, None, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("B, T, Hq, Hkv, S, D, window, n_quantized", QUANT_SHAPES)
def test_quantized_cache_matches_reference(B, T, Hq, Hkv, S, D, window, n_quantized, bits, dtype):
    check_quantized(bits, B, T, Hq, Hkv, S, D, window, n_quantized, dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_quantized_cache_split_count(bits, num_splits):
    check_quantized(bits, 1, 4, 3, 1, 600, 64, None, 576, torch.float32, num_splits=num_splits)


def mass_buffer(B, Hkv, S):
    """(B, Hkv, S) fp32 of random running totals: a view of a longer accumulator, as a cache keeps it."""
    return torch.rand(B, Hkv + 1, S + 13, device=DEVICE)[:, 1:, :S]


def check_mass(got, before, q, k, window):
    want = before + ref.attention_mass(q, k, window)
    assert (got - want).abs().max().item() <= 1e-5 * q.shape[1] * q.shape[2]


# (B, T, Hq, Hkv, S, D, window, num_splits)
MASS_SHAPES = [
    (1, 1, 4, 4, 1, 64, None, None),
    (2, 4, 6, 2, 33, 80, None, None),
    (1, 16, 3, 1, 100, 64, 20, None),
    (1, 4, 4, 1, 1000, 128, None, 1),
    (1, 4, 4, 1, 1000, 128, None, None),
    (1, 16, 8, 2, 1000, 64, 300, 3),
]


@pytest.mark.parametrize("B, T, Hq, Hkv, S, D, window, num_splits", MASS_SHAPES)
def test_mass_adds_the_reference_mass(B, T, Hq, Hkv, S, D, window, num_splits):
    k, v = cache_views(B, Hkv, S, D, torch.float32)
    q = torch.randn(B, T, Hq + 2 * Hkv, D, device=DEVICE)[:, :, :Hq]
    mass = mass_buffer(B, Hkv, S)
    before = mass.clone()
    got = decode_attention(q, k, v, window, num_splits=num_splits, mass=mass)
    assert (got - ref.attention(q, k, v, window)).abs().max().item() <= ATOL[torch.float32]
    check_mass(mass, before, q, k, window)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_splits", [1, None])
def test_mass_over_a_quantized_cache(bits, num_splits):
    B, T, Hq, Hkv, S, D, window = 2, 4, 3, 1, 600, 80, None
    kv = quantized_cache(bits, B, Hkv, S, D, 544, torch.float32)
    q = torch.randn(B, T, Hq, D, device=DEVICE)
    mass = mass_buffer(B, Hkv, S)
    before = mass.clone()
    got = quantized_decode_attention(q, kv, window, num_splits=num_splits, mass=mass)
    assert (got - ref.quantized_attention(q, kv, window)).abs().max().item() <= ATOL[torch.float32]
    check_mass(mass, before, q, ref.dequantize_kv(kv)[0], window)


@pytest.mark.parametrize("bits", [8, 4])
def test_dispatch(bits):
    """`kernels.attention(mass=)` and `kernels.quantized_attention` (C kernel or reference on a CPU, Triton on CUDA)."""
    B, T, Hq, Hkv, S, D, window = 1, 4, 6, 2, 70, 64, 50
    q = torch.randn(B, T, Hq, D, device=DEVICE)
    kv = quantized_cache(bits, B, Hkv, S, D, 32, torch.float32)
    k, v = ref.dequantize_kv(kv)
    for mass in (None, mass_buffer(B, Hkv, S)):
        before = None if mass is None else mass.clone()
        got = kernels.quantized_attention(q, kv, window, mass=mass)
        assert (got - ref.quantized_attention(q, kv, window)).abs().max().item() <= ATOL[torch.float32]
        if mass is not None:
            check_mass(mass, before, q, k, window)
            mass.copy_(before)
        got = kernels.attention(q, k, v, window, mass=mass)
        assert (got - ref.attention(q, k, v, window)).abs().max().item() <= ATOL[torch.float32]
        if mass is not None:
            check_mass(mass, before, q, k, window)
