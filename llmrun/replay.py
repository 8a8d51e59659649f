"""A draft/target pair's acceptance, recorded where its weights are and replayed on random weights of the same
shapes: the speedup the pair would give on a machine that cannot hold its files (a lent GPU that takes 64 MiB a
transfer, where the Qwen2.5-Coder 0.5B/1.5B pair weighs 1.6 GB).

What speculation costs does not depend on the weights' values, only on their shapes and on which draft tokens are
accepted. Which are accepted is a property of the real pair and the reply, recorded once (`record`): for each
position i of a reply y, the probability that a draft token there is accepted, given the reply so far and given
that the token that ended up at i is y_i:
- greedy: 1 if the draft's argmax after y_<i is y_i (the target's own), else 0;
- sampling: min(p(y_i), q(y_i)) / p(y_i), p and q the target's and the draft's distributions after y_<i (penalty,
  temperature, top-k, top-p, min-p applied), since a draft token is accepted and emits y with probability
  min(p(y), q(y)) and position i emits y with probability p(y).
Given the reply, the decisions at the positions that get drafted are independent with these probabilities,
whatever K the policy chooses. So replaying them (`Trace.decide`, which overrules verification's decisions) on a
pair of the same shapes runs the real pair's accept/reject pattern: its draft steps, target blocks, rollbacks and
adaptive K choices, with this machine's timings. Only the tokens are not replayed: random weights emit their own,
and no cost depends on which they are.

`simulate` goes one step further and runs the draft-length policy itself against a trace on a clock, each
forward costing what a table of measured step times says (no model runs): a policy change weighed on every
trace and seed in a second, and a GPU's figure foreseen from its step times alone.

Prompt lookup (`NgramDrafter`) replays more simply still, from the reply alone (`Reply`, `ReplayedLookup`): its
proposal is a function of the context, and a lookup's draft token is accepted exactly when it is the token plain
decoding emits there, greedy or sampled (the draft is chosen outright: `speculative.verify` draws the position's
token as plain sampling does, with the same seed, and accepts the draft if it comes out). A run on other weights
of the same vocabulary whose lookups read the real reply's tokens, and whose decisions are the reply's, takes the
real run's steps: a copy-heavy reply of a model too large to carry, on a GPU. (Exactly so where a block's rows
pick the tokens one-token steps pick, as greedy speculation's tests hold on the CPU; a GPU's blocks run another
GEMV, whose last bits may turn a near-tie: the replay follows the recorded reply, the real run on such a GPU would
follow its own.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmrun.errors import LlmrunError
from llmrun.sampling import SamplingParams, sample, token_probs
from llmrun.speculative import Decide, DraftLength, NgramDrafter, Proposal, fit_vocab


@dataclass(frozen=True)
class Trace:
    """One reply's acceptance: `accept[i]` for the reply's token i, which sits at context position
    len(prompt) + i. Sampled traces come from the reply drawn with `seed`; a greedy one serves any seed."""

    prompt: tuple[int, ...]
    accept: tuple[float, ...]
    temperature: float
    seed: int

    def decide(self, seed: int) -> Decide:
        """Verification's decisions for a replay: a draft token at context position j is accepted with
        probability accept[j - len(prompt)], drawn from (seed, j) alone, so the same seed decides the same
        whatever blocks the steps were cut into."""

        def decide(position: int, accepted: bool) -> bool:
            i = position - len(self.prompt)
            if not 0 <= i < len(self.accept):
                raise LlmrunError(f"the replay reached reply token {i}, but the trace holds {len(self.accept)}: "
                                  "decode at most as many tokens as were recorded")
            return random.Random(f"{seed}:{position}").random() < self.accept[i]

        return decide

    def as_dict(self) -> dict:
        return {"prompt": list(self.prompt), "temperature": self.temperature, "seed": self.seed,
                "accept": [round(a, 4) for a in self.accept]}

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        accept = tuple(float(a) for a in d["accept"])
        if not all(0.0 <= a <= 1.0 for a in accept):
            raise LlmrunError("a trace's acceptance probabilities must lie in [0, 1]")
        return cls(tuple(int(t) for t in d["prompt"]), accept, float(d["temperature"]), int(d["seed"]))


def replayer(traces: list[Trace]) -> Callable[[int], Decide]:
    """seed -> the decisions of the timed run with that seed: run i replays trace i (cycling), drawing with seed i."""
    if not traces:
        raise LlmrunError("no trace to replay")
    return lambda seed: traces[seed % len(traces)].decide(seed)


@dataclass(frozen=True)
class Reply:
    """One reply as the real target decoded it plainly (`len(tokens)` tokens, end tokens ignored), drawn with `seed`
    at `temperature` (greedy: -1): what a lookup's replay reads (`ReplayedLookup`)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    temperature: float
    seed: int

    def context(self, length: int) -> list[int]:
        """The first `length` context positions as the real target had them: the prompt, then the reply."""
        return [*self.prompt, *self.tokens[: self._reached(length)]]

    def token(self, position: int) -> int:
        """The reply's token at context `position` (one past the prompt's, at least)."""
        i = self._reached(position + 1) - 1
        if i < 0:
            raise LlmrunError(f"context position {position} holds a prompt token, not a reply's")
        return self.tokens[i]

    def _reached(self, length: int) -> int:
        """How many reply tokens a context of `length` positions holds; past the recorded ones, a one-line error."""
        reply = length - len(self.prompt)
        if not 0 <= reply <= len(self.tokens):
            raise LlmrunError(f"the replay reached reply token {reply}, but the reply holds {len(self.tokens)}: decode"
                              " at most as many tokens as were recorded")
        return reply

    def as_dict(self) -> dict:
        return {"prompt": list(self.prompt), "temperature": self.temperature, "seed": self.seed,
                "tokens": list(self.tokens)}

    @classmethod
    def from_dict(cls, d: dict) -> Reply:
        return cls(tuple(int(t) for t in d["prompt"]), tuple(int(t) for t in d["tokens"]), float(d["temperature"]),
                   int(d["seed"]))


