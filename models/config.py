"""The architecture hyper-parameters, built explicitly from an HF `config.json` or from GGUF metadata.

Only what changes the math is read; a setting that would change it in a way we do not implement
(another activation, an unknown RoPE scaling, MLP biases...) raises instead of being silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmrun.errors import ModelFormatError, UnsupportedModelError

# HF `architectures` names this package implements; every one is a Llama-style decoder.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# GGUF `general.architecture` -> HF name. Mistral GGUFs declare "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # a window in the layers from max_window_layers on


@dataclass(frozen=True)
class RopeScaling:
    """Context extension applied to the RoPE frequencies.

    kind "linear": positions are divided by `factor` (all frequencies slowed alike).
    kind "llama3": Llama 3.1's NTK-by-parts rule: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend between `low_freq_factor` and `high_freq_factor` wavelengths.
    kind "yarn": YaRN (Qwen2.5/Qwen3 past their trained context): frequencies that turn fewer than `beta_slow`
    times over `original_max_position` slowed by `factor`, those that turn more than `beta_fast` times kept, a
    linear ramp between (its ends rounded out to whole dimensions where `truncate`), and cos/sin multiplied by
    `attention_factor` (0.1 ln(factor) + 1 unless the config gives it).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


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
    max_seq_len: int  # the context the model runs to: the trained one, or YaRN's extension of it
    tie_embeddings: bool = False  # output projection reuses the token embedding (SmolLM2, Llama 3.2 1B/3B)
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2; Llama's and Qwen3's attention_bias)
    attention_out_bias: bool = False  # the output projection carries one too (Llama's and Qwen3's attention_bias)
    qk_norm: bool = False  # each query and key head is RMS-normalized before RoPE (Qwen3)
    sliding_window: int | None = None  # each token sees only the last N positions (Mistral v0.1)
    sliding_window_from: int = 0  # layers before this one see the whole context (Qwen2's max_window_layers)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ModelFormatError(f"invalid config: {_LABELS[name]} is {value!r}, not a positive integer")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ModelFormatError(f"invalid config: {_LABELS[name]} is {value!r}, not a positive number")
        if self.head_dim % 2:
            raise ModelFormatError(f"invalid config: head size {self.head_dim} is odd (RoPE rotates pairs)")
        if self.sliding_window is not None and (type(self.sliding_window) is not int or self.sliding_window < 1):
            raise ModelFormatError(f"invalid config: sliding window {self.sliding_window!r}, not a positive integer")
        first = self.sliding_window_from
        if type(first) is not int or first < 0 or (self.sliding_window is None and first) or first >= self.n_layers:
            raise ModelFormatError(f"invalid config: sliding window from layer {first!r} of {self.n_layers} "
                                   f"(a layer's index, with a window)")
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.n_heads} attention heads are not a multiple of {self.n_kv_heads} key/value heads"
            )
        rs = self.rope_scaling
        if rs is not None:
            if not all(math.isfinite(x) and x > 0 for x in (rs.factor, rs.low_freq_factor, rs.high_freq_factor)):
                raise ModelFormatError(f"invalid config: RoPE scaling factors {rs.factor}, {rs.low_freq_factor}, "
                                       f"{rs.high_freq_factor}: each a positive number")
            if rs.kind == "llama3" and (rs.high_freq_factor <= rs.low_freq_factor or rs.original_max_position < 1):
                raise ModelFormatError(f"invalid config: llama3 RoPE scaling with low_freq_factor "
                                       f"{rs.low_freq_factor}, high_freq_factor {rs.high_freq_factor}, original "
                                       f"context {rs.original_max_position} (low < high, a positive context)")
            yarn = (rs.beta_fast, rs.beta_slow, rs.attention_factor)
            if rs.kind == "yarn" and not (all(math.isfinite(x) and x > 0 for x in yarn) and rs.factor >= 1
                                          and rs.beta_fast >= rs.beta_slow and rs.original_max_position >= 1):
                raise ModelFormatError(f"invalid config: yarn RoPE scaling with factor {rs.factor}, beta_fast "
                                       f"{rs.beta_fast}, beta_slow {rs.beta_slow}, attention_factor "
                                       f"{rs.attention_factor}, original context {rs.original_max_position} (a "
                                       f"factor of at least 1, beta_fast >= beta_slow, positive numbers)")

    def layer_window(self, layer: int) -> int | None:
        """The window layer `layer` attends within, or None for the whole context."""
        return self.sliding_window if layer >= self.sliding_window_from else None

    @property
    def n_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention_bias:
            attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        if self.attention_out_bias:
            attn += self.dim
        if self.qk_norm:
            attn += 2 * self.head_dim
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


