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
too, so the search never does worse than RTN on its tokens.

Then each group's range is searched (`fit_groups`): where AWQ's authors grid-search a clipping ratio, we start
from the group's min/max grid and alternate rounding with a least-squares fit of its scale and integer zero point,
weighted by each input channel's energy E[x_i^2], keeping the best grid seen. The range may shrink (clipping an
outlier whose input is quiet) or shift (the offset that integer zero points cannot hold exactly), and the search
never does worse than the min/max grid on that weighted error. On the embedded model it beats the clipping grid
search (`bench/quantize.py`, README). That weighted error ignores which tokens and which outputs matter most, so
each layer finally keeps whichever of the search's scales or none, on the fitted grid or the min/max one, gives
the least output error (`choose_scaling`): never more than RTN's on the calibration rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmrun.quant_formats import GroupQuant

N_GRID = 20  # a in {0, 0.05, ..., 0.95}
FIT_ROUNDS = 8  # least-squares refits of each group's grid (the error stops falling after 3-5)


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
    mean_sq: torch.Tensor  # (in,) mean x^2 over every calibration token: each channel's weight in the grid fit
    rows: torch.Tensor  # (R, in) a fixed random sample of token rows: the inputs the output error is measured on


def _linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's output on rows (R, in) for weight (out, in): the forward the search judges by default."""
    return rows @ weight.T


def search_scale(w: torch.Tensor, x: LinearInputs, bits: int, group: int, tie=None, forward=None):
    """The input-channel scales s (in,) minimising the output error of W quantized as Q(W s) / s over x.rows
    -> (s, that error, plain RTN's error).

    Candidates (AutoAWQ's "duo" form): s = mean|x|^a / mean|W|^(1-a) for a in [0, 1), |W| normalised per group,
    and s = 1 (RTN itself). The output is x W^T, or `forward(x.rows, W)` (the module the layer feeds, e.g. the
    whole MLP for gate/up). `tie` = (kv_heads, heads_per_kv, head_dim): s must be equal across the query heads
    that share a value head (o's input channels), so it can be folded into v."""
    forward = forward or _linear

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


def choose_scaling(w: torch.Tensor, x: LinearInputs, bits: int, group: int, tie=None, forward=None):
    """How to quantize W: (s (in,), grid, output error over x.rows, plain RTN's error). s is `search_scale`'s or
    1; grid is "fit" (`fit_groups` of W s, weighted by the scaled inputs' energy) or "minmax" (`quantize_groups`);
    of the four pairs, the one with the least output error (ties go to the search's s).

    The search judges its candidates on the min/max grid, which is quick. The fitted grid usually lowers the error
    further, but it weighs each input channel by its mean energy alone: where a few tokens carry massive
    activations through what follows the layer, it can do far worse. Measured on the embedded model: its 12th
    block's MLP, with the search's s on the fitted grid, erred 20x more than RTN, nearly all of it on 2 of 512
    sampled tokens; hence the comparison on the real output error."""
    forward = forward or _linear
    s, err, rtn_err = search_scale(w, x, bits, group, tie, forward)
    y = forward(x.rows, w)

    def fitted_error(c):
        q = fit_groups(w * c, x.mean_sq / (c * c), bits, group)
        return (forward(x.rows / c, q.dequantize()) - y).pow(2).mean().item()

    ones = torch.ones_like(s)
    candidates = [(err, s, "minmax"), (fitted_error(s), s, "fit"), (rtn_err, ones, "minmax"),
                  (fitted_error(ones), ones, "fit")]
    best = min(candidates, key=lambda c: c[0])  # the first of equals: the search's s
    return best[1], best[2], best[0], rtn_err


