"""`llmrun quantize`: the AWQ and GPTQ layouts (by hand and round trips), the conversion to the kernels' blocks,
AWQ's algebra (folding scales leaves the float model unchanged) and search (never worse than RTN), checkpoints
written, reloaded and generating, and each bad input's one-line error."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llmrun import awq
from llmrun.awq import LinearInputs, quantize_groups, quantize_int8_rows, search_scale
from llmrun.errors import LlmrunError, ModelFormatError
from llmrun.kernels import ref
from llmrun.models import ModelConfig, config_from_hf, config_to_hf
from llmrun.models.config import RopeScaling
from llmrun.quant_formats import GroupQuant, checkpoint_quant, pack_awq, pack_gptq, unpack_awq, unpack_gptq
from llmrun.quantize import (DEFAULT_CALIB, QuantizeOptions, calibration_windows, capture_inputs, choose_group_size, quantize,
                             read_calibration)

from .conftest import run_main
from .tiny import CONFIGS, TINY, random_model, write_gguf, write_hf_dir

# widths that group sizes of 32 divide, with GQA 3:1 and a Qwen2-style bias
QCFG = ModelConfig("Qwen2ForCausalLM", n_heads=6, n_kv_heads=2, attention_bias=True,
                   **(TINY | dict(dim=64, head_dim=32, ffn_dim=160)))


def random_groups(out, inp, bits, group, seed=0) -> GroupQuant:
    g = torch.Generator().manual_seed(seed)
    top = 2**bits
    groups = inp // group
    return GroupQuant(torch.randint(0, top, (out, inp), generator=g).to(torch.uint8),
                      (torch.rand(out, groups, generator=g) * 0.1 + 0.01).half(),
                      torch.randint(0, top, (out, groups), generator=g).to(torch.uint8), bits, group)


# --- layouts ------------------------------------------------------------------------------------------------


def test_awq_layout_by_hand():
    """AutoAWQ's GEMM layout: the transposed codes, 8 output columns per int32 in the order 0 2 4 6 1 3 5 7."""
    codes = torch.zeros(8, 32, dtype=torch.uint8)
    codes[:, 0] = torch.arange(1, 9)  # input column 0: output columns 0..7 hold 1..8
    q = GroupQuant(codes, torch.full((8, 1), 0.5).half(), torch.arange(8, dtype=torch.uint8)[:, None], 4, 32)
    packed = pack_awq(q)
    assert packed["qweight"].shape == (32, 1) and packed["qweight"].dtype == torch.int32
    # nibbles from the lowest: columns 0, 2, 4, 6, 1, 3, 5, 7 -> values 1, 3, 5, 7, 2, 4, 6, 8
    assert packed["qweight"][0, 0].item() == 0x86427531 - 2**32
    assert packed["qweight"][1:].eq(0).all()
    assert packed["qzeros"].shape == (1, 1) and packed["qzeros"][0, 0].item() == 0x75316420  # zeros 0..7
    assert packed["scales"].shape == (1, 8) and packed["scales"].dtype == torch.float16


def test_gptq_layout_by_hand():
    """GPTQ: codes packed along the input dimension in order; zero points stored minus one."""
    codes = torch.zeros(8, 8, dtype=torch.uint8)
    codes[0] = torch.arange(1, 9)  # output row 0: input columns 0..7 hold 1..8
    q = GroupQuant(codes, torch.ones(8, 1).half(), torch.full((8, 1), 8, dtype=torch.uint8), 4, 8)
    packed = pack_gptq(q)
    assert packed["qweight"].shape == (1, 8) and packed["qweight"][0, 0].item() == 0x87654321 - 2**32
    assert packed["qzeros"].shape == (1, 1) and packed["qzeros"][0, 0].item() == 0x77777777
    assert packed["g_idx"].tolist() == [0] * 8


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 128), (8, 256)])
def test_pack_unpack_round_trips(bits, group):
    q = random_groups(40, 256, bits, group)
    if bits == 4:
        back = unpack_awq(**pack_awq(q), group=group)
        assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros)
        assert torch.equal(back.scales, q.scales)
    back = unpack_gptq(*pack_gptq(q).values(), bits=bits)
    assert (back.bits, back.group) == (bits, group)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros) and torch.equal(back.scales, q.scales)


def test_gptq_act_order_is_dequantized_by_its_group_index():
    q = random_groups(16, 64, 4, 32)
    packed = pack_gptq(q)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    g_idx = packed["g_idx"][perm]  # input column i belongs to group g_idx[i]
    w = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], g_idx, 4)
    s, z = q.scales.float(), q.zeros.float()
    expect = torch.stack([s[:, g] * (q.codes[:, i].float() - z[:, g]) for i, g in enumerate(g_idx.tolist())], 1)
    torch.testing.assert_close(w, expect)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 96)])
def test_planes_hold_the_same_weights(bits, group):
    """The kernels' 32-column blocks (a group of 64/128 repeats its scale) dequantize to the same matrix."""
    q = random_groups(24, 384, bits, group)
    if bits == 8:
        q.zeros.fill_(128)
    qs, d, m, planes_bits = q.planes()
    w = ref.dequantize_blocks(qs, d, m, planes_bits)
    exact = q.dequantize()
    if bits == 8:
        assert torch.equal(w, exact)
    else:  # the offset -zero * scale is rounded to fp16
        torch.testing.assert_close(w, exact, rtol=0, atol=float(q.scales.float().max()) * 15 * 2**-11)


def test_no_planes_for_groups_off_the_blocks_or_asymmetric_int8():
    assert random_groups(8, 96, 4, 48).planes() is None
    assert random_groups(8, 64, 8, 32).planes() is None  # zero points other than 128


def test_quantization_configs():
    assert checkpoint_quant({}) is None
    awq_cfg = checkpoint_quant({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                        "zero_point": True, "version": "gemm"}})
    assert (awq_cfg.method, awq_cfg.bits, awq_cfg.group) == ("awq", 4, 128)
    for bad in ({"quant_method": "awq", "bits": 4, "version": "gemv"}, {"quant_method": "bitsandbytes"},
                {"quant_method": "gptq", "bits": 3}):
        with pytest.raises(LlmrunError):
            checkpoint_quant({"quantization_config": bad})
    assert checkpoint_quant({"quantization_config": {"quant_method": "gptq", "bits": "8", "group_size": -1}}).bits == 8
    # what a config.json may hold instead of a group size or an object: named, not a ZeroDivisionError or TypeError
    for bad, words in [({"group_size": 0}, "group_size is 0"), ({"group_size": -2}, "group_size is -2"),
                       ({"group_size": None}, "group_size is None"), ({"bits": 4.5}, "bits is 4.5"),
                       ({"group_size": True}, "group_size is True")]:
        with pytest.raises(ModelFormatError, match=words):
            checkpoint_quant({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32, **bad}})
    with pytest.raises(ModelFormatError, match="quantization_config is a list"):
        checkpoint_quant({"quantization_config": [1]})


