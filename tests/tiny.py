"""Tiny random models of every supported architecture, and writers for the file formats llmrun reads."""

import json

import torch

from llmrun.models import ModelConfig, build_model
from llmrun.models.config import RopeScaling, yarn_mscale

TINY = dict(vocab_size=128, dim=64, n_layers=2, head_dim=16, ffn_dim=96, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256)

# One config per architecture variant, with awkward GQA ratios (1, 3, 4).
CONFIGS = {
    "llama": ModelConfig("LlamaForCausalLM", n_heads=4, n_kv_heads=1, **TINY),
    "llama3.1": ModelConfig(
        "LlamaForCausalLM", n_heads=6, n_kv_heads=2, **TINY,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
    ),
    "mistral": ModelConfig("MistralForCausalLM", n_heads=4, n_kv_heads=4, sliding_window=5, **TINY),
    "smollm2": ModelConfig("LlamaForCausalLM", n_heads=9, n_kv_heads=3, tie_embeddings=True, **TINY),
    "qwen2": ModelConfig("Qwen2ForCausalLM", n_heads=4, n_kv_heads=2, attention_bias=True, **TINY),
    # per-head q/k norms, and heads wider than hidden / heads (as Qwen3-0.6B's 16 x 128 over 1024)
    "qwen3": ModelConfig("Qwen3ForCausalLM", n_heads=6, n_kv_heads=2, qk_norm=True, tie_embeddings=True, **TINY),
    # YaRN as Qwen's docs add it: 4 x a trained context of 64 (TINY's 256)
    "qwen3-yarn": ModelConfig("Qwen3ForCausalLM", n_heads=6, n_kv_heads=2, qk_norm=True, tie_embeddings=True,
                              rope_scaling=RopeScaling("yarn", 4.0, original_max_position=64,
                                                       attention_factor=yarn_mscale(4.0)), **TINY),
}


def random_model(cfg: ModelConfig, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms near 1, biases and weights small: activations stay in a sane range over the layers
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


def decode_in_steps(model, tokens, prefill: int) -> torch.Tensor:
    """Logits (T, V) of tokens (1, T) through one fp32 KV cache: the first `prefill` in one forward, then one
    token a step (what a full forward's logits must equal)."""
    from llmrun.kv_cache import KVCache

    cache = KVCache.for_model(model.config, tokens.shape[1] + 4, torch.float32, "cpu")
    with torch.no_grad():
        steps = [model(tokens[:, :prefill], 0, cache)[0]]
        cache.length = prefill
        for i in range(prefill, tokens.shape[1]):
            steps.append(model(tokens[:, i : i + 1], i, cache)[0])
            cache.length = i + 1
    return torch.cat(steps)


def hf_config_json(cfg: ModelConfig) -> dict:
    d = {
        "architectures": [cfg.architecture], "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "torch_dtype": "float32",
    }
    if cfg.sliding_window:
        d["sliding_window"] = cfg.sliding_window
    if cfg.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM") and cfg.attention_bias:
        d["attention_bias"] = True
    if cfg.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        if cfg.sliding_window:
            d["max_window_layers"] = cfg.sliding_window_from
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "yarn":  # as Qwen's docs add it: the trained context
        rs = cfg.rope_scaling                                               # stays max_position_embeddings
        d["rope_scaling"] = {"rope_type": "yarn", "factor": rs.factor,
                             "original_max_position_embeddings": rs.original_max_position}
        d["max_position_embeddings"] = rs.original_max_position
    elif cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        d["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                             "high_freq_factor": rs.high_freq_factor, "original_max_position_embeddings": rs.original_max_position}
    return d


_HF_NAMES = {
    "attn_norm": "input_layernorm", "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj",
    "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
}


def unfused_state_dict(model) -> dict:
    """The model's tensors under checkpoint-style names: q/k/v and gate/up apart, as files store them."""
    cfg = model.config
    sizes = {"attn.qkv": (("attn.q", cfg.n_heads * cfg.head_dim), ("attn.k", cfg.n_kv_heads * cfg.head_dim),
                          ("attn.v", cfg.n_kv_heads * cfg.head_dim)),
             "mlp.gate_up": (("mlp.gate", cfg.ffn_dim), ("mlp.up", cfg.ffn_dim))}
    out = {}
    for name, t in model.state_dict().items():
        parts = next(((k, v) for k, v in sizes.items() if f".{k}." in name), None)
        if parts is None:
            out[name] = t
            continue
        for (part, _), piece in zip(parts[1], t.split([n for _, n in parts[1]])):
            out[name.replace(parts[0], part)] = piece
    return out


def hf_state_dict(model) -> dict:
    out = {}
    for name, t in unfused_state_dict(model).items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            part, kind = rest.rsplit(".", 1)
            out[f"model.layers.{i}.{_HF_NAMES[part]}.{kind}"] = t
        else:
            out[{"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"}[name]] = t
    return out


def write_hf_dir(path, model, tokenizer_json_from=None):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_json(model.config)))
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text(_tiny_tokenizer_json(model.config.vocab_size))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return path


def shard_hf_dir(path, shards: int):
    """Split the directory's model.safetensors into `shards` files with an index, as transformers saves a large
    model, the tensors dealt out in turn (so a layer's tensors lie in different shards)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: names[i % shards] for i, name in enumerate(sorted(tensors))}
    for file in names:
        save_file({k: v for k, v in tensors.items() if weight_map[k] == file}, str(path / file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _tiny_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<eos>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def permute_rope_rows(w, n_heads):
    """llama.cpp's converter: each head's rows from HF's half-split order to interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(path, model, arch="llama", qtype=None):
    """Write `model` as a GGUF the way llama.cpp's converter does (Q/K rows permuted for llama): F32, or its
    matrices quantized to `qtype` (a GGML type name such as "Q4_1")."""
    import gguf
    from gguf import quants

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "yarn":  # as llama.cpp's converter writes it
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling.original_max_position)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(cfg.vocab_size)]
    w.add_token_list(tokens)
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(cfg.vocab_size - 1)
    names = {"attn_norm": "attn_norm", "attn.q": "attn_q", "attn.k": "attn_k", "attn.v": "attn_v", "attn.o": "attn_output",
             "mlp_norm": "ffn_norm", "mlp.gate": "ffn_gate", "mlp.up": "ffn_up", "mlp.down": "ffn_down",
             "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm"}
    for name, t in unfused_state_dict(model).items():
        t = t.float()
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            part, kind = rest.rsplit(".", 1)
            if arch == "llama" and part in ("attn.q", "attn.k"):
                t = permute_rope_rows(t, cfg.n_heads if part == "attn.q" else cfg.n_kv_heads)
            gname = f"blk.{i}.{names[part]}.{kind}"
        else:
            gname = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        if qtype is not None and t.dim() == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, quants.quantize(t.numpy(), kind), raw_dtype=kind)
        else:
            w.add_tensor(gname, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
