"""CUDA graphs of the decode step (llmrun/cuda_graphs.py) and the device step they replay (`KVCache.device_step`:
positions, cache slots and the number of keys in use as device tensors).

The device step runs everywhere: on a CPU under the Triton interpreter, routed as on CUDA, it must give the
logits and the cache of the ordinary step. Capturing and replaying graphs needs a GPU (tests marked `gpu`).
"""

import dataclasses

import pytest
import torch

from llmrun.kernels import ref
from llmrun.kv_cache import DeviceStep, KVCache
from llmrun.loading import load_model

from .test_triton_model import DEVICE, triton_everywhere  # noqa: F401 - a fixture
from .tiny import CONFIGS, random_model, write_gguf

PIECES = [20, 1, 1, 5, 1, 13, 1]  # a prefill (eager: too long for a graph), steps, verification blocks


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32))
    return write_gguf(tmp_path_factory.mktemp("g") / "tiny-smollm2-Q4_1.gguf", model, qtype="Q4_1")


def device_forward(model, tokens, position, slot, cache):
    """One forward with its positions, slots and key count on the device, as a CUDA graph's step runs it."""
    T = tokens.shape[1]
    positions = torch.arange(position, position + T, device=tokens.device)
    slots = torch.arange(slot, slot + T, device=tokens.device)
    cache.device_step = DeviceStep(slots, positions, (slots[-1:] + 1).to(torch.int32), cache.max_len)
    try:
        return model(tokens, positions, cache)
    finally:
        cache.device_step = None
        cache.wrote(slot, T)


def assert_same_cache(a: KVCache, b: KVCache):
    """Both caches hold the same tokens, keys and values alike, bit for bit, as attention reads them, at the same
    positions, with the same H2O attention mass."""
    assert a.length == b.length and a.evicted == b.evicted
    for layer in range(a.shape[0]):
        (ka, va), (kb, vb) = a.contents(layer), b.contents(layer)
        assert torch.equal(ka, kb) and torch.equal(va, vb), layer
    for x, y in ((a.positions, b.positions), (a.scores, b.scores)):
        assert (x is None) == (y is None) and (x is None or torch.equal(x[..., : a.length], y[..., : b.length]))


@pytest.mark.parametrize("kv_format, evict", [("fp32", None), ("int8", None), ("int4", None), ("fp32", "h2o"),
                                              ("int4", "h2o")])
def test_a_device_step_is_the_ordinary_step(tiny_gguf, triton_everywhere, kv_format, evict):  # noqa: F811
    """Steps and blocks whose positions live on the device (written with index_copy, attention reading the key
    count from the device) give the ordinary steps' logits and leave the same cache, H2O's attention mass
    included. The buffers' unused slots hold NaN: nothing may read past the keys in use (INT4: nor a key group's
    scales before it fills)."""
    from llmrun.kv_cache import Eviction

    model = load_model(str(tiny_gguf), DEVICE, "fp32", "auto").model
    tokens = torch.randint(0, model.config.vocab_size, (1, sum(PIECES)), generator=torch.Generator().manual_seed(2))
    tokens = tokens.to(DEVICE)
    eviction = Eviction(evict, 64) if evict else None
    caches = [KVCache.for_model(model, 64, torch.float32, DEVICE, kv_format=kv_format, eviction=eviction)
              for _ in range(2)]
    store = caches[1].store
    if kv_format == "fp32":
        unused = store.k, store.v
    elif kv_format == "int8":
        unused = (store.scales,)
    else:
        unused = store.k_scale, store.k_min, store.v_scale, store.v_min, store.k_recent, store.v_recent
    for t in unused:
        t.fill_(float("nan"))
    outs = [[], []]
    start = 0
    with torch.no_grad():
        for i, size in enumerate(PIECES):
            piece = tokens[:, start : start + size]
            outs[0].append(model(piece, start, caches[0])[0])
            run = model if i == 0 else None  # the prefill runs eagerly in both
            outs[1].append((run(piece, start, caches[1]) if run else device_forward(model, piece, start, start,
                                                                                      caches[1]))[0])
            for cache in caches:
                cache.length += size
            start += size
    torch.testing.assert_close(torch.cat(outs[1]), torch.cat(outs[0]), rtol=1e-5, atol=1e-5)
    assert_same_cache(caches[1], caches[0])
    # a float or INT8 cache's RoPE and write: one launch
    fused = {"fp32": {"rope_write_"}, "int8": {"rope_write_int8_"}}.get(kv_format, set())
    assert triton_everywhere & {"rope_write_", "rope_write_int8_"} == fused


@pytest.mark.parametrize("window", [None, 5])
def test_attention_reads_only_the_keys_in_use(window):
    """kernels.attention with a device-side key count, on the reference path: attention over the keys [0, length)
    of the buffer. That path masks the slots past them rather than slicing (static shapes, for the compiled
    baseline), so they must hold finite values, as a cache's do (zeros, or stale keys): here large ones."""
    from llmrun import kernels

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 4, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 40, 16, generator=g)
    k[:, :, 25:], v[:, :, 25:] = 1e4, -1e4
    length = torch.tensor([25], dtype=torch.int32)
    with kernels.reference_ops():
        got = kernels.attention(q, k, v, window, length=length)
    torch.testing.assert_close(got, ref.attention(q, k[:, :, :25], v[:, :, :25], window))


