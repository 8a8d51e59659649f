"""GGML's block types (the k-quants of Q4_K_M and Q5_K_M files, Q5_0/Q5_1, and the rarer ones `gguf.quants`
dequantizes): torch dequantization bit-identical to `gguf.quants`, their conversion to the CPU kernels' planes,
and tiny models written with them, whose packed path agrees with their exact dequantized one.

Blocks are random bytes (gguf's Python quantizer has no k-quants or IQ types), with sane fp16 scales."""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from llmrun import gguf_quants
from llmrun.errors import ModelFormatError
from llmrun.gguf_quants import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from llmrun.kernels import cpu, ref

from .tiny import CONFIGS, random_model, write_gguf

T = GGMLQuantizationType
_FP16_FIELDS = {  # byte offsets of each block's fp16 scales
    Q4_0: [0], Q4_1: [0, 2], Q5_0: [0], Q5_1: [0, 2], Q8_0: [0], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.IQ4_NL: [0], T.IQ4_XS: [0], T.IQ2_XXS: [0], T.IQ2_S: [0], T.IQ3_S: [0],
    T.TQ2_0: [64],
}
TYPES = sorted(gguf_quants.BLOCK)
# requantized to 8-bit planes: here (Q5_1, Q5_K, Q6_K) or dequantized by gguf.quants first (the others)
REQUANTIZED = [Q5_1, Q5_K, Q6_K, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_S, T.IQ3_S, T.TQ2_0]


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """(rows, bytes per row) uint8 of random blocks whose fp16 scales are ~N(0, scale) (random bytes could be
    NaN or inf there)."""
    nvalues, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // nvalues, nbytes), dtype=np.uint8)
    for offset in _FP16_FIELDS.get(qtype, []):
        b[..., offset : offset + 2] = (rng.standard_normal((rows, cols // nvalues, 1)) * scale).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def shapes(qtype):  # awkward row counts; several superblocks per row for the k-quants
    return [(1, 256), (7, 768), (33, 1280)] if GGML_QUANT_SIZES[T(qtype)][0] == 256 else [(1, 32), (5, 96), (33, 544)]


def exact(qtype, blocks) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType(qtype)).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_identical_to_gguf(qtype):
    for rows, cols in shapes(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=rows)
        got = gguf_quants.dequantize(qtype, torch.from_numpy(blocks))
        assert got.shape == (rows, cols)
        assert torch.equal(got, exact(qtype, blocks).reshape(rows, cols))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0, Q5_0])
def test_planes_of_32_blocks_are_exact(qtype):
    for rows, cols in shapes(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=rows)
        qs, d, m, bits = gguf_quants.planes(qtype, torch.from_numpy(blocks))
        assert (bits, m is not None) == gguf_quants.PLANE_FORMATS[qtype]
        assert torch.equal(ref.dequantize_blocks(qs, d, m, bits), exact(qtype, blocks).reshape(rows, cols))


def test_q4_k_planes_are_exact_but_for_fp16_products():
    """Sub-block j of a Q4_K superblock is x = d*sc_j*q - dmin*mn_j: 4-bit planes with d_j = fp16(d*sc_j),
    m_j = fp16(-dmin*mn_j), the nibbles in Q4_1 order."""
    for rows, cols in shapes(Q4_K):
        blocks = random_blocks(Q4_K, rows, cols, seed=rows)
        qs, d, m, bits = gguf_quants.planes(Q4_K, torch.from_numpy(blocks))
        b = blocks.reshape(-1, 144)
        sc, mn = quants.Q4_K.get_scale_min(b[:, 4:16])  # (n, 8) each
        super_d, super_dmin = b[:, 0:2].view(np.float16).astype(np.float32), b[:, 2:4].view(np.float16).astype(np.float32)
        want_d = (super_d * sc.astype(np.float32)).astype(np.float16).reshape(rows, -1)
        want_m = (-(super_dmin * mn.astype(np.float32))).astype(np.float16).reshape(rows, -1)
        q = (b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
        want_w = want_d.astype(np.float32)[..., None] * q.reshape(rows, -1, 32) + want_m.astype(np.float32)[..., None]
        assert bits == 4
        assert np.array_equal(d.numpy(), want_d) and np.array_equal(m.numpy(), want_m)
        assert torch.equal(ref.dequantize_blocks(qs, d, m, bits), torch.from_numpy(want_w.reshape(rows, cols)))
        # fp16 rounding of the two products moves a value by at most 2^-11 of each
        x = exact(Q4_K, blocks).reshape(rows, cols)
        bound = 2**-11 * (15 * np.abs(want_d.astype(np.float32)) + np.abs(want_m.astype(np.float32)))
        assert ((ref.dequantize_blocks(qs, d, m, bits) - x).abs() <= torch.from_numpy(bound).repeat_interleave(32, 1) * 1.01).all()


@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda t: T(t).name)
def test_other_types_requantize_to_8_bits_within_half_a_step(qtype):
    assert gguf_quants.plane_format(qtype) == (8, False)
    for rows, cols in shapes(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=rows)
        qs, d, m, bits = gguf_quants.planes(qtype, torch.from_numpy(blocks))
        assert (bits, m, qs.dtype, qs.shape) == (8, None, torch.int8, (rows, cols))
        x = exact(qtype, blocks).reshape(rows, -1, 32)
        assert x.abs().amax() > 0
        amax = x.abs().amax(-1)  # (rows, K/32)
        assert torch.equal(d, (amax / 127).half())
        err = (ref.dequantize_blocks(qs, d, m, bits).reshape(rows, -1, 32) - x).abs().amax(-1)
        # half a step, and up to 127 times half fp16's subnormal spacing where d (amax / 127 < 2^-14) is subnormal
        assert (err <= amax / 254 * (1 + 2**-9) + 127 * 2**-25).all()


