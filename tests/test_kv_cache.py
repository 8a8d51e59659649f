"""The KV cache's formats and eviction (llmrun/kv_cache.py), against the definitions in kernels/ref.py.

Quantized caches: what a cache written piece by piece hands to attention equals the quantization of the whole
sequence at once; rollbacks leave it as if the rejected tokens had never been written. Eviction: each policy
keeps exactly the tokens it names, moved with their positions; re-rotation moves keys to their slots' angles.
"""

import math
import re
from types import SimpleNamespace

import pytest
import torch

from llmrun.errors import ContextOverflowError, LlmrunError
from llmrun.kernels import ref
from llmrun.kv_cache import Eviction, KVCache, bytes_per_token, int4_ring_bytes

L, B, H, D = 2, 1, 3, 64


def random_kv(S, D=D, outliers=True, seed=0):
    """k, v (B, S, H, D) as the model writes them, keys with a few large channels (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, B, S, H, D, generator=g)
    if outliers:
        k[..., 3] *= 20
        k[..., D // 2 + 3] *= 20
    return k, v


def write(cache, k, v, pieces, start=0):
    """Write positions [start, start + sum(pieces)) of k, v in consecutive pieces, in every layer."""
    pos = start
    for n in pieces:
        for layer in range(L):
            out = cache.update(layer, pos, k[:, pos : pos + n], v[:, pos : pos + n])
        pos += n
        cache.length = pos
    return out


def read(cache, layer=0):
    """The keys and values (B, H, S, D) fp32 attention sees in `layer`."""
    nothing = torch.empty(B, 0, H, cache.shape[-1])
    k, v, _ = cache.update(layer, cache.position, nothing, nothing)
    return ref.dequantize_kv(k) if v is None else (k.float(), v.float())


def expected(fmt, k, v):
    """What a cache of format `fmt` holding all of k, v (B, S, H, D) must hand to attention."""
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
    if fmt == "int8":
        return ref.dequantize_int8(*ref.quantize_int8(k, 32)), ref.dequantize_int8(*ref.quantize_int8(v, 32))
    full = k.shape[2] // ref.KEY_GROUP * ref.KEY_GROUP  # the newest query reads these as codes, the rest exact
    k_q = ref.dequantize_int4_channels(*ref.quantize_int4_channels(k[:, :, :full]))
    v_q = ref.dequantize_int4_tokens(*ref.quantize_int4_tokens(v[:, :, :full], 32))
    return torch.cat((k_q, k[:, :, full:]), dim=2), torch.cat((v_q, v[:, :, full:]), dim=2)


@pytest.mark.parametrize("D", [64, 80, 128])
def test_round_trip_errors_are_within_half_a_step(D):
    x = torch.randn(4, 3, 96, D) * torch.rand(D) * 10
    g = ref.kv_group(D)
    codes, scale = ref.quantize_int8(x, g)
    step = scale.float().repeat_interleave(g, -1)
    assert ((ref.dequantize_int8(codes, scale) - x).abs() <= step / 2 * 1.01 + 1e-6).all()
    codes, scale, lo = ref.quantize_int4_tokens(x, g)
    step = scale.float().repeat_interleave(g, -1)
    # the minimum is stored in fp16: its rounding adds to the half step
    slack = lo.float().abs().repeat_interleave(g, -1) * 2**-11
    assert ((ref.dequantize_int4_tokens(codes, scale, lo) - x).abs() <= step / 2 * 1.01 + slack + 1e-6).all()
    codes, scale, lo = ref.quantize_int4_channels(x)
    step = scale.float().repeat_interleave(ref.KEY_GROUP, -2)
    slack = lo.float().abs().repeat_interleave(ref.KEY_GROUP, -2) * 2**-11
    assert ((ref.dequantize_int4_channels(codes, scale, lo) - x).abs() <= step / 2 * 1.01 + slack + 1e-6).all()
    # and 4 bits really are 16 levels: the codes span them
    assert ref.unpack_int4(codes).min() == 0 and ref.unpack_int4(codes).max() == 15


def test_int4_packing_puts_even_channels_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0]])
    assert ref.pack_int4(q).tolist() == [[0x21, 0x0F]]
    assert ref.unpack_int4(ref.pack_int4(q)).tolist() == q.tolist()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("pieces", [[100], [1] * 70, [5, 27, 1, 40, 3, 31, 33], [64, 64, 7]])
def test_a_cache_written_in_pieces_holds_the_whole_sequence_quantized(fmt, pieces):
    S = sum(pieces)
    k, v = random_kv(S)
    cache = KVCache(L, B, H, 256, D, torch.float32, "cpu", kv_format=fmt)
    write(cache, k, v, pieces)
    got_k, got_v = read(cache)
    want_k, want_v = expected(fmt, k, v)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("S, back", [(40, 17), (64, 17), (70, 33), (99, 5), (33, 1)])
def test_a_short_rollback_leaves_the_cache_as_if_the_rejected_tokens_never_came(fmt, S, back):
    k, v = random_kv(S + 20)
    other_k, other_v = random_kv(S + 20, seed=1)
    cache = KVCache(L, B, H, 256, D, torch.float32, "cpu", kv_format=fmt)
    write(cache, k, v, [S - back] + [1] * back)  # decoded token by token, then speculated past
    cache.truncate(S - back)
    write(cache, other_k, other_v, [back + 20], start=S - back)  # a different continuation
    fresh = KVCache(L, B, H, 256, D, torch.float32, "cpu", kv_format=fmt)
    mixed_k, mixed_v = torch.cat((k[:, : S - back], other_k[:, S - back :]), 1), torch.cat((v[:, : S - back], other_v[:, S - back :]), 1)
    write(fresh, mixed_k, mixed_v, [S - back, back + 20])
    for layer in range(L):
        a, b = read(cache, layer), read(fresh, layer)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_an_int4_rollback_past_the_rings_uses_the_codes():
    S = ref.RECENT + 136
    k, v = random_kv(S)
    cache = KVCache(L, B, H, S, D, torch.float32, "cpu", kv_format="int4")
    write(cache, k, v, [S])
    cache.truncate(70)  # positions 64..69 were quantized (keys with group 64..95) and left the rings
    got_k, got_v = read(cache)
    codes_k = ref.dequantize_int4_channels(*ref.quantize_int4_channels(k.transpose(1, 2)[:, :, :96]))[:, :, :70]
    codes_v = ref.dequantize_int4_tokens(*ref.quantize_int4_tokens(v.transpose(1, 2)[:, :, :70], 32))
    torch.testing.assert_close(got_k, codes_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_v, codes_v, rtol=0, atol=1e-5)
    write(cache, k, v, [130], start=70)  # refilled: the group's first positions are their dequantized selves
    got_k, got_v = read(cache)
    want_k, want_v = expected("int4", k[:, :200], v[:, :200])
    torch.testing.assert_close(got_v[:, :, 64:70], codes_v[:, :, 64:], rtol=0, atol=1e-5)  # no exact copy left
    torch.testing.assert_close(got_v[:, :, 70:], want_v[:, :, 70:], rtol=0, atol=1e-5)
    assert (got_k - want_k).abs().max() < 0.2 * k.abs().max()  # lossy, but bounded by a 4-bit step or two
    cache.truncate(0)  # and back to empty (a new conversation): the cache is as new
    cache.length = 0
    write(cache, k, v, [200])
    got_k, got_v = read(cache)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("path", ["c", "torch", "device"])
@pytest.mark.parametrize("fed, kept", [(1, 0), (33, 1), (9, 4), (17, 17)])
def test_an_int4_write_rolled_back_past_the_rings_leaves_nothing_to_read(path, fed, kept, monkeypatch):
    """Past the rings' first wrap, `fed` tokens written and all but `kept` rolled back (pipelined decoding's step fed
    past a reply's end: 1, none kept; a speculative block of 33, one kept) leave the cache as every reader sees one
    that never had them: the keys and values attention reads, the exact keys an eviction re-quantizes (`keys`),
    the cache after an eviction (`keep`), and after both went on alike. Each of the store's write paths: the C
    kernels (fp32 on the CPU), its torch code, and a device step's (`write_at`)."""
    if path == "torch":
        monkeypatch.setattr("llmrun.kernels.cpu_kernels_serve", lambda x: False)
    S = ref.RING + 100  # the rings wrapped: each write overwrites a slot a position RING back held
    k, v = random_kv(S + fed + 8)
    other_k, other_v = random_kv(S + fed + 8, seed=1)
    spare_k = torch.cat((k[:, : S + kept], other_k[:, S + kept :]), 1)  # the kept tokens, then others
    spare_v = torch.cat((v[:, : S + kept], other_v[:, S + kept :]), 1)

    def cache():
        c = KVCache(L, B, H, S + fed + 8, D, torch.float32, "cpu", kv_format="int4")
        write(c, k, v, [512, S - 512])
        assert c.store.ring == ref.RING and c.store.window == ref.RECENT
        return c

    plain, rolled = cache(), cache()
    write(plain, k, v, [kept], start=S)
    if path == "device":
        for layer in range(L):
            rolled.store.write_at(layer, torch.arange(S, S + fed), spare_k[:, S : S + fed].transpose(1, 2),
                                  spare_v[:, S : S + fed].transpose(1, 2))
        rolled.store.wrote(S, fed)
        rolled.length = S + fed
    else:
        write(rolled, spare_k, spare_v, [fed], start=S)
    rolled.truncate(S + kept)
    rolled.length = S + kept

    def same(a, b):
        n = a.length
        for layer in range(L):
            assert all(torch.equal(x, y) for x, y in zip(read(a, layer), read(b, layer))), layer
            assert torch.equal(a.store.keys(layer, n), b.store.keys(layer, n)), layer

    same(rolled, plain)
    for c in (plain, rolled):
        write(c, k, v, [3], start=S + kept)  # both go on alike
    same(rolled, plain)
    index = torch.randperm(S + kept + 3, generator=torch.Generator().manual_seed(0))[:300].sort().values
    for c in (plain, rolled):  # an eviction keeps 300 positions, its key groups quantized afresh from `keys`
        for layer in range(L):
            c.store.keep(layer, c.length, index.expand(B, H, -1))
        c.length = 300
    same(rolled, plain)