def run_side_by_side(graphed, eager, ops, tol=1e-4):
    """Two engines through the same ops: ("run", n) feeds both the next n of one random token sequence and compares
    their logits (to `tol`, relative to the largest; with the default, fp32's summation order, the top tokens must
    agree too); ("back", n) rolls both back n tokens (a rejected speculation)."""
    vocab = graphed.loaded.config.vocab_size
    ids = torch.randint(0, vocab, (2048,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        for op, n in ops:
            if op == "back":
                for engine in (graphed, eager):
                    engine.rollback(len(engine.tokens) - n)
                continue
            piece = ids[len(eager.tokens) : len(eager.tokens) + n]
            got, want = graphed.forward(piece, last_only=False), eager.forward(piece, last_only=False)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
            assert tol > 1e-4 or torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, qtype, kv_format, evict", [
    ("fp32", "Q4_1", "fp32", None), ("fp32", "Q4_1", "int8", None), ("fp32", None, "fp32", "window"),
    ("bf16", "Q4_1", "bf16", None), ("bf16", None, "int8", None), ("fp32", "Q4_1", "int4", None),
    ("bf16", "Q4_1", "int4", "window"), ("fp32", "Q4_1", "fp32", "h2o"), ("bf16", None, "int4", "h2o"),
])
def test_graphs_replay_the_eager_steps(tmp_path, dtype, qtype, kv_format, evict):
    """On a GPU: an engine decoding through CUDA graphs (one per block length, captured at first use) gives the
    eager engine's logits, steps and verification blocks alike, across a rollback and (window) evictions; packed
    weights (the Triton GEMV) and float ones (cuBLAS). fp32 may differ only in summation order (and greedy tokens
    agree); bf16 by its rounding."""
    from llmrun.generate import Engine
    from llmrun.kv_cache import Eviction

    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32))
    loaded = load_model(str(write_gguf(tmp_path / "m.gguf", model, qtype=qtype)), "cuda", dtype, "auto")
    eviction = Eviction(evict, 64) if evict else None
    graphed, eager = (Engine(loaded, 128, kv_format=kv_format, eviction=eviction) for _ in range(2))
    eager.graphs = None
    assert graphed.graphs is not None
    prefill = [("run", 16)] if evict else [("run", 20)]  # an evicting cache takes at most budget / 4 per write
    run_side_by_side(graphed, eager, [*prefill, ("run", 1), ("run", 1), ("run", 5), ("run", 1), ("run", 13),
                                      ("back", 4), ("run", 3), *[("run", 1)] * (40 if evict else 1)],
                     tol=1e-4 if dtype == "fp32" else 3e-2)
    assert {T for T, _ in graphed.graphs.graphs} >= {1, 5, 13, 3}
    assert graphed.cache.evicted == eager.cache.evicted and (evict is None) == (eager.cache.evicted == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, qtype, kv_format, evict, gemv_float", [
    ("bf16", "Q4_1", "bf16", None, False), ("bf16", None, "int8", None, True), ("fp32", "Q4_1", "int4", None, False),
    ("bf16", "Q8_0", "int4", "h2o", False),
])
def test_pdl_launches_give_the_plain_launches_bits(tmp_path, monkeypatch, dtype, qtype, kv_format, evict, gemv_float):
    """On Hopper: with programmatic dependent launch (LLMRUN_PDL=1) each kernel may start while the one before it
    finishes, waiting only where it reads or writes the step's data; the logits, eager and through CUDA graphs,
    steps, blocks and a rollback, are those of plain launches bit for bit (the same kernels and configs: any
    difference is a kernel touching data before its wait)."""
    from llmrun.generate import Engine
    from llmrun.kernels import common
    from llmrun.kv_cache import Eviction

    if torch.cuda.get_device_capability()[0] < 9 or common.gdc_wait is None:
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with grid dependency control")
    if gemv_float:
        monkeypatch.setenv("LLMRUN_GEMV_FLOAT", "1")
    model = random_model(dataclasses.replace(CONFIGS["qwen2"], head_dim=32))
    loaded = load_model(str(write_gguf(tmp_path / "m.gguf", model, qtype=qtype)), "cuda", dtype, "auto")
    eviction = Eviction(evict, 64) if evict else None
    engines = [Engine(loaded, 128, kv_format=kv_format, eviction=eviction) for _ in range(2)]  # [PDL, plain]
    ids = torch.randint(0, model.config.vocab_size, (2048,), generator=torch.Generator().manual_seed(5)).tolist()
    ops = [("run", 16), ("run", 1), ("run", 1), ("run", 9), ("back", 4), ("run", 3), *[("run", 1)] * 30]
    with torch.no_grad():
        for op, n in ops:
            if op == "back":
                for engine in engines:
                    engine.rollback(len(engine.tokens) - n)
                continue
            piece = ids[len(engines[1].tokens) : len(engines[1].tokens) + n]
            out = []
            for engine, on in zip(engines, ("1", "0")):
                monkeypatch.setenv("LLMRUN_PDL", on)
                out.append(engine.forward(piece, last_only=False))
            assert torch.equal(out[0], out[1]), (op, n, len(engines[1].tokens))
    assert engines[0].graphs is not None and engines[0].graphs.failed is None


