"""Activation-aware weight quantization (AWQ; Lin et al., 2023) of one transformer block, and the round-to-nearest
baselines it is measured against.

A few input channels of each linear layer carry much larger activations than the rest; rounding errors in the
weights they multiply cost the most. AWQ multiplies those weight columns by s > 1 before quantizing (their
relative rounding error shrinks) and divides the input by s, folding 1/s into the op that produces the input, so
the float model is unchanged. Per scale group:

    attn_norm -> q, k, v      (1/s folded into the RMSNorm weight)
    v         -> o            (into v's rows; with GQA one s per key/value channel, shared by its query heads)
    mlp_norm  -> gate, up     (into the RMSNorm weight)
    up        -> down         (into up's rows: down's input is silu(gate) * up)

s = mean|x|^a / mean|W|^(1-a) per input channel, a grid-searched in [0, 1) to minimise the output error on
calibration tokens (of the layer; for gate/up, of the whole MLP); s = 1, plain round-to-nearest, is a candidate
too, so the search never does worse than RTN on its tokens. Then each output row's clipping range is searched
per group, shrinking its minimum and maximum independently by up to 45%, by the input-energy-weighted rounding
error; q and k are not clipped (attention scores are sensitive to their outliers, as AutoAWQ found).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmrun.quant_formats import GroupQuant

N_GRID = 20  # a in {0, 0.05, ..., 0.95}; clipping ratios 1, 0.95, ..., 0.55
MAX_SHRINK = 0.5


def quantize_groups(w: torch.Tensor, bits: int, group: int) -> GroupQuant:
    """Asymmetric round-to-nearest with integer zero points per group of `group` input columns (AWQ's scheme):
    scale = (max - min) / (2^bits - 1) as fp16, zero = round(-min / scale), the range widened to hold 0."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // group, group)
    hi, lo = g.amax(-1).clamp(min=0), g.amin(-1).clamp(max=0)  # an integer zero point needs 0 in range
    top = 2**bits - 1
    scales = ((hi - lo).clamp(min=1e-5) / top).half()
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, top)
    codes = (g / s[..., None]).round() + zeros[..., None]
    codes = codes.clamp(0, top).to(torch.uint8).reshape(out, inp)
    return GroupQuant(codes, scales, zeros.to(torch.uint8), bits, group)


def quantize_int8_rows(w: torch.Tensor) -> GroupQuant:
    """Symmetric 8-bit per output row: scale = max|w| / 127, codes q + 128 (zero point 128)."""
    out, inp = w.shape
    scales = (w.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8).half()
    q = (w.float() / scales.float()).round().clamp(-127, 127) + 128
    return GroupQuant(q.to(torch.uint8), scales, torch.full((out, 1), 128, dtype=torch.uint8), 8, inp)


