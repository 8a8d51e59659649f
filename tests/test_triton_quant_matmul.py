"""The Triton weight-only quantized matmul (kernels/triton_quant_matmul.py) against the fp32 reference
x.float() @ dequantize_groups(W).T, on fresh random inputs with awkward shapes; under the interpreter on a CPU.

Tolerance (flash-attention's rule): kernel error <= 2 x (error of torch's own matmul in x's dtype) + atol, both
measured against the fp32 reference computed from the same (already rounded) x.
"""

import types

import pytest
import torch

from llmrun.kernels import common
from llmrun.kernels import triton_quant_matmul as tqm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [(4, True), (4, False), (8, False)]  # (bits, offsets): Q4_1 / AWQ, Q4_0, Q8_0
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # times max |y|: about one rounding


def random_planes(N, K, bits, offsets, group, seed):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    else:
        qs = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    shape = (N, K // group)
    d = ((torch.rand(shape, generator=g) * 0.02 + 0.001) * (1 - 2 * (torch.rand(shape, generator=g) < 0.3))).half()
    m = (torch.randn(shape, generator=g) * 0.05).half() if offsets else None
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return move(qs), move(d), move(m)


def pack_nibbles(q):
    """q (N, K) in 0..15 -> uint8 (N, K/2) in GGML's order: byte i of each block of 32 holds q_i | q_{i+16} << 4."""
    blocks = q.view(q.shape[0], -1, 2, 16).to(torch.uint8)
    return (blocks[:, :, 0] | blocks[:, :, 1] << 4).reshape(q.shape[0], -1)


def check_close(y, x, W):
    """y: the kernel's x @ W^T; x in its dtype, W (N, K) fp32."""
    assert y.dtype == x.dtype
    expected = x.float() @ W.T
    torch_err = ((x @ W.to(x.dtype).T).float() - expected).abs().max().item()
    err = (y.float() - expected).abs().max().item()
    atol = ATOL[x.dtype] * max(expected.abs().max().item(), 1.0)
    assert err <= 2 * torch_err + atol, f"error {err:.3g}, torch's own {torch_err:.3g}, atol {atol:.3g}"


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("offsets", [True, False])
def test_dequantize_groups_definition(group, offsets):
    """ref.dequantize_blocks: each weight is d * q + m with the scale and offset of its group of `group` columns
    (AWQ: m = -d * z), the nibbles in GGML's order."""
    N, K = 5, 256
    g = torch.Generator().manual_seed(group)
    q = torch.randint(0, 16, (N, K), generator=g)
    d = torch.rand(N, K // group, generator=g).half()
    z = torch.randint(0, 16, (N, K // group), generator=g)
    m = (-d.float() * z).half() if offsets else None
    full = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    want = full(d) * q + (full(m) if offsets else -8 * full(d))
    assert torch.equal(tqm.dequantize_groups(pack_nibbles(q), d, m, 4, group), want)
    q8 = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    assert torch.equal(tqm.dequantize_groups(q8, d, None, 8, group), full(d) * q8)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_dequantize_kernel(bits, offsets, group):
    qs, d, m = random_planes(37, 384, bits, offsets, group, seed=2)
    W = tqm.dequantize_groups(qs, d, m, bits, group)
    assert torch.equal(tqm.dequantize(qs, d, m, bits, group, torch.float32), W)
    assert torch.equal(tqm.dequantize(qs, d, m, bits, group, torch.float16), W.half())


@pytest.mark.parametrize("ids", [[5], [[36, 0, 5], [5, 5, 17]], []])
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_dequantize_rows(bits, offsets, ids):
    """An embedding lookup (kernels.quant_rows on CUDA): the rows `ids`, in ids' shape, repeats and all, each
    weight as the whole W's dequantization gives it; no other row of W is read (those are NaN scales here)."""
    qs, d, m = random_planes(37, 384, bits, offsets, 32, seed=3)
    W = tqm.dequantize_groups(qs, d, m, bits, 32)
    ids = torch.tensor(ids, dtype=torch.int64, device=DEVICE)
    unread = torch.ones(37, dtype=torch.bool, device=DEVICE)
    unread[ids.reshape(-1)] = False
    d[unread] = float("nan")
    for dtype in (torch.float32, torch.float16):
        got = tqm.dequantize(qs, d, m, bits, 32, dtype, ids=ids)
        assert got.shape == (*ids.shape, 384) and torch.equal(got, W[ids].to(dtype))


# (N, K, group) with group dividing K; the largest shape is marked slow
SHAPES = [(1, 64, 32), (1, 64, 64), (7, 96, 32), (100, 576, 32), (100, 576, 64),
          pytest.param(576, 1536, 32, marks=pytest.mark.slow), pytest.param(576, 1536, 128, marks=pytest.mark.slow)]
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8, 13, 33])  # 13: two GEMV launches (a verification block); 33: prefill
@pytest.mark.parametrize("N, K, group", SHAPES)
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_quant_linear(bits, offsets, N, K, group, M, dtype):
    qs, d, m = random_planes(N, K, bits, offsets, group, seed=N * K + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    check_close(tqm.quant_linear(x, qs, d, m, bits, group), x, tqm.dequantize_groups(qs, d, m, bits, group))


@pytest.mark.parametrize("split_k", [2, 3, 7])
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_gemv_split_k(bits, offsets, split_k):
    """Slices of K (ragged: 576 = 18 blocks of 32) summed outside the kernel give the same product."""
    qs, d, m = random_planes(70, 576, bits, offsets, 64, seed=split_k)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    check_close(tqm._gemv(x, qs, d, m, bits, 64, split_k=split_k), x, tqm.dequantize_groups(qs, d, m, bits, 64))


@pytest.mark.parametrize("split_k", [2, 5])
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_the_last_slice_sums_every_slice_in_order(bits, offsets, split_k):
    """Split K in one launch: the slice that finishes last adds every slice's fp32 sums in slice order (bit for bit
    each slice's own product, summed 0, 1, ...) and sets its counters back to 0, so the next launch starts afresh.
    (Which slice is last differs on a GPU; here the programs run in order.)"""
    N, K, group = 70, 640, 32
    qs, d, m = random_planes(N, K, bits, offsets, group, seed=split_k)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5)).to(DEVICE)  # fp32: the slices' sums themselves
    bias = torch.randn(N, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    step = K // split_k // 32 * 32 + (32 if (K // split_k) % 32 else 0)  # the kernel's slice: whole blocks of 32
    want = torch.zeros(3, N, device=DEVICE)
    for k0 in range(0, K, step):  # each slice alone, unsplit, the first with the bias
        k1 = min(k0 + step, K)
        packed = qs[:, k0 // 2 : k1 // 2] if bits == 4 else qs[:, k0:k1]
        part = tqm._gemv(x[:, k0:k1].contiguous(), packed.contiguous(), d[:, k0 // group : k1 // group].contiguous(),
                         None if m is None else m[:, k0 // group : k1 // group].contiguous(), bits, group, 1,
                         bias if k0 == 0 else None)
        want += part
    for _ in range(2):  # twice: the second launch finds the counters as the first found them
        assert torch.equal(tqm._gemv(x, qs, d, m, bits, group, split_k, bias), want)
        assert not common.counters(x.device).any()


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("N, K, M, split_k", [(1, 32, 1, None), (70, 576, 3, 3), (257, 96, 8, None),
                                              (33, 2048, 13, 4), (130, 320, 16, 2)])
def test_float_linear(N, K, M, split_k, dtype, monkeypatch):
    """The GEMV on 16-bit float weights (BITS 16, LLMRUN_GEMV_FLOAT=1): x @ W^T + b within the tolerance rule, any
    N, K a multiple of 32, 1 to 16 rows, split K or not; each row the bits it has alone."""
    if split_k:
        monkeypatch.setattr(tqm, "_default_split_k", lambda x, N, K: split_k)
    g = torch.Generator().manual_seed(N + K + M)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, dtype)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype)
    got = tqm.float_linear(x, w, bias)
    want = x.float() @ w.float().T + bias.float()
    torch_err = ((x @ w.T + bias).float() - want).abs().max().item()
    assert got.dtype == dtype and got.shape == (M, N)
    assert (got.float() - want).abs().max().item() <= 2 * torch_err + ATOL[dtype] * want.abs().max().item()
    for r in (0, M - 1):
        assert torch.equal(tqm.float_linear(x[r : r + 1], w, bias)[0], got[r])


@pytest.mark.parametrize("bits, offsets", FORMATS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_codes_as_words_or_bytes_take_the_same_sums(bits, offsets, split_k):
    """16-bit x fetches W's codes as int32 words (unpacked a step after their load), fp32 x as bytes: the same fp32
    sums either way, so an fp16 row's result is the fp32 row's rounded once."""
    qs, d, m = random_planes(70, 640, bits, offsets, 32, seed=bits + split_k)
    x = torch.randn(5, 640, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.float16)
    words = tqm._gemv(x, qs, d, m, bits, 32, split_k)
    as_bytes = tqm._gemv(x.float(), qs, d, m, bits, 32, split_k)
    assert torch.equal(words, as_bytes.half())
    shifted = torch.empty(qs.numel() + 1, dtype=qs.dtype, device=DEVICE)[1:].view(qs.shape)  # not 8-byte aligned:
    shifted.copy_(qs)  # fetched as bytes under 16-bit x too
    assert shifted.data_ptr() % 8 and torch.equal(tqm._gemv(x, shifted, d, m, bits, 32, split_k), words)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits, offsets", FORMATS + [(4, "awq")])
def test_the_gemv_takes_each_weight_exactly(bits, offsets, dtype):
    """Rows of x that pick one column each give W's columns: every code at each of its bit positions becomes
    scale * q + offset with that FFMA's one rounding (`tqm._code_weights`), for fp32 x (codes read as bytes) and
    16-bit x (as words; bf16 x as words too). Exact for symmetric codes (Q4_0, Q8_0) and AWQ's m = -d z; a Q4_1
    minimum far below its scale may round by 2^-13 of a step. bf16: scales that are powers of two, so that every
    weight is a bf16 (the interpreter's fp32-to-bf16 cast truncates; a GPU's rounds)."""
    N, K = 70, 640
    qs, d, m = random_planes(N, K, bits, offsets is True, 32, seed=bits)
    if offsets == "awq":
        z = torch.randint(0, 16, d.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        m = (-d.float() * z).half()
    if dtype == torch.bfloat16:
        d = torch.exp2(torch.log2(d.float().abs()).round()).half() * d.sign()
        m = None if m is None else -d * torch.randint(0, 16, d.shape).to(DEVICE).half()
    W = tqm.dequantize_groups(qs, d, m, bits, 32)
    picks = torch.tensor([0, 15, 16, 31, 32, 333, 600, K - 1])  # first and last of blocks and halves, K's last
    x = torch.zeros(len(picks), K, device=DEVICE)
    x[torch.arange(len(picks)), picks] = 1
    y = tqm._gemv(x.to(dtype), qs, d, m, bits, 32, split_k=3)
    want = W[:, picks].T.to(dtype)
    if offsets is True and dtype != torch.bfloat16:
        # 2^-13 of a step in fp32, then at most one fp16 rounding the other way
        ulp = want.float().abs() * 2**-10 if dtype == torch.float16 else 0
        assert ((y.float() - W[:, picks].T).abs() <= d.float().abs().max() * 2**-13 + ulp).all()
    else:
        assert torch.equal(y, want)


def test_float_linear_refuses_what_it_cannot_run():
    w = torch.zeros(8, 64, device=DEVICE).half()
    for x, weight in [(torch.zeros(1, 64, device=DEVICE), w), (torch.zeros(1, 64, device=DEVICE), w.float()),
                      (torch.zeros(17, 64, device=DEVICE).half(), w),
                      (torch.zeros(1, 48, device=DEVICE).half(), w[:, :48])]:
        with pytest.raises(ValueError, match="float_linear takes up to 16 rows"):
            tqm.float_linear(x, weight)


def test_linear_runs_the_gemv_for_decode_steps(monkeypatch):
    """`kernels.linear` on CUDA (faked here): the GEMV for up to 2 rows in 16 bits whose K divides into blocks of 32,
    F.linear (cuBLAS) for more rows; LLMRUN_GEMV_FLOAT=1 the GEMV up to 16 rows, =0 never; never on fp32, never
    inside `reference_ops`."""
    import torch.nn.functional as F

    from llmrun import kernels

    calls = []
    monkeypatch.setattr(kernels, "_use_triton", lambda x: not kernels._reference)
    monkeypatch.setattr(tqm, "float_linear",
                        lambda x, w, b=None, gated=False: calls.append(x.shape) or F.linear(x, w, b))
    monkeypatch.setattr(kernels, "_failed", set())
    w = torch.randn(40, 64).half()

    def rows_on_the_gemv(choice):
        calls.clear()
        if choice is None:
            monkeypatch.delenv("LLMRUN_GEMV_FLOAT", raising=False)
        else:
            monkeypatch.setenv("LLMRUN_GEMV_FLOAT", choice)
        for rows in (1, 2, 3, 16, 17):
            kernels.linear(torch.randn(1, rows, 64).half(), w)
        kernels.linear(torch.randn(1, 1, 48).half(), torch.randn(40, 48).half())  # K not in blocks of 32
        kernels.linear(torch.randn(1, 1, 64), w.float())  # fp32
        with kernels.reference_ops():
            kernels.linear(torch.randn(1, 1, 64).half(), w)
        assert not kernels._failed
        return [shape[1] for shape in calls]

    assert rows_on_the_gemv(None) == [1, 2]
    assert rows_on_the_gemv("1") == [1, 2, 3, 16]
    assert rows_on_the_gemv("0") == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, split_k", [(1, None), (3, 3), (13, 2), (33, None)])  # decode, split K, 2 launches, GEMM
def test_the_bias_is_added_once(M, split_k, dtype, monkeypatch):
    """A bias (Qwen's q/k/v) rides in the GEMV's fp32 sums (the first slice of K adds it, so split K counts it once)
    and in the prefill GEMM: x @ W^T + b."""
    if split_k:
        monkeypatch.setattr(tqm, "_default_split_k", lambda x, N, K: split_k)
    qs, d, m = random_planes(70, 576, 4, True, 64, seed=M)
    x = torch.randn(M, 576, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    bias = torch.randn(70, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    W = tqm.dequantize_groups(qs, d, m, 4, 64)
    got = tqm.quant_linear(x, qs, d, m, 4, 64, bias=bias)
    want = x.float() @ W.T + bias.float()
    torch_err = ((x @ W.to(dtype).T + bias).float() - want).abs().max().item()  # torch's own, in x's dtype
    assert (got.float() - want).abs().max().item() <= 2 * torch_err + ATOL[dtype] * want.abs().max().item()


@pytest.mark.parametrize("dot, half2", [("0", "0"), ("0", "1"), ("1", "0")])
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_a_row_does_not_depend_on_the_rows_beside_it(bits, offsets, dot, half2, monkeypatch, row_by_row_dot):
    """Greedy speculative decoding is exact only if a token's product has the same bits whether it runs alone or in
    a verification block: every row count up to VERIFY_ROWS gives each row the bits of the full block (on a GPU
    this also needs one autotuned config for every row count of a shape). So on the FFMA GEMV (LLMRUN_GEMV_DOT=0:
    one-token steps and, so set, blocks; its 4-bit weights in fp16 pairs too, LLMRUN_GEMV_HALF2=1) and on the
    tensor-core GEMV alone (=1: every row count on it); by default a GPU's blocks of 3 or more rows take the second
    and one-token steps the first, whose bits differ."""
    monkeypatch.setenv("LLMRUN_GEMV_DOT", dot)
    monkeypatch.setenv("LLMRUN_GEMV_HALF2", half2)
    qs, d, m = random_planes(96, 320, bits, offsets, 32, seed=bits)
    x = torch.randn(tqm.VERIFY_ROWS, 320, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    block = tqm.quant_linear(x, qs, d, m, bits, 32)
    for rows in range(1, tqm.VERIFY_ROWS):
        assert torch.equal(tqm.quant_linear(x[-rows:], qs, d, m, bits, 32), block[-rows:]), rows

def test_split_k_follows_the_sms_and_the_profiles_settings(monkeypatch):
    """K is split until about LLMRUN_GEMV_PROGRAMS_PER_SM programs of 64 columns run per SM (default 2), no slice
    under LLMRUN_GEMV_MIN_SLICE columns (default 512); never on a CPU. Shapes of llama3.2-1b on an H100's 132 SMs."""
    class FakeCuda:
        is_cuda = True
        device = torch.device("cpu")

    monkeypatch.setattr(tqm, "_sm_count", lambda index: 132)
    split = lambda N, K: tqm._default_split_k(FakeCuda(), N, K)  # noqa: E731
    assert (split(3072, 2048), split(2048, 8192), split(16384, 2048), split(128256, 2048)) == (4, 8, 1, 1)
    assert tqm._default_split_k(torch.zeros(1, 2048), 3072, 2048) == 1
    monkeypatch.setenv("LLMRUN_GEMV_PROGRAMS_PER_SM", "8")
    monkeypatch.setenv("LLMRUN_GEMV_MIN_SLICE", "128")
    assert (split(3072, 2048), split(2048, 8192), split(16384, 2048), split(128256, 2048)) == (16, 32, 4, 1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [None, 3])
def test_every_row_count_has_one_autotuner_key(bias, split_k, monkeypatch):
    """The GPU half of the test above: Triton's autotuner keys on the named arguments and every tensor argument's
    dtype, and picks a config by timing, so every row count of a weight must launch with one key (else a
    verification block could tune a BLOCK_K of its own and sum its rows in another order). Recorded on the
    launches themselves, which a GPU runs under one of the autotuner's configs."""
    keys = set()

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                N, K, k_split = args[9:12]
                dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
                keys.add((dtypes, N, K, k_split, kwargs["BITS"], kwargs["GROUP"]))
                return tqm._gemv_kernel[grid](*args, **kwargs)
            return launch

    config = tqm._GEMV_CONFIGS[0]  # on a GPU, one of the autotuner's configs (the interpreter's tiles are too big)
    blocks = {**config.kwargs, "num_warps": config.num_warps} if DEVICE == "cuda" else tqm._INTERPRETER_BLOCKS
    monkeypatch.setattr(tqm, "_gemv_launcher", lambda cuda: (Spy(), blocks))
    monkeypatch.setenv("LLMRUN_GEMV_DOT", "0")  # every row count on the FFMA GEMV, as on a CPU
    qs, d, m = random_planes(96, 320, 4, True, 32, seed=0)
    b = torch.randn(96, device=DEVICE).half() if bias else None
    for rows in range(1, tqm.VERIFY_ROWS + 1):
        x = torch.randn(rows, 320, device=DEVICE).half()
        if split_k is None:
            tqm.quant_linear(x, qs, d, m, 4, 32, b)
        else:  # as quant_linear launches them, with a split of K that needs the partial sums
            for chunk in x.split(tqm.DECODE_ROWS):
                tqm._gemv(chunk, qs, d, m, 4, 32, split_k, b)
    assert len(keys) == 1, keys



@pytest.mark.parametrize("M", [2, 12])
def test_leading_dims_and_strided_x(M):
    qs, d, m = random_planes(48, 128, 4, True, 64, seed=M)
    x = torch.randn(2, M, 256, generator=torch.Generator().manual_seed(M)).to(DEVICE)[:, :, ::2]  # (2, M, 128)
    y = tqm.quant_linear(x, qs, d, m, 4, 64)
    assert y.shape == (2, M, 48)
    check_close(y.reshape(-1, 48), x.reshape(-1, 128), tqm.dequantize_groups(qs, d, m, 4, 64))


def test_bad_shapes_say_what_fits():
    qs, d, m = random_planes(8, 128, 4, True, 64, seed=0)
    x = torch.randn(1, 128, device=DEVICE)
    with pytest.raises(ValueError, match="want qs"):
        tqm.quant_linear(x, qs, d, m, 4, 32)  # d has K/64 columns, not K/32
    with pytest.raises(ValueError, match="multiple of 32"):
        tqm.quant_linear(x, qs, d, m, 4, 48)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        tqm.quant_linear(x, qs, d, m, 3, 64)
    with pytest.raises(ValueError, match="offsets"):
        tqm.quant_linear(x, qs.view(torch.int8).repeat(1, 2), d, m, 8, 64)


@pytest.mark.autotune
@pytest.mark.parametrize("config", tqm._GEMV_CONFIGS,
                         ids=lambda c: "{BLOCK_N}x{BLOCK_K}-s{STAGES}".format(**c.kwargs) + f"-w{c.num_warps}")
@pytest.mark.parametrize("bits, half2", [(4, "0"), (8, "0"), (4, "1")])
def test_every_gemv_config(bits, half2, config, monkeypatch):
    """Each tile the autotuner may pick (it times them all and keeps the winner's output unchecked), smaller than the
    interpreter's own: several programs along N and steps along K, split in two along K; bf16 on a GPU, fp16
    under the interpreter (which ignores the warps); 4-bit weights also in fp16 pairs (LLMRUN_GEMV_HALF2=1)."""
    monkeypatch.setenv("LLMRUN_GEMV_HALF2", half2)
    blocks = {**config.kwargs, "num_warps": config.num_warps}
    monkeypatch.setattr(tqm, "_gemv_launcher", lambda cuda: (tqm._gemv_kernel, blocks))
    qs, d, m = random_planes(40, 320, bits, bits == 4, 64, seed=5)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    check_close(tqm._gemv(x, qs, d, m, bits, 64, split_k=2), x, tqm.dequantize_groups(qs, d, m, bits, 64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, split_k", [(1, None), (9, 3), (16, 2)])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_gemv_dot(bits, offsets, group, M, split_k, dtype):
    """The tensor-core GEMV (LLMRUN_GEMV_DOT=1): x @ W^T + b within the tolerance rule (its weights rounded to x's
    dtype, as torch's own matmul in that dtype has them), 1 to 16 rows in one launch, split K or not, the last
    step's blocks past K (576 = 18 blocks of 32)."""
    N, K = 70, 576 if group == 32 else 640
    qs, d, m = random_planes(N, K, bits, offsets, group, seed=M + group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    y = tqm._gemv_dot(x, qs, d, m, bits, group, split_k, bias)
    W = tqm.dequantize_groups(qs, d, m, bits, group)
    expected = x.float() @ W.T + bias.float()
    torch_err = ((x @ W.to(dtype).T + bias).float() - expected).abs().max().item()
    err = (y.float() - expected).abs().max().item()
    assert y.dtype == dtype and y.shape == (M, N)
    assert err <= 2 * torch_err + ATOL[dtype] * max(expected.abs().max().item(), 1.0), (err, torch_err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, split_k", [(1, None), (2, 3), (8, 2), (13, None)])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("offsets", [True, False])
def test_gemv_half2(offsets, group, M, split_k, dtype, monkeypatch):
    """LLMRUN_GEMV_HALF2=1: the FFMA GEMV's 4-bit weights under 16-bit x dequantized and multiplied in fp16 pairs
    (PTX on a GPU, its plain-Triton form under the interpreter), x @ W^T + b within the tolerance rule (torch's own
    error includes W rounded to x's dtype); 1 to 13 rows (two launches), split K or not, the last step's blocks past
    K (576 = 18 blocks of 32). The launches run it, and only for 4-bit weights under 16-bit x."""
    monkeypatch.setenv("LLMRUN_GEMV_HALF2", "1")
    monkeypatch.setenv("LLMRUN_GEMV_DOT", "0")  # every row count on the FFMA GEMV, as on a CPU
    launched = []
    kernel, blocks = tqm._gemv_launcher(DEVICE == "cuda")

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["BITS"], args[0].dtype, kwargs["HALF2"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(tqm, "_gemv_launcher", lambda cuda: (Spy(), blocks))
    N, K = 70, 576 if group == 32 else 640
    qs, d, m = random_planes(N, K, 4, offsets, group, seed=M + group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    if split_k is None:
        y = tqm.quant_linear(x, qs, d, m, 4, group, bias)
    else:
        y = tqm._gemv(x, qs, d, m, 4, group, split_k, bias)
    W = tqm.dequantize_groups(qs, d, m, 4, group)
    expected = x.float() @ W.T + bias.float()
    torch_err = ((x @ W.to(dtype).T + bias).float() - expected).abs().max().item()
    err = (y.float() - expected).abs().max().item()
    assert y.dtype == dtype and y.shape == (M, N)
    assert err <= 2 * torch_err + ATOL[dtype] * max(expected.abs().max().item(), 1.0), (err, torch_err)
    assert launched and set(launched) == {(4, dtype, True)}
    launched.clear()
    tqm.quant_linear(x.float(), qs, d, m, 4, group)  # fp32 x: as it was
    tqm.quant_linear(x, *random_planes(N, K, 8, False, group, seed=1), 8, group)  # 8-bit weights: as they were
    assert set(launched) == {(4, torch.float32, False), (8, dtype, False)}


def _silu_mul_of(y):
    from llmrun.kernels.activation import silu_mul

    half = y.shape[-1] // 2
    return silu_mul(y[..., :half], y[..., half:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel, M, split_k", [("ffma", 1, None), ("ffma", 2, 3), ("ffma", 8, 2), ("dot", 3, None),
                                                ("dot", 16, 2)])
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_a_gated_gemv_writes_silu_mul_of_its_product(bits, offsets, kernel, M, split_k, dtype, row_by_row_dot):
    """gated=True (W = [gate; up], a SwiGLU MLP's projection): silu(gate) * up as the GEMVs write their sums, bit for
    bit what the product and `kernels.activation`'s silu_mul give in two launches: F = 70 gate rows (no block of
    columns divides it), split K or not, a bias, both GEMVs (the tensor-core one's tl.dot computed row by row under
    the interpreter, as an MMA computes each element on its own wherever its column sits)."""
    N, K = 140, 576
    qs, d, m = random_planes(N, K, bits, offsets, 32, seed=M + bits)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    gemv = tqm._gemv if kernel == "ffma" else tqm._gemv_dot
    y = gemv(x, qs, d, m, bits, 32, split_k, bias, gated=True)
    assert y.shape == (M, 70) and y.dtype == dtype
    assert torch.equal(y, _silu_mul_of(gemv(x, qs, d, m, bits, 32, split_k, bias)))


@pytest.mark.parametrize("rows", [1, 9, 17])
def test_gated_entry_points(rows, monkeypatch):
    """quant_linear and float_linear take gated=True for every row count (17: W dequantized, then silu_mul), their
    result silu_mul of the ungated one's halves, bit for bit; an odd number of W's rows cannot be [gate; up]."""
    monkeypatch.setenv("LLMRUN_GEMV_DOT", "0")
    qs, d, m = random_planes(96, 320, 4, True, 32, seed=rows)
    x = torch.randn(1, rows, 320, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.float16)
    y = tqm.quant_linear(x, qs, d, m, 4, gated=True)
    assert y.shape == (1, rows, 48) and torch.equal(y, _silu_mul_of(tqm.quant_linear(x, qs, d, m, 4)))
    if rows <= tqm.VERIFY_ROWS:
        w = (torch.randn(96, 320, generator=torch.Generator().manual_seed(7)) / 16).to(DEVICE, torch.float16)
        assert torch.equal(tqm.float_linear(x, w, gated=True), _silu_mul_of(tqm.float_linear(x, w)))
    with pytest.raises(ValueError, match="even"):
        tqm.quant_linear(x, qs[:95], d[:95], m[:95], 4, gated=True)


@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_gemv_dot_gives_each_row_its_own_bits(bits, offsets, row_by_row_dot, monkeypatch):
    """LLMRUN_GEMV_DOT=1: a verification block of 13 rows is one launch, each row of it the bits that row has alone
    (greedy speculative decoding's exactness rests on it)."""
    monkeypatch.setenv("LLMRUN_GEMV_DOT", "1")
    launches = []
    dot = tqm._gemv_dot
    monkeypatch.setattr(tqm, "_gemv_dot", lambda *a, **k: launches.append(a[0].shape[0]) or dot(*a, **k))
    qs, d, m = random_planes(70, 640, bits, offsets, 32, seed=3)
    x = torch.randn(13, 640, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    block = tqm.quant_linear(x, qs, d, m, bits, 32)
    assert launches == [13]
    for r in (0, 5, 12):
        assert torch.equal(tqm.quant_linear(x[r : r + 1], qs, d, m, bits, 32)[0], block[r])


@pytest.mark.parametrize("env, cuda, dtype, rows, dot", [
    (None, True, torch.bfloat16, 9, True), (None, True, torch.float16, 3, True), (None, True, torch.bfloat16, 2, False),
    (None, True, torch.float32, 9, False), (None, False, torch.bfloat16, 9, False),
    ("0", True, torch.bfloat16, 9, False), ("1", False, torch.float32, 1, True),
])
def test_verification_blocks_take_the_tensor_cores(env, cuda, dtype, rows, dot, monkeypatch):
    """Which GEMV a quantized matmul of up to 16 rows runs: the tensor-core one from DOT_ROWS rows of 16-bit x on a
    GPU (faster there from 3 rows, measured), the FFMA one otherwise; LLMRUN_GEMV_DOT=0 never the tensor cores (a
    block's rows then have one-token steps' bits), =1 always. x stands in for a GPU tensor (is_cuda, dtype, shape)."""
    if env is None:
        monkeypatch.delenv("LLMRUN_GEMV_DOT", raising=False)
    else:
        monkeypatch.setenv("LLMRUN_GEMV_DOT", env)
    x = types.SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(rows, 64))
    assert tqm._takes_dot(x, 4) is dot and tqm._takes_dot(x, 8) is dot
    assert not tqm._takes_dot(x, 16)  # float weights: the GEMV's BITS 16 (LLMRUN_GEMV_FLOAT) has no dot form


@pytest.mark.gpu
@pytest.mark.parametrize("bits, offsets", FORMATS)
def test_a_bf16_block_on_a_gpu_runs_one_dot_launch_or_one_token_steps_bits(bits, offsets, monkeypatch):
    """On a GPU a 9-row bf16 block is one tensor-core launch, within the tolerance rule; with LLMRUN_GEMV_DOT=0 it
    is two FFMA launches whose rows are, bit for bit, each row's own one-token product."""
    launches = []
    for name in ("_gemv", "_gemv_dot"):
        f = getattr(tqm, name)
        monkeypatch.setattr(tqm, name, lambda *a, _f=f, _n=name, **k: launches.append(_n) or _f(*a, **k))
    qs, d, m = random_planes(300, 640, bits, offsets, 32, seed=7)
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)
    monkeypatch.delenv("LLMRUN_GEMV_DOT", raising=False)
    check_close(tqm.quant_linear(x, qs, d, m, bits, 32), x, tqm.dequantize_groups(qs, d, m, bits, 32))
    assert launches == ["_gemv_dot"]
    monkeypatch.setenv("LLMRUN_GEMV_DOT", "0")
    launches.clear()
    block = tqm.quant_linear(x, qs, d, m, bits, 32)
    assert launches == ["_gemv", "_gemv"]
    for r in (0, 7, 8):
        assert torch.equal(tqm.quant_linear(x[r : r + 1], qs, d, m, bits, 32)[0], block[r])


@pytest.mark.autotune
@pytest.mark.parametrize("config", tqm._DOT_CONFIGS,
                         ids=lambda c: "{BLOCK_N}x{BLOCK_K}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}")
@pytest.mark.parametrize("bits", [4, 8])
def test_every_dot_config(bits, config, monkeypatch):
    """Each tile the tensor-core GEMV's autotuner may pick, as `test_every_gemv_config`."""
    blocks = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    monkeypatch.setattr(tqm, "_dot_launcher", lambda cuda: (tqm._gemv_dot_kernel, blocks))
    qs, d, m = random_planes(40, 640, bits, bits == 4, 64, seed=5)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    check_close(tqm._gemv_dot(x, qs, d, m, bits, 64, split_k=2), x, tqm.dequantize_groups(qs, d, m, bits, 64))