@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("T, S, window, split_len", [(1, 1, None, None), (4, 33, None, 128), (16, 300, 7, 100),
                                                     (5, 200, 50, 200), (3, 130, None, 512), (9, 64, None, None)])
def test_the_attention_kernel_reads_the_key_count_from_the_device(bits, T, S, window, split_len):
    """decode_attention / quantized_decode_attention with `length`: over a buffer of 400 slots whose slots from
    `length` on are NaN, the attention of the first `length` keys; the splits cover the capacity (some empty).
    INT4: each row reads as codes the key groups full at its position, the rest from rings of 160 slots (wrapped
    for S 300), as decoding left them: the kernel counts that from `length` (for T 9 at S 64 the rows straddle a
    group's end)."""
    from llmrun.kernels.decode_attention import decode_attention, quantized_decode_attention

    from .kv_views import quantized_cache, random_keys_values

    Hq, Hkv, D, capacity = 6, 2, 64, 400
    k, v = random_keys_values(1, Hkv, capacity, D, DEVICE)
    q = torch.randn(1, T, Hq, D, device=DEVICE)
    length = torch.tensor([S], dtype=torch.int32, device=DEVICE)
    if bits == 0:
        k[:, :, S:], v[:, :, S:] = float("nan"), float("nan")
        got = decode_attention(q, k, v, window, split_len=split_len, length=length)
        want = ref.attention(q, k[:, :, :S], v[:, :, :S], window)
    elif bits == 8:
        (kc, ks), (vc, vs) = ref.quantize_int8(k, 32), ref.quantize_int8(v, 32)
        ks[:, :, S:], vs[:, :, S:] = float("nan"), float("nan")
        got = quantized_decode_attention(q, ref.QuantizedKV(8, kc, vc, ks, vs), window, split_len=split_len,
                                         length=length)
        want = ref.quantized_attention(q, ref.QuantizedKV(8, *(x[:, :, :S] for x in (kc, vc, ks, vs))), window)
    else:
        n_quantized, first_exact = ref.int4_decoded_state(S, 160)
        want_kv = quantized_cache(4, 1, Hkv, S, D, n_quantized, torch.float32, first_exact, (k[:, :, :S], v[:, :, :S]),
                                  DEVICE, ring=160)
        want = ref.quantized_attention(q, want_kv, window)
        got = quantized_decode_attention(q, int4_over_capacity(want_kv, capacity), window, split_len=split_len,
                                         length=length)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def int4_over_capacity(kv: ref.QuantizedKV, capacity: int) -> ref.QuantizedKV:
    """An INT4 cache of S positions in buffers of `capacity` positions (and their key groups), as a device step hands
    it to attention: the slots past S hold NaN scales and garbage codes; n_quantized and first_exact are 0 (with a
    device-side length they are not read)."""
    S, Hkv = kv.length, kv.k.shape[1]

    def over(x, fill, n):  # x (1, Hkv, m, ...) in a buffer of n
        buf = torch.full((1, Hkv, n, *x.shape[3:]), fill, dtype=x.dtype, device=x.device)
        buf[:, :, : x.shape[2]] = x
        return buf

    nan, groups = float("nan"), -(-capacity // ref.KEY_GROUP)
    return dataclasses.replace(kv, k=over(kv.k, 0x77, capacity), v=over(kv.v, 0x77, capacity),
                               k_scale=over(kv.k_scale, nan, groups), k_min=over(kv.k_min, nan, groups),
                               v_scale=over(kv.v_scale, nan, capacity), v_min=over(kv.v_min, nan, capacity),
                               n_quantized=0, first_exact=0)


@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("T, S, window", [(1, 1, None), (4, 33, None), (16, 300, 7), (5, 290, 50)])
def test_attention_mass_with_the_key_count_on_the_device(bits, T, S, window):
    """H2O's mass through a CUDA graph's step: each key in use gets exactly the attention weight of the ordinary
    launch over those S keys (the same kernels: bit for bit); the slots past them keep what they held."""
    from llmrun.kernels.decode_attention import quantized_decode_attention

    from .kv_views import quantized_cache, random_keys_values

    Hq, Hkv, D, capacity = 6, 2, 64, 320
    k, v = random_keys_values(1, Hkv, capacity, D, DEVICE)
    q = torch.randn(1, T, Hq, D, device=DEVICE)
    mass = torch.rand(1, Hkv, capacity, device=DEVICE)
    want_mass = mass.clone()
    length = torch.tensor([S], dtype=torch.int32, device=DEVICE)
    if bits == 0:
        from llmrun.kernels.decode_attention import decode_attention

        want = decode_attention(q, k[:, :, :S], v[:, :, :S], window, mass=want_mass[:, :, :S])
        got = decode_attention(q, k, v, window, mass=mass, length=length)
    elif bits == 8:
        kv = quantized_cache(8, 1, Hkv, capacity, D, 0, torch.float32, kv=(k, v), device=DEVICE)
        at_s = dataclasses.replace(kv, k=kv.k[:, :, :S], v=kv.v[:, :, :S], k_scale=kv.k_scale[:, :, :S],
                                   v_scale=kv.v_scale[:, :, :S])
        want = quantized_decode_attention(q, at_s, window, mass=want_mass[:, :, :S])
        got = quantized_decode_attention(q, kv, window, mass=mass, length=length)
    else:
        n_quantized, first_exact = ref.int4_decoded_state(S, 160)
        at_s = quantized_cache(4, 1, Hkv, S, D, n_quantized, torch.float32, first_exact, (k[:, :, :S], v[:, :, :S]),
                               DEVICE, ring=160)
        want = quantized_decode_attention(q, at_s, window, mass=want_mass[:, :, :S])
        got = quantized_decode_attention(q, int4_over_capacity(at_s, capacity), window, mass=mass, length=length)
    assert torch.equal(got, want)
    assert torch.equal(mass, want_mass)


def replaying_capture(step, pool):
    """`cuda_graphs.capture` without a GPU: a "replay" runs the step again into the same output tensor."""
    out = step()
    return (lambda: out.copy_(step())), out




def test_a_capture_that_fails_leaves_the_attention_mass_to_the_eager_step(tiny_gguf, monkeypatch):
    """A capture that breaks after its warm-up ran the step (H2O: the step's attention added to the mass of the
    keys before it): the engine warns, runs that step and the rest eagerly, and its cache, mass included, is the
    eager engine's. The first length's capture works; the one-token step's breaks."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine
    from llmrun.kv_cache import Eviction

    captures = []

    def broken_capture(step, pool):
        captures.append(1)
        if len(captures) == 1:
            return replaying_capture(step, pool)
        step()
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "capture", broken_capture)
    loaded = load_model(str(tiny_gguf), "cpu", "fp32", "auto")
    graphed, eager = (Engine(loaded, 256, eviction=Eviction("h2o", 64)) for _ in range(2))
    graphed.graphs = cuda_graphs.DecodeGraphs(graphed.model, graphed.cache)
    with pytest.warns(RuntimeWarning, match="capturing the decode step as a CUDA graph failed"):
        run_side_by_side(graphed, eager, [("run", 12), *[("run", 1)] * 3])
    assert graphed.graphs.failed and not graphed.graphs.graphs and len(captures) == 2
    assert_same_cache(graphed.cache, eager.cache)


@pytest.mark.parametrize("kv_format, evict", [("fp32", None), ("int8", None), ("fp32", "window"), ("int4", None),
                                              ("int4", "window"), ("fp32", "h2o"), ("int8", "h2o")])
def test_the_graph_runner_replays_steps_at_any_position(tiny_gguf, monkeypatch, kv_format, evict):
    """An engine whose short forwards go through `DecodeGraphs` (captured once per length, then replayed with
    the step's tokens, positions and slots staged into the graph's inputs) gives the eager engine's logits,
    through steps, verification blocks, a rollback and (window) evictions. Without a GPU the graph is stood in
    for by re-running the recorded step: this tests the runner, not CUDA."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine
    from llmrun.kv_cache import Eviction

    monkeypatch.setattr(cuda_graphs, "capture", replaying_capture)
    loaded = load_model(str(tiny_gguf), "cpu", "fp32", "auto")
    eviction = Eviction(evict, 64) if evict else None
    graphed, eager = (Engine(loaded, 256, kv_format=kv_format, eviction=eviction) for _ in range(2))
    graphed.graphs = cuda_graphs.DecodeGraphs(graphed.model, graphed.cache)
    runs = []
    monkeypatch.setattr(graphed.graphs, "_step",
                        lambda inputs, T, span, f=graphed.graphs._step: runs.append(T) or f(inputs, T, span))
    run_side_by_side(graphed, eager, [("run", 12), ("run", 1), ("run", 1), ("run", 5), ("run", 1), ("run", 13),
                                      ("back", 4), ("run", 3), *[("run", 1)] * 40, ("run", 16), ("run", 16)])
    assert set(graphed.graphs.graphs) == {(T, graphed.cache.max_len) for T in (1, 3, 5, 12, 13, 16)}  # small: all of it
    assert (evict is None) == (eager.cache.evicted == 0)
    assert_same_cache(graphed.cache, eager.cache)
    assert runs.count(1) == 1 + 43  # captured once, then each of the 43 one-token forwards a replay


def test_graphed_int4_steps_fill_key_groups_past_the_rings(tmp_path, monkeypatch):
    """INT4 through the graph runner (key groups quantized on the device from the rings) beyond the rings' 608
    slots, which wrap: the eager engine's logits and cache, through verification blocks that fill a group mid-block,
    rollbacks into a quantized group (the rings re-filled from its codes), and a prompt chunk (eager) between."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine

    monkeypatch.setattr(cuda_graphs, "capture", replaying_capture)
    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32, max_seq_len=1024))
    loaded = load_model(str(write_gguf(tmp_path / "long.gguf", model, qtype="Q4_1")), "cpu", "fp32", "auto")
    graphed, eager = (Engine(loaded, 1024, kv_format="int4") for _ in range(2))
    assert graphed.cache.store.ring == ref.RING < 1024
    graphed.graphs = cuda_graphs.DecodeGraphs(graphed.model, graphed.cache)
    run_side_by_side(graphed, eager, [("run", 500), ("run", 100), *[("run", 1)] * 5, ("run", 13), ("back", 9),
                                      ("run", 16), ("run", 7), ("back", 40), *[("run", 1)] * 3, ("run", 30),
                                      *[("run", 15)] * 4, ("back", 1), ("run", 2)])
    assert_same_cache(graphed.cache, eager.cache)
    assert graphed.cache.length > ref.RECENT + 64 and set(graphed.graphs.graphs) >= {(1, 1024), (13, 1024)}


def test_a_graph_spans_the_power_of_two_of_slots_in_use(tmp_path, monkeypatch):
    """Crossing 1024 keys in use, steps move from the graph spanning 1024 slots to the one spanning 2048 (attention's
    splits sized to the context, not to the 4096-slot cache), with the eager engine's logits throughout."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine

    monkeypatch.setattr(cuda_graphs, "capture", replaying_capture)
    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32, max_seq_len=4096))
    loaded = load_model(str(write_gguf(tmp_path / "long.gguf", model, qtype="Q4_1")), "cpu", "fp32", "auto")
    graphed, eager = (Engine(loaded, 4096) for _ in range(2))
    graphed.graphs = cuda_graphs.DecodeGraphs(graphed.model, graphed.cache)
    run_side_by_side(graphed, eager, [("run", 1020), *[("run", 1)] * 6, ("run", 4)])
    assert set(graphed.graphs.graphs) == {(1, 1024), (1, 2048), (4, 2048)}