class ReplayedLookup:
    """Prompt lookup replaying a real reply (`follow`) on other weights: each lookup reads the real context of the
    same length (the prompt and the reply's tokens, where the model decoding has tokens of its own), and `decide`
    accepts a draft token exactly when it is the reply's token at its position. The policy, the steps and their
    costs are the replaying engine's; which drafts pass is the real target's."""

    name = "ngram"

    def __init__(self, max_n: int = 3):
        self.lookup = NgramDrafter(max_n)
        self.reply: Reply | None = None
        self._drafts: dict[int, int] = {}  # context position -> the draft token proposed there by the latest lookup

    def follow(self, reply: Reply) -> Decide:
        """Replay `reply` from now on; -> the decisions for the speculator (`Speculator.decide`)."""
        self.reply, self._drafts = reply, {}
        return self.decide

    def start(self, context: list[int]) -> None:
        self.lookup.start(self.reply.context(len(context)))

    def would_propose(self, context: list[int]) -> bool:
        return self.lookup.would_propose(self.reply.context(len(context)))

    def propose(self, context: list[int], k: int, params, rng, constraint=None) -> Proposal:
        proposal = self.lookup.propose(self.reply.context(len(context)), k, params, rng)
        self._drafts = {len(context) + i: token for i, token in enumerate(proposal.tokens)}
        return proposal

    def decide(self, position: int, accepted: bool) -> bool:
        """Whether the real target took the draft token at context `position`: it is the reply's token there."""
        return self._drafts.get(position) == self.reply.token(position)