# Each field as the two formats name it, for errors.
_LABELS = {
    "vocab_size": "vocabulary size (vocab_size)", "dim": "hidden size (hidden_size / embedding_length)",
    "n_layers": "layer count (num_hidden_layers / block_count)",
    "n_heads": "attention heads (num_attention_heads / attention.head_count)",
    "n_kv_heads": "key/value heads (num_key_value_heads / attention.head_count_kv)",
    "head_dim": "head size (head_dim / attention.key_length)",
    "ffn_dim": "feed-forward width (intermediate_size / feed_forward_length)",
    "max_seq_len": "context length (max_position_embeddings / context_length)",
    "norm_eps": "RMSNorm epsilon (rms_norm_eps / attention.layer_norm_rms_epsilon)",
    "rope_theta": "RoPE base (rope_theta / rope.freq_base)",
}


def _number(value, what: str, kind=int):
    """A config value as `kind` (int or float), or a ModelFormatError naming it: JSON and GGUF metadata hold
    whatever their writer put there."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not integral):
        raise ModelFormatError(f"invalid config: {what} is {value!r}, not {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _unsupported_architecture(name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported architecture {name!r}; llmrun runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        " (Llama 2/3/3.1/3.2, Mistral, SmolLM2, Qwen2/2.5, Qwen3 dense)"
    )


def _rope_from_hf(cfg: dict, max_position: int) -> tuple[float, RopeScaling | None]:
    """RoPE's base and scaling: from `rope_parameters` (transformers >= 5 writes both there), else from
    `rope_theta` and `rope_scaling`."""
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    rs = cfg.get(key)
    if key == "rope_parameters":
        if not isinstance(rs, dict) or any(isinstance(v, dict) for v in rs.values()):
            raise UnsupportedModelError(f"config.json: unsupported rope_parameters {rs!r} (one set for every layer)")
        theta = rs.get("rope_theta", cfg.get("rope_theta"))
    else:
        theta = cfg.get("rope_theta")
    theta = 10000.0 if theta is None else _number(theta, "rope_theta", float)
    given = rs if isinstance(rs, dict) else {}
    for partial in (given.get("partial_rotary_factor"), cfg.get("partial_rotary_factor")):
        if partial is not None and _number(partial, "partial_rotary_factor", float) != 1.0:
            raise UnsupportedModelError(f"config.json: partial_rotary_factor {partial} (RoPE on part of each head) is "
                                        f"not supported; llmrun rotates whole heads")
    try:
        return theta, _rope_scaling_fields(rs, max_position)
    except KeyError as e:
        raise ModelFormatError(f"config.json: invalid {key} {rs!r} (it lacks {e.args[0]})") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelFormatError(f"config.json: invalid {key} {rs!r} ({type(e).__name__}: {e})") from e


def _rope_scaling_fields(rs: dict | None, max_position: int) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "yarn":  # as transformers reads it (modeling_rope_utils' _compute_yarn_parameters)
        original = _number(rs.get("original_max_position_embeddings") or max_position,
                           "original_max_position_embeddings")
        factor = _number(rs["factor"], "factor", float) if rs.get("factor") is not None else max_position / original
        attention = rs.get("attention_factor")
        if attention is None:
            mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
            attention = yarn_mscale(factor)
            if mscale and mscale_all_dim:
                attention = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        return RopeScaling("yarn", factor, original_max_position=original,
                           beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                           attention_factor=float(attention), truncate=bool(rs.get("truncate", True)))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs["low_freq_factor"]),
            float(rs["high_freq_factor"]),
            int(rs["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r}; llmrun implements 'linear', 'llama3' and 'yarn'")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `factor` times the trained one: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _context(max_position: int, scaling: RopeScaling | None) -> int:
    """The context a model runs to: its trained one, or YaRN's extended one (factor x the original) where larger
    (a Qwen config that adds YaRN keeps max_position_embeddings at the trained 32768)."""
    if scaling is None or scaling.kind != "yarn":
        return max_position
    extended = scaling.factor * scaling.original_max_position
    if not math.isfinite(extended):
        return max_position  # (a factor that is not a number: ModelConfig names it)
    if extended > 1 << 31:
        raise ModelFormatError(f"invalid config: yarn RoPE scaling with factor {scaling.factor} over "
                               f"{scaling.original_max_position} positions makes a context of {extended:.3g}")
    return max(max_position, int(extended))


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3"}
_ARCHITECTURES = {v: k for k, v in _MODEL_TYPES.items()}  # a config without `architectures` still has a model_type


def config_from_hf(cfg: dict) -> ModelConfig:
    """Build the config from a parsed HF `config.json`."""
    archs = cfg.get("architectures") or [_ARCHITECTURES.get(cfg.get("model_type"), cfg.get("model_type", "?"))]
    if isinstance(archs, str):  # one name, not in its list (transformers reads the model_type anyway)
        archs = [archs]
    arch = archs[0] if isinstance(archs, list) else archs
    if not isinstance(arch, str):
        raise ModelFormatError(f"invalid config: architectures is {str(cfg.get('architectures'))[:60]}, "
                               f"not a list of names")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _unsupported_architecture(arch)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported activation {act!r}; llmrun implements SwiGLU with 'silu'")
    def flag(key: str) -> bool:  # a JSON true/false; null or absent is false (transformers' Llama/Qwen2 default)
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise ModelFormatError(f"invalid config: {key} is {value!r}, not true or false")
        return bool(value)

    if flag("mlp_bias"):
        raise UnsupportedModelError("MLP biases (mlp_bias=true) are not supported")

    def need(key, default=None, kind=int):  # null counts as absent, as transformers reads it
        value = default if cfg.get(key) is None else cfg[key]
        if value is None:
            raise ModelFormatError(f"config.json lacks {key}")
        return _number(value, key, kind)

    n_heads = need("num_attention_heads")
    dim = need("hidden_size")
    qwen = arch in _QWEN
    n_layers = need("num_hidden_layers")
    max_position, window = _HF_DEFAULTS[arch]
    max_position = need("max_position_embeddings", max_position)
    sliding, sliding_from = cfg.get("sliding_window", window), 0  # (an explicit null: no window)
    if (qwen and not flag("use_sliding_window")) or arch == "LlamaForCausalLM":
        sliding = None  # Qwen configs list a window they do not use; Llama has none (as transformers: it reads none)
    if sliding is not None:
        sliding = _number(sliding, "sliding_window")
        if qwen:  # as transformers: the window is only in the layers from max_window_layers on, or as layer_types say
            sliding_from = _window_from(cfg, n_layers)
            if sliding_from >= n_layers:
                sliding, sliding_from = None, 0
    rope_theta, rope_scaling = _rope_from_hf(cfg, max_position)
    return ModelConfig(
        architecture=arch,
        vocab_size=need("vocab_size"),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=need("num_key_value_heads", n_heads),
        head_dim=need("head_dim", 128 if arch == "Qwen3ForCausalLM" else dim // max(n_heads, 1)),  # (Qwen3Config's)
        ffn_dim=need("intermediate_size"),
        norm_eps=need("rms_norm_eps", 1e-6, float),
        rope_theta=rope_theta,
        max_seq_len=_context(max_position, rope_scaling),
        tie_embeddings=flag("tie_word_embeddings"),
        # as transformers builds them: Qwen2 biases q/k/v always and o never; Llama's and Qwen3's attention_bias
        # all four; Mistral none, whatever its config says
        attention_bias=arch == "Qwen2ForCausalLM" or (arch in _OWN_BIAS and flag("attention_bias")),
        attention_out_bias=arch in _OWN_BIAS and flag("attention_bias"),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=sliding,
        sliding_window_from=sliding_from,
        rope_scaling=rope_scaling,
    )


_OWN_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM")  # attention_bias puts a bias on q, k, v and o
# transformers' defaults of what a config.json may leave out: max_position_embeddings, sliding_window
_HF_DEFAULTS = {"LlamaForCausalLM": (2048, None), "MistralForCausalLM": (4096 * 32, 4096),
                "Qwen2ForCausalLM": (32768, 4096), "Qwen3ForCausalLM": (32768, 4096)}


def _window_from(cfg: dict, n_layers: int) -> int:
    """The first windowed layer of a Qwen2/Qwen3 config with use_sliding_window: `layer_types` (full attention, then
    sliding, as transformers writes them) when given, else max_window_layers (transformers' default, 28)."""
    types = cfg.get("layer_types")
    if types is None:
        first = _number(28 if cfg.get("max_window_layers") is None else cfg["max_window_layers"], "max_window_layers")
        return min(max(first, 0), n_layers)
    if not isinstance(types, list) or len(types) != n_layers or \
            not set(types) <= {"full_attention", "sliding_attention"}:
        raise ModelFormatError(f"invalid config: layer_types {str(types)[:80]}, not a list of {n_layers} "
                               f"'full_attention'/'sliding_attention'")
    first = types.index("sliding_attention") if "sliding_attention" in types else n_layers
    if "full_attention" in types[first:]:
        raise UnsupportedModelError("layer_types with full-attention layers after a sliding-window one are not "
                                    "supported (llmrun windows every layer from the first windowed one on)")
    return first


# (q/k/v biases, output bias) as each family's config.json can say them
_HF_BIASES = {"LlamaForCausalLM": ((False, False), (True, True)), "MistralForCausalLM": ((False, False),),
              "Qwen2ForCausalLM": ((True, False),), "Qwen3ForCausalLM": ((False, False), (True, True))}


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF `config.json` fields of `cfg` (what `config_from_hf` reads back to an equal config)."""
    out = {
        "architectures": [cfg.architecture], "model_type": _MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
    }
    biases = (cfg.attention_bias, cfg.attention_out_bias)
    if biases not in _HF_BIASES[cfg.architecture]:
        raise UnsupportedModelError(
            f"a {cfg.architecture} whose q/k/v projections {'have' if biases[0] else 'lack'} biases and whose output "
            f"projection {'has' if biases[1] else 'lacks'} one cannot be written as an HF config.json")
    if cfg.architecture == "LlamaForCausalLM" and cfg.sliding_window is not None:  # (a GGUF's window)
        raise UnsupportedModelError("a LlamaForCausalLM with a sliding window cannot be written as an HF config.json: "
                                    "transformers' Llama reads none")
    if cfg.architecture in _QWEN:
        out["use_sliding_window"] = cfg.sliding_window is not None
        if cfg.sliding_window is not None:
            out["max_window_layers"] = cfg.sliding_window_from
    if cfg.architecture != "Qwen2ForCausalLM":
        out["attention_bias"] = cfg.attention_bias
    out["sliding_window"] = cfg.sliding_window
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
    elif rs is not None and rs.kind == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": rs.factor,
                               "original_max_position_embeddings": rs.original_max_position,
                               "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow,
                               "attention_factor": rs.attention_factor, "truncate": rs.truncate}
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

    def get(key, default=None, kind=int):
        value = meta.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {gguf_arch}.{key}")
        return _number(value, f"{gguf_arch}.{key}", kind)

    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    scaling = None
    if meta.get(f"{gguf_arch}.rope.scaling.type", "none") not in ("none", None):
        kind = meta[f"{gguf_arch}.rope.scaling.type"]
        if kind == "linear":
            scaling = RopeScaling("linear", get("rope.scaling.factor", kind=float))
        elif kind == "yarn":  # as llama.cpp reads it for these architectures (llama-context.cpp): betas 32 and 1,
            # 0.1 ln(factor) + 1 times attn_factor (yarn_log_multiplier, the betas' keys: DeepSeek's and Grok's only)
            factor = get("rope.scaling.factor", kind=float)
            attention = yarn_mscale(factor) * get("rope.scaling.attn_factor", 1.0, kind=float)
            original = get("rope.scaling.original_context_length", get("context_length"))
            scaling = RopeScaling("yarn", factor, original_max_position=original, attention_factor=attention)
        else:
            raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r} in GGUF; llmrun implements 'linear' "
                                        f"and 'yarn'")
    if (scaling is None or scaling.kind != "yarn") and get("rope.scaling.attn_factor", 1.0, kind=float) != 1.0:
        raise UnsupportedModelError(f"GGUF {gguf_arch}.rope.scaling.attn_factor (RoPE's cos/sin scaled, as Phi-3's "
                                    f"converter writes it) is supported with yarn scaling only")
    tokens = meta.get("tokenizer.ggml.tokens")
    if f"{gguf_arch}.vocab_size" not in meta and not tokens:
        raise ModelFormatError(f"the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing) and no "
                               f"{gguf_arch}.vocab_size")
    vocab = get("vocab_size", len(tokens or ()))
    head_dim = get("attention.key_length", dim // max(n_heads, 1))
    for key, what in (("rope.dimension_count", "RoPE on part of each head"), ("attention.value_length", "values")):
        if (size := get(key, head_dim)) != head_dim:
            raise UnsupportedModelError(f"GGUF {gguf_arch}.{key} {size} differs from the head size {head_dim} "
                                        f"({what}); llmrun runs whole heads of one size")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        dim=dim,
        n_layers=get("block_count"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        ffn_dim=get("feed_forward_length"),
        norm_eps=get("attention.layer_norm_rms_epsilon", kind=float),
        rope_theta=get("rope.freq_base", 10000.0, kind=float),
        max_seq_len=_context(get("context_length"), scaling),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
        sliding_window=get("attention.sliding_window", 0) or None,
        rope_scaling=scaling,
        qk_norm=arch == "Qwen3ForCausalLM",
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
        return inv  # linear scaling divides the positions instead (Transformer.rope_at)
    if rs.kind == "yarn":
        def dimension(rotations):  # the dimension whose frequency turns `rotations` times over the trained context
            turns = math.log(rs.original_max_position / (rotations * 2 * math.pi))
            return cfg.head_dim * turns / (2 * math.log(cfg.rope_theta))

        low, high = dimension(rs.beta_fast), dimension(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, cfg.head_dim - 1)
        high += 0.001 if low == high else 0
        ramps = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(half)]  # 0: kept, 1: slowed
        return [f / rs.factor * ramp + f * (1 - ramp) for f, ramp in zip(inv, ramps)]
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