def fake_quantize(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """w rounded to its `quantize_groups` grid, as floats."""
    return quantize_groups(w, bits, group).dequantize().to(w.dtype)


@dataclass
class LinearInputs:
    """What the search needs of one linear layer's input over the calibration tokens."""

    mean_abs: torch.Tensor  # (in,) mean |x| over every calibration token
    rows: torch.Tensor  # (R, in) a fixed random sample of token rows: the inputs the output error is measured on


def search_scale(w: torch.Tensor, x: LinearInputs, bits: int, group: int, tie=None, forward=None):
    """The input-channel scales s (in,) minimising the output error of W quantized as Q(W s) / s over x.rows
    -> (s, that error, plain RTN's error).

    Candidates (AutoAWQ's "duo" form): s = mean|x|^a / mean|W|^(1-a) for a in [0, 1), |W| normalised per group,
    and s = 1 (RTN itself). The output is x W^T, or `forward(x.rows, W)` (the module the layer feeds, e.g. the
    whole MLP for gate/up). `tie` = (kv_heads, heads_per_kv, head_dim): s must be equal across the query heads
    that share a value head (o's input channels), so it can be folded into v."""
    forward = forward or (lambda rows, weight: rows @ weight.T)

    def tied(v):  # (in,) -> the mean over the query heads of each key/value head, repeated
        if tie is None:
            return v
        kv, rep, d = tie
        return v.view(kv, rep, d).mean(1, keepdim=True).expand(kv, rep, d).reshape(-1)

    x_mean = tied(x.mean_abs)
    wg = w.abs().view(w.shape[0], -1, group)
    w_mean = tied((wg / wg.amax(-1, keepdim=True).clamp(min=1e-8)).view(w.shape[0], -1).mean(0))
    y = forward(x.rows, w)
    best = (torch.ones_like(x_mean), (forward(x.rows, fake_quantize(w, bits, group)) - y).pow(2).mean().item())
    rtn_err = best[1]
    for i in range(N_GRID):
        a = i / N_GRID
        s = (x_mean.pow(a) / w_mean.pow(1 - a).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = (forward(x.rows, fake_quantize(w * s, bits, group) / s) - y).pow(2).mean().item()
        if err < best[1]:
            best = (s, err)
    return best[0], best[1], rtn_err


def search_clip(w: torch.Tensor, rows: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """w (out, in) with each (row, group) clamped to the shrunk range [r_lo min, r_hi max] (r_lo, r_hi each in
    1, 0.95, ..., 0.55) that minimises the group's output error, approximated channel-wise: sum_i E[x_i^2]
    (w_i - Q(w)_i)^2 with E[x_i^2] over `rows` (R, in). The approximation drops the cross-channel terms, which
    makes the search cheap enough to try every pair of ratios."""
    out, inp = w.shape
    top = 2**bits - 1
    energy = rows.pow(2).mean(0).view(1, inp // group, group)  # (1, G, g)
    wg = w.reshape(out, inp // group, group)
    hi, lo = wg.amax(-1, keepdim=True).clamp(min=0), wg.amin(-1, keepdim=True).clamp(max=0)
    best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)  # (out, G)
    best = wg.clone()
    ratios = [1 - i / N_GRID for i in range(int(MAX_SHRINK * N_GRID))]
    for r_lo in ratios:
        for r_hi in ratios:
            low, high = lo * r_lo, hi * r_hi
            scale = ((high - low).clamp(min=1e-5) / top).half().float()  # as quantize_groups rounds it
            zero = (-low / scale).round().clamp(0, top)
            q = scale * (((wg / scale).round() + zero).clamp(0, top) - zero)
            err = ((q - wg).pow(2) * energy).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better[..., None], wg.clamp(low, high), best)
    return best.reshape(out, inp)


@dataclass
class BlockReport:
    """Output error (mean squared, on the sampled calibration rows) of each layer: AWQ's search vs plain RTN."""

    awq: dict[str, float]
    rtn: dict[str, float]


def awq_block(block, inputs: dict[str, LinearInputs], cfg, bits: int, group: int) -> BlockReport:
    """Scale and clip the weights of `block` (a `models.llama.Block`, fp32) in place for quantization. The block's
    float function is unchanged but for the clipping. `inputs` holds the inputs of attn.qkv, attn.o, mlp.gate_up
    and mlp.down; its rows are rescaled as the scales are folded."""
    attn, mlp = block.attn, block.mlp
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    report = BlockReport({}, {})

    def fold_into_norm(norm, linear, name, forward=None):
        s, report.awq[name], report.rtn[name] = search_scale(linear.weight, inputs[name], bits, group, forward=forward)
        norm.weight.div_(s)
        linear.weight.mul_(s)
        inputs[name].rows.div_(s)

    fold_into_norm(block.attn_norm, attn.qkv, "qkv")
    # v -> o: o's input channel (head h, dim d) is v's row (h // heads_per_kv, d)
    tie = (cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)
    s, report.awq["o"], report.rtn["o"] = search_scale(attn.o.weight, inputs["o"], bits, group, tie=tie)
    s_v = s.view(*tie)[:, 0].reshape(-1)  # (kv_rows,)
    attn.qkv.weight[q_rows + kv_rows :].div_(s_v[:, None])
    if attn.qkv.bias is not None:
        attn.qkv.bias[q_rows + kv_rows :].div_(s_v)
    attn.o.weight.mul_(s)
    inputs["o"].rows.div_(s)
    def through_mlp(rows, w):  # gate/up's scales are judged by the MLP's output (the SiLU gate mixes them)
        gate_up = rows @ w.T
        return (F.silu(gate_up[:, : cfg.ffn_dim]) * gate_up[:, cfg.ffn_dim :]) @ mlp.down.weight.T

    fold_into_norm(block.mlp_norm, mlp.gate_up, "gate_up", forward=through_mlp)
    s, report.awq["down"], report.rtn["down"] = search_scale(mlp.down.weight, inputs["down"], bits, group)
    mlp.gate_up.weight[cfg.ffn_dim :].div_(s[:, None])
    mlp.down.weight.mul_(s)
    inputs["down"].rows.div_(s)

    v = attn.qkv.weight[q_rows + kv_rows :]
    v.copy_(search_clip(v, inputs["qkv"].rows, bits, group))
    for name, linear in (("o", attn.o), ("gate_up", mlp.gate_up), ("down", mlp.down)):
        linear.weight.copy_(search_clip(linear.weight, inputs[name].rows, bits, group))
    return report