@pytest.mark.parametrize("qtype", [Q5_K, T.Q2_K], ids=lambda t: T(t).name)
def test_corrupt_scales_give_scales_not_finite_without_warnings(qtype):
    """What the load's check of the planes' scales then names (here in torch, Q2_K in gguf's numpy)."""
    import warnings

    blocks = random_blocks(qtype, 3, 512)
    blocks[1, _FP16_FIELDS[qtype][0] : _FP16_FIELDS[qtype][0] + 2] = 0xFF  # an fp16 NaN
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qs, d, m, bits = gguf_quants.planes(qtype, torch.from_numpy(blocks))
    assert torch.isfinite(d[0]).all() and not torch.isfinite(d[1]).all()


def test_float_types_and_types_gguf_cannot_dequantize_have_no_planes():
    for qtype in (T.F32, T.F16, T.BF16, T.Q8_K, T.I8, 999):
        assert gguf_quants.plane_format(qtype) is None


@pytest.mark.parametrize("offsets", [False, True])
def test_convert_planes_to_a_wider_format(offsets):
    qs, d, m, _ = gguf_quants.planes(Q4_1 if offsets else Q4_0, torch.from_numpy(random_blocks(Q4_1 if offsets else Q4_0, 9, 160)))
    w = ref.dequantize_blocks(qs, d, m, 4)
    wide = gguf_quants.convert_planes(qs, d, m, 4, 8, False)
    assert wide[3] == 8 and wide[2] is None
    got = ref.dequantize_blocks(*wide)
    if offsets:  # requantized: within half a step of max|w| / 127 per block
        amax = w.reshape(9, -1, 32).abs().amax(-1, keepdim=True)
        assert ((got - w).reshape(9, -1, 32).abs() <= amax / 254 * (1 + 2**-9)).all()
    else:
        assert torch.equal(got, w)
        assert torch.equal(ref.dequantize_blocks(*gguf_quants.convert_planes(qs, d, m, 4, 4, True)), w)
    assert gguf_quants.convert_planes(*wide, 8, False)[0] is wide[0]  # already that format


# --- a tiny Qwen2 written as a Q4_K_M file would be: mixed types, q/k/v of two formats --------------------

MIXED = {"attn_q": Q4_K, "attn_k": Q4_K, "attn_output": Q5_0, "ffn_gate": Q4_K, "ffn_up": Q4_K,
         "token_embd": Q4_K, "output": Q6_K}
PER_LAYER = {"attn_v": (Q6_K, Q4_K), "ffn_down": (Q6_K, Q4_K)}  # as llama.cpp alternates them by layer


def _types(name: str) -> int | None:
    parts = name.split(".")
    if name.startswith("blk."):
        layer, kind = int(parts[1]), parts[2]
        return PER_LAYER[kind][layer % 2] if kind in PER_LAYER else MIXED.get(kind)
    return MIXED.get(parts[0])


_RANGE = {Q4_K: 15 * 32, Q5_0: 16, Q5_1: 31, Q5_K: 31 * 32, Q6_K: 32 * 64, T.Q2_K: 3 * 15, T.Q3_K: 4 * 32,
          T.IQ4_XS: 127 * 32}  # the largest |value| a block's scales multiply


