"""Named shapes of real models, for `llmrun bench --random-weights SHAPE`: the true architecture numbers with
random weights, so speed at realistic sizes can be measured without downloading anything.

The table is plain data (importing this module does not import torch, so the CLI can list the names in its
help). Numbers are those of each model's published config.json.
"""

from __future__ import annotations

from pathlib import Path

from llmrun.errors import LlmrunError, UsageError

_LLAMA3 = dict(architecture="LlamaForCausalLM", vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0)
_LLAMA3_1_ROPE = ("llama3", 8.0, 1.0, 4.0, 8192)  # kind, factor, low_freq_factor, high_freq_factor, original max
_LLAMA3_2_ROPE = ("llama3", 32.0, 1.0, 4.0, 8192)
_QWEN2_5 = dict(architecture="Qwen2ForCausalLM", norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
                attention_bias=True, head_dim=128)
_QWEN3 = dict(architecture="Qwen3ForCausalLM", vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0,
              max_seq_len=40960, qk_norm=True, head_dim=128, n_kv_heads=8)
_SMOLLM2 = dict(architecture="LlamaForCausalLM", vocab_size=49152, norm_eps=1e-5, rope_theta=100000.0,
                max_seq_len=8192, tie_embeddings=True, head_dim=64)

# name -> ModelConfig fields (rope_scaling as a tuple); the HF repository each comes from is in the comment.
SHAPES: dict[str, dict] = {
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                      max_seq_len=8192),
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                        max_seq_len=131072, rope_scaling=_LLAMA3_1_ROPE),
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": dict(_LLAMA3, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
                        max_seq_len=131072, tie_embeddings=True, rope_scaling=_LLAMA3_2_ROPE),
    # meta-llama/Llama-3.2-3B
    "llama3.2-3b": dict(_LLAMA3, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192,
                        max_seq_len=131072, tie_embeddings=True, rope_scaling=_LLAMA3_2_ROPE),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": dict(_QWEN2_5, vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                         ffn_dim=4864, tie_embeddings=True),
    # Qwen/Qwen2.5-1.5B-Instruct
    "qwen2.5-1.5b": dict(_QWEN2_5, vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                         ffn_dim=8960, tie_embeddings=True),
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": dict(_QWEN2_5, vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944),
    # Qwen/Qwen3-0.6B (heads 16 x 128 over a hidden size of 1024)
    "qwen3-0.6b": dict(_QWEN3, dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tie_embeddings=True),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(_QWEN3, dim=4096, n_layers=36, n_heads=32, ffn_dim=12288),
    # mistralai/Mistral-7B-v0.1 (the sliding-window one; v0.3 differs in vocabulary and RoPE theta)
    "mistral-7b": dict(architecture="MistralForCausalLM", vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                       n_kv_heads=8, head_dim=128, ffn_dim=14336, norm_eps=1e-5, rope_theta=10000.0,
                       max_seq_len=32768, sliding_window=4096),
    # HuggingFaceTB/SmolLM2-135M-Instruct (the embedded model's shape)
    "smollm2-135m": dict(_SMOLLM2, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536),
    # HuggingFaceTB/SmolLM2-360M-Instruct
    "smollm2-360m": dict(_SMOLLM2, dim=960, n_layers=32, n_heads=15, n_kv_heads=5, ffn_dim=2560),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct
    "smollm2-1.7b": dict(_SMOLLM2, dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, ffn_dim=8192,
                         rope_theta=130000.0),
}
SEED = 0  # every configuration of one shape gets the same weights (the sweep compares their logits)
INIT_STD = 0.02  # normal(0, 0.02) weights and unit norms keep activations in a sane range over the layers