def test_a_graphed_int4_step_cut_short_by_ctrl_c_is_run_again(tiny_gguf, monkeypatch):
    """Ctrl-C after a replay wrote the cache but before the engine counted the tokens (the host's int4 state
    advanced, the cache's length not): the next forwards, from that position, give the eager engine's logits and
    cache."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine

    monkeypatch.setattr(cuda_graphs, "capture", replaying_capture)
    loaded = load_model(str(tiny_gguf), "cpu", "fp32", "auto")
    graphed, eager = (Engine(loaded, 256, kv_format="int4") for _ in range(2))
    graphed.graphs = cuda_graphs.DecodeGraphs(graphed.model, graphed.cache)
    run_side_by_side(graphed, eager, [("run", 30), ("run", 1)])
    wrote = graphed.cache.wrote

    def interrupted(slot, n):
        wrote(slot, n)
        raise KeyboardInterrupt

    monkeypatch.setattr(graphed.cache, "wrote", interrupted)
    with pytest.raises(KeyboardInterrupt):
        graphed.forward([5, 6, 7])
    assert graphed.cache.length == 31 and graphed.cache.store.state[0, 2] == 34
    monkeypatch.setattr(graphed.cache, "wrote", wrote)
    run_side_by_side(graphed, eager, [("run", 3), ("run", 1), ("run", 2)])
    assert_same_cache(graphed.cache, eager.cache)


def pipelined_replies(loaded, prompt, params, graphs, kv_format="fp32"):
    """The same reply from two engines alike but for `pipeline` (each step enqueued before its token is read,
    the token copied into the graph's inputs on the device): -> both engines, both replies."""
    from llmrun.generate import Engine

    engines = [Engine(loaded, 256, kv_format=kv_format) for _ in range(2)]
    replies = []
    for engine, pipeline in zip(engines, (False, True)):
        engine.pipeline = pipeline
        if graphs:
            engine.graphs = graphs(engine)
        reply = engine.generate(prompt, params)
        "".join(reply)
        replies.append(reply)
    return engines, replies


@pytest.mark.parametrize("kv_format", ["fp32", "int8", "int4"])
def test_the_graph_runner_takes_a_token_drawn_on_the_device(tiny_gguf, monkeypatch, kv_format):
    """Pipelined decoding through `DecodeGraphs`: a step's token is copied into the graph's inputs from where the
    draw left it on the device (the host does not read it first), greedy and sampled: the tokens, and the cache, of
    the same runner fed from the host."""
    from llmrun import cuda_graphs
    from llmrun.sampling import SamplingParams

    monkeypatch.setattr(cuda_graphs, "capture", replaying_capture)
    loaded = load_model(str(tiny_gguf), "cpu", "fp32", "auto")
    prompt = torch.randint(0, loaded.config.vocab_size, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    for params in (SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3)):
        runs = []
        engines, replies = pipelined_replies(loaded, prompt, params, kv_format=kv_format, graphs=lambda e: (
            runs.append(cuda_graphs.DecodeGraphs(e.model, e.cache)) or runs[-1]))
        assert replies[0].token_ids == replies[1].token_ids and len(replies[0].token_ids) == 40
        assert len(set(replies[0].token_ids)) > 5  # a reply, not one token over and over
        assert_same_cache(engines[0].cache, engines[1].cache)
        assert all(set(g.graphs) == {(1, 256)} for g in runs)  # every step through the graph of one token


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, qtype, kv_format", [("fp32", "Q4_1", "fp32"), ("bf16", "Q4_1", "bf16"),
                                                    ("bf16", None, "int8"), ("fp32", "Q4_1", "int4")])
