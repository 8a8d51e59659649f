"""Speculative decoding: a cheap drafter proposes K tokens, the target checks all of them in one forward over
K+1 positions, and the output is what the target alone would give.

- Greedy (temperature 0): draft tokens are accepted while they equal the target's argmax; the first mismatch
  is replaced by the target's own token. The output is token for token plain greedy decoding.
- Sampling: the rejection rule of Leviathan et al. and Chen et al. (2023): accept draft token x with
  probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)); when all K pass, draw a bonus
  token from the target. The emitted tokens are distributed exactly as the target's. p and q are both the
  distributions actually sampled from (penalty, temperature, top-k, top-p, min-p: `sampling.token_probs`).

Drafters propose from the verified context only, so rolling back a rejection is moving the caches' lengths:
`NgramDrafter` (prompt lookup, no model) and `ModelDrafter` (a smaller model with the same tokenizer, or the
target itself with layers skipped). `DraftLength` picks K before each step from the measured acceptance and
step costs, and stops drafting when it does not pay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmrun.errors import LlmrunError, OutsideVocabularyError, not_finite
from llmrun.kernels import ref
from llmrun.sampling import (Ahead, Randomness, SamplingParams, draw_at, drawn_rows, fetch, pick,
                             sample, sample_probs, survivors, to_device, token_probs, uniforms)

# The most draft tokens a step verifies: INT4's rings keep whole what a rolled-back block wrote, up to this many.
MAX_DRAFT_TOKENS = ref.ROLLBACK


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # (K, V) the draft's distribution for each token; None: chosen outright
    setup_s: float = 0.0  # time spent catching the drafter up with the context, not drafting

    def head(self, n: int) -> Proposal:
        """The first n draft tokens."""
        if n >= len(self.tokens):
            return self
        return Proposal(self.tokens[:n], None if self.probs is None else self.probs[:n], self.setup_s)


Decide = Callable[[int, bool], bool]  # (context position of a draft token, the rule's decision) -> the decision


def _abide(position: int, accepted: bool) -> bool:
    return accepted


def verify(logits: torch.Tensor, proposal: Proposal, params: SamplingParams, rng: Randomness | None = None,
           history: torch.Tensor | None = None, position: int = 0, decide: Decide | None = None,
           draws=None) -> tuple[int, int]:
    """Check a proposal against the target.

    logits (K+1, V): the target's logits after the context and after each draft token; history (N,): the
    context's token ids (for the repetition penalty, which also counts the accepted draft tokens); `position`:
    the context position of the first draft token (row i's draws come from `rng.at(position + i)`).
    Returns (how many draft tokens are accepted, the target's token that follows them).

    A proposal chosen outright (q one-hot at draft x) is checked by drawing the position's token from p, as plain
    sampling would, and accepting x when it comes out: that is the rejection rule for such a q (accepted with
    probability p(x); otherwise a draw from p without x, which is norm(max(0, p - q))), and it emits exactly
    the tokens plain sampling draws with the same seed.

    `decide(position, accepted) -> accepted`, when given, overrules each acceptance decision after the rule has
    done its work (a benchmark replaying a real pair's acceptance on random weights: `llmrun.replay`).
    `draws` (`cuda_graphs.DrawGraphs`, a GPU's): the rows' draws (of a proposal chosen outright) or the rule's
    device work (`decided`, a model draft's) replay a captured graph, one for each block length and setting,
    instead of ~35-45 eager launches; the same tokens.
    """
    drafts = proposal.tokens
    if decide is None:
        decide = _abide
    k = len(drafts)
    penalize = history is not None and params.repetition_penalty != 1.0

    def seen(i):  # the tokens before position i
        return torch.cat((history, history.new_tensor(drafts[:i]))) if penalize else None

    if params.greedy:
        if not penalize:
            best = fetch(logits.argmax(-1))
            n = 0
            while n < k and decide(position + n, drafts[n] == best[n]):
                n += 1
            return n, best[n]
        for i in range(k + 1):
            token = sample(logits[i], params, None, seen(i))
            if i == k or not decide(position + i, token == drafts[i]):
                return i, token
    us = [uniforms(rng.at(position + i)) for i in range(k + 1)]  # row i's two draws
    if penalize:  # each row's penalty counts the drafts before it
        return _verify_rows(logits, proposal, params, us, seen, position, decide)
    # Every row at once, as device work over the rows' top-k survivors, and one wait for what it decided
    if proposal.probs is None:  # row i's token: its own draw from p, at its first uniform
        inputs = (logits[: k + 1], to_device([u[:1] for u in us], torch.float64, logits.device))
        got = None if draws is None else draws.run(drawn_rows, inputs, params)
        got = fetch(drawn_rows(*inputs, params) if got is None else got)  # (3, K+1): tokens, exact, finite
        if not all(got[1]):  # a tie at the k-th value: the definition's distribution, row by row
            return _verify_rows(logits, proposal, params, us, seen, position, decide)
        if not all(got[2]):
            raise not_finite()
        for i, x in enumerate(drafts):
            if not decide(position + i, got[0][i] == x):
                return i, got[0][i]
        return k, got[0][k]
    inputs = (logits[: k + 1], fit_vocab(proposal.probs.to(logits.device, torch.float32), logits.shape[-1]),
              to_device(drafts, torch.int64, logits.device)[:, None], to_device(us, torch.float64, logits.device))
    got = None if draws is None else draws.run(decided, inputs, params)
    got = fetch(decided(*inputs, params) if got is None else got)
    if not all(got[2 * k + 1 : 3 * k + 2]):
        return _verify_rows(logits, proposal, params, us, seen, position, decide)
    if not got[-1]:
        raise not_finite()
    for i in range(k):
        if not decide(position + i, bool(got[i])):
            return i, got[k + i]
    return k, got[2 * k]


def decided(logits: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor,
            params: SamplingParams) -> torch.Tensor:
    """`verify`'s rule for drafts x (K, 1) drawn from q (K, V), against the target's rows logits (K+1, V), at each
    row's two uniforms u (K+1, 2) float64, as device work -> (3K + 3,) int64: each draft's acceptance (K), each
    row's token on a rejection (K), the bonus token (1), each row's exact flag (K + 1: `Survivors.exact`) and
    whether every draw had a finite total (1). Nothing here waits for the device."""
    k = len(x)
    rows = survivors(logits, params)
    p, ids = rows.probs[:k], None if rows.ids is None else rows.ids[:k]  # (K, n)
    px = p.gather(-1, x) if ids is None else (p * (ids == x)).sum(-1, keepdim=True)  # (K, 1) p(x), 0 if dropped
    accepted = u[:k, :1] * q.gather(-1, x) < px  # r < p(x) / q(x)
    residual = (p - (q if ids is None else q.gather(-1, ids))).clamp_(min=0.0)  # 0 where p is 0 anyway
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p <= q everywhere: p == q but rounding
    fixed, fixed_finite = pick(ids, residual, u[:k, 1:])  # (K,) row i's token on a rejection
    bonus, finite = pick(None if rows.ids is None else rows.ids[k:], rows.probs[k:], u[k:, :1])  # all accepted
    ok = finite & fixed_finite.all()  # (1,)
    return torch.cat((accepted[:, 0].long(), fixed, bonus, rows.exact.long(), ok.long()))


def _verify_rows(logits, proposal, params, us, seen, position, decide) -> tuple[int, int]:
    """`verify`'s sampled rule a row at a time over each row's whole-vocabulary distribution (`token_probs`), with
    the same draws: for a row penalized by the drafts before it, or a tie at the k-th value."""
    drafts, vocab = proposal.tokens, logits.shape[-1]
    for i, x in enumerate(drafts):
        p = token_probs(logits[i], params, seen(i))  # (V,)
        if proposal.probs is None:
            token = draw_at(p, us[i][0])
            if decide(position + i, token == x):
                continue
            return i, token
        q = fit_vocab(proposal.probs[i].to(p.device, torch.float32), vocab)
        qx, px = fetch(torch.stack((q[x], p[x])))
        if decide(position + i, us[i][0] * qx < px):  # r < p/q
            continue
        residual = (p - q).clamp_(min=0.0)
        if fetch(residual.sum()) <= 0.0:  # p <= q everywhere only when p == q up to rounding
            residual = p
        return i, draw_at(residual, us[i][1])
    k = len(drafts)
    return k, draw_at(token_probs(logits[k], params, seen(k)), us[k][0])


def fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft distribution over the target's vocabulary size (embedding tables are often padded)."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from `max_n` down to
    `min_n`, longest first) and propose the tokens that followed it. Free to run; pays off when the reply
    copies from the prompt or from itself (code edits, summaries, answers quoting a document)."""

    name = "ngram"
    TAIL = 16  # indexed tokens checked against each context between replies' starts (`_sync`)

    def __init__(self, max_n: int = 3, min_n: int | None = None):
        if max_n < 1:
            raise ValueError("the n-gram length must be at least 1")
        self.max_n = max_n
        self.min_n = min(2, max_n) if min_n is None else min_n
        self._indexed: list[int] = []  # the context whose n-grams are in the index
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence

    def start(self, context: list[int]) -> None:
        self._sync(context, whole=True)

    def propose(self, context: list[int], k: int, params: SamplingParams, rng, constraint=None) -> Proposal:
        """Up to k tokens; a `constraint` (structured output) is left to the caller, which cuts the proposal
        where it leaves the grammar: the draft is deterministic, so that is exact."""
        at = self._match(context)
        return Proposal() if at is None else Proposal(context[at : at + k])

    def would_propose(self, context: list[int]) -> bool:
        """Whether `propose` would find a match for `context` (a lookup knows at no cost): a pipelined reply goes on
        by plain steps fed from the device while it would not (`llmrun.generate`)."""
        return self._match(context) is not None

    def _match(self, context: list[int]) -> int | None:
        """The position right after the latest occurrence of the context's longest indexed tail, or None."""
        self._sync(context)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            at = self._index.get(tuple(context[-n:]))
            if at is not None:
                return at
        return None

    def _sync(self, context: list[int], whole: bool = False) -> None:
        """Index the n-grams ending at positions 1 .. len(context) - 1: each has a continuation, and the one
        ending at the very end (the query) is left out, or it would find itself. Within a reply the context only
        grows, so a step compares the last TAIL indexed tokens with it (a whole comparison grew with the context:
        ~80 us a step at 32k tokens), `start` (`whole`) all of them: a conversation edited before the tail between
        two steps would only make the lookup propose worse drafts, which verification refuses."""
        last = len(context) - 1
        done = len(self._indexed)  # n-grams ending at positions <= done are indexed already
        checked = 0 if whole else max(done - self.TAIL, 0)
        if done > last or context[checked:done] != self._indexed[checked:]:  # a new conversation, an edited prompt
            self._index, self._indexed, done = {}, [], 0
        for end in range(done + 1, last + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(context[end - n : end])] = end
        self._indexed += context[done : max(last, 0)]


class ModelDrafter:
    """Drafts with a model of its own (an `Engine` with its own KV cache): K autoregressive steps, sampled with
    the same settings as the target. Its cache follows the verified context by prefix reuse: tokens the target
    rejected are simply overwritten on the next proposal."""

    def __init__(self, engine, name: str, vocab: int | None = None):
        self.engine = engine
        self.name = name
        # the target's embedding rows: a draft whose table is wider (padded otherwise) proposes none past them
        self.vocab = vocab

    def _within(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.vocab is None or logits.shape[-1] <= self.vocab else logits[..., : self.vocab]

    def _prefill(self, context: list[int]):
        """The draft's logits after `context`; None where the context holds a token past the draft's embedding
        (its table narrower than the target's): it proposes nothing then."""
        try:
            return self._within(self.engine.prefill(context)[0])
        except OutsideVocabularyError:
            return None

    def start(self, context: list[int]) -> None:
        if len(context) < self.engine.max_len:  # a draft with a shorter context just proposes nothing
            self._prefill(context)

    def would_propose(self, context: list[int]) -> bool:
        """A model always drafts (as far as its context reaches: `propose` knows)."""
        return True

    def propose(self, context: list[int], k: int, params: SamplingParams, rng, constraint=None) -> Proposal:
        """k tokens drafted autoregressively (draft i, for context position len(context) + i, from that
        position's draft stream of `rng`). Under a `constraint` (`llmrun.grammar.Constraint`, left as it was
        found) the draft samples from its grammar-masked distribution, which is then its q for verification."""
        engine = self.engine
        k = int(min(k, engine.max_len - len(context), engine.max_block - 1))
        if k <= 0:
            return Proposal()
        behind, t0 = len(context) - len(engine.tokens), time.perf_counter()
        # An evicting cache makes room for the whole draft now: an eviction between draft tokens would stop the
        # rollback after verification from reaching back, and the draft would start over.
        if engine.eviction is not None:
            engine.cache.make_room(int(min(max(behind, 0) + k, engine.max_block)))
        logits = self._prefill(context)  # one or two new tokens; after a pause in drafting, every one since
        if logits is None:
            return Proposal()
        setup_s = time.perf_counter() - t0 if behind > 2 else 0.0
        penalize = params.repetition_penalty != 1.0
        if engine.pipeline and constraint is None and not penalize:
            tokens, probs = self._draft_ahead(logits, len(context), k, params, rng)
            return Proposal(tokens, probs, setup_s)
        tokens, probs = [], []
        for i in range(k):
            history = torch.tensor(engine.tokens, device=engine.device) if penalize else None
            if constraint is not None:
                logits = constraint.constrain(logits)
            if params.greedy:
                token = sample(logits, params, None, history)
            else:
                token, q = sample_probs(logits, params, rng.at(len(context) + i, stream=1), history)
                probs.append(q)
            tokens.append(token)
            if constraint is not None:
                constraint.accept(token)
                if constraint.finished:  # the draft ended the grammar: nothing may follow
                    break
            if i + 1 < k:
                logits = self._within(engine.decode(token))
        if constraint is not None:
            constraint.rollback(len(tokens))
        return Proposal(tokens, torch.stack(probs) if probs else None, setup_s)

    def _draft_ahead(self, logits, position: int, k: int, params: SamplingParams, rng):
        """`propose`'s drafts on a pipelined engine (a GPU): each draft token fed to the next forward from the
        device, where its draw left it, and all k read at the end, one wait for the k steps where each waited for
        the host. -> (tokens, their q (k, V) or None when greedy). A draw that needed the whole vocabulary (ties at
        top-k's edge past its candidates) differs from the token fed after it: the proposal ends with it, and the
        forwards after it leave the draft's cache."""
        engine = self.engine
        aheads, fed = [], []  # fed[i]: where draft i went in the draft's token list (the forward it fed)
        for i in range(k):
            generator = None if params.greedy else rng.at(position + i, stream=1)
            aheads.append(Ahead(logits, params, generator, dense=True))
            if i + 1 < k:
                fed.append(len(engine.tokens))
                logits = self._within(engine.forward(aheads[-1].token))
        tokens = []
        for i, ahead in enumerate(aheads):
            token, fed_right = ahead.read()
            tokens.append(token)
            if not fed_right:
                if i < len(fed):
                    engine.rollback(fed[i])
                break
            if i < len(fed):
                engine.tokens[fed[i]] = token
        probs = None if params.greedy else torch.stack([a.probs for a in aheads[: len(tokens)]])
        return tokens, probs


class DraftLength:
    """Chooses K before each step to maximize expected tokens per second, from three running estimates:

    - the per-token acceptance rate a (exponentially forgetting counts), so that K draft tokens yield
      (1 - a^(K+1)) / (1 - a) tokens per step;
    - the target's step time for T tokens, measured per T; a T not yet measured is interpolated between its
      measured neighbours, or, one past the largest, taken as barely dearer than it (optimism: the only way to
      learn that verifying more tokens is cheap, as it is while a step is memory-bound, is to try). K grows a
      token at a time, each longer block tried before the next: a CPU's cost is no straight line in the block's
      length (Qwen2.5-1.5B on 2 cores: 5 tokens cost 2.4 one-token steps, 8 cost 2.9, and one timing put 9 well
      above 8), and a line drawn through one dear length would hide the cheaper ones below it;
    - the drafter's time per proposed token, before any is measured `draft_cost` x a plain step (a model
      draft's share of the target's weight bytes; 0 for a lookup).

    K = 0 (a plain step) wins when speculation would be slower; then a one-token probe runs now and then (a
    lookup: after 4 plain steps, then 8, 16...; a model draft: at the start of each reply), so a change of text
    (into a copied passage, say) is noticed. A model draft learns nothing while it is off and cannot be probed
    cheaply within a reply, so it is turned off only when even its optimistic acceptance (one standard error
    above the estimate) would not pay: one early rejection, resting on a step's evidence, does not end drafting
    for the whole reply, while a draft that keeps failing is off within a few steps (`llmrun.replay.simulate`
    weighs this on recorded replies). A drafter that could not pay even if every token were accepted is not
    probed again. With `adaptive=False`, K is always `max_k`.
    """

    DECAY = 0.9  # weight of the past per step in the acceptance counts
    SMOOTH = 0.3  # weight of a new timing in its running average
    GROWTH = 0.05  # assumed extra cost per token past the largest measured step, relative to it

    def __init__(self, max_k: int = 8, adaptive: bool = True, draft_cost: float = 0.0):
        if max_k < 1:
            raise ValueError("the draft length must be at least 1")
        self.max_k = max_k
        self.adaptive = adaptive
        self.draft_cost = draft_cost
        self.accepted, self.rejected = 1.0, 1.0  # prior: half the draft tokens pass
        self.step_s: dict[int, float] = {}  # tokens per target forward -> seconds
        self.draft_s: float | None = None  # seconds per drafted token
        self.k = max_k  # the latest choice
        self.hopeless = False  # set when no K could beat a plain step even with every draft token accepted
        self._wait, self._patience = 0, self._first_patience  # plain steps before the next probe

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, room: int) -> int:
        """K for the next step, at most `room` (what the context and the token budget leave)."""
        room = max(0, min(room, self.max_k))
        if not self.adaptive or room == 0:
            self.k = room
            return room
        if 1 not in self.step_s or self.hopeless:  # first a plain step: the baseline every K is weighed against
            self.k = 0
            return 0
        plain = 1.0 / self._target_s(1)
        if all((k + 1) / self._cost(k) <= plain for k in range(1, self.max_k + 1)):
            self.hopeless = True  # not even with every draft token accepted
            self.k = 0
            return 0
        if self.draft_s is None:  # never drafted yet: try it once, so the estimates rest on measurements
            self.k = min(room, max(1, self.max_k // 2))
            return self.k
        best_k = self._best_k(room, self.acceptance)
        if best_k == 0 and self.draft_cost > 0:  # off only if it would not pay even at the optimistic acceptance
            best_k = self._best_k(room, self.optimistic_acceptance)
        if best_k == 0:
            self._wait += 1
            if self._wait >= self._patience and not self.hopeless:  # probe: the text may have changed
                self._wait, self._patience = 0, min(2 * self._patience, 256) if self.draft_cost == 0 else float("inf")
                best_k = 1
        else:
            self._wait, self._patience = 0, self._first_patience
        self.k = best_k
        return best_k

    def observe(self, drafted: int, accepted: int, target_s: float, draft_s: float) -> None:
        """Record one step: `drafted` tokens proposed (0: a plain step), `accepted` of them taken; the target's
        forward and verification took `target_s`, drafting `draft_s`."""
        _average(self.step_s, drafted + 1, target_s, self.SMOOTH)
        if drafted:
            per_token = draft_s / drafted
            self.draft_s = per_token if self.draft_s is None else (1 - self.SMOOTH) * self.draft_s + self.SMOOTH * per_token
            self.accepted = self.DECAY * self.accepted + accepted
            self.rejected = self.DECAY * self.rejected + (accepted < drafted)

    @property
    def _first_patience(self) -> float:
        """A lookup's probe costs one verified token. A model draft's would also catch its cache up with every
        token since it last drafted, which costs more than the probe can win back within a reply: a model
        draft is probed once per reply instead (`begin_reply`)."""
        return 4 if self.draft_cost == 0 else float("inf")

    def begin_reply(self) -> None:
        """A new reply: while a model draft is off, the reply's first step is a probe."""
        if self.draft_cost > 0 and self.step_s and not self.hopeless:
            self._wait, self._patience = 0, 1

    @property
    def optimistic_acceptance(self) -> float:
        """The acceptance estimate plus one standard error of it: the counts decay, so it never rests on more
        than a few steps' evidence, and on one step's (a first probe) it reaches well above the estimate."""
        a, n = self.acceptance, self.accepted + self.rejected
        return a + (a * (1 - a) / n) ** 0.5

    def _best_k(self, room: int, acceptance: float) -> int:
        """The K of the highest expected tokens per second at this acceptance; 0 when no K beats a plain step."""
        best_k, best = 0, 1.0 / self._target_s(1)
        for k in range(1, min(room, max(self.step_s)) + 1):  # blocks up to one token past the longest measured
            rate = self._expected_tokens(k, acceptance) / self._cost(k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def _cost(self, k: int) -> float:
        draft_s = self.draft_cost * self.step_s[1] if self.draft_s is None else self.draft_s
        return self._target_s(k + 1) + k * draft_s

    @staticmethod
    def _expected_tokens(k: int, acceptance: float) -> float:
        a = min(acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def _target_s(self, tokens: int) -> float:
        if tokens in self.step_s:
            return self.step_s[tokens]
        below = max(t for t in self.step_s if t < tokens)  # 1 is always there
        above = [t for t in self.step_s if t > tokens]
        if not above:
            return self.step_s[below] * (1 + self.GROWTH * (tokens - below))
        above = min(above)
        w = (tokens - below) / (above - below)
        return (1 - w) * self.step_s[below] + w * self.step_s[above]


def _average(table: dict, key, value: float, weight: float) -> None:
    table[key] = value if key not in table else (1 - weight) * table[key] + weight * value


@dataclass
class Speculator:
    """What an `Engine` needs to decode speculatively: a drafter and the policy for K."""

    drafter: NgramDrafter | ModelDrafter
    length: DraftLength
    decide: Decide | None = None  # overrules verification's decisions (see `verify`); None: the rule decides

    @property
    def name(self) -> str:
        return self.drafter.name


def self_draft_layers(n_layers: int) -> list[int]:
    """The layers a self-draft keeps: every other one between the first and last two, about 55% of them.
    The first and last layers matter most to the output (they map tokens in and logits out)."""
    inner = range(2, n_layers - 2)
    return sorted({0, 1, n_layers - 2, n_layers - 1, *inner[::2]} & set(range(n_layers)))


def make_speculator(engine, *, draft: str | None = None, ngram: int | None = None, draft_tokens: int = 8,
                    adaptive: bool = True, load=None) -> Speculator | None:
    """The speculator for the CLI's options, or None without --draft / --ngram.

    `draft`: "self" (a 4-bit copy of the target), "self:skip" (the target with layers skipped), or a model to
    load with `load(spec) -> LoadedModel` (same device, dtype and weight mode as the target); `ngram`: the
    longest n-gram to look up.
    """
    from llmrun.errors import UsageError

    if draft is not None and ngram is not None:
        raise UsageError("--draft and --ngram both choose the drafter; pass one of them")
    if draft is None and ngram is None:
        return None
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise UsageError(f"--draft-tokens {draft_tokens}: choose 1 to {MAX_DRAFT_TOKENS} tokens per step")
    length = DraftLength(draft_tokens, adaptive)
    if ngram is not None:
        if not 1 <= ngram <= 8:
            raise UsageError(f"--ngram {ngram}: choose an n-gram length from 1 to 8")
        return Speculator(NgramDrafter(ngram), length)
    if draft in ("self", "self:int4"):
        sub, name = engine.model.with_int4_weights(), "self (int4 copy)"
        return _model_speculator(engine, engine.sibling(model=sub), name, length)
    if draft == "self:skip":
        n = engine.model.config.n_layers
        keep = self_draft_layers(n)
        sub, name = engine.model.with_layers(keep), f"self ({len(keep)}/{n} layers)"
        return _model_speculator(engine, engine.sibling(model=sub), name, length)
    try:
        loaded = load(draft)
        sibling = engine.sibling(loaded)  # (its cache: a --kv format its heads cannot take, a context too short)
    except LlmrunError as e:  # (what the target's load would say, unless it is known for the draft's)
        message = str(e) if str(e).startswith(draft) else f"{draft}: {e}"
        raise type(e)(f"--draft {message}") from None
    check_same_vocabulary(engine.tokenizer, loaded.tokenizer)
    return _model_speculator(engine, sibling, draft, length)


def short_draft_note(engine, speculator) -> str | None:
    """What to say of a model draft whose context is shorter than the target's; None for any other drafter."""
    drafting = getattr(speculator and speculator.drafter, "engine", None)  # a model draft's own engine
    if drafting is not None and engine.eviction is not None and drafting.eviction.budget < engine.eviction.budget:
        return (f"draft: its context holds {drafting.eviction.budget} positions, fewer than --kv-budget "
                f"{engine.eviction.budget}: its own cache keeps the last {drafting.eviction.budget} tokens")
    if drafting is None or drafting.max_len >= engine.max_len:
        return None
    return (f"draft: its context holds {drafting.max_len} positions, the target's {engine.max_len}: past "
            f"{drafting.max_len} it proposes nothing, and decoding goes on plainly")


def _model_speculator(target, draft, name: str, length: DraftLength) -> Speculator:
    """A model drafter; its cost relative to the target, until measured, is its share of the weight bytes (what
    a memory-bound decode step reads)."""
    length.draft_cost = _weight_bytes(draft.model) / _weight_bytes(target.model)
    return Speculator(ModelDrafter(draft, name, target.model.config.vocab_size), length)


def _weight_bytes(model) -> int:
    return sum(t.nbytes for t in model.state_dict().values())


def check_same_vocabulary(target, draft) -> None:
    """Raise unless both tokenizers map the same strings to the same ids (draft tokens are target tokens)."""
    from llmrun.errors import LlmrunError

    a, b = target.vocabulary(), draft.vocabulary()
    if a == b:
        return
    if len(a) != len(b):
        detail = f"{len(b)} tokens vs the target's {len(a)}"
    else:
        by_id = {i: t for t, i in a.items()}
        token, i = next((t, i) for t, i in sorted(b.items(), key=lambda x: x[1]) if by_id.get(i) != t)
        detail = f"id {i} is {token!r} in the draft but {by_id.get(i)!r} in the target"
    raise LlmrunError(f"the draft model's tokenizer differs from the target's ({detail}); "
                      "use a draft from the same model family, or --ngram / --draft self")
