"""The Llama family in one file: Llama 2/3/3.x, Mistral, SmolLM2, Qwen2/2.5 and Qwen3 differ only in config flags
(GQA ratio, tied embeddings, q/k/v biases, sliding window, RoPE scaling, Qwen3's per-head q/k norms).

Module names are ours (`layers.3.attn.qkv`); loaders map HF and GGUF tensor names onto them explicitly,
concatenating the q/k/v and gate/up projections that checkpoints store apart.
Linear layers are `nn.Linear` run through `kernels.linear` (`Linear`); the loader swaps in `models.quant` layers for
weights it keeps quantized.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
import torch.nn as nn

from llmrun import kernels

from .config import ModelConfig, rope_inv_freq
from .quant import QuantEmbedding, QuantLinear


STACK_MAX_TOKENS = 16  # forwards of up to this many tokens run through the CPU's whole-stack call


class Linear(nn.Linear):
    """An `nn.Linear` whose forward is `kernels.linear`, the one dispatch point for float matmuls."""

    def forward(self, x, gated: bool = False):
        return kernels.linear(x, self.weight, self.bias, gated)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # q, k and v projections as one matmul: rows [q (Hq*D); k (Hkv*D); v (Hkv*D)]
        self.qkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.attention_bias)
        self.o = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.attention_out_bias)
        # Qwen3: each q and k head RMS-normalized over head_dim (one weight for all q heads, one for all k heads)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, start_pos: int, cache, window):
        B, T, _ = x.shape
        Hq, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x).view(B, T, Hq + 2 * Hkv, self.head_dim)
        if self.q_norm is not None:  # before RoPE, which the cache's write applies
            kernels.head_rms_norm_(qkv, Hq, Hkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if cache is None:
            qk = kernels.apply_rope(qkv[:, :, : Hq + Hkv], cos, sin)  # q and k heads in one pass
            q, k, v = qk[:, :, :Hq], qk[:, :, Hq:], qkv[:, :, Hq + Hkv :]  # (B, T, H, D) each
            # k, v (B, Hkv, T, D), copied to rows as a cache holds them: the kernel a cached forward runs serves, so
            # each row's bits are those of the same row computed with a cache (the C kernels are batch invariant)
            y = kernels.attention(q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), window)
        else:
            # q rotated (B, T, Hq, D); k, v (B, Hkv, S, D) over the cache's S slots, or a quantized cache (v None);
            # mass: H2O's scores
            q, k, v, mass = cache.update_qkv(self.layer_idx, start_pos, qkv, Hq, cos, sin)
            step = getattr(cache, "device_step", None)  # a CUDA graph's step: the keys in use are counted on the device
            length = None if step is None else step.length
            if v is None:
                y = kernels.quantized_attention(q, k, window, mass=mass, length=length)
            else:
                y = kernels.attention(q, k, v, window, mass=mass, length=length)  # (B, T, Hq, D)
        return self.o(y.reshape(B, T, Hq * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ffn_dim = cfg.ffn_dim
        self.gate_up = Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)  # rows [gate; up]: one matmul
        self.down = Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        # silu(gate) * up: on a GPU the gate/up matmul's GEMV writes it (a decode step's launch fewer), elsewhere
        # kernels.silu_mul after the matmul
        return self.down(self.gate_up(x, gated=True))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, start_pos, cache, window):
        h, mlp_out = self.residuals(x, None, cos, sin, start_pos, cache, window)
        return h + mlp_out

    def residuals(self, x, pending, cos, sin, start_pos, cache, window):
        """The block's output left as two addends (h, mlp_out), so that whatever norm comes next adds them in its
        own launch (`kernels.add_rms_norm`); `pending` is the previous block's mlp_out (x then its h), or None."""
        if pending is None:
            normed = self.attn_norm(x)
        else:
            x, normed = kernels.add_rms_norm(x, pending, self.attn_norm.weight, self.attn_norm.eps)
        h, normed = kernels.add_rms_norm(x, self.attn(normed, cos, sin, start_pos, cache, window),
                                         self.mlp_norm.weight, self.mlp_norm.eps)
        return h, self.mlp(normed)