def test_pipelined_graph_steps_give_the_steps_fed_from_the_host(tmp_path, dtype, qtype, kv_format):
    """On a GPU: steps enqueued before their token reaches the host, each replaying its CUDA graph with the token
    copied in on the device, give the very tokens (greedy and sampled) and cache of steps fed from the host."""
    from llmrun.sampling import SamplingParams

    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32))
    loaded = load_model(str(write_gguf(tmp_path / "m.gguf", model, qtype=qtype)), "cuda", dtype, "auto")
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    for params in (SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_new_tokens=60, ignore_eos=True, seed=3)):
        engines, replies = pipelined_replies(loaded, prompt, params, graphs=None, kv_format=kv_format)
        assert all(e.graphs is not None and e.graphs.graphs for e in engines)
        assert replies[0].token_ids == replies[1].token_ids and len(replies[0].token_ids) == 60
        assert_same_cache(engines[0].cache, engines[1].cache)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_model_draft_fed_on_the_device_through_graphs(tmp_path, dtype):
    """On a GPU: a model draft whose tokens feed its next graph replay from the device (read once, k at a time)
    proposes what a draft fed from the host proposes, so speculative replies, greedy and sampled, are the same."""
    from llmrun.sampling import SamplingParams

    from .test_speculative import drafting_engine

    cfg = dataclasses.replace(CONFIGS["smollm2"], head_dim=32)
    target, draft = (load_model(str(write_gguf(tmp_path / f"{name}.gguf", random_model(c, seed=seed), qtype="Q4_1")),
                                "cuda", dtype, "auto")
                     for name, c, seed in (("t", cfg, 0), ("d", dataclasses.replace(cfg, n_layers=1), 7)))
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    for params in (SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3)):
        runs = []
        for pipeline in (False, True):
            engine, drafter = drafting_engine(target, draft, 256, pipeline)
            reply = engine.generate(prompt, params)
            list(reply)
            runs.append((reply.token_ids, reply.stats.drafted, reply.stats.accepted, drafter.engine.tokens))
            assert drafter.engine.graphs is not None and drafter.engine.graphs.graphs
        assert runs[0] == runs[1] and runs[0][1] > 0