def test_gptq_g_idx_out_of_range():
    """An act-order checkpoint's g_idx naming a group it lacks: one error, not an IndexError."""
    qweight = torch.zeros(64 // 4, 8, dtype=torch.int32)  # 64 input columns of 8-bit codes, 8 outputs
    qzeros, scales = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 8, dtype=torch.float16)
    g_idx = torch.arange(64) % 2  # act order: columns alternate between the two groups
    assert unpack_gptq(qweight, qzeros, scales, g_idx, 8).shape == (8, 64)
    for bad in (g_idx + 1, g_idx - 1, g_idx[:63]):
        with pytest.raises(ModelFormatError, match="g_idx"):
            unpack_gptq(qweight, qzeros, scales, bad, 8)


# --- rounding and the AWQ search --------------------------------------------------------------------------


def test_round_to_nearest_groups():
    w = torch.randn(16, 128) + torch.linspace(-1, 3, 16)[:, None]  # some rows all positive: zero must fit
    q = quantize_groups(w, 4, 32)
    assert q.codes.max() <= 15 and q.zeros.max() <= 15
    half_step = q.scales.float().repeat_interleave(32, 1) / 2
    assert ((q.dequantize() - w).abs() <= half_step * 1.01 + 1e-6).all()
    q8 = quantize_int8_rows(w)
    assert q8.zeros.eq(128).all() and q8.group == 128
    assert ((q8.dequantize() - w).abs() <= q8.scales.float() / 2 * 1.01).all()


