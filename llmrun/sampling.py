"""Turning logits into the next token: repetition penalty, temperature, top-k, top-p, min-p.

`token_probs` gives the distribution actually sampled from, so speculative verification can apply the same
filters to target and draft alike. Order (as in HF transformers): penalty, temperature, top-k, top-p, min-p.

A draw is the inverse of the cumulative distribution in token-id order at a uniform number drawn on the host
(`uniforms`, from the position's stream of `Randomness`), and everything before it is device work over the top-k
survivors: on a GPU a sampled token costs a few dozen small launches, enqueued while the forward runs, and one
wait, for the token itself (`fetch`). (The data-dependent branches, `nonzero` and `torch.multinomial` of the draw
before waited several times a token: plain decoding at temperature 0.8 ran 0.8 ms a token slower than greedy on
the H100 and the H200, the same graphs.) `Ahead` leaves a drawn token on the device for the next forward to read,
the host reading it later: pipelined plain decoding (`Engine.plain_steps`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from llmrun.errors import not_finite


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy (argmax)
    top_k: int = 40  # keep the k most likely tokens; 0 turns it off
    top_p: float = 0.95  # keep the smallest set whose probability reaches p (tied tokens all in or all out); 1: off
    min_p: float = 0.05  # drop tokens below min_p x the top token's probability; 0 turns it off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the context (CTRL's rule)
    seed: int | None = None  # same seed, same output
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these strings
    ignore_eos: bool = False  # keep going past end-of-generation tokens (benchmarks: a fixed token count)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def mass_limit(self) -> float:
        """top_p as the probabilities' fp32 compares it: a top_p that fp32 rounds to 0 (below ~1e-45) would drop
        the top token too; any below fp32's smallest normal keeps the top token alone (its ties with it), as p does."""
        return max(self.top_p, 1.1754944e-38)


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
    """logits (..., V) already divided by the temperature -> the same with removed tokens set to -inf (each row on
    its own). Tokens of equal logits share their fate: top-k keeps every token tied with the k-th, top-p keeps or
    drops a group of tied tokens whole (`mass_before`), so that no order among them decides."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        # drop a token when the tokens more likely than it already reach top_p (the top token always stays)
        drop_sorted = mass_before(sorted_logits, sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def mass_before(values: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """values (..., n) sorted largest first (ties in any order) and their probabilities -> for each, the total
    probability of the values larger than it: what top-p holds against p. Tied values get their group's figure,
    taken where the group starts, which no order within a group changes (its members' probabilities are equal)."""
    before = probs.cumsum(-1) - probs
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[..., 1:] = values[..., 1:] != values[..., :-1]
    at = torch.arange(values.shape[-1], device=values.device)
    return before.gather(-1, torch.where(starts, at, 0).cummax(-1).values)


def vocabulary_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The definition: the filters over the whole vocabulary of logits (..., V) (penalized already)."""
    return filter_logits(logits.float() / params.temperature, params.top_k, params.mass_limit, params.min_p).softmax(-1)


@dataclass
class Survivors:
    """The tokens rows of logits may draw after the filters: ids (R, n) (None: the whole vocabulary, n = V) and
    their probabilities (R, n) fp32, each row summing to 1. `exact` (R,) bool, on the logits' device: False where
    tokens tied with the k-th largest value run past the candidates, all of which the definition keeps
    (`vocabulary_probs` then gives the row's distribution)."""

    ids: torch.Tensor | None
    probs: torch.Tensor
    exact: torch.Tensor

    def dense(self, vocab: int) -> torch.Tensor:
        """(R, vocab): each row's probabilities at their token ids, 0 elsewhere."""
        if self.ids is None:
            return self.probs
        return self.probs.new_zeros(self.probs.shape[0], vocab).scatter_(-1, self.ids, self.probs)


def survivors(logits: torch.Tensor, params: SamplingParams) -> Survivors:
    """Rows of logits (R, V), penalized already (not greedy) -> what each may draw: the temperature, then top-k,
    then top-p and min-p on the k survivors alone (they can only drop more), so that a row costs a top-k over
    the vocabulary rather than a sort of it. Device work only: nothing here waits for the device.

    Top-k keeps every token tied with the k-th value, as the definition does (`filter_logits`): the candidates are
    the top 2k, of which those below the k-th value drop. A row is exact unless its ties run past them. Ties are
    common where logits come in 16 bits: rounded to bf16, 40% of the embedded model's sampled steps tie at the
    40th value (measured over 200 steps), each of which, with k candidates, took the whole vocabulary's draw."""
    logits = logits.float() / params.temperature
    k, V = params.top_k, logits.shape[-1]
    if not 0 < k < V:
        probs = filter_logits(logits, 0, params.mass_limit, params.min_p).softmax(-1)
        return Survivors(None, probs, torch.ones(len(logits), dtype=torch.bool, device=logits.device))
    n = min(2 * k, V)
    values, ids = torch.topk(logits, n)  # (R, n), largest first
    kth = values[:, k - 1 : k]
    # a k-th value of -inf (fewer than k tokens allowed, as under a grammar's mask) leaves every allowed one among k
    exact = (kth[:, 0] == float("-inf")) | (values[:, -1] < kth[:, 0]) | (n == V)  # no tie past the candidates
    values = values.masked_fill(values < kth, float("-inf"))
    # filter_logits's top-p and min-p on values sorted already: no sort, and the top token's probability is the first
    if params.top_p < 1.0:
        values = values.masked_fill(mass_before(values, values.softmax(-1)) >= params.mass_limit, float("-inf"))
    if params.min_p > 0.0:
        probs = values.softmax(-1)
        values = values.masked_fill(probs < params.min_p * probs[:, :1], float("-inf"))
    return Survivors(ids, values.softmax(-1), exact)


def token_probs(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution (V,) fp32 the next token is drawn from; one-hot at the argmax when greedy."""
    logits = penalized(logits, params, history)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    rows = survivors(logits[None], params)
    if fetch(rows.exact)[0]:
        return rows.dense(logits.shape[-1])[0]
    return vocabulary_probs(logits, params)


def penalized(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None) -> torch.Tensor:
    """logits (V,) fp32, with the repetition penalty applied over `history` where there is one."""
    logits = logits.float()
    if history is None or params.repetition_penalty == 1.0:
        return logits
    return apply_repetition_penalty(logits, history, params.repetition_penalty)


def drawn(logits: torch.Tensor, params: SamplingParams, u: float | torch.Tensor) -> tuple[Survivors, torch.Tensor]:
    """A sampled draw from logits (V,) at uniform u (a float, or (1, 1) float64 on the device), or one a row from
    rows (R, V) at uniforms u ((R, 1) float64 on the device), as device work -> (the survivors it drew among,
    (token, exact, finite) int64 (3,), or (3, R) a column a row): `pick` over `survivors`, its flags beside the
    token, for one copy to the host. `Ahead`'s and sampled verification's, and what `cuda_graphs.DrawGraphs`
    captures."""
    rows = survivors(logits if logits.dim() == 2 else logits[None], params)
    tokens, finite = pick(rows.ids, rows.probs, u)
    values = torch.stack((tokens, rows.exact.long(), finite.long()))  # (3, R)
    return rows, values if logits.dim() == 2 else values[:, 0]


def drawn_rows(logits: torch.Tensor, u: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`drawn`'s (token, exact, finite) (3, R) of rows (R, V) at uniforms u (R, 1) float64, in the argument order
    of `cuda_graphs.DrawGraphs.run`, which replays it."""
    return drawn(logits, params, u)[1]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           history: torch.Tensor | None = None) -> int:
    """Draw the next token id from logits (V,). On a GPU the device is waited for once, for the token."""
    return Ahead(logits, params, generator, history).read()[0]


def sample_probs(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 history: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """`sample`'s token and the distribution (V,) it was drawn from (`token_probs`'s): a draft's token and its q."""
    if params.greedy:
        probs = token_probs(logits, params, history)
        return fetch(probs.argmax()), probs
    ahead = Ahead(logits, params, generator, history, dense=True)
    return ahead.read()[0], ahead.probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token id drawn from probs (V,): nonnegative weights, at least one positive, not necessarily summing to 1."""
    return draw_at(probs, uniforms(generator)[0])


def draw_at(probs: torch.Tensor, u: float) -> int:
    """The token of probs (V,) whose share of the cumulative weight holds u in [0, 1) (`pick`)."""
    token, finite = pick(None, probs[None], u)
    token, finite = fetch(torch.stack((token[0], finite[0].long())))
    if not finite:
        raise not_finite()
    return token


def pick(ids: torch.Tensor | None, weights: torch.Tensor, u: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draws: for each row of weights (R, n) (nonnegative, not necessarily normalized; at token ids
    (R, n), or None for ids 0..n-1) the token whose share of the cumulative weight, in token-id order, holds u
    (a float, or (R, 1) float64) times the row's total. -> (tokens (R,), finite (R,) bool: the row's total was
    positive and finite, so its token means something). In token-id order, so that a row's survivors and the
    same distribution over the whole vocabulary give the same token for the same u; a token of weight 0 is never
    drawn. Device work only."""
    if ids is not None:
        ids, order = ids.sort(-1)
        weights = weights.gather(-1, order)
    cumulative = weights.double().cumsum(-1)  # (R, n)
    total = cumulative[:, -1:]
    index = torch.searchsorted(cumulative, total * u, right=True)  # (R, 1) the first entry past u's share
    # u's share rounded up to the total: the last token with weight (clamped to 0 for a row with none: not finite)
    last = torch.where(weights > 0, torch.arange(weights.shape[-1], device=weights.device), -1)
    index = torch.minimum(index, last.amax(-1, keepdim=True)).clamp_(min=0)
    tokens = index if ids is None else ids.gather(-1, index)
    return tokens[:, 0], (total[:, 0] > 0) & torch.isfinite(total[:, 0])


def uniforms(generator: torch.Generator | None) -> list[float]:
    """A position's two uniform numbers in [0, 1), from a host generator: its token's draw and, in sampled
    verification, the second draw on a rejection. Drawn on the host, they reach the device as arguments."""
    return torch.rand(2, generator=generator, dtype=torch.float64).tolist()


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for it: to a GPU through pinned memory, asynchronously."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def fetch(tensor: torch.Tensor):
    """tensor's values on the host (`tolist`). From a GPU through pinned memory, waiting for that copy's event
    alone: the one wait of a sampled token (a `.item()` or `.tolist()` would too, but as a synchronizing op that
    `torch.cuda.set_sync_debug_mode` flags, so that a test can hold sampling to this one)."""
    return Fetch(tensor).wait()


class Fetch:
    """A device tensor's values on their way to the host: the copy is enqueued now, behind the work that makes
    them, and `wait` waits for it alone, so that work enqueued in between (the next decode step) runs meanwhile.
    The values are those of now, also where the tensor is written again later (a captured draw's output)."""

    def __init__(self, tensor: torch.Tensor):
        self.done = None
        if tensor.device.type != "cuda":
            self.tensor = tensor.clone()
            return
        self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.tensor.copy_(tensor, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def wait(self):
        if self.done is not None:
            self.done.synchronize()
        return self.tensor.tolist()


class Ahead:
    """A draw from logits (V,) (penalized over `history` where given) at a generator's uniform, as device work, with
    the copy of its token to the host enqueued behind it: `token` on the device can feed the next forward before
    the host reads it (`Engine.plain_steps`, a model draft), `read` waits for it (`sample` is a draw read at once).
    With `dense` (sampled), `probs` is then the distribution (V,) it was drawn from (`sample_probs`'s). With `draws`
    (`cuda_graphs.DrawGraphs`), a sampled draw without `dense` replays its captured graph: the same token."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 history: torch.Tensor | None = None, dense: bool = False, draws=None):
        logits = penalized(logits, params, history)
        self.logits, self.params, self.probs = logits, params, None
        if params.greedy:
            self.u, self.token = None, logits.argmax().view(1)
            self._values = Fetch(self.token)
            return
        self.u = uniforms(generator)[0]
        values = None if draws is None or dense else draws.draw(logits, params, self.u)  # read behind it, in order
        if values is None:
            rows, values = drawn(logits, params, self.u)
            if dense:
                self.probs = rows.dense(logits.shape[-1])[0]
        self.token, self._values = values[:1], Fetch(values)

    def read(self) -> tuple[int, bool]:
        """-> (the token, whether it is `token`'s value: False where the row was not exact (`Survivors`), and the
        token is the whole-vocabulary definition's draw at the same uniform instead, `probs` the definition's
        distribution). Waits for the device; raises as `sample` does on logits that are not finite."""
        values = self._values.wait()
        if self.u is None:
            return values[0], True
        token, exact, finite = values
        if not exact:
            probs = vocabulary_probs(self.logits, self.params)
            self.probs = None if self.probs is None else probs
            return draw_at(probs, self.u), False
        if not finite:
            raise not_finite()
        return token, True


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

    def __init__(self, seed: int | None):
        self.seed = secrets.randbits(64) if seed is None else seed
        self._generator = torch.Generator()  # on the host: see `uniforms`

    def at(self, position: int, stream: int = 0) -> torch.Generator:
        """The generator for `position`, at the start of its stream (one generator, reseeded: use it before
        asking for another position)."""
        return self._generator.manual_seed(_mix(self.seed, position, stream))