# --- sampled draws as CUDA graphs (`DrawGraphs`) --------------------------------------------------------------------


@pytest.mark.parametrize("real", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_a_captured_draw_is_the_eager_draw(monkeypatch, real):
    """`DrawGraphs` (a replaying capture without a GPU): for each filter setting, one graph, captured at its first
    draw and replayed after, gives the eager draw's token, tie flag and finiteness flag at the same uniform, over
    random logits, logits tied past top-k's candidates (read through the whole vocabulary's draw, as eagerly) and
    logits that are not finite; a new setting captures a graph of its own."""
    from llmrun import cuda_graphs
    from llmrun.sampling import Ahead, SamplingParams

    captured, capture = [], cuda_graphs.capture if real else replaying_capture
    monkeypatch.setattr(cuda_graphs, "capture", lambda step, pool: captured.append(1) or capture(step, pool))
    draws = cuda_graphs.DrawGraphs(torch.device(DEVICE))
    g = torch.Generator().manual_seed(0)
    settings = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=5, top_p=0.5, min_p=0.0),
                SamplingParams(temperature=0.7, top_k=0, top_p=0.9), SamplingParams(temperature=0.8, top_k=3)]
    for params in settings:
        for i in range(40):
            logits = torch.randn(300, generator=g) * 3
            if i % 5 == 1:  # ties past top-k's 2k candidates: the exact flag is down
                logits = torch.where(logits > -1, logits.round(), logits)
            if i == 7:
                logits[11] = float("nan")
            logits = logits.to(DEVICE)
            generator = torch.Generator().manual_seed(i)
            eager, graphed = Ahead(logits, params, generator), Ahead(logits, params, generator.manual_seed(i),
                                                                     draws=draws)
            assert eager._values.wait() == graphed._values.wait() and eager.u == graphed.u, (params, i)
            try:
                assert eager.read() == graphed.read(), (params, i)
            except Exception as e:  # noqa: BLE001 - a draw from logits that are not finite raises alike
                with pytest.raises(type(e)):
                    graphed.read()
    assert len(draws.graphs) == len(captured) == len(settings) and not draws.failed
    few = cuda_graphs.DrawGraphs(torch.device(DEVICE))  # at most MAX_GRAPHS kept: the least recently used let go
    few.MAX_GRAPHS = 2
    before = cuda_graphs.captures()
    for params in [settings[0], settings[1], settings[0], settings[2], settings[0], settings[1]]:
        assert torch.equal(few.draw(logits, params, 0.5), draws.draw(logits, params, 0.5))
    # s0, s1 captured; s0 a replay; s2 lets s1 go; s0 a replay; s1 captured again, letting s2 go
    assert len(captured) == len(settings) + 4 and cuda_graphs.captures() - before == 4
    assert [key[2:] for key in few.graphs] == [(p.temperature, p.top_k, p.top_p, p.min_p) for p in settings[:2]]


