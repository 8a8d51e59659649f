"""Turning logits into the next token: repetition penalty, temperature, top-k, top-p, min-p.

`token_probs` gives the distribution actually sampled from, so speculative verification can apply the same
filters to target and draft alike. Order (as in HF transformers): penalty, temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from llmrun.errors import LlmrunError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy (argmax)
    top_k: int = 40  # keep the k most likely tokens; 0 turns it off
    top_p: float = 0.95  # keep the smallest set whose probability reaches p; 1 turns it off
    min_p: float = 0.05  # drop tokens below min_p x the top token's probability; 0 turns it off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the context (CTRL's rule)
    seed: int | None = None  # same seed, same output
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these strings
    ignore_eos: bool = False  # keep going past end-of-generation tokens (benchmarks: a fixed token count)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (V,); history (N,) token ids. Positive logits of seen tokens are divided by the penalty,
    negative ones multiplied, so the token always becomes less likely."""
    if penalty == 1.0 or history.numel() == 0:
        return logits
    seen = logits.gather(0, history)
    logits = logits.clone()
    logits.scatter_(0, history, torch.where(seen > 0, seen / penalty, seen * penalty))
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits (V,) already divided by the temperature -> the same with removed tokens set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def token_probs(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution (V,) fp32 the next token is drawn from; one-hot at the argmax when greedy."""
    logits = logits.float()
    if history is not None:
        logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # Top-k first: top-p and min-p can only drop more, so they run on the k survivors, not the vocabulary
        # (unless the k-th value is tied, and more than k survive). A k-th value of -inf (fewer than k tokens
        # allowed, as under a grammar's mask) leaves every allowed token among the k.
        values, ids = torch.topk(logits, params.top_k)
        if values[-1] == float("-inf") or int((logits >= values[-1]).sum()) == params.top_k:
            kept = filter_logits(values, 0, params.top_p, params.min_p).softmax(-1)
            return torch.zeros_like(logits).index_put_((ids,), kept)
    return filter_logits(logits, params.top_k, params.top_p, params.min_p).softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           history: torch.Tensor | None = None) -> int:
    """Draw the next token id from logits (V,)."""
    if params.greedy:
        if history is not None and params.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
        return int(logits.argmax())
    return draw(token_probs(logits, params, history), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token id drawn from probs (V,): nonnegative weights, at least one positive, not necessarily summing to 1.
    Only the tokens with positive weight take part (after top-k / top-p / min-p, a few dozen), so the draw costs
    one pass to find them rather than torch.multinomial's work over the whole vocabulary; same distribution."""
    support = probs.nonzero().squeeze(1)
    try:
        return int(support[torch.multinomial(probs[support], 1, generator=generator)])
    except RuntimeError as e:  # NaN or inf: the logits were not finite (checked once a prompt, not every step)
        raise LlmrunError(f"cannot sample the next token: the model's output is not finite ({e})") from None


_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """64 well-mixed bits from a few integers (splitmix64's finalizer over their sum under odd multipliers)."""
    x = sum(v * m for v, m in zip(values, (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Randomness:
    """The random numbers of a reply, keyed by position: the token that goes to context position j is drawn from a
    stream of its own, seeded from (seed, j, stream). So what a position draws does not depend on how the steps
    before it were cut into speculative blocks, and with a drafter whose proposals are not sampled (prompt
    lookup, a grammar's forced text) sampled speculation gives the plain sampler's very tokens for the same
    seed, whatever K. Stream 0 is the target's; stream 1 a draft model's, which must be independent of it."""

    def __init__(self, seed: int | None, device):
        self.seed = secrets.randbits(64) if seed is None else seed
        self._generator = torch.Generator(device=device)

    def at(self, position: int, stream: int = 0) -> torch.Generator:
        """The generator for `position`, at the start of its stream (one generator, reseeded: use it before
        asking for another position)."""
        return self._generator.manual_seed(_mix(self.seed, position, stream))