def test_the_scale_search_protects_outlier_channels():
    """Inputs with a few channels 30x larger: AWQ's scales cut the output error well below RTN's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g)
    x[:, :4] *= 30
    w = torch.randn(96, 256, generator=g) * 0.05
    inputs = LinearInputs(x.abs().mean(0), x.pow(2).mean(0), x)
    s, err, rtn_err = search_scale(w, inputs, 4, 64)
    assert err < 0.7 * rtn_err
    assert s[:4].min() > s[4:].max()  # the loud channels are scaled up


def test_each_layer_keeps_the_scaling_and_grid_that_err_least():
    """`choose_scaling` returns the best of its four ways (search's scales or none, fitted or min/max grid), judged
    by the output error through a nonlinear `forward` (an MLP-like gate, as gate/up's is judged), and never worse
    than RTN's."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 128, generator=g)
    x[:, :3] *= 20
    x[:8] *= 8  # a few tokens with massive activations
    w = torch.randn(64, 128, generator=g) * 0.05
    down = torch.randn(16, 32, generator=g)
    forward = lambda rows, weight: (torch.nn.functional.silu(rows @ weight[:32].T) * (rows @ weight[32:].T)) @ down.T
    inputs = LinearInputs(x.abs().mean(0), x.pow(2).mean(0), x)
    s, grid, err, rtn_err = awq.choose_scaling(w, inputs, 4, 32, forward=forward)
    y = forward(x, w)

    def error(c, quantized):
        return (forward(x / c, quantized.dequantize()) - y).pow(2).mean().item()

    searched = search_scale(w, inputs, 4, 32, forward=forward)[0]
    ones = torch.ones_like(searched)
    ways = {(tag, "fit"): error(c, awq.fit_groups(w * c, x.pow(2).mean(0) / c**2, 4, 32))
            for tag, c in (("s", searched), ("1", ones))}
    ways |= {(tag, "minmax"): error(c, quantize_groups(w * c, 4, 32)) for tag, c in (("s", searched), ("1", ones))}
    assert rtn_err == pytest.approx(ways["1", "minmax"], rel=1e-5)
    assert err == pytest.approx(min(ways.values()), rel=1e-5) and err <= rtn_err
    assert torch.equal(s, searched if min(ways, key=ways.get)[0] == "s" else ones) and grid == min(ways, key=ways.get)[1]


def weighted_group_error(q: GroupQuant, w, energy):
    """(out, in / group): each group's rounding error weighted by its input channels' energy."""
    out, inp = w.shape
    return ((q.dequantize() - w).pow(2) * energy).view(out, inp // q.group, q.group).sum(-1)


@pytest.mark.parametrize("group, bits", [(32, 4), (64, 4), (128, 8)])
def test_the_c_grid_error_is_the_torch_one(group, bits):
    """AWQ's inner loop in C (`kernels.cpu.grid_error`) against its torch form: every group's weighted rounding error
    to float32 rounding (a group's sum runs in another order), on grids that clip (codes at both ends), with zero
    energies, a zero weight and a group whose scale is the smallest."""
    from llmrun import kernels
    from llmrun.kernels import cpu

    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    g = torch.Generator().manual_seed(group)
    top = 2**bits - 1
    wg = torch.randn(37, 5, group, generator=g) * 0.05
    wg[0, 0] = 0.0
    assert kernels.cpu_kernels_serve(wg)  # so `got` below is the C kernel's
    e = torch.exp(torch.randn(1, 5, group, generator=g) * 2)
    e[0, 1, :3] = 0.0
    hi, lo = wg.amax(-1, keepdim=True).clamp(min=0), wg.amin(-1, keepdim=True).clamp(max=0)
    for r_lo, r_hi in ((1.0, 1.0), (0.6, 0.8), (0.55, 1.0)):
        scale = ((hi * r_hi - lo * r_lo).clamp(min=1e-5) / top).half().float()
        zero = (-lo * r_lo / scale).round().clamp(0, top)
        got = awq._grid_error(wg, e, scale, zero, top)
        with kernels.reference_ops():
            want = awq._grid_error(wg, e, scale, zero, top)
        assert got.shape == (37, 5) and not torch.equal(want, torch.zeros_like(want))
        torch.testing.assert_close(got, want, rtol=group * 2**-24, atol=0)  # group terms summed in another order


@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_grid_fit_never_loses_to_min_max_and_usually_wins(group):
    """Random weights (some rows all of one sign, so the zero point sits at an end), energies spread over four
    orders of magnitude: in every group the fitted grid's weighted error is at most the min/max grid's, and over
    the layer below it (by 22-23% at groups of 32 and 64, 9% at 128 with these seeds)."""
    g = torch.Generator().manual_seed(group)
    w = torch.randn(48, 256, generator=g) * 0.1 + torch.linspace(-0.3, 0.3, 48)[:, None]
    energy = torch.exp(torch.randn(256, generator=g) * 2)
    fitted, plain = awq.fit_groups(w, energy, 4, group), quantize_groups(w, 4, group)
    assert fitted.codes.max() <= 15 and fitted.zeros.max() <= 15 and (fitted.scales > 0).all()
    mine, theirs = weighted_group_error(fitted, w, energy), weighted_group_error(plain, w, energy)
    assert (mine <= theirs).all()
    assert mine.sum() < 0.95 * theirs.sum()


def test_the_grid_fit_clips_an_outlier_on_a_quiet_channel():
    """A weight outlier on a channel whose input is nearly silent: the fitted grid gives it up for finer steps
    on the others (clipping), cutting the group's weighted error by a third to a tenth."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g) * 0.1
    w[:, 5] = 2.0
    energy = torch.ones(64)
    energy[5] = 1e-6
    fitted, plain = awq.fit_groups(w, energy, 4, 32), quantize_groups(w, 4, 32)
    assert (fitted.dequantize()[:, 5] < 1.5).all()  # clipped
    assert (fitted.scales[:, 0].float() < 0.75 * plain.scales[:, 0].float()).all()  # finer steps
    mine, theirs = weighted_group_error(fitted, w, energy), weighted_group_error(plain, w, energy)
    assert (mine[:, 0] < 0.7 * theirs[:, 0]).all() and mine[:, 0].sum() < 0.4 * theirs[:, 0].sum()
    assert (mine[:, 1] <= theirs[:, 1]).all()


def test_the_grid_fit_on_a_grid_integer_zero_points_cannot_hold():
    """Weights on a 4-bit grid offset by 0.4 of a step (a GGUF Q4_1 block, w = d q + m: the embedded model's
    case), which no integer zero point reproduces: min/max rounding is off by 0.4 step on every weight; the fit
    is never worse, and trades scale against offset to do better over the layer."""
    g = torch.Generator().manual_seed(1)
    d = torch.rand(16, 1, generator=g) * 0.02 + 0.01
    q = torch.randint(0, 16, (16, 32), generator=g).float()
    q[:, 0], q[:, 1] = 0, 15
    w = d * (q - 7.4)
    fitted, plain = awq.fit_groups(w, torch.ones(32), 4, 32), quantize_groups(w, 4, 32)
    mine, theirs = weighted_group_error(fitted, w, torch.ones(32)), weighted_group_error(plain, w, torch.ones(32))
    assert torch.allclose((plain.dequantize() - w).abs() / d, torch.tensor(0.4), atol=0.01)
    assert (mine <= theirs).all() and mine.sum() < 0.9 * theirs.sum()


def test_the_grid_fit_handles_flat_groups_and_silent_channels():
    """Groups of one value, all zeros, and channels with no energy at all: finite grids, no NaN, and where
    nothing can be fitted the min/max grid stands."""
    w = torch.zeros(4, 64)
    w[1] = 0.5
    w[2, :32] = torch.linspace(-1, 1, 32)
    w[3] = torch.linspace(-1, 1, 64)
    energy = torch.ones(64)
    energy[32:] = 0
    fitted, plain = awq.fit_groups(w, energy, 4, 32), quantize_groups(w, 4, 32)
    assert torch.isfinite(fitted.dequantize()).all() and (fitted.scales > 0).all()
    assert torch.equal(fitted.dequantize()[:, 32:], plain.dequantize()[:, 32:])  # silent: nothing to fit
    assert (fitted.dequantize()[:2] - w[:2]).abs().max() < 1e-3


def test_folding_the_scales_keeps_the_float_block(monkeypatch):
    """`awq_block` changes how the weights round but not what the block computes: the scales folded into the
    norms, into v's rows (one per key/value channel under GQA, bias included) and into up's rows cancel
    exactly."""
    def random_scales(w, inputs, bits, group, tie=None, forward=None):  # far from 1, tied across GQA heads as the search's are
        shape = (tie[0], 1, tie[2]) if tie else (w.shape[1],)
        s = torch.exp(torch.randn(shape))
        return (s.expand(*tie).reshape(-1) if tie else s), 0.0, 0.0

    monkeypatch.setattr(awq, "search_scale", random_scales)
    model = random_model(QCFG, seed=3)
    block = model.layers[0]
    x = torch.randn(4, 24, QCFG.dim)
    cos, sin = (t[:24] for t in model._rope_tables(24, x.device))
    weights_before = {name: p.clone() for name, p in block.named_parameters()}
    with torch.no_grad():
        inputs, before = capture_inputs(block, x, cos, sin, None, 256, torch.Generator().manual_seed(0))
        awq.awq_block(block, inputs, QCFG, 4, 32)
        after = block(x, cos, sin, 0, None, None)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    changed = [name for name, p in block.named_parameters() if not torch.equal(p, weights_before[name])]
    assert sorted(changed) == ["attn.o.weight", "attn.qkv.bias", "attn.qkv.weight", "attn_norm.weight",
                               "mlp.down.weight", "mlp.gate_up.weight", "mlp_norm.weight"]


def test_choose_group_size():
    smol = replace(CONFIGS["smollm2"], dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536)
    assert choose_group_size(smol, None) == 64  # 576 is not a multiple of 128
    assert choose_group_size(smol, None, blocks_of_32=True) == 32  # a GGUF's Q4_1 blocks: keep their grid
    assert choose_group_size(smol, 64, blocks_of_32=True) == 64
    assert choose_group_size(smol, 32) == 32
    assert choose_group_size(smol, 96) == 96  # a fit outside the defaults
    with pytest.raises(LlmrunError, match=r"--group-size 128 .*576.*sizes that fit: 192, 96, 64, 32$"):
        choose_group_size(smol, 128)
    for bad in (48, 0, -32):  # named as what they are: 576 is a multiple of 48
        with pytest.raises(LlmrunError, match=rf"--group-size {bad}: it must be a positive multiple of 32; .* 192, 96, 64, 32$"):
            choose_group_size(smol, bad)


def test_calibration_windows(tiny_tokenizer):
    tok = tiny_tokenizer
    text = " ".join(f"w{i % 100}" for i in range(1000))
    windows, note = calibration_windows(tok, text, samples=8, seq_len=64, seed=0)
    assert windows.shape == (8, 64) and note is None
    assert len({tuple(w.tolist()) for w in windows}) == 8
    windows, note = calibration_windows(tok, text, samples=100, seq_len=64, seed=0)
    assert windows.shape == (15, 64) and "fewer than --samples 100" in note
    with pytest.raises(LlmrunError, match="fewer than --seq-len"):
        calibration_windows(tok, "w1 w2", samples=8, seq_len=64, seed=0)


def test_a_bare_canterbury_calibrates_on_the_default_texts(monkeypatch):
    read = []
    monkeypatch.setattr("llmrun.eval.read_text", lambda spec: read.append(spec) or spec)
    assert read_calibration("canterbury") == read_calibration(None) == "\n\n".join(DEFAULT_CALIB)
    assert "canterbury:alice29" not in read
    assert read_calibration("canterbury:alice29") == "canterbury:alice29"  # named, it is the user's choice


def test_config_to_hf_round_trips():
    for cfg in [*CONFIGS.values(), QCFG, replace(CONFIGS["llama"], rope_scaling=RopeScaling("linear", 4.0))]:
        assert config_from_hf(config_to_hf(cfg)) == cfg


# --- checkpoints end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    model = random_model(QCFG, seed=0)
    path = write_hf_dir(root / "float", model)
    text = " ".join(f"w{(i * 7) % 127}" for i in range(4000))
    (root / "calib.txt").write_text(text)
    (root / "short.txt").write_text("w1 w2 w3")
    return path, model, root / "calib.txt"


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_source):
    from llmrun.tokenizer import tokenizer_from_hf_dir

    return tokenizer_from_hf_dir(tiny_source[0])


def test_the_output_config_names_one_dtype(tiny_source, tmp_path):
    import shutil

    source = shutil.copytree(tiny_source[0], tmp_path / "src")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))  # as transformers 5 writes it
    quantize(str(source), tmp_path / "q", QuantizeOptions("int8"), device="cpu")  # (widths of 144: no 4-bit groups)
    written = json.loads((tmp_path / "q" / "config.json").read_text())
    assert (written["dtype"], written["torch_dtype"]) == ("float16", "float16")


@pytest.mark.parametrize("method", ["awq", "rtn", "int8"])
def test_a_checkpoint_reloads_close_to_the_float_model(tiny_source, tmp_path, method):
    from llmrun.loading import load_model

    source, model, calib = tiny_source
    options = QuantizeOptions(method, calib=str(calib) if method == "awq" else None, samples=8, seq_len=64)
    result = quantize(str(source), tmp_path / "q", options, device="cpu")
    assert (result.bits, result.group_size) == ((8, -1) if method == "int8" else (4, 32))
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = config["quantization_config"]
    if method == "int8":
        assert qc == {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True, "desc_act": False,
                      "checkpoint_format": "gptq"}
    else:
        assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == \
            {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    if method == "awq":  # the calibration as it was used: as many windows as the text held, up to --samples
        assert result.calibration_tokens == 8 * 64
        assert {k: config["llmrun"][k] for k in ("samples", "seq_len", "seed")} == {"samples": 8, "seq_len": 64,
                                                                                   "seed": 0}
    packed = load_model(str(tmp_path / "q"), device="cpu", dtype="fp32")
    plain = load_model(str(tmp_path / "q"), device="cpu", dtype="fp32", weights="dequant")
    assert packed.weights == "packed" and plain.weights == "dequant"
    ids = torch.tensor([[3, 17, 99, 5, 64, 2, 88, 41]])
    with torch.no_grad():
        want = model(ids)
        got_plain, got_packed = plain.model(ids), packed.model(ids)
    # the packed path differs from the checkpoint only by the 8-bit output head and fp16 offsets
    torch.testing.assert_close(got_packed, got_plain, rtol=0, atol=0.05 * got_plain.abs().max().item())
    rel = (got_plain - want).norm() / want.norm()
    assert rel < (0.05 if method == "int8" else 0.5)
    if method != "awq":  # the checkpoint holds exactly the rounded source weights
        rounded = quantize_int8_rows if method == "int8" else lambda w: quantize_groups(w, 4, 32)
        for ours, theirs in zip(plain.model.layers, model.layers):
            for name in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
                w = theirs.get_submodule(name).weight
                assert torch.equal(ours.get_submodule(name).weight, rounded(w).dequantize())


def test_the_config_records_the_calibration_used_not_asked(tiny_source, tmp_path):
    source, _, calib = tiny_source
    result = quantize(str(source), tmp_path / "q", QuantizeOptions("awq", calib=str(calib), samples=100_000,
                                                                   seq_len=64, seed=3), device="cpu")
    used = result.calibration_tokens // 64
    assert 0 < used < 100_000 and any(f"using {used}" in note for note in result.notes)
    recorded = json.loads((tmp_path / "q" / "config.json").read_text())["llmrun"]
    assert {k: recorded[k] for k in ("samples", "seq_len", "seed")} == {"samples": used, "seq_len": 64, "seed": 3}


def test_progress_while_quantizing_and_loading_the_checkpoint(tiny_source, tmp_path):
    from safetensors import safe_open

    from llmrun.loading import load_weights, open_model

    from .test_loading import assert_counts_up_to

    source, model, _ = tiny_source
    calls = []
    quantize(str(source), tmp_path / "q", QuantizeOptions("rtn"), device="cpu", on_progress=lambda *call: calls.append(call))
    reading = [call for call in calls if call[2] == "reading weights"]
    assert [done for done, _, _ in reading] == list(range(len(reading))) and reading[-1][0] == reading[-1][1]
    blocks = calls[len(reading):]
    assert [(done, total) for done, total, _ in blocks] == [(i, QCFG.n_layers) for i in range(QCFG.n_layers + 1)]

    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    codes = ("qweight", "qzeros", "scales")
    layers = {name.rpartition(".")[0] for name in names if name.endswith(".qweight")}
    for weights in ("auto", "dequant"):  # each quantized layer is one step, read as codes or dequantized
        calls = []
        load_weights(open_model(str(tmp_path / "q")), device="cpu", dtype="fp32", weights=weights,
                     on_progress=lambda *call: calls.append(call))
        assert_counts_up_to(calls, len([n for n in names if n.rpartition(".")[2] not in codes]) + len(layers))


AWQ_HELD_OUT = (
    "The old lighthouse keeper climbed the stairs every evening, counting the steps as his father had taught him. "
    "From the lamp room he could see the fishing boats returning, their lights scattered across the dark water. "
    "He wrote the weather in a small notebook: wind from the west, a falling barometer, rain expected by morning."
)


@pytest.fixture(scope="module")
def smollm2_quantized(tmp_path_factory):
    """The embedded model quantized by AWQ and by RTN at the default group size (32: its GGUF's blocks) -> the
    directory holding both, and AWQ's QuantizeResult. AWQ's calibration is small and fixed: fixtures/calibration.txt,
    14 replies of the embedded model itself to `llmrun chat -p` prompts on everyday topics (seed 7, temperature
    0.7), about 4,900 tokens."""
    root = tmp_path_factory.mktemp("smollm2-q")
    calib = str(Path(__file__).parent / "fixtures" / "calibration.txt")
    results = {}
    for method in ("awq", "rtn"):
        opts = QuantizeOptions(method, calib=calib if method == "awq" else None, samples=8, seq_len=256, search_rows=256)
        results[method] = quantize("smollm2", root / method, opts, device="cpu")
    assert results["awq"].group_size == 32
    return root, results["awq"]


@pytest.mark.slow
def test_awq_is_never_worse_than_rtn_on_the_embedded_model(smollm2_quantized, smollm2_dequant):
    """Layer by layer on the calibration rows (as `llmrun quantize` reports it), then block by block on held-out
    text fed the float model's own hidden states: AWQ's output is closer to the float model's than
    round-to-nearest's."""
    from llmrun.loading import load_model

    root, awq_result = smollm2_quantized
    ratios = awq_result.awq_error_vs_rtn
    assert set(ratios) == {"qkv", "o", "gate_up", "down"} and all(r < 1 for r in ratios.values()), ratios
    orig = smollm2_dequant.model
    quantized = {m: load_model(str(root / m), device="cpu", dtype="fp32", weights="dequant").model
                 for m in ("awq", "rtn")}
    ids = torch.tensor([smollm2_dequant.tokenizer.encode(AWQ_HELD_OUT)])
    T = ids.shape[1]
    cos, sin = (t[:T] for t in orig._rope_tables(T, ids.device))
    errors = {"awq": [], "rtn": []}
    with torch.no_grad():
        h = orig.embed(ids)
        for i, block in enumerate(orig.layers):
            want = block(h, cos, sin, 0, None, None)
            for m, model in quantized.items():
                errors[m].append((model.layers[i](h, cos, sin, 0, None, None) - want).pow(2).mean().item())
            h = want
    awq_err, rtn_err = torch.tensor(errors["awq"]), torch.tensor(errors["rtn"])
    assert (awq_err <= rtn_err).all(), [i for i in range(len(awq_err)) if awq_err[i] > rtn_err[i]]
    assert awq_err.sum() < 0.8 * rtn_err.sum()


@pytest.mark.parametrize("act_order", [False, True])
def test_a_gptq_int4_checkpoint_loads_as_its_awq_twin(tiny_source, tmp_path, act_order):
    """The same INT4 codes in GPTQ's layout (4-bit, asymmetric; with desc_act, input columns listed by g_idx)
    give the same model as in AWQ's: packed when the groups are in order, dequantized under act-order."""
    from safetensors.torch import load_file, save_file

    from llmrun.loading import load_model

    quantize(str(tiny_source[0]), tmp_path / "awq", QuantizeOptions("rtn"), device="cpu")
    tensors, converted = load_file(str(tmp_path / "awq" / "model.safetensors")), {}
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "qweight":
            q = unpack_awq(t, tensors[f"{module}.qzeros"], tensors[f"{module}.scales"], 32)
            converted.update({f"{module}.{k}": v for k, v in pack_gptq(q).items()})
        elif suffix not in ("qzeros", "scales"):
            converted[name] = t
    (tmp_path / "gptq").mkdir()
    save_file(converted, str(tmp_path / "gptq" / "model.safetensors"))
    for f in (tmp_path / "awq").glob("*.json"):
        (tmp_path / "gptq" / f.name).write_text(f.read_text())
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False,
                                     "desc_act": act_order}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    ids = torch.tensor([[3, 17, 99, 5, 64, 2]])
    awq_model = load_model(str(tmp_path / "awq"), device="cpu", dtype="fp32")
    gptq_model = load_model(str(tmp_path / "gptq"), device="cpu", dtype="fp32")
    assert gptq_model.weights == ("dequant" if act_order else "packed")
    with torch.no_grad():
        if act_order:
            awq_model = load_model(str(tmp_path / "awq"), device="cpu", dtype="fp32", weights="dequant")
        torch.testing.assert_close(gptq_model.model(ids), awq_model.model(ids))


def test_cli_quantizes_a_gguf_and_the_result_chats(tmp_path, monkeypatch, capsys):
    """A GGUF source (tokenizer exported as tokenizer.json): quantize, then info and generate on the result."""
    model = random_model(replace(QCFG, architecture="LlamaForCausalLM", attention_bias=False), seed=1)
    gguf_path = write_gguf(tmp_path / "tiny.gguf", model, qtype="Q4_1")
    code, out, err = run_main(["quantize", gguf_path, "--rtn", "-o", tmp_path / "q", "--json"], monkeypatch, capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["method"] == "rtn" and doc["group_size"] == 32
    assert "dequantized first" in err and "wrote" in err
    files = sorted(p.name for p in (tmp_path / "q").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"]
    code, out, err = run_main(["info", tmp_path / "q"], monkeypatch, capsys)
    assert code == 0 and "AWQ INT4" in err + out
    code, out, err = run_main(["generate", tmp_path / "q", "abc", "-n", "4", "--temperature", "0"], monkeypatch, capsys)
    assert code == 0, err


@pytest.mark.parametrize("method", ["--rtn", "--awq"])
def test_a_qwen3_checkpoint_keeps_its_head_norms(tmp_path, monkeypatch, capsys, method):
    """Qwen3's q_norm/k_norm stay float beside the layer norms (they were left out: the checkpoint did not load);
    AWQ's scales, folded into the inputs of q/k/v, leave the norms after them as they are."""
    from llmrun.loading import load_model

    cfg = replace(QCFG, architecture="Qwen3ForCausalLM", attention_bias=False, qk_norm=True, tie_embeddings=True)
    model = random_model(cfg, seed=2)
    source = write_hf_dir(tmp_path / "float", model)
    code, _, err = run_main(["quantize", source, method, "-o", tmp_path / "q", "--group-size", "32"], monkeypatch, capsys)
    assert code == 0, err
    quantized = load_model(str(tmp_path / "q"), "cpu", "fp32", "dequant").model
    assert torch.equal(quantized.layers[1].attn.k_norm.weight, model.layers[1].attn.k_norm.weight.half().float())
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)
        assert (quantized(tokens) - want).norm() / want.norm() < 0.5  # (as the other families' 4-bit checkpoints)


def test_the_exported_tokenizer_reads_back_the_same(embedded_path, tmp_path):
    from llmrun.loading import open_model
    from llmrun.tokenizer import tokenizer_from_hf_dir

    tok = open_model(str(embedded_path)).tokenizer
    tok.save(tmp_path)
    back = tokenizer_from_hf_dir(tmp_path)
    for text in ["Hello world!", "  indented\n\tcode = 12345;", "naïve café ☕", "<|im_start|>user"]:
        assert back.encode(text) == tok.encode(text)
        assert back.encode(text, special=True) == tok.encode(text, special=True)
    messages = [{"role": "user", "content": "Hi"}]
    assert back.encode_chat(messages) == tok.encode_chat(messages)
    assert (back.bos_id, back.eos_id, back.eos_ids, back.add_bos) == (tok.bos_id, tok.eos_id, tok.eos_ids, tok.add_bos)


# --- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--calib", "/nonexistent/calib.txt"], "no such file"),
    (["--rtn", "--group-size", "48"], "multiple of 32"),
    (["--rtn", "--group-size", "128"], "sizes that fit: 32"),
    (["--awq", "--rtn"], "choose one of --awq, --rtn and --int8"),
    (["--bits", "8"], "for 8 bits use --int8"),
    (["--int8", "--group-size", "32"], "per output channel"),
    (["--rtn", "--samples", "4"], "calibration applies to --awq only"),
    (["--int8", "--seed", "5"], "--seed: calibration applies to --awq only"),
    (["--seq-len", "100000"], "exceeds the model's context of 256 tokens"),
    (["--calib", "SHORT", "--seq-len", "64"], "fewer than --seq-len"),
])
def test_bad_input_is_one_line(tiny_source, tmp_path, monkeypatch, capsys, args, message):
    source, _, calib = tiny_source
    if "--calib" not in args and "--rtn" not in args and "--int8" not in args:
        args = [*args, "--calib", calib]
    args = [str(calib.with_name("short.txt")) if a == "SHORT" else a for a in args]
    code, out, err = run_main(["quantize", source, "-o", tmp_path / "new" / "q", *args], monkeypatch, capsys)
    assert code != 0 and out == ""
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists()  # nothing made, the directories above -o neither


def test_refuses_a_quantized_input_and_a_full_output_dir(tiny_source, tmp_path, monkeypatch, capsys):
    source = tiny_source[0]
    assert run_main(["quantize", source, "--rtn", "-o", tmp_path / "q"], monkeypatch, capsys)[0] == 0
    code, _, err = run_main(["quantize", tmp_path / "q", "--rtn", "-o", tmp_path / "again"], monkeypatch, capsys)
    assert code == 1 and "already quantized (RTN INT4, in the AWQ layout)" in err  # as `llmrun models` calls it
    code, _, err = run_main(["quantize", source, "--rtn", "-o", tmp_path / "q"], monkeypatch, capsys)
    assert code == 1 and "not an empty directory" in err
    code, _, err = run_main(["quantize", source, "--rtn", "-o", ""], monkeypatch, capsys)  # (not ".")
    assert code == 2 and "'--out' / '-o': is empty" in err


def test_an_empty_output_dir_is_filled_in_place(tiny_source, tmp_path, monkeypatch, capsys):
    """-o . (or any existing empty directory: a mount point, one with modes of its own) receives the files; the
    directory itself stays, its modes too, and no temporary directory is left in it. DIR/.. is DIR's parent."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    here = tmp_path / "here"
    here.mkdir(mode=0o750)
    inode = here.stat().st_ino
    code, _, err = run_main(["quantize", tiny_source[0], "--int8", "-o", "."], monkeypatch, capsys, cwd=here)
    assert code == 0, err
    assert sorted(p.name for p in here.iterdir() if p.name.startswith(".")) == []
    assert (here / "config.json").is_file() and (here / "model.safetensors").is_file()
    assert here.stat().st_ino == inode and here.stat().st_mode & 0o777 == 0o750
    assert run_main(["generate", ".", "w1", "-n", "2"], monkeypatch, capsys, cwd=here)[0] == 0
    (tmp_path / "up").mkdir()
    code, _, err = run_main(["quantize", tiny_source[0], "--int8", "-o", tmp_path / "up" / "missing" / ".."],
                            monkeypatch, capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "up").iterdir()) == sorted(p.name for p in here.iterdir())


def test_a_failed_write_into_an_empty_dir_leaves_it_empty(tiny_source, tmp_path, monkeypatch):
    import llmrun.quantize as q

    def fail_at(n):
        real, calls = os.replace, []

        def replace(src, dst):
            calls.append(dst)
            if len(calls) == n:
                raise OSError(28, "No space left on device")
            real(src, dst)
        return replace

    (tmp_path / "q").mkdir()
    for n in (1, 2):  # the first file, or a later one after the first was moved in
        monkeypatch.setattr(q.os, "replace", fail_at(n))
        with pytest.raises(LlmrunError, match="writing failed \\(No space left on device\\)"):
            quantize(str(tiny_source[0]), tmp_path / "q", QuantizeOptions("int8"), device="cpu")
        assert list((tmp_path / "q").iterdir()) == []
    monkeypatch.undo()
    real = q._float_tensors

    def appears(model):  # a file written into -o during the work: nothing is written beside or over it
        (tmp_path / "q" / "late").write_text("")
        return real(model)

    monkeypatch.setattr(q, "_float_tensors", appears)
    with pytest.raises(LlmrunError, match="files appeared in it while quantizing"):
        quantize(str(tiny_source[0]), tmp_path / "q", QuantizeOptions("int8"), device="cpu")
    assert [p.name for p in (tmp_path / "q").iterdir()] == ["late"]


def test_the_output_dir_may_be_a_symlink(tiny_source, tmp_path, monkeypatch, capsys):
    """-o through a link writes the checkpoint where it points: an empty directory, or one still to be made."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "to_empty").symlink_to(tmp_path / "empty")
    (tmp_path / "to_missing").symlink_to(tmp_path / "disk" / "q")
    for link, target in (("to_empty", "empty"), ("to_missing", "disk/q")):
        code, _, err = run_main(["quantize", tiny_source[0], "--int8", "-o", tmp_path / link], monkeypatch, capsys)
        assert code == 0, err
        assert (tmp_path / link).is_symlink() and (tmp_path / target / "model.safetensors").is_file()
        assert run_main(["generate", tmp_path / link, "w1", "-n", "2"], monkeypatch, capsys)[0] == 0
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "via").symlink_to(tmp_path / "loop" / "sub")
    for out in ("loop", "via", "loop/sub"):
        code, _, err = run_main(["quantize", tiny_source[0], "--int8", "-o", tmp_path / out], monkeypatch, capsys)
        assert code == 1 and "go round in a loop" in err and len(err.strip().splitlines()) == 1, err


def test_an_unsupported_quantization_method_fails_to_load(tiny_source, tmp_path, monkeypatch, capsys):
    import shutil

    path = shutil.copytree(tiny_source[0], tmp_path / "bnb")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(["generate", path, "hi", "-n", "2"], monkeypatch, capsys)
    assert code == 1 and "'bitsandbytes'" in err and "Traceback" not in err


def test_a_checkpoint_whose_config_contradicts_its_packed_tensors_fails_to_load(tmp_path):
    """A vocabulary the config gives but the (tied, so packed) embedding does not have: named as the float path
    names it, not a state-dict size mismatch."""
    from llmrun.loading import load_model

    from .tiny import CONFIGS, random_model, write_hf_dir

    cfg = replace(CONFIGS["smollm2"], n_heads=8, n_kv_heads=2, ffn_dim=128)  # widths of 32s: packed
    quantize(str(write_hf_dir(tmp_path / "float", random_model(cfg))), tmp_path / "q", QuantizeOptions("rtn"),
             device="cpu")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] // 2}))
    for weights in ("auto", "dequant"):
        with pytest.raises(ModelFormatError, match="the config implies"):
            load_model(str(tmp_path / "q"), device="cpu", dtype="fp32", weights=weights)


