"""The Triton KV-cache writes (kernels/kv_write.py) against kernels/ref.py's: quantization fused with the store, bit
for bit the reference's codes, scales and minimums (the same fp32 arithmetic: division rounded to nearest, round half
to even), over every buffer the write touches and none it does not.

On a machine without CUDA they run under the Triton interpreter; bf16 only on a GPU. Ties (a value exactly halfway
between two codes) are forced in, where round half to even and an approximate division would show.
"""

import pytest
import torch

from llmrun.kernels import kv_write, ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def new_tokens(B, H, T, D, dtype, seed):
    """k or v (B, H, T, D) as the model hands them: a head-major view of token-major rows, with outlier channels,
    exact zeros (a group of zeros: scale 0) and values on code ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=g)
    x[..., 1] *= 20
    x[..., D - 16 :] = 0 if T > 1 else x[..., D - 16 :]  # a whole group of zeros
    x[..., 3] = torch.randint(-8, 8, (B, T, H), generator=g) / 2  # halves: ties for small scales
    return x.to(dtype).to(DEVICE).transpose(1, 2)


def garbage_like(shape, dtype, seed):
    """A buffer of random contents (the untouched parts must stay exactly as they were)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return torch.randint(-128 if dtype == torch.int8 else 0, 128 if dtype == torch.int8 else 256, shape,
                         generator=g, dtype=dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, T, slot, C, D", [(1, 3, 1, 0, 40, 64), (1, 1, 16, 40, 64, 80), (2, 2, 5, 7, 33, 96),
                                                 (1, 8, 9, 1000, 1100, 128), (1, 2, 3, 17, 20, 256)])