def replay_lookups(drafter: ReplayedLookup, replies: list[Reply]) -> Callable[[int], Decide]:
    """seed -> the decisions of the timed run with that seed, through `drafter`: it replays the reply drawn with
    that seed where there is one (so that a run deciding for itself with the same seed, on the real weights, takes
    the same steps), else reply `seed` (cycling; a greedy reply serves every seed)."""
    if not replies:
        raise LlmrunError("no reply to replay")
    by_seed = {reply.seed: reply for reply in replies}
    return lambda seed: drafter.follow(by_seed.get(seed, replies[seed % len(replies)]))


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one forward of T tokens after a prompt, per T, of the target and of the draft model (none for a
    lookup: an empty table) (`bench/replay.py measure` times T = 1, 2, 3, 5, 9 and saves them as "step_seconds").
    A T between two measured ones is interpolated; past the largest, the line through the two largest goes on."""

    target: dict[int, float]
    draft: dict[int, float]

    @classmethod
    def from_dict(cls, d: dict) -> StepCosts:
        target, draft = ({int(t): float(s) for t, s in d.get(m, {}).items()} for m in ("target", "draft"))
        for table in (target, draft) if draft else (target,):
            if 1 not in table or min(table.values()) <= 0:
                raise LlmrunError("step costs need positive seconds for T = 1 of each model")
        return cls(target, draft)

    def reshaped(self, block_cost: float | None = None, draft_ratio: float | None = None) -> StepCosts:
        """The costs of another machine, for asking what the policy would give there: with `block_cost`, a block of
        T tokens costs 1 + block_cost * (T - 1) one-token steps, for both models (a GPU's memory-bound forward is
        nearly flat in T: a small block_cost); with `draft_ratio`, the draft's steps are rescaled so that its
        one-token step costs that share of the target's."""
        target, draft = dict(self.target), dict(self.draft)
        if block_cost is not None:
            target = {t: target[1] * (1 + block_cost * (t - 1)) for t in target}
            draft = {t: draft[1] * (1 + block_cost * (t - 1)) for t in draft}
        if draft_ratio is not None:
            draft = {t: s * draft_ratio * target[1] / draft[1] for t, s in draft.items()}
        return StepCosts(target, draft)

    def seconds(self, model: str, tokens: int) -> float:
        table = self.target if model == "target" else self.draft
        if tokens in table:
            return table[tokens]
        known = sorted(table)
        lower = [t for t in known if t < tokens]
        upper = [t for t in known if t > tokens]
        a, b = (lower[-1], upper[0]) if lower and upper else (known[-2], known[-1]) if len(known) > 1 else (1, 1)
        if a == b:
            return table[1] * tokens
        return table[a] + (table[b] - table[a]) * (tokens - a) / (b - a)


@dataclass(frozen=True)
class Simulated:
    plain_s: float  # the reply decoded plainly: one one-token target step a token
    speculative_s: float
    steps: int
    drafted: int
    accepted: int

    @property
    def speedup(self) -> float:
        return self.plain_s / self.speculative_s


def simulate(trace: Trace, costs: StepCosts, length: DraftLength, seed: int = 0) -> Simulated:
    """Decode `trace`'s reply speculatively with a model draft on a simulated clock: `length` (a fresh policy)
    chooses K each step as in `Generation`, the draft catches up with the context by one forward of the tokens
    it has not seen and drafts the rest one token a step, the target verifies K + 1 tokens, and the trace decides
    each draft token (`Trace.decide(seed)`). The first reply token comes from the prefill, as in decoding; the
    figures count the other len(trace.accept) - 1."""
    decide = trace.decide(seed)
    start, total = len(trace.prompt), len(trace.accept)
    target = lambda t: costs.seconds("target", t)  # noqa: E731
    draft = lambda t: costs.seconds("draft", t)  # noqa: E731
    length.begin_reply()
    known = held = start  # context tokens the draft's cache holds, of which still valid (it prefilled the prompt)
    done, clock, steps, drafted, accepted = 1, 0.0, 0, 0, 0  # reply tokens emitted
    while done < total:
        context = start + done  # the latest token is fed this step, at position context - 1
        k = length.choose(total - done - 1)
        if k:
            fed = context - known  # the draft's catch-up forward, which gives its first token's logits
            setup = draft(fed) if context - held > 2 else 0.0  # as ModelDrafter counts it
            draft_s = draft(fed) + (k - 1) * draft(1) - setup
            n = 0
            while n < k and decide(context + n, True):
                n += 1
            held, known = context + k - 1, context + min(n, k - 1)  # its drafts up to the first rejection stay
            clock += setup + draft_s + target(k + 1)
            length.observe(k, n, target(k + 1), draft_s)
            drafted, accepted = drafted + k, accepted + n
        else:
            n = 0
            clock += target(1)
            length.observe(0, 0, target(1), 0.0)
        done += n + 1
        steps += 1
    return Simulated((total - 1) * target(1), clock, steps, drafted, accepted)