@pytest.fixture(scope="module")
def packed_checkpoint(tmp_path_factory):
    """A tied-embedding RTN checkpoint whose widths are whole groups, so it loads packed on a CPU, and its source."""
    root = tmp_path_factory.mktemp("packed")
    cfg = replace(CONFIGS["smollm2"], n_heads=8, n_kv_heads=2, ffn_dim=128)
    source = write_hf_dir(root / "float", random_model(cfg))
    quantize(str(source), root / "q", QuantizeOptions("rtn"), device="cpu")
    return source, root / "q"


def _edit_tensor(path: Path, name: str, change) -> None:
    from safetensors.torch import load_file, save_file

    [file] = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, file)


@pytest.mark.parametrize("name,change,message", [
    ("model.layers.0.self_attn.q_proj.qweight", lambda t: t.float(), "qweight is a 2-D float32 tensor; AWQ stores"),
    ("model.layers.1.mlp.up_proj.qzeros", lambda t: t.to(torch.int8), "qzeros is a 2-D int8 tensor"),
    ("model.layers.0.self_attn.o_proj.scales", lambda t: t.view(torch.int16), "scales is a 2-D int16 tensor"),
    ("model.layers.0.self_attn.o_proj.qweight", lambda t: t.flatten(), "qweight is a 1-D int32 tensor"),
    ("model.embed_tokens.weight", lambda t: t.flatten(), "model.embed_tokens.weight has shape"),
    ("model.embed_tokens.weight", lambda t: t.to(torch.int32), "model.embed_tokens.weight holds int32, not floats"),
    ("model.norm.weight", lambda t: t > 0, "model.norm.weight holds bool, not floats"),
    ("model.layers.0.input_layernorm.weight", lambda t: t[:-1], "input_layernorm.weight has shape (63,), the config"),
])
@pytest.mark.parametrize("weights", ["auto", "dequant"])
def test_a_checkpoint_tensor_stored_as_the_wrong_kind_is_named(packed_checkpoint, tmp_path, monkeypatch, capsys,
                                                               name, change, message, weights):
    import shutil

    path = shutil.copytree(packed_checkpoint[1], tmp_path / "q")
    _edit_tensor(path, name, change)
    code, out, err = run_main(["generate", path, "hi", "-n", "2", "--device", "cpu", "--weights", weights],
                              monkeypatch, capsys)
    assert code == 1 and out == "" and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("weights", ["auto", "dequant"])
