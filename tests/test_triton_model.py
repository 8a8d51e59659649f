"""The whole model on the Triton path: every op routed to its Triton kernel (on CUDA natively; on a CPU under the
interpreter, routed as on CUDA), quantized weights through the W4A16/W8A16 kernels, against the plain-PyTorch path
of the same file, in fp32."""

import dataclasses

import pytest
import torch

from llmrun import kernels
from llmrun.kv_cache import KVCache
from llmrun.loading import load_model
from llmrun.models.llama import Transformer
from llmrun.models.quant import QuantLinear

from .tiny import CONFIGS, random_model, write_gguf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_everywhere(monkeypatch):
    """Every op on its Triton kernel whatever the device, and no C decode stack nor C cache writes: the CUDA path,
    on CPU tensors. Yields the names of the Triton entry points that ran."""
    from llmrun.kernels import activation, decode_attention, kv_write, norm, rotary, triton_quant_matmul

    if DEVICE == "cpu":
        monkeypatch.setattr(kernels, "_use_triton", lambda x: not kernels._reference)
        monkeypatch.setattr(kernels, "cpu_kernels_serve", lambda x: False)
    monkeypatch.setattr(kernels, "_failed", set())  # a kernel that fails would fall back to PyTorch: none may
    monkeypatch.setattr(Transformer, "_decode_stack", lambda self, x, cache: None)
    ran = set()
    for module, name in [(norm, "rms_norm"), (norm, "add_rms_norm"), (norm, "head_rms_norm_"), (rotary, "rope_"),
                         (rotary, "rope_write_"),
                         (activation, "silu_mul"),
                         (decode_attention, "decode_attention"), (decode_attention, "quantized_decode_attention"),
                         (triton_quant_matmul, "quant_linear"), (triton_quant_matmul, "float_linear"),
                         (kv_write, "write_int8_pair"), (kv_write, "write_int4"), (kv_write, "write_dense"),
                         (kv_write, "rope_write_int8_")]:
        def spy(*args, _f=getattr(module, name), _name=name, **kwargs):
            ran.add(_name)
            return _f(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    yield ran
    assert not kernels._failed


def run(model, tokens, pieces, kv_format):
    """Logits (T, V) of `tokens` fed in consecutive pieces through one cache of `kv_format`."""
    cache = KVCache.for_model(model, 64, torch.float32, DEVICE, kv_format=kv_format)
    out, start = [], 0
    with torch.no_grad():
        for size in pieces:
            out.append(model(tokens[:, start : start + size], start, cache)[0])
            start += size
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("arch, qtype", [("smollm2", "Q4_1"), ("qwen2", "Q8_0"), ("llama", "Q4_0"), ("qwen3", "Q4_0")])
@pytest.mark.parametrize("kv_format", ["fp32", "int8", "int4"])
def test_the_triton_path_matches_the_plain_pytorch_path(tmp_path, triton_everywhere, arch, qtype, kv_format):
    """A prefill (the dequantize-then-GEMM path, SDPA), decode steps (the GEMV and split-K attention kernels) and
    verification blocks, over every cache format: the logits of plain PyTorch on the dequantized weights."""
    model = random_model(dataclasses.replace(CONFIGS[arch], head_dim=32))
    path = write_gguf(tmp_path / f"tiny-{arch}-{qtype}.gguf", model, "qwen3" if arch == "qwen3" else "llama", qtype)
    packed = load_model(str(path), DEVICE, "fp32", "auto").model
    plain = load_model(str(path), DEVICE, "fp32", "dequant").model
    assert isinstance(packed.layers[0].attn.qkv, QuantLinear)
    tokens = torch.randint(0, model.config.vocab_size, (1, 41), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    pieces = [20, 1, 1, 5, 1, 13]  # prefill > 16 tokens and > 8 rows; steps; blocks
    got = run(packed, tokens, pieces, kv_format)
    want = run(plain, tokens, [41], kv_format)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    attention = {"fp32": {"decode_attention"}, "int8": {"quantized_decode_attention", "write_int8_pair"},
                 "int4": {"quantized_decode_attention", "write_int4"}}[kv_format]
    head_norms = {"head_rms_norm_"} if arch == "qwen3" else set()
    assert triton_everywhere == {"add_rms_norm", "rms_norm", "rope_", "silu_mul", "quant_linear", *attention, *head_norms}


@pytest.mark.slow
@pytest.mark.parametrize("kv_format", ["fp32", "int8", "int4"])
def test_a_verification_block_gives_each_row_a_one_token_steps_logits(tmp_path, triton_everywhere, row_by_row_dot,
                                                                     monkeypatch, kv_format):
    """On the Triton path, the logits of a block of 9 tokens (a speculative verification) equal, bit for bit, those of
    the same 9 tokens fed one at a time: what lets greedy speculative decoding on a GPU emit exactly plain greedy's
    tokens. Attention splits of 16 keys, so the block's rows cross split boundaries; under the interpreter, tl.dot
    computes row by row (`row_by_row_dot`), as a GPU's MMA does."""
    from llmrun.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "SPLIT_LEN", 16)
    model = random_model(dataclasses.replace(CONFIGS["smollm2"], head_dim=32))
    path = write_gguf(tmp_path / "tiny-smollm2-Q4_1.gguf", model, qtype="Q4_1")
    packed = load_model(str(path), DEVICE, "fp32", "auto").model
    tokens = torch.randint(0, model.config.vocab_size, (1, 39), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    block = run(packed, tokens, [30, 9], kv_format)[30:]
    steps = run(packed, tokens, [30] + [1] * 9, kv_format)[30:]
    assert torch.equal(block, steps)


@pytest.mark.slow
def test_float_weights_on_the_gemv(tmp_path, triton_everywhere, row_by_row_dot, monkeypatch):
    """LLMRUN_GEMV_FLOAT=1: a float model's decode steps and verification blocks run their linear layers on the
    GEMV (by default its one-token steps alone). fp16 (the GEMV takes 16-bit weights): the logits of the same model
    on F.linear, within fp16's rounding, and a block of 9 tokens gives each row, bit for bit, a one-token step's."""
    from llmrun.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "SPLIT_LEN", 16)
    model = random_model(dataclasses.replace(CONFIGS["qwen2"], head_dim=32))  # q/k/v biases: added in the GEMV
    path = write_gguf(tmp_path / "tiny-qwen2-F16.gguf", model, qtype="F16")
    plain = load_model(str(path), DEVICE, "fp16", "auto").model
    tokens = torch.randint(0, model.config.vocab_size, (1, 39), generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def run16(pieces):
        cache = KVCache.for_model(plain, 64, torch.float16, DEVICE)
        out, start = [], 0
        with torch.no_grad():
            for size in pieces:
                out.append(plain(tokens[:, start : start + size], start, cache)[0])
                start += size
        return torch.cat(out)[30:]

    want = run16([30, 9])
    assert "float_linear" not in triton_everywhere
    monkeypatch.setenv("LLMRUN_GEMV_FLOAT", "1")
    block, steps = run16([30, 9]), run16([30] + [1] * 9)
    assert "float_linear" in triton_everywhere
    assert torch.equal(block, steps)
    torch.testing.assert_close(block, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("qtype, dtype", [("Q4_0", "fp32"), ("Q8_0", "fp32"), ("F16", "fp16")])
def test_a_decode_step_gates_inside_the_gate_up_matmul(tmp_path, triton_everywhere, monkeypatch, qtype, dtype):
    """A decode step's MLP runs silu(gate) * up inside the gate/up GEMV (packed and float weights): no silu_mul
    launch, and logits bit for bit those of the gate/up product followed by silu_mul (a prefill and a
    verification block beside it: fused or not by their own paths)."""
    from llmrun.models import llama

    model = random_model(dataclasses.replace(CONFIGS["qwen2"], head_dim=32))
    loaded = load_model(str(write_gguf(tmp_path / f"m-{qtype}.gguf", model, qtype=qtype)), DEVICE, dtype, "auto").model
    tokens = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cache_dtype = torch.float32 if dtype == "fp32" else torch.float16

    def logits(pieces):
        cache = KVCache.for_model(loaded, 32, cache_dtype, DEVICE)
        out, start, step_ops = [], 0, set()
        with torch.no_grad():
            for size in pieces:
                triton_everywhere.clear()
                out.append(loaded(tokens[:, start : start + size], start, cache)[0])
                if size == 1:
                    step_ops |= triton_everywhere
                start += size
        return torch.cat(out), step_ops

    fused, step_ops = logits([20, 1, 3])
    assert "silu_mul" not in step_ops and {"quant_linear" if qtype != "F16" else "float_linear"} <= step_ops
    monkeypatch.setattr(llama.MLP, "forward", lambda self, x: self.down(
        kernels.silu_mul(*self.gate_up(x).split(self.ffn_dim, dim=-1))))
    unfused, step_ops = logits([20, 1, 3])
    assert "silu_mul" in step_ops
    assert torch.equal(fused, unfused)


def test_a_decode_step_adds_each_residual_inside_a_norm(tmp_path, triton_everywhere, monkeypatch):
    """Launches cost a decode step time of their own on a GPU (bench/GPU_NOTES.md): every residual add runs inside
    the RMSNorm that follows it, the last one inside the final norm. A step of L layers: one plain RMSNorm (the
    first layer's), 2 L adds with a norm, and not one residual add on its own; nor any other add: the quantized
    embedding's lookup is one kernel too (an H200 found the plain-PyTorch dequantization's add here, 2026-11-26)."""
    from llmrun.kernels import norm

    model = random_model(dataclasses.replace(CONFIGS["llama"], head_dim=32))
    packed = load_model(str(write_gguf(tmp_path / "tiny.gguf", model, qtype="Q4_0")), DEVICE, "fp32", "auto").model
    calls = {"rms_norm": 0, "add_rms_norm": 0}
    for name in calls:
        def count(*args, _f=getattr(norm, name), _name=name, **kwargs):
            calls[_name] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(norm, name, count)
    cache = KVCache.for_model(packed, 16, torch.float32, DEVICE)
    tokens = torch.tensor([[3, 1, 4, 1, 5]], device=DEVICE)
    with torch.no_grad():
        packed(tokens[:, :4], 0, cache)
        calls.update(rms_norm=0, add_rms_norm=0)
        with torch.profiler.profile() as prof:
            packed(tokens[:, 4:], 4, cache, last_only=True)
    assert calls == {"rms_norm": 1, "add_rms_norm": 2 * packed.config.n_layers}
    assert not [e for e in prof.events() if e.name in ("aten::add", "aten::add_")]