def int4_block(block: Block) -> Block:
    """A copy of `block` whose four linear layers are 4-bit round-to-nearest blocks of its weights (norms
    shared)."""
    from .quant import int4_linear

    block, attn, mlp = copy.copy(block), copy.copy(block.attn), copy.copy(block.mlp)
    block._modules, attn._modules, mlp._modules = dict(block._modules), dict(attn._modules), dict(mlp._modules)
    attn.qkv, attn.o = int4_linear(attn.qkv), int4_linear(attn.o)
    mlp.gate_up, mlp.down = int4_linear(mlp.gate_up), int4_linear(mlp.down)
    block.attn, block.mlp = attn, mlp
    return block


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # The loaders build on the meta device, where nn.Embedding's own init (normal_) imports torch._dynamo: 2-3 s
        # of every start. Its table is drawn here only on a real device (the same draw: tests' random models).
        table = torch.empty(cfg.vocab_size, cfg.dim)
        if table.device.type != "meta":
            nn.init.normal_(table)
        self.embed = nn.Embedding.from_pretrained(table, freeze=False)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Divisors of the RoPE frequencies (GGUF `rope_freqs`, Llama 3.1); None when the config says it all.
        self.rope_freq_factors: list[float] | None = None
        self._cos = self._sin = None  # (positions, D) fp32 tables, grown on demand
        self._stack = None  # (cache buffers' addresses, kernels.cpu.DecodeStack or None)
        self.reference_ops = False  # True: every op is kernels.ref's plain PyTorch (the eager baseline)

    def with_layers(self, keep: list[int]) -> Transformer:
        """A model that shares every weight with this one but runs only the layers `keep`, renumbered 0.. for
        its own KV cache (a self-speculative draft: no second model, no extra weights)."""
        sub = copy.copy(self)
        sub._modules = dict(self._modules)  # its own module table: setting `layers` must not touch ours
        sub.config = dataclasses.replace(self.config, n_layers=len(keep))
        blocks = []
        for j, i in enumerate(keep):
            block, attn = copy.copy(self.layers[i]), copy.copy(self.layers[i].attn)
            block._modules = dict(block._modules)
            attn.layer_idx = j
            block.attn = attn
            blocks.append(block)
        sub.layers = nn.ModuleList(blocks)
        sub._stack = None
        return sub

    def with_int4_weights(self) -> Transformer:
        """A copy whose linear layers (output head included) are 4-bit round-to-nearest blocks of the weights;
        norms and the embedding lookup are shared. A cheap draft of a wider-weighted model."""
        from .quant import int4_linear

        sub = copy.copy(self)
        sub._modules = dict(self._modules)
        sub.reference_ops = False  # the draft always runs llmrun's kernels
        sub._stack = None
        sub.layers = nn.ModuleList(int4_block(block) for block in self.layers)
        # a tied head becomes an untied quantized copy of the embedding table
        sub.lm_head = int4_linear(self.embed if self.lm_head is None else self.lm_head)
        return sub

    def _rope_tables(self, end: int, device):
        if self._cos is None or self._cos.shape[0] < end or self._cos.device != device:
            length = max(end, 256 if self._cos is None else 2 * self._cos.shape[0])
            cos, sin = self.rope_at(torch.arange(length))  # (length, D)
            rs = self.config.rope_scaling
            if rs is not None and rs.attention_factor != 1:  # YaRN's: on the tables, not on re-rotations (rope_at)
                cos, sin = cos * rs.attention_factor, sin * rs.attention_factor
            self._cos, self._sin = cos.to(device), sin.to(device)
        return self._cos, self._sin

    def rope_at(self, positions: torch.Tensor):
        """cos, sin (..., D) fp32 of the RoPE angles at `positions` (...), computed in fp64; positions may be
        negative: rotating a key by them moves it that many positions."""
        cfg = self.config
        inv = torch.tensor(rope_inv_freq(cfg, self.rope_freq_factors), dtype=torch.float64, device=positions.device)
        pos = positions.to(torch.float64)
        if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":
            pos = pos / cfg.rope_scaling.factor
        angles = pos[..., None] * inv  # (..., D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., D): pairs (i, i + D/2) share an angle
        return angles.cos().float(), angles.sin().float()

    def _decode_stack(self, x, cache):
        """The CPU's whole-stack decode step (`kernels.cpu.DecodeStack`) for this cache, when every layer's
        matmuls are quantized for the CPU kernels, activations are fp32 and the cache is fp32, int8 or int4 (with
        or without H2O's attention mass); else None."""
        dense, fmt, store = getattr(cache, "dense", None), getattr(cache, "format", None), getattr(cache, "store", None)
        if dense is not None and dense[0].dtype == torch.float32:
            kv = dict(fp32_kv=dense)
        elif fmt == "int8":
            kv = dict(int8_kv=(store.codes, store.scales))
        elif fmt == "int4" and store.k_recent.dtype == torch.float32 and store.k.shape[1] == 1:
            kv = dict(int4_kv=(*store.buffers, store.state))
        else:
            return None
        scores = getattr(cache, "scores", None)
        key = (*(t.data_ptr() for t in next(iter(kv.values()))), None if scores is None else scores.data_ptr())
        if self._stack is not None and self._stack[0] == key:
            return self._stack[1]
        stack = None
        linears = [(l.attn.qkv, l.attn.o, l.mlp.gate_up, l.mlp.down) for l in self.layers]
        if (x.device.type == "cpu" and x.dtype == torch.float32 and not self.config.sliding_window_from
                and all(isinstance(w, QuantLinear) for ws in linears for w in ws) and kernels.cpu.available()):
            cfg = self.config
            layers = [dict(attn_norm=l.attn_norm.weight, mlp_norm=l.mlp_norm.weight, qkv=l.attn.qkv, o=l.attn.o,
                           gate_up=l.mlp.gate_up, down=l.mlp.down,  # and Qwen3's head norms, or None
                           **{n: getattr(getattr(l.attn, n), "weight", None) for n in ("q_norm", "k_norm")})
                      for l in self.layers]
            stack = kernels.cpu.DecodeStack(
                layers, **kv, scores=scores, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                dim=cfg.dim, ffn_dim=cfg.ffn_dim, eps=cfg.norm_eps, window=cfg.sliding_window)
        self._stack = (key, stack)
        # the stack holds the cache's buffers: it goes when the cache does, not at the next cache's first step
        weakref.finalize(cache, self._forget_stack, key)
        return stack

    def _forget_stack(self, key) -> None:
        if self._stack is not None and self._stack[0] == key:
            self._stack = None

    def forward(self, tokens: torch.Tensor, start_pos: int | torch.Tensor = 0, cache=None, last_only: bool = False):
        """tokens (B, T) at positions start_pos..start_pos+T-1 -> logits (B, T, V) fp32 ((B, 1, V) if last_only).

        `cache` is a KV cache holding positions [0, start_pos); the new keys/values are written into it.
        Without a cache the tokens attend only to each other (start_pos then only shifts RoPE).
        start_pos may instead be the T positions as a device tensor, with the cache's `device_step` set: a step that
        reads no position on the host, for CUDA graphs (`llmrun.cuda_graphs`).
        """
        with kernels.reference_ops(self.reference_ops):
            return self._forward(tokens, start_pos, cache, last_only)

    def _forward(self, tokens, start_pos, cache, last_only):
        B, T = tokens.shape
        x = self.embed(tokens)  # (B, T, dim)
        on_device = isinstance(start_pos, torch.Tensor)
        if on_device:  # positions (T,) on the device: the tables must already cover them (DecodeGraphs sees to it)
            cos, sin = self._rope_tables(0, x.device)
            cos, sin = cos.index_select(0, start_pos).to(x.dtype), sin.index_select(0, start_pos).to(x.dtype)
        else:
            cos, sin = self._rope_tables(start_pos + T, x.device)
            cos = cos[start_pos : start_pos + T].to(x.dtype).contiguous()  # (T, D)
            sin = sin[start_pos : start_pos + T].to(x.dtype).contiguous()
        # decode steps and speculative blocks; longer prompts amortize the Python of the layer loop anyway
        short = T <= STACK_MAX_TOKENS and B == 1 and cache is not None and not self.reference_ops and not on_device
        stack = self._decode_stack(x, cache) if short else None
        if stack is not None:  # one C call for all layers: the same kernels as the loop below, bit for bit
            x = stack(x, cache.slot(start_pos), cos, sin)
            cache.record_positions(start_pos, T)
            x = self.norm(x[:, -1:] if last_only else x)
        else:
            # each residual add runs inside the next norm's launch: a decode step's launches cost time of their own
            pending = None
            for i, layer in enumerate(self.layers):
                x, pending = layer.residuals(x, pending, cos, sin, start_pos, cache, self.config.layer_window(i))
            if last_only:
                x, pending = x[:, -1:], pending[:, -1:]
            x = kernels.add_rms_norm(x, pending, self.norm.weight, self.norm.eps)[1]
        if self.lm_head is not None:
            logits = self.lm_head(x)
        elif isinstance(self.embed, QuantEmbedding):
            logits = self.embed.project(x)  # tied, quantized
        else:
            logits = kernels.linear(x, self.embed.weight)
        return logits.float()