def test_a_checkpoint_missing_tensors_names_them_as_its_files_would(packed_checkpoint, tmp_path, monkeypatch,
                                                                     capsys, weights):
    """As the checkpoint names them, not as the model's packed planes: an untied head's hint, a layer's qweight."""
    import shutil

    from safetensors.torch import load_file, save_file

    untied = shutil.copytree(packed_checkpoint[1], tmp_path / "untied")
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    gaps = shutil.copytree(packed_checkpoint[1], tmp_path / "gaps")
    [file] = gaps.glob("*.safetensors")
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if ".1.self_attn." not in k and ".0.mlp.down_proj" not in k}, file)
    norm = shutil.copytree(packed_checkpoint[1], tmp_path / "norm")  # a float tensor of a block
    save_file({k: v for k, v in tensors.items() if k != "model.layers.0.input_layernorm.weight"},
              next(norm.glob("*.safetensors")))
    for path, message in ((untied, "missing tensors lm_head.weight (a model whose head is its embedding says so: "
                                   "tie_word_embeddings true in config.json)"),
                          (gaps, "missing tensors model.layers.0.mlp.down_proj.qweight, "
                                 "model.layers.1.self_attn.o_proj.qweight, model.layers.1.self_attn.q_proj.qweight, "
                                 "model.layers.1.self_attn.k_proj.qweight ..."),
                          (norm, "missing tensors model.layers.0.input_layernorm.weight")):
        code, _, err = run_main(["generate", path, "hi", "-n", "2", "--device", "cpu", "--weights", weights],
                                monkeypatch, capsys)
        assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err