def shape_config(name: str):
    """The ModelConfig of a named shape."""
    from llmrun.models import ModelConfig
    from llmrun.models.config import RopeScaling

    if name not in SHAPES:
        raise UsageError(f"--random-weights: unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    if "rope_scaling" in fields:
        fields["rope_scaling"] = RopeScaling(*fields["rope_scaling"])
    return ModelConfig(**fields)


def random_model_files(name: str):
    """ModelFiles for a shape: its config and the embedded SmolLM2 tokenizer (ids are mapped into the shape's
    vocabulary by the workload; with random weights their meaning is irrelevant). Where the embedded model is not
    installed, LLMRUN_RANDOM_TOKENIZER may name a GGUF file whose tokenizer to take instead: its metadata is enough
    (`gguf_file.write_metadata_only`, as bench/gpu_prepare.sh writes one for a lent GPU machine)."""
    import os

    from llmrun.gguf_file import GGUFFile
    from llmrun.loading import ModelFiles, ModelSource, embedded_model_path
    from llmrun.tokenizer import tokenizer_from_gguf

    config = shape_config(name)
    source = os.environ.get("LLMRUN_RANDOM_TOKENIZER") or embedded_model_path()
    tokenizer = tokenizer_from_gguf(GGUFFile(source).metadata)
    return ModelFiles(ModelSource(f"random:{name}", Path(f"random:{name}"), "random"), config, tokenizer)


def free_memory(device) -> int:
    """Bytes that can still be allocated on `device`: MemAvailable on CPU, the driver's free memory on CUDA."""
    import os

    import torch

    from llmrun.bench import proc_bytes

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if available is None else available


INT4_BYTES = 0.625  # per weight in 4-bit blocks of 32 with an fp16 scale and offset each


def weight_bytes(config, dtype, int4: bool = False, loading: bool = True) -> int:
    """The most memory `load_random` holds for the weights: all of them in `dtype`; with `int4` the float
    embedding, norms and biases, the matrices in 4-bit blocks, and, while one is rounded (`loading`), the largest
    float matrix drawn at a time (a block's, or the untied output head's)."""
    if not int4:
        return config.n_params * dtype.itemsize
    block = sum(width * sum(outs) for width, outs in config.linear_widths().values())
    head = config.vocab_size * config.dim
    untied_head = 0 if config.tie_embeddings else head
    floats = config.n_params - config.n_layers * block - untied_head + (max(block, untied_head) if loading else 0)
    return int(floats * dtype.itemsize + (config.n_layers * block + head) * INT4_BYTES)


def check_fits(name: str, config, device, dtype, ctx: int, kv_format: str | None = None, int4: bool = False) -> None:
    """Refuse, with one line, a shape whose weights (`weight_bytes`) and KV cache (in `kv_format`, default `dtype`)
    would not fit in the free memory."""
    from llmrun.kv_cache import bytes_per_token, format_of
    from llmrun.memory import human_bytes

    weights = weight_bytes(config, dtype, int4)
    kv = bytes_per_token(config, kv_format or format_of(dtype)) * ctx
    free = free_memory(device)
    if weights + kv > free:
        smaller = [] if int4 else ["--weights int4"]
        if not (int4 and device.type == "cpu") and dtype.itemsize > 2:  # (4-bit on a CPU computes in fp32)
            smaller.append("a 2-byte --dtype")
        raise LlmrunError(
            f"--random-weights {name} needs {human_bytes(weights + kv)} (weights {human_bytes(weights)} + KV"
            f" {human_bytes(kv)} at --ctx {ctx}) but {device.type} has {human_bytes(free)} free;"
            f" use a smaller shape, {', '.join([*smaller, 'a smaller --ctx'])}"
        )


def load_random(files, device, dtype, weights: str = "auto"):
    """Build the shape's model straight on `device` in `dtype` (never a CPU fp32 copy first), with seeded random
    weights: normal(0, INIT_STD), norms 1. The same seed gives the same weights in every dtype (each tensor is
    drawn in fp32, one at a time, then rounded). weights: "auto" or "dequant" (float matrices; "dequant" runs the
    plain-PyTorch ops), or "int4" (4-bit round-to-nearest blocks, as `loading.round_to_int4` makes them: each
    block's matrices are rounded as soon as they are drawn, so only one block is ever held in floats)."""
    import torch

    from llmrun.loading import LoadedModel, packed_kernels
    from llmrun.models import build_model
    from llmrun.models.llama import int4_block
    from llmrun.models.quant import int4_linear

    int4 = weights == "int4"
    if int4 and (why := packed_kernels(device, dtype)) is not None:
        raise LlmrunError(f"--weights int4 needs llmrun's kernels for quantized weights, but {why}")
    with torch.device("meta"):
        model = build_model(files.config).to(dtype)
    generator = torch.Generator(device=device).manual_seed(SEED)

    def draw(prefix: str, module):  # in the order of the model's named_parameters
        module.to_empty(device=device)
        for name, p in module.named_parameters(prefix):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0.0, INIT_STD, generator=generator))
        return module

    with torch.no_grad():
        draw("embed", model.embed)
        for i, block in enumerate(model.layers):
            model.layers[i] = int4_block(draw(f"layers.{i}", block)) if int4 else draw(f"layers.{i}", block)
        draw("norm", model.norm)
        if model.lm_head is not None:
            draw("lm_head", model.lm_head)
        if int4:  # a tied head becomes an untied 4-bit copy of the embedding table, as in round_to_int4
            model.lm_head = int4_linear(model.embed if model.lm_head is None else model.lm_head)
    model.eval().requires_grad_(False)
    model.reference_ops = weights == "dequant"
    return LoadedModel(files, model, device, dtype, "packed" if int4 else "dequant")
