"""Decode / verify attention over the KV cache (kernels/decode_attention.py) against kernels/ref.py in fp32.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so long caches come with few heads; bf16 runs only on a GPU. Tolerance: within
2 x torch's own error in the same dtype (against fp32) + atol.
"""

import dataclasses
import functools

import pytest
import torch

from llmrun import kernels
from llmrun.kernels import common, ref
from llmrun.kernels import decode_attention as module
from llmrun.kernels.decode_attention import decode_attention, quantized_decode_attention

from . import kv_views

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
ATOL = {torch.float32: 1e-5, torch.float16: 3e-4, torch.bfloat16: 1e-2}
# fp32 kernel against the fp32 reference (rather than against fp64 with the reference's own error as the margin):
# each rounds its own way, and at these shapes (outputs up to ~3) the reference alone is ~4e-6 from fp64; an H200
# measured 1.7e-5 between the two (test_mass_over_a_quantized_cache[None-8], 2026-11-26), the interpreter ~2e-6
FP32_VS_REFERENCE = 3e-5
in_buffer = kv_views.in_buffer
random_keys_values = functools.partial(kv_views.random_keys_values, device=DEVICE)
quantized_cache = functools.partial(kv_views.quantized_cache, device=DEVICE)
mass_buffer = functools.partial(kv_views.mass_buffer, device=DEVICE)


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
    assert not common.counters(q.device).any()  # the last split of each row block set its counter back
    limit = 2 * (same.float() - want).abs().max().item() + ATOL[dtype]
    assert (got.float() - want).abs().max().item() <= limit