def test_layers_left_in_floats_load_packed_beside_the_codes(packed_checkpoint, tmp_path):
    """AutoAWQ's modules_to_not_convert: a layer stored as a float weight stays a float matrix in the packed model,
    and a fused matrix with such a part (here k of layer 1's q/k/v) is made float whole; the other layers keep
    their codes, and the model computes what the dequantized path computes, as closely as the all-packed model."""
    import shutil

    import torch.nn as nn
    from safetensors.torch import load_file, save_file

    from llmrun.loading import load_model
    from llmrun.models.quant import QuantLinear

    path = shutil.copytree(packed_checkpoint[1], tmp_path / "q")
    plain = load_model(str(path), device="cpu", dtype="fp32", weights="dequant").model
    cfg = plain.config
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    floats = {"model.layers.0.mlp.down_proj": plain.layers[0].mlp.down.weight,
              "model.layers.1.self_attn.k_proj": plain.layers[1].attn.qkv.weight[q_rows:q_rows + kv_rows]}
    [file] = path.glob("*.safetensors")
    tensors = load_file(file)
    for module, w in floats.items():
        for suffix in ("qweight", "qzeros", "scales"):
            del tensors[f"{module}.{suffix}"]
        tensors[f"{module}.weight"] = w.contiguous()  # the dequantized codes, in fp32
    save_file(tensors, file)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["layers.0.mlp.down_proj", "layers.1.self_attn.k_proj"]
    (path / "config.json").write_text(json.dumps(config))

    packed = load_model(str(path), device="cpu", dtype="fp32")
    assert packed.weights == "packed"
    layers = packed.model.layers
    for float_layer in (layers[0].mlp.down, layers[1].attn.qkv):
        assert isinstance(float_layer, nn.Linear) and not isinstance(float_layer, QuantLinear)
    assert isinstance(layers[0].attn.qkv, QuantLinear) and isinstance(layers[1].mlp.down, QuantLinear)
    assert torch.equal(layers[0].mlp.down.weight, plain.layers[0].mlp.down.weight)
    assert torch.equal(layers[1].attn.qkv.weight, plain.layers[1].attn.qkv.weight)
    all_packed = load_model(str(packed_checkpoint[1]), device="cpu", dtype="fp32").model
    ids = torch.tensor([[3, 17, 99, 5, 64, 2, 88, 41]])
    with torch.no_grad():
        got, want, packed_all = packed.model(ids), plain(ids), all_packed(ids)
    # the packed path's distance from the dequantized one (its 8-bit head, the C kernels' rounding), no further
    error, packed_error = ((got - want).norm() / want.norm()).item(), ((packed_all - want).norm() / want.norm()).item()
    assert error < 0.06 and error <= 1.1 * packed_error, (error, packed_error)