def simulate_lookup(reply: Reply, costs: StepCosts, length: DraftLength, max_n: int = 3) -> Simulated:
    """`simulate` for prompt lookup (`--ngram max_n`) replaying `reply`, as an engine that is not pipelined decodes
    (a CPU's): each step `length` chooses K, the lookup proposes from the real context (free), the target verifies
    what it proposed (without a match: a plain step), and the reply decides each draft token."""
    drafter = ReplayedLookup(max_n)
    decide = drafter.follow(reply)
    start, total = len(reply.prompt), len(reply.tokens)
    length.begin_reply()
    drafter.start(reply.context(start))
    done, clock, steps, drafted, accepted = 1, 0.0, 0, 0, 0
    while done < total:
        context = reply.context(start + done)
        k = length.choose(total - done - 1)
        drafts = drafter.propose(context, k, None, None).tokens if k else []
        n = 0
        while n < len(drafts) and decide(len(context) + n, True):
            n += 1
        step_s = costs.seconds("target", len(drafts) + 1)
        clock += step_s
        length.observe(len(drafts), n, step_s, 0.0)
        drafted, accepted = drafted + len(drafts), accepted + n
        done += n + 1
        steps += 1
    return Simulated((total - 1) * costs.seconds("target", 1), clock, steps, drafted, accepted)


@torch.inference_mode()
def record_reply(target, prompt: list[int], params: SamplingParams) -> Reply:
    """The reply of `target` (an Engine) to `prompt`, decoded plainly with `params` (`params.max_new_tokens` tokens,
    end tokens ignored): what a lookup's replay follows."""
    import dataclasses

    from llmrun.generate import Generation

    params = dataclasses.replace(params, ignore_eos=True, stop=())
    target.reset()
    reply = Generation(target, prompt, params)
    for _ in reply:
        pass
    seed = -1 if params.greedy or params.seed is None else params.seed
    return Reply(tuple(prompt), tuple(reply.token_ids), params.temperature, seed)


@torch.inference_mode()
def record(target, draft, prompt: list[int], params: SamplingParams) -> Trace:
    """The acceptance trace of one reply of `target` (an Engine) to `prompt`, decoded plainly with `params`
    (`params.max_new_tokens` tokens, end tokens ignored), against `draft` (an Engine with the same vocabulary)."""
    reply = list(record_reply(target, prompt, params).tokens)
    ids = list(prompt) + reply
    q_logits = _step_logits(draft, prompt, reply)
    p_logits = None if params.greedy else _step_logits(target, prompt, reply)
    accept = []
    for i, y in enumerate(reply):
        history = None
        if params.repetition_penalty != 1.0:
            history = torch.tensor(ids[: len(prompt) + i], device=q_logits.device)
        if params.greedy:  # the draft's token, chosen as it drafts
            accept.append(float(sample(q_logits[i], params, None, history) == y))
            continue
        p = token_probs(p_logits[i], params, history)
        q = fit_vocab(token_probs(q_logits[i], params, history).to(p.device, torch.float32), p.shape[-1])
        accept.append(min(1.0, float(q[y] / p[y])) if p[y] > 0 else 0.0)  # min(p, q) / p
    seed = -1 if params.greedy or params.seed is None else params.seed
    return Trace(tuple(prompt), tuple(accept), params.temperature, seed)


def _step_logits(engine, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """(len(reply), V) fp32: the logits that chose each reply token, from a prefill of the prompt and then one
    decode step a token, as decoding computes them (a draft model drafts by such steps too)."""
    engine.reset()
    logits, _ = engine.prefill(prompt)
    rows = [logits.float()]
    for token in reply[:-1]:
        rows.append(engine.decode(token).float())
    engine.reset()
    return torch.stack(rows)
