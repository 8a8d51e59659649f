"""The C kernels of kernels/cpu_kernels.c against kernels/ref.py, on random inputs with awkward shapes.

Besides matching the reference, every kernel must be *batch invariant*: a token's result is bit-identical
whether it is computed alone or among others, so a cached decode reproduces the prefill exactly and greedy
speculative decoding (which verifies several tokens in one call) emits exactly what plain greedy emits.
"""

import platform
from pathlib import Path

import pytest
import torch

from llmrun.kernels import cpu, ref

from .kv_views import mass_buffer, quantized_cache

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def random_planes(N, K, bits, offsets, seed=0):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    else:
        qs = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    d = (torch.rand(N, K // 32, generator=g) * 0.02 + 0.001).half() * (1 - 2 * (torch.rand(N, K // 32, generator=g) < 0.3))
    m = (torch.randn(N, K // 32, generator=g) * 0.05).half() if offsets else None
    return qs, d, m


FORMATS = [(4, True), (4, False), (8, False)]  # Q4_1, Q4_0, Q8_0


@pytest.mark.parametrize("bits, offsets", FORMATS)
@pytest.mark.parametrize("N, K", [(1, 32), (7, 96), (33, 288), (100, 544), (64, 1024), (33, 1056)])
@pytest.mark.parametrize("M", [1, 3, 33, 70])
def test_quant_matmul_matches_reference(bits, offsets, N, K, M):
    qs, d, m = random_planes(N, K, bits, offsets)
    x = torch.randn(M, K)
    x[-1, :32] = 0  # an all-zero block: scale 0
    got = cpu.quant_matmul(x, qs, d, m, bits)
    want = ref.quant_matmul(x, qs, d, m, bits)
    # the same int8-rounded activations and weights; only the fp32 summation order differs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    w = ref.dequantize_blocks(qs, d, m, bits)
    exact = x @ w.T
    # 8-bit activations: each value is off by at most half a step, amax / 254, so each block of 32 by at most
    # sqrt(32) / 254 of its norm (a bound relative to |exact| fails when the outputs cancel out)
    assert (got - exact).norm() <= 1.001 * 32**0.5 / 254 * x.norm() * w.norm()


@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_quant_matmul_is_batch_invariant_and_accumulates(bits, offsets):
    qs, d, m = random_planes(41, 1056, bits, offsets)
    x = torch.randn(45, 1056)
    all_rows = cpu.quant_matmul(x, qs, d, m, bits)
    # alone, and among 45 rows: tiles of 32 rows, passes of up to 8 (AVX-512 VNNI: of two weight rows, the odd
    # last one alone, where a tile's activations outgrow L1, which one row's do not)
    for i in range(45):
        assert torch.equal(cpu.quant_matmul(x[i : i + 1], qs, d, m, bits)[0], all_rows[i])
    assert torch.equal(cpu.quant_matmul(x[5:14], qs, d, m, bits), all_rows[5:14])
    base = torch.randn(45, 41)
    out = base.clone()
    assert cpu.quant_matmul(x, qs, d, m, bits, out=out) is out
    torch.testing.assert_close(out, base + all_rows)


@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_quant_rows_dequantize_exactly(bits, offsets):
    qs, d, m = random_planes(50, 96, bits, offsets)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    want = ref.dequantize_blocks(qs, d, m, bits)[ids]
    assert torch.equal(cpu.quant_rows(ids, qs, d, m, bits), want)


def test_gguf_planes_are_the_file_bits(smollm2):
    from llmrun.gguf_file import GGUFFile

    g = GGUFFile(smollm2.files.source.path)
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight"):  # Q4_1, Q4_1, Q8_0
        qs, d, m, bits = g.tensors[name].blocks()
        assert torch.equal(ref.dequantize_blocks(qs, d, m, bits), g.tensors[name].dequantize())


@pytest.mark.parametrize("M, K", [(1, 576), (5, 100), (3, 7)])
def test_rms_norm(M, K):
    x, w = torch.randn(M, K) * 3, torch.randn(K)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu.rms_norm(x[1:2], w, 1e-5)[0], cpu.rms_norm(x, w, 1e-5)[1]) if M > 1 else True


@pytest.mark.parametrize("T, H, D", [(1, 9, 64), (6, 3, 16), (4, 2, 6)])
def test_rope_in_place_on_strided_heads(T, H, D):
    whole = torch.randn(1, T, H + 2, D)  # like a fused qkv output: rotate only the first H heads
    angles = torch.randn(T, D // 2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want = ref.apply_rope(whole[:, :, :H], cos, sin)
    untouched = whole[:, :, H:].clone()
    got = cpu.rope_(whole[:, :, :H], cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(whole[:, :, H:], untouched)


def test_silu_mul_on_halves_of_one_tensor():
    gate_up = torch.randn(1, 5, 2 * 96) * 4
    g, u = gate_up[..., :96], gate_up[..., 96:]
    torch.testing.assert_close(cpu.silu_mul(g, u), ref.silu_mul(g, u), rtol=1e-5, atol=1e-5)


# D 80 and 128: value channels past a multiple of 64, and two runs of 64; S 70: keys in several tiles of 32 (each
# row's value sums kept between them); T 16: the rows of a kv head split into runs across the threads
@pytest.mark.parametrize("Hq, Hkv, D", [(4, 1, 16), (9, 3, 64), (6, 6, 12), (8, 2, 128), (12, 4, 80)])
@pytest.mark.parametrize("T, S", [(1, 1), (1, 17), (5, 5), (5, 23), (16, 70)])
@pytest.mark.parametrize("window", [None, 3])
def test_attention_matches_reference_on_cache_views(Hq, Hkv, D, T, S, window):
    max_len = 80
    cache_k, cache_v = torch.randn(1, Hkv, max_len, D), torch.randn(1, Hkv, max_len, D)
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]  # head-strided views, as the KV cache hands them out
    q = torch.randn(1, T, Hq, D)
    got = cpu.attention(q, k, v, window)
    want = ref.attention(q, k.contiguous(), v.contiguous(), window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for t in range(T):  # query t alone, at the same position, gives the same bits
        alone = cpu.attention(q[:, t : t + 1].contiguous(), k[:, :, : S - T + t + 1], v[:, :, : S - T + t + 1], window)
        assert torch.equal(alone[0, 0], got[0, t])


@pytest.mark.parametrize("D", [64, 80, 128])
def test_int8_quantization_is_the_reference_bit_for_bit(D):
    group = ref.kv_group(D)
    x = torch.randn(7, 5, D) * torch.rand(7, 5, 1) * 30
    x[0, 0] = 0  # scale 0: codes 0
    x[0, 1, :group] = 3e-5 * torch.randn(group)  # scales below fp16's smallest normal
    x[0, 2, :group] = torch.randn(group) * 1e7  # max / 127 past fp16's range: scale inf, codes 0
    x[0, 3] = (torch.arange(D) % group - group / 2 + 0.5) / 8  # scale 1/8 exactly: every code a tie, to even
    x[0, 3, ::group] = 127 / 8
    codes, scales = cpu.quantize_int8(x, group)
    want_codes, want_scales = ref.quantize_int8(x, group)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales.view(torch.int16), want_scales.view(torch.int16))


def random_int8_cache(Hkv, S, D, max_len=320, seed=0):
    """k, v codes (1, Hkv, S, D) and their scales: views of (1, Hkv, max_len, ...) buffers, as the cache hands them."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 1, Hkv, max_len, D, generator=g) * torch.rand(D, generator=g) * 4
    (kc, ks), (vc, vs) = ref.quantize_int8(k, ref.kv_group(D)), ref.quantize_int8(v, ref.kv_group(D))
    return kc[:, :, :S], vc[:, :, :S], ks[:, :, :S], vs[:, :, :S]


@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("T, S", [(1, 1), (1, 33), (4, 33), (16, 33), (1, 300), (4, 300), (16, 300)])
@pytest.mark.parametrize("window", [None, 7])
def test_int8_attention_matches_reference(Hq, Hkv, D, T, S, window):
    kc, vc, ks, vs = random_int8_cache(Hkv, S, D)
    q = torch.randn(1, T, Hq, D)
    got = cpu.attention_int8(q, kc, vc, ks, vs, window)
    want = ref.quantized_attention(q, ref.QuantizedKV(8, kc, vc, ks, vs), window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the codes are never dequantized one by one (scales multiply sums of codes), which moves a rounding or two
    # from the fp32 kernel over the dequantized cache
    k, v = ref.dequantize_int8(kc, ks), ref.dequantize_int8(vc, vs)
    torch.testing.assert_close(got, cpu.attention(q, k, v, window), rtol=1e-5, atol=1e-5)
    t = T - 1  # the last query alone, at the same position, gives the same bits
    assert torch.equal(cpu.attention_int8(q[:, t:].contiguous(), kc, vc, ks, vs, window)[0, 0], got[0, t])


# INT4 (S, n_quantized, first_exact): all exact; one group of codes; rows on both sides of a group's end (62..65,
# 84..99, 284..299); a ring that lost a block's first rows' exact keys (first_exact 0 of a 40-key cache is exact
# from 0: rows read codes only from 32 on); a long cache.
INT4_STATES = [(1, 0, 0), (33, 32, 32), (66, 64, 32), (100, 96, 64), (40, 32, 0), (300, 288, 256), (1000, 992, 960)]


@pytest.mark.parametrize("Hq, Hkv, D", [(4, 4, 64), (9, 3, 80), (8, 2, 128), (6, 2, 48)])
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("S, n_quantized, first_exact", INT4_STATES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("ring", [ref.RECENT, 72])
def test_int4_attention_matches_reference(Hq, Hkv, D, T, S, n_quantized, first_exact, window, ring):
    if T > S:
        pytest.skip("more queries than keys")
    kv = quantized_cache(4, 1, Hkv, S, D, n_quantized, torch.float32, first_exact, ring=ring)
    q = torch.randn(1, T, Hq, D)
    mass = mass_buffer(1, Hkv, S)
    before = mass.clone()
    got = cpu.attention_int4(q, kv, window, mass)
    # two fp32 softmaxes over up to 1000 keys with x20 outliers, summed in other orders: 1e-5 failed once in ~1000
    torch.testing.assert_close(got, ref.quantized_attention(q, kv, window), rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(mass - before, ref.quantized_attention_mass(q, kv, window), rtol=1e-4, atol=1e-5)
    # each row reads its own keys: the fp32 kernel over the dequantized cache, one run of rows at a time, up to
    # the roundings that reading codes moves (a group's scale multiplies a sum of codes; over 1000 keys that
    # reached 1.25e-5 once)
    runs = [cpu.attention(q[:, r0:r1], k, v, window) for r0, r1, k, v in ref.quantized_row_blocks(kv, T)]
    torch.testing.assert_close(got, torch.cat(runs, dim=1), rtol=1e-5, atol=2e-5)
    t = T - 1  # the last query alone, at the same position, gives the same bits
    assert torch.equal(cpu.attention_int4(q[:, t:].contiguous(), kv, window)[0, 0], got[0, t])


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("T, S, window", [(1, 1, None), (4, 33, None), (16, 300, 7)])
def test_attention_mass_matches_reference(bits, T, S, window):
    """H2O's attention mass from the C kernels: each key's softmax weight, summed over queries and query heads."""
    Hq, Hkv, D = 9, 3, 64
    q = torch.randn(1, T, Hq, D)
    mass = mass_buffer(1, Hkv, S)
    before = mass.clone()
    if bits == 8:
        kc, vc, ks, vs = random_int8_cache(Hkv, S, D)
        cpu.attention_int8(q, kc, vc, ks, vs, window, mass)
        k = ref.dequantize_int8(kc, ks)
    else:
        k, v = (x[:, :, :S] for x in torch.randn(2, 1, Hkv, S + 5, D))
        cpu.attention(q, k, v, window, mass)
    torch.testing.assert_close(mass - before, ref.attention_mass(q, k, window), rtol=1e-4, atol=1e-5)


def int4_store_runs(D, ops, seed=0):
    """The INT4 store (llmrun/kv_cache.py) through `ops` twice: its writes by the C kernels and by torch
    (`reference_ops`) -> (C store, torch store) after each op. ops: ("write", slot, T) or ("truncate", length)."""
    from llmrun import kernels
    from llmrun.kv_cache import _Int4Store

    g = torch.Generator().manual_seed(seed)
    Hkv, C = 3, 1024
    stores = [_Int4Store(2, 1, Hkv, C, D, torch.float32, "cpu") for _ in range(2)]
    for op in ops:
        if op[0] == "truncate":
            for store in stores:
                store.truncate(op[1])
        else:
            _, slot, T = op
            k = torch.randn(1, Hkv, T, D, generator=g) * torch.rand(1, 1, 1, D, generator=g) * 8
            v = torch.randn(1, Hkv, T, D, generator=g)
            k[0, 0, :, : D // 2] = 0.25  # a channel constant over its group: scale 0, codes 0
            k[0, 1] *= 1e-6  # scales below fp16's smallest normal
            v[0, 2, 0] = 1e-7
            for layer in range(2):
                stores[0].write(layer, slot, k, v)
                with kernels.reference_ops():
                    stores[1].write(layer, slot, k, v)
        yield stores


@pytest.mark.parametrize("D", [64, 80])
def test_int4_store_writes_are_the_torch_writes_bit_for_bit(D, monkeypatch):
    """The C kernels write an INT4 cache (values per token; keys and values into the exact rings, each key group
    that fills quantized per channel) exactly as the store's torch code does: decode steps, blocks, prompt chunks
    that wrap around the rings, rollbacks shallow and past the rings, and writes after the rings lost positions."""
    calls = []
    monkeypatch.setattr(cpu, "int4_write", lambda *args, f=cpu.int4_write: calls.append(1) or f(*args))
    assert ref.RECENT == 576  # the rollbacks below reach past the rings
    ops = [("write", 0, 5), *[("write", s, 1) for s in range(5, 40)], ("write", 40, 16), ("write", 56, 9),
           ("truncate", 50), ("write", 50, 20), ("write", 70, 600), ("truncate", 80), ("write", 80, 3),
           ("write", 83, 700), ("truncate", 740), ("write", 740, 1), ("truncate", 150), ("write", 150, 33),
           ("write", 183, 1)]
    for c_store, torch_store in int4_store_runs(D, ops):
        assert torch.equal(c_store.state, torch_store.state)
        for a, b in zip(c_store.buffers, torch_store.buffers):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert len(calls) == 2 * sum(op[0] == "write" for op in ops)  # every write took the C path


@pytest.fixture(scope="module", params=[("smollm2", "Q4_1"), ("smollm2", "Q4_0"), ("smollm2", "Q8_0"),
                                        ("qwen2", "Q4_1"), ("mistral", "Q8_0"), ("qwen3", "Q4_1"),
                                        ("qwen3-biases", "Q4_1")], ids="-".join)
def tiny_quantized(request, tmp_path_factory):
    """A tiny GGUF with quantized matrices: SmolLM2's GQA 9/3 and tied embeddings, Qwen2's q/k/v biases,
    Mistral's sliding window (5 positions, shorter than the 12 tokens run below), Qwen3's head norms (and its
    attention_bias: biases on q/k/v and o, the residual adding o's biased output)."""
    import dataclasses

    from .tiny import CONFIGS, random_model, write_gguf

    arch, qtype = request.param
    biases = dict(attention_bias=True, attention_out_bias=True) if arch.endswith("-biases") else {}
    arch = arch.removesuffix("-biases")
    # head_dim 32 so every matrix has whole blocks of 32 columns
    model = random_model(dataclasses.replace(CONFIGS[arch], head_dim=32, **biases))
    return write_gguf(tmp_path_factory.mktemp("q") / f"tiny-{arch}-{qtype}.gguf", model,
                      "qwen3" if arch == "qwen3" else "llama", qtype)


@pytest.mark.parametrize("kv_format", ["fp32", "int8", "int4"])
def test_packed_model_matches_dequantized_and_is_batch_invariant(tiny_quantized, kv_format):
    from llmrun.models.llama import STACK_MAX_TOKENS
    from llmrun.kv_cache import KVCache
    from llmrun.loading import load_model
    from llmrun.models.quant import QuantEmbedding, QuantLinear

    packed = load_model(str(tiny_quantized), "cpu", "fp32", "auto")
    plain = load_model(str(tiny_quantized), "cpu", "fp32", "dequant")
    assert (packed.weights, plain.weights) == ("packed", "dequant")
    assert isinstance(packed.model.layers[0].attn.qkv, QuantLinear)
    assert isinstance(packed.model.embed if packed.model.lm_head is None else packed.model.lm_head, (QuantEmbedding, QuantLinear))
    assert packed.weight_bytes < plain.weight_bytes / 3
    n = STACK_MAX_TOKENS + 4  # a prefill longer than the whole-stack call takes: it runs the layer loop
    tokens = torch.randint(0, packed.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))

    def run(sizes):  # forward the tokens in consecutive pieces of these sizes through one cache
        cache = KVCache.for_model(packed.config, n + 4, torch.float32, "cpu", kv_format=kv_format)
        out, start = [], 0
        for size in sizes:
            out.append(packed.model(tokens[:, start : start + size], start, cache)[0])
            start += size
        return torch.cat(out), cache

    with torch.no_grad():
        exact = plain.model(tokens)[0]
        prefill, cache = run([n])
        if kv_format == "fp32":  # the packed weights' error alone (an int8 cache's: tests/test_kv_cache.py)
            torch.testing.assert_close(prefill, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
        steps, step_cache = run([1] * n)
        assert packed.model._stack[1] is not None  # the steps ran as one C call each (kernels.cpu.DecodeStack)
        blocks, _ = run([3, 1, 7, STACK_MAX_TOKENS - 7, 4])  # speculative blocks through the same C call
    assert torch.equal(steps, prefill)  # one token at a time: the same bits
    assert torch.equal(blocks, prefill)
    for a, b in zip(vars(step_cache.store).values(), vars(cache.store).values()):  # the stack wrote what the loop wrote
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_decode_stack_lives_as_long_as_its_cache(smollm2):
    """The model keeps one stack for the cache it decodes into across steps; once that cache is gone, the stack (and
    with it the cache's buffers, which it holds) goes too, not at the next cache's first step (a dropped engine's
    cache stayed in memory)."""
    import gc
    import weakref

    from llmrun.kv_cache import KVCache

    model = smollm2.model
    cache = KVCache.for_model(model, 64, torch.float32, "cpu")
    stacks = []
    with torch.no_grad():
        for position in range(4):
            model(torch.tensor([[position + 5]]), position, cache)
            cache.length += 1
            stacks.append(model._stack[1])
    assert stacks[0] is not None and all(s is stacks[0] for s in stacks)
    buffer = weakref.ref(cache.dense[0])
    del cache, stacks
    gc.collect()
    assert buffer() is None and model._stack is None


@pytest.mark.parametrize("kv_format, evict", [("int8", None), ("int4", None), ("fp32", "h2o"), ("int4", "h2o")])
def test_the_decode_stack_writes_and_reads_the_cache_as_the_layer_loop(smollm2, monkeypatch, kv_format, evict):
    """The embedded model: the whole-stack C call writes the cache the layer-by-layer forward writes (INT8 codes as
    ref.quantize_int8, INT4 as the store, H2O's attention mass), evicting when full, and gives its logits, bit
    for bit."""
    from llmrun.kv_cache import Eviction, KVCache
    from llmrun.models.llama import Transformer

    model = smollm2.model
    tokens = torch.randint(0, smollm2.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(5))
    # a short prefill, decode steps, speculative blocks (all T <= 16), past a few INT4 key groups and (H2O,
    # budget 64) several evictions
    pieces = [12, 1, 1, 5, 1, 16, 1, 3, *[1] * 20, 16, 7, 16, 1]
    eviction = Eviction(evict, 64) if evict else None

    def run():
        cache = KVCache.for_model(model, 128, torch.float32, "cpu", kv_format=kv_format, eviction=eviction)
        out, start = [], 0
        with torch.no_grad():
            for size in pieces:
                cache.make_room(size)
                out.append(model(tokens[:, start : start + size], cache.position, cache)[0])
                cache.length += size
                start += size
        return torch.cat(out), cache

    stacked, cache = run()
    assert model._stack[1] is not None  # the steps ran as one C call each
    assert evict is None or cache.evicted > 0
    monkeypatch.setattr(Transformer, "_decode_stack", lambda self, x, cache: None)
    looped, loop_cache = run()
    assert torch.equal(stacked, looped)
    for a, b in zip(vars(cache.store).values(), vars(loop_cache.store).values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in ((cache.scores, loop_cache.scores), (cache.positions, loop_cache.positions)):
        assert (a is None and b is None) or torch.equal(a, b)
    if kv_format == "int8" and evict is None:  # layer 0's codes are its K/V quantized (they do not depend on the cache)
        dense = KVCache.for_model(model, 128, torch.float32, "cpu")
        with torch.no_grad():
            model(tokens[:, : sum(pieces)], 0, dense)
        for i, x in enumerate((dense.store.k[0], dense.store.v[0])):
            codes, scales = ref.quantize_int8(x[:, :, : sum(pieces)], ref.kv_group(x.shape[-1]))
            assert torch.equal(cache.store.codes[i, 0, :, :, : sum(pieces)], codes)
            assert torch.equal(cache.store.scales[i, 0, :, :, : sum(pieces)], scales)


def test_without_cpu_kernels_the_dequantized_path_runs_with_a_note(tiny_quantized, monkeypatch):
    from llmrun.loading import load_model

    monkeypatch.setenv("LLMRUN_NO_CPU_KERNELS", "1")
    cpu._lib.cache_clear()
    try:
        loaded = load_model(str(tiny_quantized), "cpu", "fp32", "auto")
    finally:
        monkeypatch.delenv("LLMRUN_NO_CPU_KERNELS")
        cpu._lib.cache_clear()
    assert loaded.weights == "dequant"
    assert any("LLMRUN_NO_CPU_KERNELS" in note for note in loaded.notes)
    assert cpu.available()


def test_no_compiler_is_reported_not_raised(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    cpu._lib.cache_clear()
    try:
        assert not cpu.available()
        assert "no C compiler" in cpu.unavailable_reason()
    finally:
        monkeypatch.undo()
        cpu._lib.cache_clear()
    assert cpu.available()


def test_a_library_that_does_not_load_is_reported_and_a_cached_one_built_again(tmp_path, monkeypatch):
    """A library just built that does not load (a cache on a noexec mount; here one cut short) is the reason the
    kernels are off, not an OSError traceback, and it is not built again at every start; one that loaded once and
    is found cut short since is built again, once. (The builds copy this session's library: no compiler runs.)"""
    built = cpu._lib()._name
    builds = []

    def build(cc, out):  # the first build is cut short, the next whole
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(Path(built).read_bytes()[: 100 if not builds else None])
        builds.append(out)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_compile", build)
    try:
        for start in range(2):
            cpu._lib.cache_clear()
            assert not cpu.available() and len(builds) == 1
            reason = cpu.unavailable_reason()
            assert reason.startswith(f"cannot load the CPU kernels: {builds[0]}: ") and "XDG_CACHE_HOME" in reason
        builds[0].with_suffix(".unloadable").unlink()  # as if it had loaded once, and been cut short since
        cpu._lib.cache_clear()
        assert cpu.available() and len(builds) == 2 and builds[1] == builds[0]
    finally:
        monkeypatch.undo()
        cpu._lib.cache_clear()
    assert cpu.available()


def test_dequant_weights_run_plain_pytorch_only(tiny_quantized, monkeypatch):
    """`--weights dequant` is the eager baseline: no llmrun kernel runs, only kernels.ref's torch ops."""
    from llmrun.loading import load_model

    plain = load_model(str(tiny_quantized), "cpu", "fp32", "dequant")

    def forbidden(*args, **kwargs):
        raise AssertionError("a C kernel ran on the plain-PyTorch path")

    for name in ("quant_matmul", "quant_rows", "rms_norm", "rope_", "silu_mul", "attention"):
        monkeypatch.setattr(cpu, name, forbidden)
    from llmrun.kv_cache import KVCache

    cache = KVCache.for_model(plain.config, 8, torch.float32, "cpu")
    with torch.no_grad():
        plain.model(torch.tensor([[1, 2, 3]]), 0, cache)
        plain.model(torch.tensor([[4]]), 3, cache)


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(params=["x86-64", "x86-64-v3"])
def portable_kernels(request, monkeypatch):
    """The C kernels built for another x86-64 level than this CPU's, loaded for this test only: plain x86-64, the
    scalar loops that CPUs without AVX2 (and every non-x86 CPU) run; and x86-64-v3, the AVX2 kernels, which a CPU
    with AVX-512 VNNI does not run natively."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the native build is already the portable one here")
    if request.param == "x86-64-v3":
        flags = _cpu_flags()
        if not {"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"} <= flags:
            pytest.skip("this CPU cannot run x86-64-v3 code")
        if "avx512_vnni" not in flags:
            pytest.skip("the native build is already the AVX2 one here")
    monkeypatch.setattr(cpu, "FLAGS", [f"-march={request.param}" if f == "-march=native" else f for f in cpu.FLAGS])
    cpu._lib.cache_clear()
    assert cpu.available(), cpu.unavailable_reason()
    yield
    cpu._lib.cache_clear()


@pytest.mark.slow
def test_the_portable_build_keeps_every_guarantee(portable_kernels, monkeypatch):
    """Built for other x86-64 levels, the kernels match the reference, are batch invariant, and read quantized
    caches with the bits of the fp32 kernel over their dequantized copies."""
    for bits, offsets in FORMATS:
        test_quant_matmul_matches_reference(bits, offsets, 33, 288, 3)
        test_quant_matmul_is_batch_invariant_and_accumulates(bits, offsets)
        test_quant_rows_dequantize_exactly(bits, offsets)
    test_rms_norm(3, 100)
    test_rope_in_place_on_strided_heads(5, 3, 16)
    test_silu_mul_on_halves_of_one_tensor()
    test_attention_matches_reference_on_cache_views(9, 3, 64, 5, 23, 3)
    test_int8_quantization_is_the_reference_bit_for_bit(80)
    test_int8_attention_matches_reference(9, 3, 64, 4, 300, None)
    for D in (48, 128):
        test_int4_attention_matches_reference(8, 2, D, 16, 300, 288, 256, 7, 72)
        test_attention_mass_matches_reference(8 if D == 48 else 32, 4, 33, None)
    test_int4_store_writes_are_the_torch_writes_bit_for_bit(80, monkeypatch)