def fit_groups(w: torch.Tensor, energy: torch.Tensor, bits: int, group: int, rounds: int = FIT_ROUNDS) -> GroupQuant:
    """w (out, in) quantized group-wise with each (row, group)'s grid chosen to minimise its rounding error
    weighted by the input channels' energy (in,) (E[x_i^2]: the output error, less its cross-channel terms).

    Two searches, the better kept per group: AWQ's clipping grid (the min/max range with its ends shrunk
    independently, by 0 to 45% in steps of 5%), which finds drastic clips a local search misses; and a local
    refinement from both that grid's best and the plain min/max grid: given the codes, the scale and offset
    solve a weighted least-squares fit of the weights to them, the zero point is the offset rounded to an
    integer, and the codes are rounded again, `rounds` times. The min/max grid is a candidate, so no group does
    worse than `quantize_groups`."""
    out, inp = w.shape
    wg = w.float().reshape(out, inp // group, group)  # (out, G, g)
    e = energy.float().reshape(1, inp // group, group)  # (1, G, g)
    plain = quantize_groups(w, bits, group)
    start = (plain.scales.float()[..., None], plain.zeros.float()[..., None])  # (out, G, 1) each
    err, scale, zero = _refit(wg, e, bits, *start, rounds)
    err_c, scale_c, zero_c = _refit(wg, e, bits, *_clip_search(wg, e, bits), rounds)
    better = (err_c < err)[..., None]
    scale, zero = torch.where(better, scale_c, scale), torch.where(better, zero_c, zero)
    codes = ((wg / scale).round() + zero).clamp(0, 2**bits - 1)
    return GroupQuant(codes.to(torch.uint8).reshape(out, inp), scale[..., 0].half(), zero[..., 0].to(torch.uint8),
                      bits, group)


def _grid_error(wg, e, scale, zero, top):
    """(out, G) weighted rounding error of the groups wg (out, G, g) on the grids scale, zero (out, G, 1): the grid
    search's inner loop (`kernels.grid_error`: in C on a CPU that has the C kernels)."""
    from llmrun import kernels

    return kernels.grid_error(wg, e, scale, zero, top)


def _clip_search(wg, e, bits):
    """The (scale, zero) (out, G, 1) of the best clipped range [r_lo min, r_hi max] per group."""
    top = 2**bits - 1
    hi, lo = wg.amax(-1, keepdim=True).clamp(min=0), wg.amin(-1, keepdim=True).clamp(max=0)
    best_err = torch.full(wg.shape[:2], float("inf"), device=wg.device)
    best_scale, best_zero = torch.ones_like(hi), torch.zeros_like(hi)
    ratios = [1 - i / 20 for i in range(10)]
    for r_lo in ratios:
        for r_hi in ratios:
            scale = ((hi * r_hi - lo * r_lo).clamp(min=1e-5) / top).half().float()  # as quantize_groups rounds it
            zero = (-lo * r_lo / scale).round().clamp(0, top)
            err = _grid_error(wg, e, scale, zero, top)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better[..., None], scale, best_scale)
            best_zero = torch.where(better[..., None], zero, best_zero)
    return best_scale, best_zero


def _refit(wg, e, bits, scale, zero, rounds):
    """Alternate rounding with the least-squares fit of each group's grid, from (scale, zero) (out, G, 1)
    -> the best (error (out, G), scale, zero) seen, the start included."""
    top = 2**bits - 1
    best = (_grid_error(wg, e, scale, zero, top), scale, zero)
    e_sum, ew_sum = e.sum(-1), (e * wg).sum(-1)  # (1, G), (out, G)
    for _ in range(rounds):
        codes = ((wg / scale).round() + zero).clamp(0, top)
        # minimise sum_i e_i (w_i - a q_i - b)^2 over (a, b): the 2x2 normal equations
        eq = e * codes
        a11, a12, r1 = (eq * codes).sum(-1), eq.sum(-1), (eq * wg).sum(-1)
        det = a11 * e_sum - a12 * a12
        a = (e_sum * r1 - a12 * ew_sum) / det.clamp(min=1e-30)
        b = (a11 * ew_sum - a12 * r1) / det.clamp(min=1e-30)
        fits = (det > 1e-6 * a11 * e_sum) & (a > 0)  # codes that vary, on channels with energy; a rising grid
        scale = torch.where(fits, a, scale[..., 0]).half().float().clamp(min=2**-24)[..., None]
        zero = torch.where(fits[..., None], (-b[..., None] / scale).round(), zero).clamp(0, top)
        err = _grid_error(wg, e, scale, zero, top)
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better[..., None], scale, best[1]),
                torch.where(better[..., None], zero, best[2]))
    return best


