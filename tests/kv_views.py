"""Quantized KV caches (`ref.QuantizedKV`) of random keys and values, laid out as the KV cache hands them to
attention: every tensor a view of a larger buffer whose other entries are garbage the kernels must not read.
Shared by the Triton and the C kernels' tests."""

import torch

from llmrun.kernels import ref


def in_buffer(x, spare=3):
    """x (B, Hkv, N, ...) as a cache holds it: the first N positions of one layer of a (layers, B, Hkv, N + spare, ...)
    buffer; every other entry is garbage (NaN, or random codes) that the kernel must not use."""
    shape = (3, x.shape[0], x.shape[1], x.shape[2] + spare, *x.shape[3:])
    if x.dtype.is_floating_point:
        buf = torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)
    else:
        buf = torch.randint(0, 256, shape, dtype=torch.uint8, device=x.device).view(x.dtype)
    buf[2, :, :, :x.shape[2]] = x
    return buf[2, :, :, :x.shape[2]]


def random_keys_values(B, Hkv, S, D, device="cpu"):
    """k, v (B, Hkv, S, D) fp32: random, the keys with a few outlier channels (x20) as real keys have."""
    k = torch.randn(B, Hkv, S, D, device=device)
    k[..., [1, D // 2, D - 3]] *= 20
    return k, torch.randn(B, Hkv, S, D, device=device)


def quantized_cache(bits, B, Hkv, S, D, n_quantized, dtype, first_exact=None, kv=None, device="cpu", ring=ref.RECENT):
    """A QuantizedKV of random keys and values (or of kv = (k, v)), every tensor a view of a larger buffer.
    INT4 keys [0, n_quantized) are codes (values all have codes); keys and values [first_exact, S) (default
    [n_quantized, S)) sit exact in the rings k_recent and v_recent of `ring` slots, whose other slots are NaN."""
    k, v = random_keys_values(B, Hkv, S, D, device) if kv is None else kv
    group = ref.kv_group(D)
    if bits == 8:
        (k_codes, k_scale), (v_codes, v_scale) = ref.quantize_int8(k, group), ref.quantize_int8(v, group)
        return ref.QuantizedKV(8, in_buffer(k_codes), in_buffer(v_codes), in_buffer(k_scale), in_buffer(v_scale))
    first_exact = n_quantized if first_exact is None else first_exact
    v_codes, v_scale, v_min = ref.quantize_int4_tokens(v, group)
    k_codes = torch.randint(0, 256, (B, Hkv, S, D // 2), dtype=torch.uint8, device=device)  # garbage past n_quantized
    k_codes[:, :, :n_quantized], k_scale, k_min = ref.quantize_int4_channels(k[:, :, :n_quantized])
    k_recent = torch.full((B, Hkv, ring, D), float("nan"), dtype=dtype, device=device)
    v_recent = torch.full_like(k_recent, float("nan"))
    recent = torch.arange(first_exact, S, device=device)
    k_recent[:, :, recent % ring] = k[:, :, recent].to(dtype)
    v_recent[:, :, recent % ring] = v[:, :, recent].to(dtype)
    return ref.QuantizedKV(4, in_buffer(k_codes), in_buffer(v_codes), in_buffer(k_scale), in_buffer(v_scale),
                           in_buffer(k_min), in_buffer(v_min), in_buffer(k_recent, spare=0), in_buffer(v_recent, spare=0),
                           n_quantized, first_exact)


def mass_buffer(B, Hkv, S, device="cpu"):
    """(B, Hkv, S) fp32 of random running totals: a view of a longer accumulator, as a cache keeps it."""
    return torch.rand(B, Hkv + 1, S + 13, device=device)[:, 1:, :S]