def test_int8_write_is_the_reference_bit_for_bit(dtype, B, H, T, slot, C, D):
    x = new_tokens(B, H, T, D, dtype, seed=D + T)
    group = ref.kv_group(D)
    codes = garbage_like((2, B, H, C, D), torch.int8, 1)[1]  # a layer's view of a larger buffer
    scales = garbage_like((2, B, H, C, D // group), torch.float16, 2)[1]
    want_codes, want_scales = codes.clone(), scales.clone()
    slots = torch.arange(slot, slot + T, device=DEVICE)
    ref.write_int8(x, want_codes, want_scales, slots)
    kv_write.write_int8(x, codes, scales, slots)
    assert torch.equal(codes, want_codes) and torch.equal(scales.view(torch.int16), want_scales.view(torch.int16))


@pytest.mark.parametrize("B, H, T, slot, C, D", [(1, 3, 1, 0, 40, 64), (2, 2, 5, 7, 33, 96), (1, 8, 9, 1000, 1100, 128)])
def test_int8_pair_is_two_int8_writes(B, H, T, slot, C, D):
    """A layer's K and V in one launch (an INT8 cache holds them as codes[0] and codes[1]), each as `write_int8`."""
    k, v = new_tokens(B, H, T, D, torch.float16, seed=1), new_tokens(B, H, T, D, torch.float16, seed=2)
    group = ref.kv_group(D)
    codes = garbage_like((3, 2, B, H, C, D), torch.int8, 3)[1]  # layer 1's (2, ...) view of (L, 2, ...)
    scales = garbage_like((3, 2, B, H, C, D // group), torch.float16, 4)[1]
    want_codes, want_scales = codes.clone(), scales.clone()
    slots = torch.arange(slot, slot + T, device=DEVICE)
    for i, x in enumerate((k, v)):
        ref.write_int8(x, want_codes[i], want_scales[i], slots)
    kv_write.write_int8_pair(k, v, codes, scales, slots)
    assert torch.equal(codes, want_codes) and torch.equal(scales.view(torch.int16), want_scales.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, Hq, Hkv, D, slot, C", [(1, 1, 9, 3, 64, 0, 40), (2, 5, 4, 4, 96, 7, 33),
                                                       (1, 16, 32, 8, 128, 1000, 1100), (1, 3, 14, 2, 80, 30, 64)])
def test_rope_and_the_int8_write_in_one_launch_are_the_two_launches(dtype, B, T, Hq, Hkv, D, slot, C):
    """A CUDA graph's step over an INT8 cache: RoPE of the q and k heads in place and the write of the rotated k and
    the v heads in one launch, bit for bit `rotary.rope_` then `write_int8_pair` (GQA ratios 3, 1, 4, 7; head_dim
    80's groups of 16), nothing else of the layer touched. Keys and values carry outliers, ties and a head of
    zeros (scale 0)."""
    from llmrun.kernels.rotary import rope_

    g = torch.Generator().manual_seed(slot + D)
    keys, values = (new_tokens(B, Hkv, T, D, torch.float32, seed).cpu().transpose(1, 2) for seed in (D, D + 1))
    qkv = torch.cat((torch.randn(B, T, Hq, D, generator=g), keys, values), 2)  # (on the CPU: new_tokens' are on DEVICE)
    qkv[:, :, Hq + Hkv - 1] = 0  # a key head of zeros
    qkv = qkv.to(dtype).to(DEVICE)
    angles = torch.randn(T, D // 2, generator=g)
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    group = ref.kv_group(D)
    codes = garbage_like((3, 2, B, Hkv, C, D), torch.int8, 3)[1]  # layer 1's (2, ...) view of (L, 2, ...)
    scales = garbage_like((3, 2, B, Hkv, C, D // group), torch.float16, 4)[1]
    want, want_codes, want_scales = qkv.clone(), codes.clone(), scales.clone()
    slots = torch.arange(slot, slot + T, device=DEVICE)
    rope_(want[:, :, : Hq + Hkv], cos, sin)
    kv_write.write_int8_pair(want[:, :, Hq : Hq + Hkv].transpose(1, 2), want[:, :, Hq + Hkv :].transpose(1, 2),
                             want_codes, want_scales, slots)
    kv_write.rope_write_int8_(qkv, Hq, cos, sin, codes, scales, slots)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(qkv.view(bits), want.view(bits))
    assert torch.equal(codes, want_codes) and torch.equal(scales.view(torch.int16), want_scales.view(torch.int16))


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                (torch.float16, torch.float16),
                                                pytest.param(torch.bfloat16, torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("B, H, T, slot, C, D", [(1, 3, 1, 0, 40, 64), (2, 2, 5, 7, 33, 80), (1, 8, 16, 1000, 1100, 128)])
def test_dense_write_is_index_copy_bit_for_bit(dtype, cache_dtype, B, H, T, slot, C, D):
    """A float cache's K and V in one launch, cast to the cache's dtype: what `index_copy_` of each writes, and
    nothing else of the buffers."""
    k, v = new_tokens(B, H, T, D, dtype, seed=3), new_tokens(B, H, T, D, dtype, seed=4)
    k_out, v_out = garbage_like((2, B, H, C, D), cache_dtype, 5).unbind(0)
    want_k, want_v = k_out.clone(), v_out.clone()
    slots = torch.arange(slot, slot + T, device=DEVICE)
    want_k.index_copy_(2, slots, k.to(cache_dtype))
    want_v.index_copy_(2, slots, v.to(cache_dtype))
    kv_write.write_dense(k, v, k_out, v_out, slots)
    bits = torch.int32 if cache_dtype == torch.float32 else torch.int16
    assert torch.equal(k_out.view(bits), want_k.view(bits)) and torch.equal(v_out.view(bits), want_v.view(bits))


def int4_layer(B, H, C, D, R, dtype):
    """An INT4 layer's buffers (k, v, k_scale, k_min, v_scale, v_min, k_recent, v_recent), random contents: the rings
    stand for keys written before, the rest for garbage the write must overwrite or leave alone."""
    G, group = ref.KEY_GROUP, ref.kv_group(D)
    shapes = [((B, H, C, D // 2), torch.uint8)] * 2 + [((B, H, -(-C // G), D), torch.float16)] * 2 \
        + [((B, H, C, D // group), torch.float16)] * 2 + [((B, H, R, D), dtype)] * 2
    return [garbage_like(shape, dt, i) for i, (shape, dt) in enumerate(shapes)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, T, slot, C, R, D", [
    (1, 3, 1, 0, 40, 40, 64),  # the first token; a last group that cannot fill (positions past C not stored)
    (1, 3, 1, 31, 64, 64, 80),  # the token that fills the first group (head_dim 80: groups of 16 channels)
    (1, 1, 16, 40, 70, 70, 96),  # a block inside one group
    (2, 2, 5, 30, 100, 64, 128),  # a block over two groups (the first one filled), batch 2; rings wrapped
    (1, 8, 16, 1000, 1100, 576, 256),  # far into a long cache: rings wrapped, the first group filled mid-block
    (1, 2, 33, 95, 200, 96, 64),  # the longest block: 33 tokens fill the group of the first and start the next
    (1, 3, 7, 54, 61, 61, 80),  # the last slots of a buffer that ends within a group
    (1, 2, 100, 45, 200, 200, 64),  # a prompt chunk: every group it touches, the first one partial
    (1, 1, 512, 1024, 1600, 608, 64),  # a prompt chunk of PREFILL_ROWS far into a long cache: rings wrapped
    (1, 2, 65, 31, 200, 96, 64),  # at the edge the cache allows (slot % 32 + T = the ring): three groups, none lost
    # a whole short cache in one chunk (--ctx 100): the last group's positions past the buffer read ring slots 0-27,
    # which the same launch fills (their keys come from the input: on a GPU, another program's store raced the read;
    # the interpreter runs the programs in order, so only a GPU run can catch that race)
    (1, 2, 100, 0, 100, 100, 64),
])
def test_int4_write_is_the_reference_bit_for_bit(dtype, B, H, T, slot, C, R, D):
    """Values per token, both rings, every key group from the first slot's to the last slot's. The codes of a partial
    group's positions past the new tokens come from stale ring slots in both (never read); past a buffer that ends
    within a group the reference clamps its writes to the last slot, so the codes compared stop at the last whole
    group."""
    k, v = new_tokens(B, H, T, D, dtype, seed=D + T), new_tokens(B, H, T, D, dtype, seed=D + T + 1)
    got = int4_layer(B, H, C, D, R, dtype)
    want = [t.clone() for t in got]
    slots = torch.arange(slot, slot + T, device=DEVICE)
    ref.write_int4(k, v, *want, slots)
    kv_write.write_int4(k, v, *got, slots)
    whole = C // ref.KEY_GROUP * ref.KEY_GROUP
    assert torch.equal(got[0][:, :, :whole], want[0][:, :, :whole]), "key codes"
    for name, a, b in zip(["v codes", "k scale", "k min", "v scale", "v min", "k ring", "v ring"], got[1:], want[1:]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    touched = torch.zeros(C, dtype=torch.bool)
    touched[slot : slot + T] = True
    assert torch.equal(got[1][:, :, ~touched.to(DEVICE)], int4_layer(B, H, C, D, R, dtype)[1][:, :, ~touched.to(DEVICE)])


def test_int4_write_quantizes_a_group_as_the_group_quantizer():
    """The token that fills a key group leaves exactly `ref.quantize_int4_channels` of the group's keys (the 31 before
    it from the ring, itself from the input)."""
    B, H, D, R = 1, 2, 64, 64
    keys = torch.randn(B, H, 32, D, device=DEVICE)
    layer = int4_layer(B, H, 64, D, R, torch.float32)
    layer[6][:, :, 32:64] = keys  # ring slots of positions 32..63 (ring of 64): 32..62 written before
    k = keys[:, :, 31:32].clone()
    kv_write.write_int4(k, torch.randn_like(k), *layer, torch.tensor([63], device=DEVICE))
    codes, scale, lo = ref.quantize_int4_channels(keys)
    assert torch.equal(layer[0][:, :, 32:64], codes) and torch.equal(layer[2][:, :, 1], scale[:, :, 0])
    assert torch.equal(layer[3][:, :, 1], lo[:, :, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, S, C, D", [(1, 3, 1, 40, 64), (1, 1, 300, 310, 80), (2, 2, 65, 65, 96),
                                           (1, 8, 1000, 1100, 128), (1, 2, 20, 20, 256)])
def test_int8_dequantized_whole_is_the_reference_bit_for_bit(dtype, B, H, S, C, D):
    """kv_dequantize.int8_pair: a layer's INT8 keys and values (views of the first S of C slots of a larger buffer),
    dequantized in one launch to the reference's values (`ref.dequantize_int8`, rounded once to dtype)."""
    from llmrun.kernels import kv_dequantize

    group = ref.kv_group(D)
    codes = garbage_like((3, 2, B, H, C, D), torch.int8, 5)[1]
    scales = (garbage_like((3, 2, B, H, C, D // group), torch.float16, 6)[1].abs() * 0.05).to(torch.float16)
    k, v = (x[:, :, :S] for x in codes)
    k_scale, v_scale = (x[:, :, :S] for x in scales)
    got_k, got_v = kv_dequantize.int8_pair(k, v, k_scale, v_scale, dtype)
    assert got_k.is_contiguous() and got_k.dtype == dtype and got_k.shape == (B, H, S, D)
    assert torch.equal(got_k, ref.dequantize_int8(k, k_scale).to(dtype))
    assert torch.equal(got_v, ref.dequantize_int8(v, v_scale).to(dtype))


def test_a_prompt_over_an_int8_cache_reads_it_dequantized_in_one_launch(monkeypatch):
    """`kernels.quantized_attention` for a prompt chunk (more than 16 rows) over an INT8 cache on CUDA (faked here)
    attends over the one-launch dequantization, and gives what it gives over the reference's."""
    from llmrun import kernels
    from llmrun.kernels import kv_dequantize

    B, H, S, T, D = 1, 2, 70, 20, 64
    group = ref.kv_group(D)
    codes = garbage_like((2, B, H, 80, D), torch.int8, 7)
    scales = (garbage_like((2, B, H, 80, D // group), torch.float16, 8).abs() * 0.05).to(torch.float16)
    kv = ref.QuantizedKV(8, codes[0, :, :, :S], codes[1, :, :, :S], scales[0, :, :, :S], scales[1, :, :, :S])
    q = torch.randn(B, T, 4, D).to(DEVICE)
    want = kernels.quantized_attention(q, kv)
    calls = []
    real = kv_dequantize.int8_pair
    monkeypatch.setattr(kv_dequantize, "int8_pair", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kernels, "_use_triton", lambda x: True)
    monkeypatch.setattr(kernels, "_cpu_reads", lambda q, kv, mass: False)  # the C kernels would read the codes
    got = kernels.quantized_attention(q, kv)
    assert calls == [1] and torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _int4_keys_values_by_torch(kv, first, last, dtype, repeat):
    """What `kernels.int4_attention`'s torch ops hand SDPA: the codes' values, then the rings' [first, S)."""
    S, R = kv.length, kv.k_recent.shape[2]
    ring = torch.arange(first, S, device=kv.k.device) % R
    k = ref.dequantize_int4_channels(kv.k[:, :, :last], kv.k_scale, kv.k_min).to(dtype)
    v = ref.dequantize_int4_tokens(kv.v[:, :, :last], kv.v_scale[:, :, :last], kv.v_min[:, :, :last]).to(dtype)
    k, v = torch.cat((k, kv.k_recent[:, :, ring].to(dtype)), 2), torch.cat((v, kv.v_recent[:, :, ring].to(dtype)), 2)
    return k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Hkv, S, D, n_quantized, first_exact, first, last, ring, repeat", [
    (1, 2, 100, 64, 96, 64, 64, 96, 64, 1),  # a chunk's rows straddling a group: both copies of [64, 96)
    (1, 3, 700, 128, 672, 96, 160, 672, 608, 3),  # the ring wrapped (slots of [160, 700) past 608), GQA 3
    (2, 1, 45, 80, 32, 0, 0, 32, 64, 7),  # head_dim 80 (padded to 128), GQA 7, two sequences
    (1, 2, 20, 64, 0, 0, 0, 0, 32, 4),  # no codes yet: the rings alone
    (1, 8, 300, 96, 288, 288, 288, 288, 64, 1),  # every row reads [0, 288) as codes, the rest exact
])
def test_int4_dequantized_whole_is_the_torch_ops_bit_for_bit(dtype, B, Hkv, S, D, n_quantized, first_exact, first,
                                                              last, ring, repeat):
    """kv_dequantize.int4_pair: an INT4 layer's keys and values as `kernels.int4_attention` attends over them
    (positions [0, last) from their codes, then [first, S) from the rings, every kv head repeated for its query
    heads), in one launch and bit for bit what its torch ops give; the rings' other slots are NaN, never read."""
    from llmrun.kernels import kv_dequantize

    from .kv_views import quantized_cache

    torch.manual_seed(S + D)
    kv = quantized_cache(4, B, Hkv, S, D, n_quantized, dtype, first_exact, device=DEVICE, ring=ring)
    got_k, got_v = kv_dequantize.int4_pair(kv, first, last, dtype, repeat)
    want_k, want_v = _int4_keys_values_by_torch(kv, first, last, dtype, repeat)
    assert got_k.is_contiguous() and got_k.dtype == dtype and got_k.shape == (B, Hkv * repeat, last + S - first, D)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_an_int4_prompt_chunk_reads_the_cache_dequantized_in_one_launch(monkeypatch):
    """`kernels.quantized_attention` for a prompt chunk over an INT4 cache on CUDA (faked here) attends over the
    one-launch dequantization (H2O's mass too), and gives what it gives over the torch ops' copy, bit for bit."""
    from llmrun import kernels
    from llmrun.kernels import kv_dequantize

    from .kv_views import mass_buffer, quantized_cache

    B, Hkv, S, T, D = 1, 2, 150, 40, 64
    kv = quantized_cache(4, B, Hkv, S, D, 128, torch.float32, 96, device=DEVICE, ring=64)
    q = torch.randn(B, T, 6, D, device=DEVICE)
    want_mass = mass_buffer(B, Hkv, S, DEVICE)
    got_mass = want_mass.clone()
    monkeypatch.setattr(kernels, "_cpu_reads", lambda q, kv, mass: False)  # the C kernels would read the codes
    want = kernels.quantized_attention(q, kv, 100, mass=want_mass)
    calls = []
    real = kv_dequantize.int4_pair
    monkeypatch.setattr(kv_dequantize, "int4_pair", lambda *a: calls.append(a[1:3]) or real(*a))
    monkeypatch.setattr(kernels, "_use_triton", lambda x: True)
    got = kernels.quantized_attention(q, kv, 100, mass=got_mass)
    assert len(calls) == 1 and torch.equal(got, want) and torch.equal(got_mass, want_mass)