@dataclass
class BlockReport:
    """Output error (mean squared, on the sampled calibration rows) of each layer quantized by AWQ and by plain
    round-to-nearest; for gate/up, of the MLP's output."""

    awq: dict[str, float]
    rtn: dict[str, float]


LAYERS = {"qkv": "attn.qkv", "o": "attn.o", "gate_up": "mlp.gate_up", "down": "mlp.down"}  # input name -> module


def awq_block(block, inputs: dict[str, LinearInputs], cfg, bits: int, group: int):
    """Quantize the four linear layers of `block` (a `models.llama.Block`, fp32) with AWQ -> ({module name:
    GroupQuant}, BlockReport). The scales are folded into the block's weights in place, which leaves its float
    function unchanged. `inputs` holds the inputs of attn.qkv, attn.o, mlp.gate_up and mlp.down (keys as in
    LAYERS); they are rescaled as the scales are folded."""
    attn, mlp = block.attn, block.mlp
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    report = BlockReport({}, {})

    def through_mlp(rows, w):  # gate/up's scales are judged by the MLP's output (the SiLU gate mixes them)
        gate_up = rows @ w.T
        return (F.silu(gate_up[:, : cfg.ffn_dim]) * gate_up[:, cfg.ffn_dim :]) @ mlp.down.weight.T

    def output_error(name, weights):
        """On the sampled rows, the error of the layer's output, or for gate/up of the MLP's (down in float), as
        the scale search measures it: AWQ trades gate/up's own error for the MLP's."""
        forward = through_mlp if name == "gate_up" else _linear
        rows, exact = inputs[name].rows, block.get_submodule(LAYERS[name]).weight
        return (forward(rows, weights) - forward(rows, exact)).pow(2).mean().item()

    for name, module in LAYERS.items():
        report.rtn[name] = output_error(name, fake_quantize(block.get_submodule(module).weight, bits, group))

    grids = {}  # layer -> "fit" or "minmax", as choose_scaling picked

    def scaling(name, tie=None, forward=None):
        s, grids[name], _, _ = choose_scaling(block.get_submodule(LAYERS[name]).weight, inputs[name], bits, group,
                                              tie=tie, forward=forward)
        return s

    def divide_inputs(name, s):
        inputs[name].rows.div_(s)
        inputs[name].mean_sq.div_(s * s)

    def fold_into_norm(norm, linear, name, forward=None):
        s = scaling(name, forward=forward)
        norm.weight.div_(s)
        linear.weight.mul_(s)
        divide_inputs(name, s)

    fold_into_norm(block.attn_norm, attn.qkv, "qkv")
    # v -> o: o's input channel (head h, dim d) is v's row (h // heads_per_kv, d)
    tie = (cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)
    s = scaling("o", tie=tie)
    s_v = s.view(*tie)[:, 0].reshape(-1)  # (kv_rows,)
    attn.qkv.weight[q_rows + kv_rows :].div_(s_v[:, None])
    if attn.qkv.bias is not None:
        attn.qkv.bias[q_rows + kv_rows :].div_(s_v)
    attn.o.weight.mul_(s)
    divide_inputs("o", s)

    fold_into_norm(block.mlp_norm, mlp.gate_up, "gate_up", forward=through_mlp)
    s = scaling("down")
    mlp.gate_up.weight[cfg.ffn_dim :].div_(s[:, None])
    mlp.down.weight.mul_(s)
    divide_inputs("down", s)

    quantized = {}
    for name, module in LAYERS.items():
        w = block.get_submodule(module).weight
        quantized[module] = (fit_groups(w, inputs[name].mean_sq, bits, group) if grids[name] == "fit"
                             else quantize_groups(w, bits, group))
        report.awq[name] = output_error(name, quantized[module].dequantize())
    return quantized, report