@pytest.mark.parametrize("rejected", [0, 9, 33, ref.RECENT - ref.KEY_GROUP])
@pytest.mark.parametrize("start, T", [(40, 8), (60, 4), (95, 1), (90, 17), (31, 33), (63, 33), (100, 33),
                                      (700, 512), (37, ref.RECENT - ref.KEY_GROUP + 1)])
def test_each_row_of_an_int4_block_reads_the_keys_one_token_steps_read(start, T, rejected):
    """A block of T tokens after a prompt of `start` (and after a block of `rejected` other tokens rolled back, up
    to the deepest rollback the rings keep exact): query row r reads bit for bit the keys and values a one-token
    step at its position read. (60, 4): the group [32, 64) fills at the last row; (63, 33): the groups ending at 64
    and 96 fill in the block; (700, 512): a prompt chunk; (37, RECENT - 31): the longest block the rings serve."""
    S = start + T
    k, v = random_kv(max(S, start + rejected))
    other_k, other_v = random_kv(start + rejected, seed=1)
    size = max(S, start + rejected)
    block = KVCache(L, B, H, size, D, torch.float32, "cpu", kv_format="int4")
    write(block, k, v, [start])
    if rejected:
        write(block, other_k, other_v, [rejected], start=start)
        block.truncate(start)
    kv, _, _ = write(block, k, v, [T], start=start)
    assert len(set(kv.row_quantized(T))) == S // 32 - (start + 1) // 32 + 1  # no row is clamped
    steps = KVCache(L, B, H, size, D, torch.float32, "cpu", kv_format="int4")
    write(steps, k, v, [start])
    rows = {}  # row r -> the keys and values (B, H, start + r + 1, D) a one-token step at position start + r read
    for r in range(T):
        one, _, _ = write(steps, k, v, [1], start=start + r)
        rows[r] = ref.dequantize_kv(one)
    seen = 0
    for r0, r1, k_read, v_read in ref.quantized_row_blocks(kv, T):
        for r in range(r0, r1):
            n = start + r + 1
            assert torch.equal(k_read[:, :, :n], rows[r][0]) and torch.equal(v_read[:, :, :n], rows[r][1]), r
            seen += 1
    assert seen == T


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_int8_cache_dequantized_for_a_prompt_chunk(dtype):
    """`kernels.dequantized_int8` (prefill's attention over an INT8 cache on a GPU): `ref.dequantize_kv` rounded
    once to `dtype`, bit for bit."""
    from llmrun.kernels import dequantized_int8

    k, v = random_kv(140)
    cache = KVCache(L, B, H, 140, D, torch.float32, "cpu", kv_format="int8")
    write(cache, k, v, [100])
    kv, _, _ = write(cache, k, v, [40], start=100)
    got, want = dequantized_int8(kv, dtype), ref.dequantize_kv(kv)
    assert all(torch.equal(g, w.to(dtype)) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start, T, window", [(700, 512, None), (63, 33, None),
                                              (37, ref.RECENT - ref.KEY_GROUP + 1, 300), (100, 600, None), (95, 1, None), (1000, 300, 700), (30, 2, None)])
