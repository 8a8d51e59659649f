"""The architecture hyper-parameters, built explicitly from an HF `config.json` or from GGUF metadata.

Only what changes the math is read; a setting that would change it in a way we do not implement
(another activation, an unknown RoPE scaling, MLP biases...) raises instead of being silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmrun.errors import UnsupportedModelError

# HF `architectures` names this package implements; every one is a Llama-style decoder.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# GGUF `general.architecture` -> HF name. Mistral GGUFs declare "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class RopeScaling:
    """Context extension applied to the RoPE frequencies.

    kind "linear": positions are divided by `factor` (all frequencies slowed alike).
    kind "llama3": Llama 3.1's NTK-by-parts rule: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend between `low_freq_factor` and `high_freq_factor` wavelengths.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF `architectures` name, the registry key
    vocab_size: int
    dim: int  # residual stream width (hidden_size)
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; fewer than n_heads means grouped-query attention
    head_dim: int
    ffn_dim: int  # SwiGLU inner width
    norm_eps: float
    rope_theta: float
    max_seq_len: int  # the context the model was trained for
    tie_embeddings: bool = False  # output projection reuses the token embedding (SmolLM2, Llama 3.2 1B/3B)
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    sliding_window: int | None = None  # each token sees only the last N positions (Mistral v0.1)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.n_heads} attention heads are not a multiple of {self.n_kv_heads} key/value heads"
            )

    @property
    def n_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention_bias:
            attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + 2 * self.dim) + embed + self.dim

    def linear_widths(self) -> dict[str, tuple[int, list[int]]]:
        """Each block's (fused) linear layer -> (input width, output widths of the parts checkpoints store apart)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {"attn.qkv": (self.dim, [q, kv, kv]), "attn.o": (q, [self.dim]),
                "mlp.gate_up": (self.dim, [self.ffn_dim, self.ffn_dim]), "mlp.down": (self.ffn_dim, [self.dim])}

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_element


def _unsupported_architecture(name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported architecture {name!r}; llmrun runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        " (Llama 2/3/3.1/3.2, Mistral, SmolLM2, Qwen2/2.5)"
    )


def _rope_scaling_from_hf(rs: dict | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs["low_freq_factor"]),
            float(rs["high_freq_factor"]),
            int(rs["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r}; llmrun implements 'linear' and 'llama3'")


def config_from_hf(cfg: dict) -> ModelConfig:
    """Build the config from a parsed HF `config.json`."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _unsupported_architecture(arch)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported activation {act!r}; llmrun implements SwiGLU with 'silu'")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("MLP biases (mlp_bias=true) are not supported")
    n_heads = cfg["num_attention_heads"]
    qwen2 = arch == "Qwen2ForCausalLM"
    sliding = cfg.get("sliding_window")
    if qwen2 and not cfg.get("use_sliding_window", False):
        sliding = None  # Qwen2 configs list a window they do not use
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn_dim=cfg["intermediate_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=qwen2 or bool(cfg.get("attention_bias", False)),
        sliding_window=sliding,
        rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling")),
    )


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF `config.json` fields of `cfg` (what `config_from_hf` reads back to an equal config)."""
    out = {
        "architectures": [cfg.architecture], "model_type": _MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
    }
    if cfg.architecture == "Qwen2ForCausalLM":
        out["use_sliding_window"] = cfg.sliding_window is not None
    else:
        out["attention_bias"] = cfg.attention_bias
    out["sliding_window"] = cfg.sliding_window
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
    elif rs is not None:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                               "high_freq_factor": rs.high_freq_factor,
                               "original_max_position_embeddings": rs.original_max_position}
    return out


def config_from_gguf(meta: dict, tensor_names: set[str]) -> ModelConfig:
    """Build the config from GGUF metadata (keys are prefixed by the architecture, e.g. `llama.block_count`)."""
    gguf_arch = meta.get("general.architecture", "?")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise _unsupported_architecture(gguf_arch)
    arch = GGUF_ARCHITECTURES[gguf_arch]

    def get(key, default=None):
        value = meta.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {gguf_arch}.{key}")
        return value

    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    scaling = None
    if meta.get(f"{gguf_arch}.rope.scaling.type", "none") not in ("none", None):
        kind = meta[f"{gguf_arch}.rope.scaling.type"]
        if kind != "linear":
            raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r} in GGUF; llmrun implements 'linear'")
        scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
    vocab = meta.get(f"{gguf_arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        dim=dim,
        n_layers=get("block_count"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", dim // n_heads),
        ffn_dim=get("feed_forward_length"),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_seq_len=get("context_length"),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=meta.get(f"{gguf_arch}.attention.sliding_window"),
        rope_scaling=scaling,
    )


def rope_inv_freq(cfg: ModelConfig, freq_factors=None):
    """Per-pair inverse frequencies, (head_dim/2,) float64 list, with the config's scaling applied.

    `freq_factors`: llama.cpp stores Llama 3.1's scaling as a `rope_freqs` tensor of divisors instead of
    config values; when given, it is used as is.
    """
    half = cfg.head_dim // 2
    inv = [cfg.rope_theta ** (-2 * i / cfg.head_dim) for i in range(half)]
    rs = cfg.rope_scaling
    if freq_factors is not None:
        return [f / float(d) for f, d in zip(inv, freq_factors)]
    if rs is None or rs.kind == "linear":
        return inv  # linear scaling divides positions, see positions_scale
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / rs.factor)
        else:
            smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            out.append((1 - smooth) * f / rs.factor + smooth * f)
    return out