def retyped_copy(src, dst, types) -> None:
    """Rewrite the GGUF `src` with each matrix whose name `types` maps to a GGML type replaced by random blocks
    of that type (metadata and the other tensors unchanged)."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for i, t in enumerate(reader.tensors):
        shape = [int(n) for n in reversed(t.shape)]
        qtype = types(t.name) if len(shape) == 2 else None
        if qtype is None:
            writer.add_tensor(t.name, np.array(t.data).reshape(shape))
        else:  # weights ~0.1: values of random q times fp16 scales ~N(0, 0.1 / range of q)
            scale = 0.1 / _RANGE.get(qtype, 1)
            blocks = random_blocks(qtype, shape[0], shape[1], seed=i, scale=scale)
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny(tmp, types):
    cfg = dataclasses.replace(CONFIGS["qwen2"], dim=256, head_dim=64, ffn_dim=512)  # k-quant rows: 256 columns
    write_gguf(tmp / "f32.gguf", random_model(cfg), arch="qwen2")
    retyped_copy(tmp / "f32.gguf", tmp / "tiny.gguf", types)
    return tmp / "tiny.gguf"


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("kquants"), _types)


def test_dequant_path_is_the_exact_dequantization(tiny_q4_k_m):
    from llmrun.gguf_file import GGUFFile
    from llmrun.loading import load_model

    plain = load_model(str(tiny_q4_k_m), "cpu", "fp32", "dequant")
    assert plain.weights == "dequant"
    g = GGUFFile(tiny_q4_k_m)
    for layer in (0, 1):
        want = torch.cat([exact(g.tensors[f"blk.{layer}.attn_{p}.weight"].ggml_type, g.tensors[f"blk.{layer}.attn_{p}.weight"].data)
                          for p in "qkv"])
        assert torch.equal(plain.model.layers[layer].attn.qkv.weight, want)
    assert torch.equal(plain.model.lm_head.weight, exact(Q6_K, g.tensors["output.weight"].data))


@pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
def test_packed_q4_k_m_model_matches_dequantized(tiny_q4_k_m):
    from llmrun.loading import load_model
    from llmrun.models.quant import QuantEmbedding, QuantLinear

    packed = load_model(str(tiny_q4_k_m), "cpu", "fp32", "auto")
    plain = load_model(str(tiny_q4_k_m), "cpu", "fp32", "dequant")
    assert packed.weights == "packed" and packed.notes == []
    layers = packed.model.layers
    formats = lambda w: (type(w), w.bits, w.m is not None)  # noqa: E731
    assert formats(layers[0].attn.qkv) == (QuantLinear, 8, False)  # v is Q6_K: q and k follow it to 8 bits
    assert formats(layers[1].attn.qkv) == (QuantLinear, 4, True)  # all Q4_K
    assert formats(layers[0].attn.o) == (QuantLinear, 8, False)  # Q5_0
    assert formats(layers[0].mlp.gate_up) == (QuantLinear, 4, True)
    assert [formats(l.mlp.down)[1] for l in layers] == [8, 4]
    assert formats(packed.model.embed) == (QuantEmbedding, 4, True)
    assert formats(packed.model.lm_head) == (QuantLinear, 8, False)
    tokens = torch.randint(0, packed.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = plain.model(tokens), packed.model(tokens)
    # activations rounded to 8 bits per block of 32 before each matmul (as llama.cpp does), fp16 products of
    # Q4_K, and the requantized Q6_K: small differences, the same ranking of the likely tokens
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


# a Q5_K_M file's mix (Q5_K, Q6_K in attn_v/ffn_down), with the lower k-quants, an IQ type and Q5_1 among them
OTHERS = {"attn_q": Q5_K, "attn_k": Q5_K, "attn_v": Q6_K, "attn_output": T.Q3_K, "ffn_gate": Q5_K,
          "ffn_up": T.Q2_K, "ffn_down": T.IQ4_XS, "token_embd": Q5_1, "output": Q5_K}


@pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
def test_every_block_type_loads_packed(tmp_path):
    """No matrix of a block type runs dequantized (they did: a 7B Q5_K_M model took 28 GB in fp32): each is
    8-bit planes, within half a step of its exact values, and the model agrees with its dequantized path."""
    from llmrun.loading import load_model
    from llmrun.models.quant import QuantEmbedding, QuantLinear

    path = write_tiny(tmp_path, lambda name: OTHERS.get(name.split(".")[-2]))
    packed = load_model(str(path), "cpu", "fp32", "auto")
    plain = load_model(str(path), "cpu", "fp32", "dequant")
    assert packed.weights == "packed" and packed.notes == []
    m = packed.model
    for w in (m.layers[0].attn.qkv, m.layers[0].attn.o, m.layers[1].mlp.gate_up, m.layers[1].mlp.down, m.lm_head):
        assert (type(w), w.bits, w.m) == (QuantLinear, 8, None)
    assert (type(m.embed), m.embed.bits) == (QuantEmbedding, 8)
    tokens = torch.randint(0, packed.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = plain.model(tokens), packed.model(tokens)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_a_type_gguf_cannot_dequantize_is_a_clear_error(tmp_path):
    from llmrun.loading import load_model

    path = write_tiny(tmp_path, lambda name: T.Q8_K if ".ffn_up." in name else None)
    with pytest.raises(ModelFormatError, match="ffn_up.weight: GGML type Q8_K cannot be dequantized"):
        load_model(str(path), "cpu", "fp32", "auto")