def test_an_int4_prompt_chunk_attends_in_one_call(start, T, window, dtype, monkeypatch):
    """`kernels.int4_attention` (a prompt chunk over an INT4 cache on a GPU, or 16-bit on a CPU): one SDPA call
    for rows that read different key groups as codes, each row the attention of `ref.quantized_attention`'s runs,
    over the same keys and values rounded to `dtype` (fp32: within summation order; bf16: within its rounding of
    the output), with H2O's mass of `ref.quantized_attention_mass`. (100, 600): a block past the rings, whose
    first rows read codes; windows that cut into the codes and into the exact keys."""
    from llmrun import kernels

    S, Hq = start + T, 2 * H  # GQA: two query heads a kv head
    k, v = random_kv(S)
    cache = KVCache(L, B, H, S, D, torch.float32, "cpu", kv_format="int4")
    write(cache, k, v, [start])
    kv, _, _ = write(cache, k, v, [T], start=start)
    q = torch.randn(B, T, Hq, D, generator=torch.Generator().manual_seed(T))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    mass = torch.zeros(B, H, S)
    got = kernels.int4_attention(q.to(dtype), kv, window, mass)
    assert calls == [1] and got.dtype == dtype and got.shape == (B, T, Hq, D)
    monkeypatch.undo()
    # the reference's runs over q, keys and values rounded to dtype: in fp32 (want), and in dtype as the runs were
    # attended before (the tolerance rule: within twice their error, plus an fp32 atol)
    runs = [(r0, r1, k_run.to(dtype), v_run.to(dtype)) for r0, r1, k_run, v_run in ref.quantized_row_blocks(kv, T)]
    want = torch.cat([ref.attention(q[:, r0:r1].to(dtype).float(), k_run.float(), v_run.float(), window)
                      for r0, r1, k_run, v_run in runs], dim=1)
    before = torch.cat([ref.attention(q[:, r0:r1].to(dtype), k_run, v_run, window) for r0, r1, k_run, v_run in runs],
                       dim=1)
    torch_err = (before.float() - want).abs().max().item()
    assert (got.float() - want).abs().max().item() <= 2 * torch_err + 1e-5
    if dtype == torch.float32:
        assert (got - ref.quantized_attention(q, kv, window)).abs().max().item() <= 1e-5
        want_mass = ref.quantized_attention_mass(q, kv, window)
        assert (mass - want_mass).abs().max().item() <= 1e-5 * T * Hq


