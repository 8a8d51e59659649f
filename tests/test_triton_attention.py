"""Decode / verify attention over the KV cache (kernels/decode_attention.py) against kernels/ref.py in fp32.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so long caches come with few heads; bf16 runs only on a GPU. Tolerance: within
2 x torch's own error in the same dtype (against fp32) + atol.
"""

import pytest
import torch

from llmrun.kernels import decode_attention as module
from llmrun.kernels import ref
from llmrun.kernels.decode_attention import decode_attention

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