@pytest.mark.parametrize("real", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_a_captured_block_of_draws_is_the_eager_block(monkeypatch, real):
    """Sampled verification's draws, a row of a block each (`DrawGraphs.run` of `drawn_rows`, R uniforms): each
    row's token, tie flag and finiteness flag those of the eager draws (`sampling.drawn`) at the same uniforms, over
    random rows, rows tied past top-k's candidates and a row that is not finite; one graph a block length and
    setting, none past MAX_TOKENS rows."""
    from llmrun import cuda_graphs
    from llmrun.sampling import SamplingParams, drawn, drawn_rows, to_device

    captured, capture = [], cuda_graphs.capture if real else replaying_capture
    monkeypatch.setattr(cuda_graphs, "capture", lambda step, pool: captured.append(1) or capture(step, pool))
    draws = cuda_graphs.DrawGraphs(torch.device(DEVICE))
    g = torch.Generator().manual_seed(1)
    settings = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=5, top_p=0.5, min_p=0.0),
                SamplingParams(temperature=0.7, top_k=0, top_p=0.9)]
    flags = set()
    for params in settings:
        for rows in (2, 5, 9):
            for i in range(6):
                logits = torch.randn(rows, 300, generator=g) * 3
                if i == 1:  # ties past top-k's 2k candidates: the exact flag is down
                    logits = torch.where(logits > -1, logits.round(), logits)
                if i == 2:
                    logits[rows - 1, 7] = float("nan")
                logits, us = logits.to(DEVICE), torch.rand(rows, generator=g, dtype=torch.float64).tolist()
                u = to_device([[u] for u in us], torch.float64, logits.device)
                eager, graphed = drawn(logits, params, u)[1], draws.run(drawn_rows, (logits, u.clone()), params)
                assert graphed.shape == (3, rows) and torch.equal(graphed, eager), (params, rows, i)
                flags |= {(bool(e), bool(f)) for e, f in eager[1:].T.tolist()}
    assert len(draws.graphs) == len(captured) == 3 * len(settings) and not draws.failed
    assert {(False, True), (True, False), (True, True)} <= flags  # the flags' cases all met
    rows = cuda_graphs.MAX_TOKENS + 1  # a block whose forward has no graph of its own: its draws are eager too
    u = torch.full((rows, 1), 0.5, dtype=torch.float64, device=DEVICE)
    assert draws.run(drawn_rows, (torch.randn(rows, 300, device=DEVICE), u), settings[0]) is None
    assert len(captured) == 3 * len(settings)