@pytest.mark.parametrize("window", [None, 300])
def test_an_int4_prompt_chunk_on_cuda_repeats_the_kv_heads(window, monkeypatch):
    """On CUDA (routed so here) the chunk's SDPA call gets the kv heads repeated for their query heads and no GQA:
    flash takes no mask and the memory-efficient kernel no GQA, so with both SDPA would run its math kernel. The
    same attention either way."""
    from llmrun import kernels

    start, T, Hq = 100, 300, 2 * H
    k, v = random_kv(start + T)
    cache = KVCache(L, B, H, start + T, D, torch.float32, "cpu", kv_format="int4")
    write(cache, k, v, [start])
    kv, _, _ = write(cache, k, v, [T], start=start)
    q = torch.randn(B, T, Hq, D, generator=torch.Generator().manual_seed(1))
    want = kernels.int4_attention(q, kv, window)
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    heads = lambda q, k, v, **kw: calls.append((k.shape[1], v.shape[1], kw["enable_gqa"])) or sdpa(q, k, v, **kw)
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", heads)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    got = kernels.int4_attention(q, kv, window)
    monkeypatch.undo()
    assert calls == [(Hq, Hq, False)]
    assert (got - want).abs().max().item() <= 1e-5


def test_a_long_int4_block_reads_codes_where_the_rings_lost_the_exact_keys():
    """A block longer than the rings serve: rows whose one-token keys and values are gone read the codes instead."""
    assert ref.RECENT == 576  # the positions below follow from it
    k, v = random_kv(700)
    cache = KVCache(L, B, H, 700, D, torch.float32, "cpu", kv_format="int4")
    write(cache, k, v, [100])
    kv, _, _ = write(cache, k, v, [600], start=100)
    assert (kv.n_quantized, kv.first_exact) == (672, 128)  # the rings hold the exact positions [124, 700)
    # rows at positions 100..699: those before 127 read up to 128 as codes, not their own 96; the rest their own
    assert kv.row_quantized(600) == [128] * 28 + [(p + 1) // 32 * 32 for p in range(128, 700)]
    r0, r1, k_read, v_read = next(ref.quantized_row_blocks(kv, 600))
    assert (r0, r1) == (0, 28 + 31)
    want_k, want_v = expected("int4", k[:, :128], v[:, :128])
    torch.testing.assert_close(k_read[:, :, :128], want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(v_read[:, :, :128], want_v, rtol=0, atol=1e-5)


def test_without_eviction_a_full_cache_refuses_more():
    cache = KVCache(L, B, H, 8, D, torch.float32, "cpu")
    cache.make_room(8)
    cache.length = 8
    with pytest.raises(ContextOverflowError):
        cache.make_room(1)


def evicting(policy, budget=64, sinks=4, fmt="fp32", max_position=None):
    return KVCache(L, B, H, 0, D, torch.float32, "cpu", kv_format=fmt, eviction=Eviction(policy, budget, sinks),
                   max_position=max_position)


def feed(cache, k, v, n, chunk=1):
    """Feed the first n tokens of k, v through make_room + update, `chunk` at a time; mass: none added."""
    fed = 0
    while fed < n:
        m = min(chunk, n - fed)
        cache.make_room(m)
        pos = cache.position
        for layer in range(L):
            cache.update(layer, pos, k[:, fed : fed + m], v[:, fed : fed + m])
        cache.length += m
        fed += m


def test_window_eviction_keeps_the_sinks_and_the_most_recent_tokens():
    k, v = random_kv(300, outliers=False)
    cache = evicting("window", budget=64, sinks=4)
    feed(cache, k, v, 300, chunk=5)
    assert cache.seen == 300 and cache.length <= 64
    kept = [*range(4), *range(300 - (cache.length - 4), 300)]
    assert cache.positions[0, 0, 0, : cache.length].tolist() == kept  # positions: the original ones
    got_k, got_v = read(cache)
    assert torch.equal(got_k, k[:, kept].transpose(1, 2)) and torch.equal(got_v, v[:, kept].transpose(1, 2))
    assert cache.position == 300  # new tokens go on at their own positions


def test_h2o_keeps_the_sinks_the_recent_window_and_the_heaviest_hitters():
    k, v = random_kv(64, outliers=False)
    cache = evicting("h2o", budget=64, sinks=4)
    feed(cache, k, v, 64, chunk=16)
    # hand-built attention mass: per (layer, head) a different set of heavy tokens among the middle ones
    heavy = {}
    for layer in range(L):
        for h in range(H):
            picks = torch.randperm(60 - 26, generator=torch.Generator().manual_seed(layer * 10 + h))[:20] + 4
            cache.scores[layer, 0, h, :64] = torch.rand(64) * 0.5
            cache.scores[layer, 0, h, picks] = 10 + torch.rand(20)
            heavy[layer, h] = sorted(picks.tolist())
    cache.make_room(8)  # full: keep 64 - 8 - slack 8 = 48: 4 sinks, 22 recent, the 22 heaviest of the middle
    assert cache.length == 48
    for (layer, h), picks in heavy.items():
        positions = cache.positions[layer, 0, h, :48].tolist()
        assert positions[:4] == [0, 1, 2, 3] and positions[-22:] == list(range(42, 64))
        middle = positions[4:26]
        assert set(picks) <= set(middle)  # all 20 planted heavy hitters survive, and 2 of the rest
        got_k, _ = read(cache, layer)
        assert torch.equal(got_k[0, h], k[0, positions, h])
        # scores moved with their tokens
        assert (cache.scores[layer, 0, h, 4:26][[middle.index(p) for p in picks]] >= 10).all()


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_a_rollback_after_eviction_returns_to_the_tokens_before_the_block(fmt):
    k, v = random_kv(200)
    cache = evicting("window", budget=64, fmt=fmt)
    feed(cache, k, v, 120, chunk=3)
    before = [t.clone() for t in read(cache)], cache.seen, cache.length
    feed(cache, k[:, 120:], v[:, 120:], 7, chunk=7)  # a speculative block: eviction may run first
    assert cache.can_truncate(123)
    cache.truncate(123)  # 3 of 6 drafts accepted
    assert cache.seen == 123
    if cache.evicted == before[1] - before[2]:  # no eviction in between: the old slots are untouched
        got = read(cache)
        n = before[2]
        assert torch.equal(got[0][:, :, :n], before[0][0]) and torch.equal(got[1][:, :, :n], before[0][1])
    assert not cache.can_truncate(cache.horizon - 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3-yarn"])
def test_re_rotation_moves_every_kept_key_to_the_angle_of_its_slot(arch):
    """YaRN's attention factor is on the tables the forward rotates keys with, not on a re-rotation (keys would be
    scaled again at each)."""
    from tests.tiny import CONFIGS, random_model

    model = random_model(CONFIGS[arch])
    cos_table, sin_table = model._rope_tables(256, "cpu")
    base = torch.randn(B, 400, H, 16)  # keys before RoPE
    cache = KVCache(L, B, H, 0, 16, torch.float32, "cpu", eviction=Eviction("window", 64, 4), max_position=256)
    cache._rope = model.rope_at
    for i in range(0, 400, 4):  # as the model writes them: rotated to the position the cache gives
        cache.make_room(4)
        pos = cache.position
        k = ref.apply_rope(base[:, i : i + 4], cos_table[pos : pos + 4], sin_table[pos : pos + 4])
        for layer in range(L):
            cache.update(layer, pos, k, torch.randn(B, 4, H, 16))
        cache.length += 4
    assert cache.position < 256 and cache.seen == 400  # renumbered on the way past position 256
    # the invariant: every kept key is its token's key rotated to the position the cache now gives it
    positions = cache.positions[0, 0, 0, : cache.length]
    assert cache.rope_offset < 400 - 256 and positions.tolist() == sorted(positions.tolist())
    originals = [*range(4), *range(400 - (cache.length - 4), 400)]
    want = ref.apply_rope(base[:, originals], cos_table[positions], sin_table[positions]).transpose(1, 2)
    torch.testing.assert_close(read(cache)[0], want, rtol=0, atol=1e-4)


def test_eviction_options_are_checked():
    with pytest.raises(LlmrunError, match="unknown eviction policy"):
        Eviction("lru", 512)
    with pytest.raises(LlmrunError, match="too small"):
        Eviction("window", 16)
    with pytest.raises(LlmrunError, match="unknown KV cache format"):
        KVCache(L, B, H, 8, D, torch.float32, "cpu", kv_format="int3")


def test_bytes_per_token_counts_codes_and_scales():
    from tests.tiny import CONFIGS

    cfg = CONFIGS["smollm2"]  # 2 layers, 3 kv heads, head_dim 16: one group of 16 channels
    per_head = {"bf16": 2 * 16 * 2, "fp32": 2 * 16 * 4, "int8": 2 * (16 + 2),
                "int4": (8 + 4) + (8 + 4 * 16 // 32)}
    for fmt, n in per_head.items():
        assert bytes_per_token(cfg, fmt) == 2 * 3 * n
    cache = KVCache.for_model(cfg, 64, torch.float32, "cpu", kv_format="int8")
    assert cache.nbytes == 64 * bytes_per_token(cfg, "int8")
    cache.length = 10
    assert math.isclose(cache.fp16_equivalent() / cache.bytes_in_use(), 64 / 36)


# --- through the engine ---------------------------------------------------------------------------------------------

from llmrun.generate import Engine  # noqa: E402
from llmrun.sampling import SamplingParams  # noqa: E402
from llmrun.speculative import DraftLength, NgramDrafter, Speculator  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=40)
COPY = "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple,"


def reply(engine, ids, params=GREEDY, speculator=None):
    engine.reset()
    engine.speculator = speculator
    g = engine.generate(ids, params)
    "".join(g)
    engine.speculator = None
    return g


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_greedy_speculation_over_a_quantized_cache_emits_the_plain_greedy_tokens(smollm2, fmt):
    """INT8 (per token): a block's K/V are quantized as one token's would be. INT4: each row of a block reads the
    key groups that were full when one-token decoding reached it as codes, the rest exact. Either way the tokens,
    and the cache bit for bit, are plain greedy decoding's (~65 tokens: the key groups ending at 32 and 64 fill)."""
    engine = Engine(smollm2, 256, kv_format=fmt)
    ids = smollm2.tokenizer.encode(COPY)
    n_layers = engine.model.config.n_layers
    plain = reply(engine, ids)
    plain_cache = [engine.cache.contents(layer) for layer in range(n_layers)]
    for n, k in ((3, 5), (2, 8)):
        spec = reply(engine, ids, speculator=Speculator(NgramDrafter(n), DraftLength(k, adaptive=False)))
        assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0
        n_tok = min(len(engine.tokens), plain_cache[0][0].shape[2])
        for layer in range(n_layers):
            for got, want in zip(engine.cache.contents(layer), plain_cache[layer]):  # keys, values
                assert torch.equal(got[:, :, :n_tok], want[:, :, :n_tok])
        if fmt == "int4":
            continue  # a fresh prefill reads its keys otherwise (a long block: `row_quantized`)
        fresh = engine.sibling()
        fresh.prefill(engine.tokens + [0])  # the cache after all those rollbacks: as if prefilled afresh
        for layer in range(engine.model.config.n_layers):
            a, b = engine.cache.contents(layer), fresh.cache.contents(layer)
            n_tok = len(engine.tokens)
            assert torch.equal(a[0], b[0][:, :, :n_tok]) and torch.equal(a[1], b[1][:, :, :n_tok])


def test_quantized_caches_stay_close_to_the_full_precision_one(smollm2):
    """Teacher-forced next-token distributions over a real text: INT8 nearly exact, INT4 close."""
    ids = smollm2.tokenizer.encode(COPY * 6)[:300]
    logp = {}
    for fmt in (None, "int8", "int4"):
        engine = Engine(smollm2, 512, kv_format=fmt)
        logp[fmt] = torch.cat([engine.forward(ids[i : i + 100], last_only=False) for i in range(0, 300, 100)]).log_softmax(-1)
    def kl(fmt):
        return (logp[None].exp() * (logp[None] - logp[fmt])).sum(-1).mean().item()
    assert kl("int8") < 0.01 and kl("int4") < 0.1 and kl("int8") < kl("int4")
    assert (logp["int8"].argmax(-1) == logp[None].argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("policy", ["window", "h2o"])
def test_a_budget_that_is_never_reached_changes_nothing(smollm2, policy):
    ids = smollm2.tokenizer.encode(COPY)
    plain = reply(Engine(smollm2, 256), ids)
    bounded = reply(Engine(smollm2, 256, eviction=Eviction(policy, 256)), ids)
    assert bounded.token_ids == plain.token_ids


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    """A tiny random model whose context is 256 tokens."""
    from llmrun.loading import load_model
    from tests.tiny import CONFIGS, random_model, write_hf_dir

    return load_model(str(write_hf_dir(tmp_path_factory.mktemp("tiny") / "m", random_model(CONFIGS["smollm2"]))),
                      "cpu", "fp32")


@pytest.mark.parametrize("fmt, policy", [(None, "window"), (None, "h2o"), ("int8", "h2o"), ("int4", "window")])
def test_with_eviction_a_conversation_runs_past_the_model_context(tiny_loaded, fmt, policy):
    engine = Engine(tiny_loaded, kv_format=fmt, eviction=Eviction(policy, 96, 4))
    params = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)
    ids = list(range(1, 100))
    for turn in range(8):  # 8 turns of 100 prompt + 50 new tokens: 1200 tokens through a 256-token model
        g = engine.generate(engine.tokens + ids, params)
        list(g)
        assert len(g.token_ids) == 50 and (g.stats.reused_tokens > 0 or turn == 0)
        assert engine.cache.length <= 96 and engine.cache.position < 256
        assert engine.cache.seen == len(engine.tokens)
    assert len(engine.tokens) > 1000 and engine.cache.evicted > 900


def test_without_eviction_the_context_runs_out_with_a_clear_error(tiny_loaded):
    engine = Engine(tiny_loaded)
    with pytest.raises(ContextOverflowError, match="context holds 256"):
        engine.prefill(list(range(1, 100)) * 3)


def test_speculation_with_an_evicting_cache_keeps_the_cache_consistent(smollm2):
    engine = Engine(smollm2, eviction=Eviction("h2o", 64, 4), kv_format="int8")
    ids = smollm2.tokenizer.encode(COPY * 3)
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    g = reply(engine, ids, params, Speculator(NgramDrafter(3), DraftLength(6, adaptive=False)))
    assert g.stats.accepted > 0 and engine.cache.evicted > 0 and len(g.token_ids) == 60
    assert engine.cache.seen == len(engine.tokens) and engine.cache.length <= 64


# --- the command line -------------------------------------------------------------------------------------------

def test_cli_quantized_and_evicting_caches_report_their_bytes(monkeypatch, capsys):
    import json

    from tests.conftest import run_main

    args = ["generate", "--json", "--temperature", "0", "-n", "40", COPY * 3]  # ~70 prompt tokens
    docs = {}
    for extra in ([], ["--kv", "int8"], ["--kv", "int4", "--kv-evict", "h2o", "--kv-budget", "64"]):
        code, out, err = run_main([*args[:1], *extra, *args[1:]], monkeypatch, capsys)
        assert code == 0, err
        docs[" ".join(extra)] = json.loads(out)["memory"]
    assert docs[""]["kv_format"] == "fp32" and docs["--kv int8"]["kv_format"] == "int8"
    assert docs["--kv int8"]["kv_compression"] == pytest.approx(2 * 64 / (64 + 4), rel=1e-3)  # vs fp16: 1.88x
    evicting = docs["--kv int4 --kv-evict h2o --kv-budget 64"]
    assert evicting["kv_eviction"]["policy"] == "h2o" and evicting["kv_eviction"]["evicted_tokens"] > 0
    assert evicting["kv_allocated"] < docs["--kv int8"]["kv_allocated"] / 8


@pytest.mark.parametrize("args, message", [
    (["--kv-evict", "h2o"], "--kv-budget"),
    (["--kv-budget", "100"], "--kv-evict"),
    (["--kv-sinks", "2"], "'--kv-sinks': needs --kv-evict"),
    (["--kv-evict", "window", "--kv-budget", "10"], "too small"),
    (["--kv", "int3"], "int3"),
    (["--kv-evict", "window", "--kv-budget", "100000"], "more than the model's context"),
])
def test_cli_bad_kv_options_give_one_line_errors(monkeypatch, capsys, args, message):
    from tests.conftest import run_main

    code, out, err = run_main(["chat", "-p", "hi", "-n", "4", *args], monkeypatch, capsys)
    assert code != 0 and out == ""
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_the_one_call_decode_stack_records_positions_for_eviction(smollm2, fmt):
    """The packed model decodes through the C stack, which writes K/V itself: the positions eviction moves and
    re-rotation reads must still be those of the tokens."""
    engine = Engine(smollm2, kv_format=fmt, eviction=Eviction("window", 64, 4))
    ids = smollm2.tokenizer.encode(COPY * 6)  # ~120 tokens through a 64-token cache
    for token in ids:  # one token per forward: every write goes through the stack
        engine.forward([token])
    cache = engine.cache
    assert cache.evicted > 0
    want = [*range(4), *range(cache.seen - (cache.length - 4), cache.seen)]
    assert (cache.positions[:, 0, :, : cache.length] == torch.tensor(want)).all()


def test_kv_help_gives_the_bits_each_quantized_format_stores():
    """--kv's help quotes each quantized format's bits per value, scales included: what the cache stores."""
    from llmrun.cli.options import _RUNTIME

    help_text = next(option.help for name, _, _, option in _RUNTIME if name == "kv")
    cfg = SimpleNamespace(head_dim=64, n_layers=1, n_kv_heads=1)
    for fmt in ("int8", "int4"):
        bits = 8 * bytes_per_token(cfg, fmt) / (2 * cfg.head_dim)  # (8.5, 5)
        assert re.search(rf"{fmt} \([^)]*\b{re.escape(f'{bits:g}')} bits", help_text), (fmt, bits, help_text)


@pytest.mark.parametrize("max_len", [100, 608, 700])
def test_the_int4_rings_take_what_info_says(max_len):
    """`int4_ring_bytes`, which `llmrun info` reports for the model's context: the bytes the cache's rings take,
    shorter rings for a cache shorter than RING."""
    cfg = SimpleNamespace(n_layers=2, n_kv_heads=3, head_dim=32)
    cache = KVCache(cfg.n_layers, 1, cfg.n_kv_heads, max_len, cfg.head_dim, torch.float32, "cpu", kv_format="int4")
    rings = cache.store.k_recent.nbytes + cache.store.v_recent.nbytes
    assert int4_ring_bytes(cfg, 4, max_len) == rings and cache.store.ring == min(max_len, ref.RING)


def test_info_reports_the_rings_of_the_models_context(tmp_path):
    import json

    from typer.testing import CliRunner

    from llmrun.cli import app

    from .tiny import CONFIGS, random_model, write_gguf

    model = random_model(CONFIGS["llama"])
    path = write_gguf(tmp_path / "m.gguf", model)
    doc = json.loads(CliRunner().invoke(app, ["info", str(path), "--json"]).stdout)
    slots = min(model.config.max_seq_len, ref.RING)
    assert slots < ref.RING  # (a context shorter than the rings')
    assert doc["kv_int4_rings"]["slots"] == slots and doc["kv_int4_rings"]["positions"] == ref.ring_window(slots)
    assert doc["kv_int4_rings"]["fp32"] == int4_ring_bytes(model.config, 4, model.config.max_seq_len)


def test_a_head_size_16_does_not_divide_keeps_float_caches_only(tmp_path, monkeypatch, capsys):
    """head_dim 24: `info` gives its float formats' bytes and says n/a (null in --json) for int8/int4 (it failed
    with a traceback), and --kv int8/int4 is one error line before the weights load; fp32 runs."""
    import json
    from dataclasses import replace

    from llmrun.loading import load_model

    from .conftest import run_main
    from .tiny import CONFIGS, random_model, write_hf_dir

    cfg = replace(CONFIGS["llama"], head_dim=24)
    path = write_hf_dir(tmp_path / "m", random_model(cfg))
    code, out, err = run_main(["info", path, "--json"], monkeypatch, capsys)
    doc = json.loads(out)
    assert code == 0 and doc["kv_int4_rings"] is None
    assert doc["kv_bytes_per_token"] == {"fp32": cfg.kv_bytes_per_token(4), "bf16": cfg.kv_bytes_per_token(2),
                                         "fp16": cfg.kv_bytes_per_token(2), "int8": None, "int4": None}
    code, out, err = run_main(["info", path], monkeypatch, capsys)
    cells = "".join(err.replace("│", "").split())  # (the table's cells, however narrow the terminal wraps them)
    assert code == 0 and "int8n/a(headsize),int4n/a(headsize)" in cells and "kvint4ringsn/a(headsize)" in cells
    for fmt in ("int8", "int4"):
        monkeypatch.setattr("llmrun.loading.load_weights", lambda *a, **k: pytest.fail("loaded the weights"))
        code, out, err = run_main(["generate", path, "w1", "-n", "2", "--kv", fmt, "--threads", "1"], monkeypatch,
                                  capsys)
        assert code == 1 and out == "" and err.strip().splitlines() == [
            f"error: an {fmt} KV cache needs a head size divisible by 16 (a scale covers 16 or 32 channels); this "
            f"model's heads have 24: use --kv fp32, bf16 or fp16"], err
        monkeypatch.undo()
        with pytest.raises(LlmrunError, match=f"an {fmt} KV cache needs a head size divisible by 16"):
            Engine(load_model(str(path), device="cpu", dtype="fp32"), 64, kv_format=fmt)
    code, out, err = run_main(["generate", path, "w1", "-n", "2", "--kv", "fp32", "--threads", "1"], monkeypatch, capsys)
    assert code == 0, err