def test_a_sharded_checkpoint_loads_layers_whose_tensors_lie_in_different_shards(packed_checkpoint, tmp_path):
    """A large AWQ/GPTQ checkpoint comes in shards, and a layer's qweight, qzeros and scales need not share one."""
    import shutil

    from llmrun.loading import load_model

    from .tiny import shard_hf_dir

    path = shard_hf_dir(shutil.copytree(packed_checkpoint[1], tmp_path / "q"), 3)
    ids = torch.tensor([[3, 17, 99, 5, 64, 2, 88, 41]])
    for weights in ("auto", "dequant"):
        whole = load_model(str(packed_checkpoint[1]), device="cpu", dtype="fp32", weights=weights)
        sharded = load_model(str(path), device="cpu", dtype="fp32", weights=weights)
        assert sharded.weights == whole.weights
        with torch.no_grad():
            assert torch.equal(sharded.model(ids), whole.model(ids))


def test_corrupt_weights_are_one_error_line_without_warnings(tmp_path, monkeypatch, capsys):
    """Scales of all ones bits in a Q5_1 tensor: inf and NaN. Loading it packed names the tensor; its exact
    dequantization (--weights dequant) runs and says the output is not finite; no numpy or torch warning comes
    first; quantize refuses them."""
    import warnings

    import gguf

    path = write_gguf(tmp_path / "m.gguf", random_model(CONFIGS["llama"]), qtype="Q5_1")
    reader = gguf.GGUFReader(str(path), "r+")
    next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data[:, :4] = 0xFF  # each row's first scales
    del reader
    corrupt = "blk.0.attn_q.weight or blk.0.attn_k.weight or blk.0.attn_v.weight hold NaN or inf"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (pytest would keep a warning off stderr)
        code, out, err = run_main(["generate", path, "hi", "-n", "2", "--temperature", "0"], monkeypatch, capsys)
        assert code == 1 and out == "" and err.count("\n") == 1 and corrupt in err, err
        code, out, err = run_main(["generate", path, "hi", "-n", "2", "--temperature", "0", "--weights", "dequant"],
                                  monkeypatch, capsys)
    assert code == 1 and out == "" and err.strip() == "error: the model's output is not finite (NaN or inf): its " \
        "weights are corrupt", err
    code, _, err = run_main(["quantize", path, "--rtn", "-o", tmp_path / "q"], monkeypatch, capsys)
    assert code == 1 and corrupt in err, err
    assert not (tmp_path / "q").exists()


def test_packed_scales_that_are_not_finite_are_refused_at_load(packed_checkpoint, tmp_path):
    """A NaN scale kept packed: one of the C kernels' paths gave finite, wrong text from it, where the dequantized
    path's output check catches it."""
    import shutil

    from llmrun.loading import load_model

    path = shutil.copytree(packed_checkpoint[1], tmp_path / "q")
    nan_first = lambda t: t.index_fill(1, torch.tensor([0]), torch.nan)  # noqa: E731
    _edit_tensor(path, "model.layers.1.self_attn.v_proj.scales", nan_first)
    with pytest.raises(ModelFormatError, match=r"the block scales of model.layers.1.self_attn.q_proj.qweight or "
                                               r"\S+k_proj.qweight or \S+v_proj.qweight hold NaN or inf values"):
        load_model(str(path), device="cpu", dtype="fp32")