# (B, T, Hq, Hkv, S, D, window): GQA groups 1, 3, 4, 7; every head_dim; T 1, 4, 16; lengths 1, 17, 1000, 4097
SHAPES = [
    (1, 1, 4, 4, 1, 64, None),
    (2, 1, 6, 2, 17, 80, None),
    (1, 4, 8, 2, 17, 96, 5),
    (1, 16, 7, 1, 17, 128, None),  # 112 rows: 7 row blocks
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


@pytest.mark.parametrize("split_len", [1024, None, 100, 32])  # 1, 3, 6 and 19 splits
def test_split_length_does_not_change_the_result(split_len):
    check(1, 4, 4, 1, 600, 64, None, torch.float32, split_len=split_len)


def test_split_that_some_rows_cannot_see():
    """Splits of 8 keys, window 40, T 16: keys [45, 100) in splits 5 to 12 (keys 40-103); [40, 53) is all out of
    query 15's window, [93, 100) all in the future of queries 0-8. Those partials must weigh nothing in the
    combine, and the keys of split 5 before 45 never be read."""
    for dtype in (torch.float32, torch.float16):
        check(1, 16, 4, 2, 100, 64, 40, dtype, split_len=8)


def first_keys(kv, n):
    """The cache `kv` (a (k, v) pair or a QuantizedKV) as it stood with its first n positions written."""
    if isinstance(kv, tuple):
        return tuple(x[:, :, :n] for x in kv)
    cut = {name: getattr(kv, name)[:, :, :n] for name in ("k", "v", "v_scale", "v_min") if getattr(kv, name) is not None}
    if kv.bits == 8:
        cut["k_scale"] = kv.k_scale[:, :, :n]
    return dataclasses.replace(kv, **cut)


# (kv format, dtype, T, Hq, Hkv, S, window, split_len): blocks whose rows' keys cross split boundaries (a row that
# has one split while its block has two; with a window, splits that only the block's early rows see), 1 to 3 row
# blocks (G 3, 4, 7; up to 45 rows)
INVARIANT_BLOCKS = [
    ("fp32", torch.float32, 9, 6, 2, 100, None, 32),
    ("fp32", torch.float32, 9, 6, 2, 260, None, None),
    ("fp32", torch.float32, 5, 7, 1, 130, 40, 16),
    ("fp32", torch.float32, 9, 6, 2, 100, 21, 4),  # rows' windows start in 3 different splits: the combine's runs
    # of splits are numbered from the first key, not from a launch's first split
    ("fp16", torch.float16, 9, 12, 3, 100, 20, 32),
    ("int8", torch.float32, 9, 6, 2, 100, None, 32),
    ("int8", torch.float16, 15, 3, 1, 260, 100, None),
    ("int4", torch.float32, 9, 6, 2, 100, None, 32),
    ("int4", torch.float32, 5, 8, 2, 96, 30, 32),
]


@pytest.mark.parametrize("fmt, dtype, T, Hq, Hkv, S, window, split_len", INVARIANT_BLOCKS)
def test_a_rows_bits_do_not_depend_on_its_block(fmt, dtype, T, Hq, Hkv, S, window, split_len, row_by_row_dot):
    """Each row of a block of T queries (a speculative verification) gives bit for bit what the same query gives
    alone, over the cache as it stood when its token came (a one-token decode step): what greedy speculative decoding
    needs to emit exactly plain greedy's tokens. Under the interpreter here (`row_by_row_dot`), on a GPU when one
    runs the suite."""
    B, D = 1, 64
    if fmt in ("fp32", "fp16"):
        kv = cache_views(B, Hkv, S, D, dtype)
    else:
        n_quantized, first_exact = ref.int4_decoded_state(S) if fmt == "int4" else (0, None)
        kv = quantized_cache(int(fmt[3]), B, Hkv, S, D, n_quantized, dtype, first_exact)

    def attend(q, kv):
        if isinstance(kv, tuple):
            return decode_attention(q, *kv, window, split_len=split_len)
        return quantized_decode_attention(q, kv, window, split_len=split_len)

    q = torch.randn(B, T, Hq, D, device=DEVICE).to(dtype)
    block = attend(q, kv)
    for t in range(T):
        assert torch.equal(block[:, t], attend(q[:, t : t + 1], first_keys(kv, S - T + t + 1))[:, 0]), t


@pytest.mark.autotune
def test_autotuner_drops_configs_that_cannot_fit(monkeypatch):
    """fp32 at head_dim 256, one row block, on an H100 (227 KB of shared memory a block): Triton's autotuner, through
    the split kernel's pruning, keeps the 6 configs whose tiles fit (BLOCK_N 32, or 64 with 2 stages); on a GPU too
    small for any, the smallest. tests/test_triton_compile.py holds the estimate against the compiler."""
    tuner, _ = module._split_launcher(True)
    q, kv = torch.empty(1, 1, 8, 256), torch.empty(1, 1, 64, 256)
    monkeypatch.setattr(tuner, "nargs", {"Q": q, "K": kv, "V": kv, "KScale": kv, "KMin": kv, "KRecent": kv, "VRecent": kv},
                        raising=False)  # the positional args by name, as Autotuner.run sets them
    meta = {"BITS": 0, "GROUP": 32, "SCORES": False, "BLOCK_M": 16, "BLOCK_D": 256}
    monkeypatch.setattr(module, "_device_limits", lambda index: (9, 227 * 1024))
    kept = tuner.prune_configs(meta)
    assert len(kept) == 6 and {(c.kwargs["BLOCK_N"], c.num_stages) for c in kept} == {(32, 2), (32, 3), (64, 2)}
    monkeypatch.setattr(module, "_device_limits", lambda index: (8, 48 * 1024))
    assert tuner.prune_configs(meta) == [module.SPLIT_CONFIGS[0]]


@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_launch_of_a_cache_has_one_autotuner_key(bits, dtype, monkeypatch):
    """Triton's autotuner keys on the named arguments and on every tensor argument's dtype, and picks a config by
    timing. A cache's launches must all share one key, or a direct launch and a split one, an eager step and a
    CUDA graph's (the key count on the device), with and without H2O's mass, could each tune a BLOCK_N of their
    own, and a row's sums would change order between them (an H200 saw a graph's step and the eager step leave
    different caches, 2026-11-26). Recorded on the interpreter's launches: the key's arguments and the dtypes."""
    keys = set()
    key_args = ["BLOCK_D", "BITS", "GROUP", "HAS_WINDOW", "PRECISION"]

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                dtypes = tuple(str(a.dtype) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                keys.add((dtypes, *(kwargs[k] for k in key_args)))
                return module._split_kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_split_launcher", lambda cuda: (Spy(), {"BLOCK_N": 64, "num_warps": 4}))
    B, Hq, Hkv, D, capacity = 1, 4, 2, 64, 608
    k, v = cache_views(B, Hkv, capacity, D, dtype)

    def attend(T, S, **kwargs):
        q = torch.randn(B, T, Hq, D, device=DEVICE).to(dtype)
        if bits == 0:
            return decode_attention(q, k[:, :, :S], v[:, :, :S], **kwargs)
        kv = quantized_cache(bits, B, Hkv, S, D, S // ref.KEY_GROUP * ref.KEY_GROUP, dtype)
        return quantized_decode_attention(q, kv, **kwargs)

    length = torch.tensor([300], dtype=torch.int32, device=DEVICE)
    attend(1, 40)  # one split: the direct launch
    attend(4, 300)  # two splits and the combine
    attend(1, capacity, length=length)  # a graph's step: the capacity, the key count on the device
    attend(4, 300, mass=mass_buffer(B, Hkv, 300))  # H2O
    assert len(keys) == 1, keys


# --- a quantized cache (ref.QuantizedKV), and the attention mass ------------------------------------------------------


def check_quantized(bits, B, T, Hq, Hkv, S, D, window, n_quantized, dtype, first_exact=None, mass=False,
                    ring=ref.RECENT, **kwargs):
    kv = quantized_cache(bits, B, Hkv, S, D, n_quantized, dtype, first_exact, ring=ring)
    q = torch.randn(B, T, Hq + 2 * Hkv, D, device=DEVICE).to(dtype)[:, :, :Hq]
    # against fp64: fp32's own rounding (a softmax over up to 1000 keys with x20 outliers) is not nothing either
    blocks = list(ref.quantized_row_blocks(kv, T))
    want = torch.cat([ref.attention(q[:, r0:r1].double(), k.double(), v.double(), window) for r0, r1, k, v in blocks],
                     dim=1)
    same = torch.cat([ref.attention(q[:, r0:r1], k.to(dtype), v.to(dtype), window) for r0, r1, k, v in blocks], dim=1)
    acc = mass_buffer(B, Hkv, S) if mass else None
    before = None if acc is None else acc.clone()
    got = quantized_decode_attention(q, kv, window, mass=acc, **kwargs)
    assert got.shape == (B, T, Hq, D) and got.dtype == dtype
    limit = 2 * (same.double() - want).abs().max().item() + ATOL[dtype]
    assert (got.double() - want).abs().max().item() <= limit
    if mass:
        want_mass = before + ref.quantized_attention_mass(q.float(), kv, window)
        assert (acc - want_mass).abs().max().item() <= 1e-5 * T * Hq


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
@pytest.mark.parametrize("split_len", [1024, 200])  # 1 and 3 splits
def test_quantized_cache_split_length(bits, split_len):
    check_quantized(bits, 1, 4, 3, 1, 600, 64, None, 576, torch.float32, split_len=split_len)


def check_mass(got, before, q, k, window):
    want = before + ref.attention_mass(q, k, window)
    assert (got - want).abs().max().item() <= 1e-5 * q.shape[1] * q.shape[2]


# --- INT4: each query row of a block reads the keys one-token decoding read there --------------------------------


def rows_one_by_one(q, k, v, window, n_quantized, first_exact):
    """Brute force: every query row alone, over keys and values [0, its nq) dequantized from their codes (keys
    quantized over the whole groups of [0, n_quantized)) and exact ones after; nq = the positions of the groups full
    when its token came, clamped to [first_exact, n_quantized]. -> output (B, T, Hq, D) and attention mass
    (B, Hkv, S), fp32."""
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    codes = ref.dequantize_int4_channels(*ref.quantize_int4_channels(k[:, :, :n_quantized]))
    values = ref.dequantize_int4_tokens(*ref.quantize_int4_tokens(v, ref.kv_group(D)))
    out, mass = torch.zeros(B, T, Hq, D, device=q.device), torch.zeros(B, Hkv, S, device=q.device)
    for r in range(T):
        p = S - T + r
        nq = min(max((p + 1) // ref.KEY_GROUP * ref.KEY_GROUP, first_exact), n_quantized)
        keys = torch.cat((codes[:, :, :nq], k[:, :, nq:]), dim=2)
        vals = torch.cat((values[:, :, :nq], v[:, :, nq:]), dim=2)
        first = 0 if window is None else max(0, p + 1 - window)
        for h in range(Hq):
            scores = torch.einsum("bd,bsd->bs", q[:, r, h], keys[:, h // (Hq // Hkv), first : p + 1]) / D**0.5
            w = scores.softmax(-1)  # (B, keys first..p)
            out[:, r, h] = torch.einsum("bs,bsd->bd", w, vals[:, h // (Hq // Hkv), first : p + 1])
            mass[:, h // (Hq // Hkv), first : p + 1] += w
    return out, mass


# (T, S, window, ring): blocks of 1, 4, 17, 33 queries whose rows' groups switch 0, 1 or 2 times (33 rows from
# position 63: the groups ending at 64 and at 96 fill inside the block), 64 rows in rings of 64 slots whose early
# rows are clamped to first_exact (the rings no longer hold their exact keys), and 100 rows that the rings serve.
ROW_BLOCKS = [(1, 97, None, ref.RECENT), (4, 100, None, ref.RECENT), (4, 98, 20, ref.RECENT),
              (17, 130, None, ref.RECENT), (17, 1000, 300, ref.RECENT), (33, 96, None, ref.RECENT),
              (33, 600, 100, ref.RECENT), (64, 200, None, 64), (100, 700, None, ref.RECENT)]


@pytest.mark.parametrize("T, S, window, ring", ROW_BLOCKS)
def test_int4_reference_reads_each_rows_own_keys(T, S, window, ring):
    B, Hq, Hkv, D = 2, 6, 2, 64
    n_quantized, first_exact = ref.int4_decoded_state(S, ring)
    k, v = random_keys_values(B, Hkv, S, D)
    kv = quantized_cache(4, B, Hkv, S, D, n_quantized, torch.float32, first_exact, kv=(k, v), ring=ring)
    q = torch.randn(B, T, Hq, D, device=DEVICE)
    want, want_mass = rows_one_by_one(q, k, v, window, n_quantized, first_exact)
    # 1e-4: two fp32 softmaxes over up to 1000 keys with x20 outliers, summed in other orders (1e-5 failed ~1 in 50);
    # reading a wrong key version moves the output by ~1e-1
    assert (ref.quantized_attention(q, kv, window) - want).abs().max().item() <= 1e-4
    assert (ref.quantized_attention_mass(q, kv, window) - want_mass).abs().max().item() <= 1e-5 * T
    all_codes = ref.attention(q, *ref.dequantize_kv(kv), window)  # every row reading n_quantized keys as codes
    rows_differ = len(set(kv.row_quantized(T))) > 1
    assert rows_differ == ((all_codes - want).abs().max().item() > 1e-3)


# (B, T, Hq, Hkv, S, D, window, split_len, ring): GQA 1, 3, 4; D 64, 80, 128; the row blocks above; one split
# or more, splits of 32 keys putting a split boundary inside the two-version range
INT4_ROW_SHAPES = [
    (1, 1, 4, 4, 97, 64, None, 32, ref.RECENT),
    (2, 4, 6, 2, 98, 80, None, None, ref.RECENT),
    (1, 4, 4, 1, 100, 128, 20, 32, ref.RECENT),
    (1, 17, 3, 3, 130, 64, None, 96, ref.RECENT),
    (1, 17, 4, 1, 1000, 80, 300, 32, ref.RECENT),
    (1, 33, 6, 2, 96, 128, None, 32, ref.RECENT),  # 99 rows: 7 row blocks
    (1, 33, 4, 1, 600, 64, 100, 224, ref.RECENT),
    (1, 64, 2, 1, 200, 64, None, 32, 64),
    (1, 70, 2, 1, 700, 64, None, 32, ref.RECENT),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, Hq, Hkv, S, D, window, split_len, ring", INT4_ROW_SHAPES)
def test_int4_rows_read_their_own_keys(B, T, Hq, Hkv, S, D, window, split_len, ring, dtype):
    n_quantized, first_exact = ref.int4_decoded_state(S, ring)
    check_quantized(4, B, T, Hq, Hkv, S, D, window, n_quantized, dtype, first_exact, mass=dtype == torch.float32,
                    ring=ring, split_len=split_len)


# (B, T, Hq, Hkv, S, D, window, split_len)
MASS_SHAPES = [
    (1, 1, 4, 4, 1, 64, None, None),
    (2, 4, 6, 2, 33, 80, None, 16),
    (1, 16, 3, 1, 100, 64, 20, 32),
    (1, 4, 4, 1, 1000, 128, None, 1024),
    (1, 4, 4, 1, 1000, 128, None, None),
    (1, 16, 8, 2, 1000, 64, 300, 96),
]


@pytest.mark.parametrize("B, T, Hq, Hkv, S, D, window, split_len", MASS_SHAPES)
def test_mass_adds_the_reference_mass(B, T, Hq, Hkv, S, D, window, split_len):
    k, v = cache_views(B, Hkv, S, D, torch.float32)
    q = torch.randn(B, T, Hq + 2 * Hkv, D, device=DEVICE)[:, :, :Hq]
    mass = mass_buffer(B, Hkv, S)
    before = mass.clone()
    got = decode_attention(q, k, v, window, split_len=split_len, mass=mass)
    assert (got - ref.attention(q, k, v, window)).abs().max().item() <= FP32_VS_REFERENCE
    check_mass(mass, before, q, k, window)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("split_len", [1024, None])
def test_mass_over_a_quantized_cache(bits, split_len):
    B, T, Hq, Hkv, S, D, window = 2, 4, 3, 1, 600, 80, None
    kv = quantized_cache(bits, B, Hkv, S, D, 544, torch.float32)
    q = torch.randn(B, T, Hq, D, device=DEVICE)
    mass = mass_buffer(B, Hkv, S)
    before = mass.clone()
    got = quantized_decode_attention(q, kv, window, split_len=split_len, mass=mass)
    assert (got - ref.quantized_attention(q, kv, window)).abs().max().item() <= FP32_VS_REFERENCE
    check_mass(mass, before, q, ref.dequantize_kv(kv)[0], window)


@pytest.mark.parametrize("bits", [8, 4])
def test_dispatch(bits):
    """`kernels.attention(mass=)` and `kernels.quantized_attention` (C kernel or reference on a CPU, Triton on CUDA).
    INT4: the block's first row reads the group [32, 64) exact, the others as codes."""
    B, T, Hq, Hkv, S, D, window = 1, 4, 6, 2, 66, 64, 50
    q = torch.randn(B, T, Hq, D, device=DEVICE)
    n_quantized, first_exact = ref.int4_decoded_state(S)
    kv = quantized_cache(bits, B, Hkv, S, D, n_quantized, torch.float32, first_exact)
    k, v = ref.dequantize_kv(kv)
    for mass in (None, mass_buffer(B, Hkv, S)):
        before = None if mass is None else mass.clone()
        got = kernels.quantized_attention(q, kv, window, mass=mass)
        assert (got - ref.quantized_attention(q, kv, window)).abs().max().item() <= FP32_VS_REFERENCE
        if mass is not None:
            assert (mass - before - ref.quantized_attention_mass(q, kv, window)).abs().max().item() <= 1e-5 * T * Hq
            mass.copy_(before)
        got = kernels.attention(q, k, v, window, mass=mass)
        assert (got - ref.attention(q, k, v, window)).abs().max().item() <= FP32_VS_REFERENCE
        if mass is not None:
            check_mass(mass, before, q, k, window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T, S, Hq, Hkv", [(20, 20, 6, 2), (33, 1000, 8, 8), (512, 1500, 9, 3)])
def test_a_prompt_chunk_attends_through_the_lower_right_causal_bias(T, S, Hq, Hkv, dtype):
    """A 16-bit prompt chunk's causal attention with PyTorch's lower-right causal bias instead of a mask tensor (so
    that SDPA may run FlashAttention on CUDA): on a CPU the bias becomes the reference's mask, bit for bit; on a GPU
    within the tolerance rule against fp32, and without falling back."""
    g = torch.Generator().manual_seed(T + S)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE, dtype) for shape in ((1, T, Hq, 64), (1, Hkv, S, 64),
                                                                              (1, Hkv, S, 64)))
    got = kernels._chunk_attention(q, k, v)
    want = ref.attention(q, k, v)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        exact = ref.attention(q.float(), k.float(), v.float())
        assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 1e-3


def test_which_prompt_chunks_take_the_causal_bias(monkeypatch):
    """kernels.attention on the CUDA path (routed so here): 16-bit chunks of more than 16 rows without a window or
    H2O's mass take the lower-right causal bias; fp32, windows and mass the reference's mask."""
    monkeypatch.setattr(kernels, "_use_triton", lambda x: True)
    taken = []
    chunk = kernels._chunk_attention
    monkeypatch.setattr(kernels, "_chunk_attention", lambda *a: taken.append(a[0].dtype) or chunk(*a))
    monkeypatch.setattr(kernels, "_failed", set())
    for dtype, window, mass in [(torch.bfloat16, None, None), (torch.float32, None, None), (torch.float16, 50, None),
                                (torch.float16, None, torch.zeros(1, 2, 80)), (torch.float16, None, None)]:
        q = torch.randn(1, 20, 4, 64).to(DEVICE, dtype)
        k, v = (torch.randn(1, 2, 80, 64).to(DEVICE, dtype) for _ in range(2))
        y = kernels.attention(q, k, v, window, None if mass is None else mass.to(DEVICE))
        assert (y.float() - ref.attention(q.float(), k.float(), v.float(), window)).abs().max() <= 2e-2
    assert taken == [torch.bfloat16, torch.float16] and not kernels._failed


@pytest.mark.gpu
@pytest.mark.parametrize("T, S, Hq, Hkv, D, window", [(512, 1500, 32, 8, 128, None), (300, 700, 9, 3, 64, 200)])
def test_an_int4_prompt_chunk_runs_on_a_fused_sdpa_kernel(T, S, Hq, Hkv, D, window):
    """A bf16 prompt chunk over an INT4 cache (`kernels.int4_attention`, a mask and GQA) on a GPU: SDPA serves it
    with its math kernel ruled out (an H100's INT4 prefill at 8k ran at 1/16 of bf16's), within the tolerance rule
    against the fp32 reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from llmrun.kv_cache import KVCache

    g = torch.Generator().manual_seed(T)
    k, v = (torch.randn(1, S, Hkv, D, generator=g).to(DEVICE) for _ in range(2))
    cache = KVCache(1, 1, Hkv, S, D, torch.float32, DEVICE, kv_format="int4")
    for position, n in ((0, S - T), (S - T, T)):
        kv, _, _ = cache.update(0, position, k[:, position : position + n], v[:, position : position + n])
        cache.length = position + n
    q = torch.randn(1, T, Hq, D, generator=g).to(DEVICE)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        got = kernels.int4_attention(q.bfloat16(), kv, window)
    exact = ref.quantized_attention(q, kv, window)
    runs = ref.quantized_row_blocks(kv, T)  # the reference's runs of rows, attended in bf16: torch's own error
    before = torch.cat([ref.attention(q[:, r0:r1].bfloat16(), k_run.bfloat16(), v_run.bfloat16(), window)
                        for r0, r1, k_run, v_run in runs], dim=1)
    torch_err = (before.float() - exact).abs().max().item()
    assert (got.float() - exact).abs().max().item() <= 2 * torch_err + ATOL[torch.bfloat16]


# --- every config the autotuner may pick ------------------------------------------------------------------------------


def split_configs():
    """The split kernel's autotuning configs: all of them on a GPU; under the interpreter, which ignores warps and
    stages, one for each tile length."""
    if DEVICE == "cuda":
        return module.SPLIT_CONFIGS
    return list({c.kwargs["BLOCK_N"]: c for c in module.SPLIT_CONFIGS}.values())


@pytest.mark.autotune
@pytest.mark.parametrize("case", ["dense", "window", "int8", "int4", "mass"])
@pytest.mark.parametrize("config", split_configs(),
                         ids=lambda c: f"n{c.kwargs['BLOCK_N']}-w{c.num_warps}-s{c.num_stages}")
def test_every_split_config(config, case, monkeypatch):
    """Each config the autotuner may pick computes the reference's attention (the autotuner times them all and
    keeps the winner's output unchecked): 1000 keys, 4 splits whose last ends inside a tile of every BLOCK_N, GQA 4,
    a verification block of 4 tokens, head_dim 128; bf16 on a GPU (fp16 under the interpreter), fp32 with the mass.
    A config the GPU's shared memory cannot hold is skipped, as the autotuner prunes it."""
    from triton.runtime.errors import OutOfResources

    settings = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    monkeypatch.setattr(module, "_split_launcher", lambda cuda: (module._split_kernel, settings))
    dtype = torch.float32 if case == "mass" else torch.bfloat16 if DEVICE == "cuda" else torch.float16
    B, T, Hq, Hkv, S, D = 1, 4, 8, 2, 1000, 128
    try:
        if case in ("dense", "window"):
            check(B, T, Hq, Hkv, S, D, 300 if case == "window" else None, dtype)
        elif case in ("int8", "int4"):
            check_quantized(int(case[3]), B, T, Hq, Hkv, S, D, None, 992, dtype)
        else:
            k, v = cache_views(B, Hkv, S, D, dtype)
            q = torch.randn(B, T, Hq + 2 * Hkv, D, device=DEVICE)[:, :, :Hq]
            mass = mass_buffer(B, Hkv, S)
            before = mass.clone()
            got = decode_attention(q, k, v, mass=mass)
            assert (got - ref.attention(q, k, v)).abs().max().item() <= ATOL[dtype]
            check_mass(mass, before, q, k, None)
    except OutOfResources:
        pytest.skip(f"{settings} needs more shared memory than this GPU has")