def test_sampled_lookup_speculation_through_draw_graphs_is_plain_sampling(smollm2, monkeypatch):
    """Sampled speculation whose verification draws go through `DrawGraphs` (a replaying capture) gives the plain
    sampled reply, seed for seed, as its eager draws do: a lookup's blocks verified by one graph a block length."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine
    from llmrun.sampling import SamplingParams
    from llmrun.speculative import DraftLength, NgramDrafter, Speculator

    monkeypatch.setattr(cuda_graphs, "capture", replaying_capture)
    ids = smollm2.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(")
    engine = Engine(smollm2, 128)
    drafted = 0
    for seed in (1, 2):
        params = SamplingParams(temperature=0.7, seed=seed, max_new_tokens=24)
        replies = []
        for speculator, draws in [(None, None), (Speculator(NgramDrafter(3), DraftLength(4, adaptive=False)),
                                                 cuda_graphs.DrawGraphs(engine.device))]:
            engine.reset()
            engine.speculator, engine.draws = speculator, draws
            reply = engine.generate(ids, params)
            replies.append(("".join(reply), reply.token_ids))
            drafted += reply.stats.drafted
        assert replies[0] == replies[1], seed
        assert any(key[0] == "drawn_rows" for key in draws.graphs) and not draws.failed  # blocks drawn by graphs
    engine.speculator = engine.draws = None
    assert drafted > 0


@pytest.mark.parametrize("real", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_a_captured_verification_decides_as_the_eager_rule(monkeypatch, real):
    """A model draft's sampled verification (`speculative.decided`: acceptances, the tokens on a rejection, the
    bonus token, the flags) replayed from its graph (`DrawGraphs.run`) decides as the eager rule, over drafts drawn
    from q and drafts q gives little weight, rows tied past top-k's candidates and a row that is not finite; one
    graph a block length and setting."""
    from llmrun import cuda_graphs
    from llmrun.sampling import SamplingParams, token_probs
    from llmrun.speculative import decided

    captured, capture = [], cuda_graphs.capture if real else replaying_capture
    monkeypatch.setattr(cuda_graphs, "capture", lambda step, pool: captured.append(1) or capture(step, pool))
    draws = cuda_graphs.DrawGraphs(torch.device(DEVICE))
    g = torch.Generator().manual_seed(2)
    settings = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=0, top_p=0.9, min_p=0.0)]
    accepted = set()
    for params in settings:
        for k in (1, 4, 8):
            for i in range(5):
                logits = torch.randn(k + 1, 300, generator=g) * 3
                q = torch.stack([token_probs(torch.randn(300, generator=g) * 3 + logits[j], params) for j in range(k)])
                if i == 1:
                    logits = torch.where(logits > -1, logits.round(), logits)
                if i == 2:
                    logits[0, 5] = float("nan")
                x = torch.multinomial(q, 1, generator=g) if i != 3 else torch.randint(0, 300, (k, 1), generator=g)
                u = torch.rand(k + 1, 2, generator=g, dtype=torch.float64)
                inputs = tuple(t.to(DEVICE) for t in (logits, q, x, u))
                eager, graphed = decided(*inputs, params), draws.run(decided, inputs, params)
                assert torch.equal(graphed, eager), (params, k, i)
                accepted |= set(eager[:k].tolist())
    assert len(draws.graphs) == len(captured) == 3 * len(settings) and not draws.failed
    assert accepted == {0, 1}  # drafts taken and drafts refused


def test_model_draft_sampling_through_draw_graphs_is_the_eager_one(tiny_pair, monkeypatch):
    """A model draft's sampled speculation whose verification replays `DrawGraphs` (a replaying capture) gives the
    reply of the one verifying eagerly, seed for seed."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine
    from llmrun.sampling import SamplingParams
    from llmrun.speculative import DraftLength, ModelDrafter, Speculator

    monkeypatch.setattr(cuda_graphs, "capture", replaying_capture)
    target, draft = tiny_pair
    engine = Engine(target, 96)
    engine.speculator = Speculator(ModelDrafter(engine.sibling(draft), "tiny"), DraftLength(4, adaptive=False))
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=30, ignore_eos=True,
                                seed=seed)
        replies = []
        for draws in (None, cuda_graphs.DrawGraphs(engine.device)):
            engine.reset()
            engine.draws = draws
            reply = engine.generate([5, 17, 42, 9], params)
            list(reply)
            replies.append((reply.token_ids, reply.stats.drafted, reply.stats.accepted))
        assert replies[0] == replies[1], seed
        assert any(key[0] == "decided" for key in draws.graphs) and 0 < replies[0][2] < replies[0][1]
    engine.speculator = engine.draws = None


def test_pipelined_sampling_through_draw_graphs_is_plain_sampling(smollm2, monkeypatch):
    """A pipelined engine (forced here on the CPU) whose draws go through `DrawGraphs` (a replaying capture) gives
    the reply and the cache of the one drawing eagerly, seed for seed, with and without a repetition penalty (its
    penalized logits drawn by the graph too); one graph a setting. A capture that fails is said once and the
    draws run eagerly from then on, the reply the same."""
    from llmrun import cuda_graphs
    from llmrun.generate import Engine
    from llmrun.sampling import SamplingParams

    ids = smollm2.tokenizer.encode("The three primary colours are")
    engine = Engine(smollm2, 128)
    engine.pipeline = True
    replies = {}
    for captures in (None, replaying_capture, "broken"):
        if captures == "broken":
            def broken(step, pool):
                step()
                raise RuntimeError("operation not permitted when stream is capturing")
            monkeypatch.setattr(cuda_graphs, "capture", broken)
        elif captures is not None:
            monkeypatch.setattr(cuda_graphs, "capture", captures)
        engine.draws = None if captures is None else cuda_graphs.DrawGraphs(engine.device)
        for seed, penalty in [(1, 1.0), (2, 1.0), (3, 1.3)]:
            params = SamplingParams(temperature=0.9, seed=seed, max_new_tokens=24, repetition_penalty=penalty)
            engine.reset()
            if captures == "broken" and seed == 1:
                with pytest.warns(RuntimeWarning, match="capturing the sampled draw"):
                    reply = engine.generate(ids, params)
                    "".join(reply)
            else:
                reply = engine.generate(ids, params)
                "".join(reply)
            replies.setdefault(seed, []).append((reply.token_ids, list(engine.tokens), engine.cache.length))
        if captures is replaying_capture:
            assert len(engine.draws.graphs) == 1 and not engine.draws.failed
    assert engine.draws.failed and not engine.draws.graphs
    for seed, runs in replies.items():
        assert runs[0] == runs[1] == runs[2], seed