@pytest.mark.parametrize("weights", ["auto", "dequant"])
def test_a_missing_or_misshapen_layer_is_named_as_the_checkpoint_stores_it(packed_checkpoint, tmp_path, weights):
    """A layer absent from the checkpoint is named once, alone (packed, its fused group's present parts were listed
    too, and it twice); a layer kept in floats by its .weight, with that tensor's shape; a quantized layer by the
    shape of the matrix its codes make."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmrun.loading import load_model

    def edit(case, change, config_change=None):
        path = shutil.copytree(packed_checkpoint[1], tmp_path / f"{case}-{weights}")
        tensors = load_file(path / "model.safetensors")
        change(tensors)
        save_file(tensors, path / "model.safetensors")
        if config_change:
            config = json.loads((path / "config.json").read_text())
            config_change(config)
            (path / "config.json").write_text(json.dumps(config))
        return str(path)

    k = "model.layers.0.self_attn.k_proj"

    def drop_k(tensors):
        for suffix in ("qweight", "qzeros", "scales"):
            del tensors[f"{k}.{suffix}"]

    with pytest.raises(ModelFormatError, match=rf"missing tensors {k}.qweight$"):
        load_model(edit("absent", drop_k), device="cpu", dtype="fp32", weights=weights)
    path = edit("float", lambda t: (drop_k(t), t.update({f"{k}.weight": torch.zeros(16, 64)})),
                lambda c: c["quantization_config"].update(modules_to_not_convert=["layers.0.self_attn.k_proj"]))
    with pytest.raises(ModelFormatError, match=rf"tensor {k}.weight has shape \(16, 64\), the config implies "
                                               r"\(32, 64\)$"):
        load_model(path, device="cpu", dtype="fp32", weights=weights)
    if weights == "dequant":  # (packed, the codes' planes are checked against the config's matrix first)
        path = edit("codes", lambda t: None, lambda c: c.update(num_key_value_heads=4))
        with pytest.raises(ModelFormatError, match=rf"quantized layer {k} makes a matrix of shape \(32, 64\), "
                                                   r"the config implies \(64, 64\)$"):
            load_model(path, device="cpu", dtype="fp32", weights=weights)


def test_codes_labelled_unsigned_read_the_same(packed_checkpoint, tmp_path, monkeypatch, capsys):
    """qweight and qzeros as U32 (the same bits, as some writers label them) load as the int32 ones do."""
    import shutil

    path = shutil.copytree(packed_checkpoint[1], tmp_path / "q")
    for name in ("model.layers.0.self_attn.q_proj.qweight", "model.layers.0.self_attn.q_proj.qzeros"):
        _edit_tensor(path, name, lambda t: t.view(torch.uint32))
    args = ["generate", "w1 w2", "-n", "4", "--temperature", "0", "--device", "cpu", "--json"]
    signed, unsigned = (run_main([args[0], p, *args[1:]], monkeypatch, capsys) for p in (packed_checkpoint[1], path))
    assert signed[0] == unsigned[0] == 0, unsigned[2]
    assert json.loads(signed[1])["text"] == json.loads(unsigned[1])["text"]


def test_quantize_refuses_a_source_tensor_that_is_not_floats(packed_checkpoint, tmp_path, monkeypatch, capsys):
    import shutil

    source = shutil.copytree(packed_checkpoint[0], tmp_path / "float")
    _edit_tensor(source, "model.layers.0.input_layernorm.weight", lambda t: t.to(torch.int64))
    code, _, err = run_main(["quantize", source, "--rtn", "-o", tmp_path / "q"], monkeypatch, capsys)
    assert code == 1 and "input_layernorm.weight holds int64, not floats" in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.gpu
def test_awq_on_a_gpu_and_its_checkpoint_packed_there(tiny_source, tmp_path):
    """`--device cuda`: the search runs on the GPU (each block moved there in turn) and its checkpoint is as close
    to the float model as the CPU's; AWQ codes load packed onto the GPU's W4A16 kernels and compute what the
    checkpoint holds."""
    from llmrun.loading import load_model

    source, model, calib = tiny_source
    options = QuantizeOptions("awq", calib=str(calib), samples=8, seq_len=64)
    errors = {}
    ids = torch.tensor([[3, 17, 99, 5, 64, 2, 88, 41]])
    with torch.no_grad():
        want = model(ids)
        for device in ("cuda", "cpu"):
            result = quantize(str(source), tmp_path / device, options, device=device)
            assert result.awq_error_vs_rtn and all(r < 1 for r in result.awq_error_vs_rtn.values())
            plain = load_model(str(tmp_path / device), device="cpu", dtype="fp32", weights="dequant")
            errors[device] = ((plain.model(ids) - want).norm() / want.norm()).item()
        assert errors["cuda"] < 1.25 * errors["cpu"] + 1e-3, errors
        packed = load_model(str(tmp_path / "cuda"), device="cuda", dtype="fp32")
        assert packed.weights == "packed"
        got = packed.model(ids.cuda()).float().cpu()
        packed.model.reference_ops = True  # the same planes through kernels.ref: dequantized in fp32, then matmul
        exact = packed.model(ids.cuda()).float().cpu()
    torch.testing.assert_close(got, exact, rtol=0, atol=1e-3 * exact.abs().max().item())


def test_a_disk_that_fills_up_is_one_error_and_leaves_nothing(tiny_source, tmp_path, monkeypatch, capsys):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):  # what safetensors raises for ENOSPC
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, out, err = run_main(["quantize", tiny_source[0], "--rtn", "-o", tmp_path / "q"], monkeypatch, capsys)
    assert code == 1 and out == ""
    assert err.strip() == f"error: -o {tmp_path / 'q'}: writing failed (I/O error: No space left on device)", err
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_cannot_be_written_fails_before_the_work(tmp_path, monkeypatch):
    import llmrun.quantize as q

    monkeypatch.setattr(q, "_check_source", lambda files: pytest.fail("the model was opened before -o was checked"))
    (tmp_path / "afile").write_text("")
    with pytest.raises(LlmrunError, match=f"afile/sub/deeper: {tmp_path / 'afile'} is a file, not a directory$"):
        quantize("smollm2", tmp_path / "afile" / "sub" / "deeper", QuantizeOptions("rtn"))
    (tmp_path / "ro").mkdir(mode=0o500)
    if not os.access(tmp_path / "ro", os.W_OK):  # (root writes anywhere)
        with pytest.raises(LlmrunError, match="ro/sub: cannot write there"):
            quantize("smollm2", tmp_path / "ro" / "sub", QuantizeOptions("rtn"))
    with pytest.raises(LlmrunError, match="exists and is not an empty directory"):
        quantize("smollm2", tmp_path / "afile", QuantizeOptions("rtn"))


@pytest.mark.parametrize("method,tensor,value", [
    ("rtn", "norm.weight", 1e6),  # finite in fp32 and bf16, inf in fp16
    ("int8", "layers.0.mlp.down.weight", 1e28),  # its scales overflow
])
def test_values_past_fp16_are_refused_not_written(tmp_path, method, tensor, value):
    """quantize exited 0 on a checkpoint that every load then refused (inf norms or scales)."""
    cfg = replace(CONFIGS["smollm2"], n_heads=8, n_kv_heads=2, ffn_dim=128)
    model = random_model(cfg)
    with torch.no_grad():
        model.get_parameter(tensor).fill_(value)
    source = write_hf_dir(tmp_path / "float", model)
    with pytest.raises(LlmrunError, match=r"does not fit in fp16, which AWQ/GPTQ checkpoints store"):
        quantize(str(source), tmp_path / "q", QuantizeOptions(method), device="cpu")
    assert not (tmp_path / "q").exists()
