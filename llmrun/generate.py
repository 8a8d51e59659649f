"""The generation loop: prefill, decode step by step, sample, detokenize for streaming, stop.

An `Engine` owns one model and one KV cache, and remembers which tokens the cache holds, so a new prompt that
extends the previous one (the next chat turn) prefills only its new tokens.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from llmrun import cuda_graphs, threads
from llmrun.errors import ContextOverflowError, LlmrunError, OutsideVocabularyError, UsageError, not_finite
from llmrun.kernels import ref
from llmrun.kv_cache import Eviction, KVCache
from llmrun.loading import LoadedModel
from llmrun.sampling import Ahead, Randomness, SamplingParams, sample
from llmrun.speculative import Proposal, verify
from llmrun.tokenizer import StreamDecoder

# prompt tokens per forward: bounds the (T, S) attention scores of long prompts; INT4's rings hold one whole
PREFILL_CHUNK = ref.PREFILL_ROWS
UNREAD = -1  # in an engine's token list: a token fed from the device whose value the host has not read yet


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose K/V were already cached (earlier turns)
    new_tokens: int = 0
    decode_steps: int = 0  # target forwards after the prefill: one token each, or a speculative block
    decode_tokens: int = 0  # tokens those steps produced (an end token included)
    drafted: int = 0  # speculative decoding: draft tokens proposed ...
    accepted: int = 0  # ... and accepted by the target
    draft_k: int | None = None  # the draft length chosen for the latest step (None: no drafter)
    constrained: bool = False  # structured output: a grammar masked every token ...
    forced: int = 0  # ... and this many came from jump-forward proposals (the rest were sampled) ...
    forced_proposed: int = 0  # ... out of those proposed
    grammar_s: float = 0.0  # time spent in grammar work: masks, accepting tokens, jump-forward
    ttft_s: float = 0.0  # from the call to the first sampled token: prefill plus one sampling
    prefill_s: float = 0.0
    decode_s: float = 0.0  # from the first generated token to the last
    context_used: int = 0
    context_max: int = 0
    finish_reason: str = ""  # "stop" (end token or stop string), "length", "context" or "interrupted"

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mask_us_per_token(self) -> float | None:
        return 1e6 * self.grammar_s / self.new_tokens if self.new_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.decode_tokens / self.decode_steps if self.decode_steps else None

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
            "new_tokens": self.new_tokens, "ttft_s": round(self.ttft_s, 4),
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "prefill_tok_s": round(self.prefill_tok_s, 2), "decode_tok_s": round(self.decode_tok_s, 2),
            "context_used": self.context_used, "context_max": self.context_max,
            "finish_reason": self.finish_reason, "decode_steps": self.decode_steps,
            "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
            "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
            "tokens_per_step": None if self.tokens_per_step is None else round(self.tokens_per_step, 3),
            "draft_k": self.draft_k, "constrained": self.constrained, "forced_tokens": self.forced,
            "forced_proposed": self.forced_proposed, "sampled_tokens": self.new_tokens - self.forced,
            "mask_us_per_token": None if self.mask_us_per_token is None else round(self.mask_us_per_token, 1),
        }


class StopMatcher:
    """Holds back streamed text that might be the start of a stop string; reports the first full match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; return what can be shown now (everything before a stop string, when one appears)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        keep = 0  # the longest end of the text that begins a stop string, held back: only up to the text's length
        for stop in self.stops:  # (every length of a 100k-character stop string, every token, cost 130 ms a token)
            keep = next((k for k in range(min(len(stop) - 1, len(self.pending)), keep, -1)
                         if self.pending.endswith(stop[:k])), keep)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Engine:
    """`model` overrides the loaded one (a view of it sharing its weights, e.g. with layers skipped);
    `speculator` (see `llmrun.speculative`) makes generation speculative; `grammar` (see `llmrun.grammar`)
    constrains every reply.

    The KV cache holds `max_len` tokens (at most the model's context), in the model's dtype unless `kv_format`
    says otherwise (see `llmrun.kv_cache`). With an `eviction` policy it holds a budget of them and the context
    is unbounded (`max_len` is infinite): older tokens make room for new ones."""

    def __init__(self, loaded: LoadedModel, max_len: int | float | None = None, model=None,
                 kv_format: str | None = None, eviction: Eviction | None = None):
        self.loaded = loaded
        self.model = model or loaded.model
        cfg = self.model.config
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.kv_format, self.eviction = kv_format, eviction
        ctx = int(min(max_len or cfg.max_seq_len, cfg.max_seq_len))
        if eviction is not None and eviction.budget > cfg.max_seq_len:
            raise UsageError(f"--kv-budget {eviction.budget} is more than the model's context ({cfg.max_seq_len})")
        self.cache = KVCache.for_model(self.model, ctx, loaded.dtype, loaded.device, kv_format=kv_format,
                                       eviction=eviction)
        self.max_len = ctx if eviction is None else math.inf  # the most tokens a conversation may reach
        self.max_block = math.inf if eviction is None else eviction.max_write  # the most tokens one forward adds
        self.prefill_chunk = int(min(PREFILL_CHUNK, self.max_block))
        self.tokens: list[int] = []  # the tokens fed so far, in order: the cache holds their K/V (less any evicted)
        self.speculator = None
        self.grammar = None
        self.graphs = cuda_graphs.for_engine(self.model, self.cache)  # on CUDA: decode steps as CUDA graphs
        # and sampled draws, plain decoding's and verification's (`DrawGraphs`)
        self.draws = None if self.graphs is None else cuda_graphs.DrawGraphs(self.device)
        # plain decoding enqueues each step before the host reads the token it feeds (`plain_steps`): where the
        # device runs behind the host (CUDA), and a forward fed past a reply's end can leave the cache without a
        # trace (not H2O's: its attention adds to the mass of the tokens it keeps)
        # the CPU thread governor (`llmrun.threads`) runs on the C kernels only, whose outputs are each one thread's:
        # PyTorch's float matmuls round otherwise with another thread count, and a reply's bits would follow the load
        self.governed = self.device.type == "cpu" and loaded.weights == "packed"
        self.pipeline = (self.device.type == "cuda" and (eviction is None or eviction.policy == "window")
                         and os.environ.get("LLMRUN_PIPELINE", "1") != "0")

    def sibling(self, loaded: LoadedModel | None = None, model=None) -> Engine:
        """An engine with this one's context and KV-cache settings, for another model (a speculative draft)."""
        cfg = (model or (loaded or self.loaded).model).config
        eviction = self.eviction
        if eviction is not None and eviction.budget > cfg.max_seq_len:  # it proposes from its context's last tokens
            # (fewer sinks where --kv-sinks would ask for more than a quarter of its context)
            eviction = replace(eviction, sinks=min(eviction.sinks, cfg.max_seq_len // 4))
            if cfg.max_seq_len < eviction.least_budget:
                raise UsageError(f"--kv-evict: the draft's context ({cfg.max_seq_len}) is shorter than the least "
                                 f"budget an evicting cache takes ({eviction.least_budget})")
            eviction = replace(eviction, budget=cfg.max_seq_len)
        return Engine(loaded or self.loaded, self.max_len, model=model, kv_format=self.kv_format, eviction=eviction)

    def reset(self) -> None:
        self.rollback(0)

    def rollback(self, length: int) -> None:
        """Forget every token from position `length` on (a rejected speculation, an edited conversation). An
        evicting cache that dropped tokens after `length` cannot go back there: it starts over, empty."""
        if self.cache.can_truncate(length):
            self.cache.truncate(length)
            del self.tokens[length:]
        else:
            self.cache.reset()
            self.tokens.clear()

    @torch.inference_mode()
    def forward(self, ids: list[int] | torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """Run ids after the cached tokens; return the logits (V,) of the last one (or (T, V)). ids may be a
        tensor (T,) on the device, whose values the host has not read: the token list holds UNREAD in their place
        until the caller puts them there."""
        self.cache.make_room(len(ids))  # evicts, or raises ContextOverflowError
        start = self.cache.length
        logits = None if self.graphs is None else self.graphs.forward(ids, self.cache.position, start)
        if logits is None:
            x = ids.view(1, -1) if torch.is_tensor(ids) else torch.tensor([ids], dtype=torch.long, device=self.device)
            governor = threads.governor() if self.governed else None
            if governor is not None:  # fewer threads while other processes hold the cores (`llmrun.threads`)
                governor.start(id(self.model), len(ids))
            try:
                logits = self.model(x, start_pos=self.cache.position, cache=self.cache, last_only=last_only)
            except BaseException:  # Ctrl-C, out of memory: a try of another thread count ends with it
                if governor is not None:
                    governor.abort()
                raise
            if governor is not None:
                governor.stop()
        # Only now, with the forward complete, do the cache and the token list advance (Ctrl-C safe).
        self.cache.length = start + len(ids)
        self.tokens.extend([UNREAD] * len(ids) if torch.is_tensor(ids) else ids)
        return logits[0, -1] if last_only else logits[0]

    def plain_steps(self, token: int, params: SamplingParams, rng: Randomness, steps: int,
                    go_on: Callable[[], bool] | None = None) -> Iterator[int]:
        """Plain decoding: feed `token`, then each token sampled after it, `steps` forwards at most, and yield each
        sampled token (`sample`'s, for the same seed) as the host reads it. `go_on`, when given, is asked before each
        forward after the first, while the token that forward would feed is not yet yielded: False ends the steps
        after that token (not fed).

        On a pipelined engine (`pipeline`: a GPU) the next forward is enqueued before the host reads the token it
        feeds, straight from the device where the draw left it, so the device goes from step to step while the host
        streams, detokenizes and checks for stops. A forward fed past the reply's end (the consumer stops taking
        tokens: an end token, a stop string, Ctrl-C) leaves the cache when the generator closes, so the cache and
        the token list end as plain decoding leaves them. A draw that needs the whole vocabulary (ties at top-k's
        edge past its candidates) gives another token than the one fed ahead: that forward is rolled back and run
        again. A forward that must first evict (or renumber positions) waits for its token instead: a rollback could
        not undo it."""
        if steps <= 0:
            return

        def draw(logits) -> Ahead:  # the draw of the position after the tokens fed so far
            return Ahead(logits, params, None if params.greedy else rng.at(len(self.tokens)), draws=self.draws)

        if not self.pipeline:
            for i in range(steps):
                token = draw(self.forward([token])).read()[0]
                more = i + 1 < steps and (go_on is None or go_on())
                yield token
                if not more:
                    return
            return

        def launch(fed) -> Ahead:  # a forward fed `fed` (a host token or a device one), and the draw after it
            return draw(self.forward(fed if torch.is_tensor(fed) else [fed]))

        ahead, launched, spare = launch(token), 1, None  # spare: where the forward fed ahead of the host went
        try:
            while ahead is not None:
                nxt = None
                more = launched < steps and (go_on is None or go_on())  # a forward is to feed `ahead`'s token
                if more and self.cache.writes_freely(1):
                    spare = len(self.tokens)
                    nxt = launch(ahead.token)
                token, fed_right = ahead.read()
                if nxt is not None and not fed_right:
                    self.rollback(spare)
                    nxt = None
                elif nxt is not None:
                    self.tokens[spare] = token
                yield token
                spare = None  # the consumer took the token: the forward that fed it (or will) is plain decoding's
                if more and nxt is None:  # not fed ahead (it evicts first), or fed another token (a tie)
                    nxt = launch(token)
                launched += more
                ahead = nxt
        finally:  # (the cache may count the forward fed ahead where the token list does not yet: a Ctrl-C between)
            if spare is not None and max(len(self.tokens), self.cache.seen) > spare:
                self.rollback(spare)

    def more_context(self) -> str:
        """What makes room when the context is full: a larger --ctx while the model's own allows, else eviction."""
        trained = self.model.config.max_seq_len
        if self.max_len < trained:
            return f"raise --ctx (up to {trained})"
        return f"bound the cache with --kv-evict (the context is the model's own {trained} positions)"

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Make the cache hold `prompt`, reusing the longest cached prefix; return the last logits (V,) and the
        number of reused tokens."""
        if not prompt:
            raise LlmrunError("the prompt is empty: there is nothing to continue")
        if len(prompt) >= self.max_len:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens and the context holds {self.max_len}, leaving no room to "
                f"generate; shorten it or {self.more_context()}"
            )
        common = 0
        for a, b in zip(self.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # always run at least one token to get its logits
        top, rows = max(prompt[common:]), self.model.config.vocab_size
        if top >= rows:  # (before the embedding reads past its table)
            raise OutsideVocabularyError(f"token id {top} is past the model's embedding of {rows} tokens: its "
                                         "tokenizer has more tokens than its weights")
        self.rollback(common)
        common = len(self.tokens)  # 0 if an evicting cache had to start over
        for i in range(common, len(prompt), self.prefill_chunk):
            logits = self.forward(prompt[i : i + self.prefill_chunk])
        return logits, common

    def decode(self, token: int) -> torch.Tensor:
        """Feed one token after the cached ones; return the logits (V,) of the next."""
        return self.forward([token])

    def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        return Generation(self, prompt, params)


class Generation:
    """Iterate to stream the reply's text pieces; `stats` is filled in as it goes.

    Stops at an end-of-generation token, a stop string, max_new_tokens, or a full context. When the consumer
    stops early (Ctrl-C), the engine's cache still matches its token list.
    With a speculator on the engine, each step verifies a block of draft tokens; the emitted tokens are the
    same as without (greedy) or have the same distribution (sampling). With a grammar, every token is one it
    allows, and text it forces is proposed and verified the same way (jump-forward).
    """

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams):
        self.engine, self.prompt, self.params = engine, prompt, params
        # "interrupted" until the loop ends on its own (also when it is closed before it starts)
        self.stats = GenerationStats(prompt_tokens=len(prompt), context_max=engine.cache.max_len,
                                     context_used=engine.cache.length, finish_reason="interrupted")
        self.token_ids: list[int] = []
        self.text = ""
        self._last_step = None  # (drafting, tokens proposed, accepted) of the latest _step
        self._chosen = None  # the policy's K for the next step, chosen ahead of it (`_paused`, `_plain`)

    def __iter__(self):
        engine, params, stats = self.engine, self.params, self.stats
        spec = engine.speculator
        self._eos = frozenset() if params.ignore_eos else engine.tokenizer.eos_ids
        self._detok = StreamDecoder(engine.tokenizer)
        self._stops = StopMatcher(params.stop)
        self._constraint = None if engine.grammar is None else engine.grammar.start()
        self.stats.constrained = self._constraint is not None
        rng = Randomness(params.seed)
        t0, t_first = time.perf_counter(), None
        try:  # the prefill too: after Ctrl-C during it, `finally` still records where the cache stands
            logits, stats.reused_tokens = engine.prefill(self.prompt)
            if not bool(torch.isfinite(logits).all()):  # once a reply: corrupt weights show here, not as a token
                raise not_finite(engine.loaded.dtype)
            if spec is not None:
                spec.length.begin_reply()
                if not spec.length.hopeless:
                    spec.drafter.start(engine.tokens)
            stats.prefill_s = time.perf_counter() - t0
            if self._constraint is not None:
                logits = self._constraint.constrain(logits)
            tokens = [sample(logits, params, rng.at(len(engine.tokens)), self._history())]
            t_first = time.perf_counter()
            stats.ttft_s = t_first - t0
            while True:
                for used, token in enumerate(tokens, 1):
                    piece = self._take(token)
                    if piece:
                        self.text += piece
                        yield piece
                    if stats.finish_reason != "interrupted":
                        self._uncount(len(tokens) - used)
                        break
                else:
                    if len(engine.tokens) >= engine.max_len:
                        stats.finish_reason = "context"
                    elif self._plainly():  # one token a forward from here on (`Engine.plain_steps`)
                        yield from self._plain(tokens[-1], rng)
                    elif self._paused(tokens[-1]):  # nothing to draft for now: plain steps until there is
                        last = yield from self._plain(tokens[-1], rng, until_drafting=True)
                        if last is not None:
                            tokens = self._step(last, rng)  # the step the policy chose to draft
                            continue
                    else:
                        tokens = self._step(tokens[-1], rng)
                        continue
                break
            if not self._stops.stopped:
                tail = self._stops.feed(self._detok.flush())
                tail += "" if self._stops.stopped else self._stops.flush()
                if tail:
                    self.text += tail
                    yield tail
        finally:
            if spec is not None:  # accepted draft tokens past the end of the reply: not part of the conversation
                # nor its last token where plain decoding would not have fed it: one taken at the token budget or
                # completing a stop string (an end token is no reply token: the one before it was fed)
                unfed = stats.finish_reason == "length" or (stats.finish_reason == "stop" and self._stops.stopped)
                engine.rollback(min(len(engine.tokens), len(self.prompt) + len(self.token_ids) - unfed))
            stats.context_used = engine.cache.length
            if self._constraint is not None:
                stats.grammar_s = self._constraint.seconds
            if t_first is not None:
                stats.decode_s = time.perf_counter() - t_first

    def _plainly(self) -> bool:
        """Whether the reply goes on by plain decoding: no drafts (no speculator, or one that can never pay), no
        grammar, no repetition penalty (whose history would be the token list, read on the host)."""
        spec = self.engine.speculator
        return ((spec is None or spec.length.hopeless) and self._constraint is None
                and self.params.repetition_penalty == 1.0)

    def _paused(self, token: int) -> bool:
        """Whether a speculative reply on a pipelined engine goes on by plain steps for now (no grammar, no
        repetition penalty): the policy chose K = 0 for the step fed `token` (kept in `_chosen` for `_step`
        otherwise), or the drafter has nothing to propose after it (a lookup without a match, whose step would
        be a plain one fed from the host: the device idle while the host reads each token and feeds it)."""
        engine, spec = self.engine, self.engine.speculator
        if not engine.pipeline or self._constraint is not None or self.params.repetition_penalty != 1.0:
            return False
        self._chosen = spec.length.choose(self._room(len(engine.tokens), self.stats.new_tokens))
        if self._chosen and not spec.drafter.would_propose(engine.tokens + [token]):
            self._chosen = None
            return True
        return self._chosen == 0

    def _room(self, start: int, taken: int) -> int:
        """The draft tokens a step fed at `start` may verify, `taken` tokens of the reply counted: what the token
        budget, the context and an evicting cache's largest write leave."""
        engine = self.engine
        return int(min(self.params.max_new_tokens - taken - 1, engine.max_len - start - 1, engine.max_block - 1))

    def _plain(self, token: int, rng: Randomness, until_drafting: bool = False):
        """Plain decoding from `token` (sampled and taken, not yet fed) on: yield the text of each token until the
        reply ends, or, `until_drafting` (a speculative reply with nothing to draft for now), until the policy
        chooses to draft for the next step and the drafter has something to propose: -> the last token then (taken,
        not fed; else None). Each step's time goes to the policy as a plain step's."""
        engine, stats, spec = self.engine, self.stats, self.engine.speculator
        drafts_next = []

        def go_on() -> bool:  # asked before each step, its token not yet taken: the policy's K for it
            k = spec.length.choose(self._room(len(engine.tokens), stats.new_tokens + 1))
            # The token in flight is unknown here: a lookup is asked of the context up to the token before it (a
            # match there most likely goes on past it, as in a copied passage; the draft then follows that token)
            if k and not spec.drafter.would_propose(engine.tokens):
                k = 0
            if k:
                self._chosen = k
                drafts_next.append(k)
            return not k

        # the forwards plain decoding may run: one a token up to the reply's length, while the context has room
        room = int(min(self.params.max_new_tokens - stats.new_tokens, engine.max_len - len(engine.tokens)))
        steps = engine.plain_steps(token, self.params, rng, room, go_on if until_drafting else None)
        try:
            while True:
                t0, captured = time.perf_counter(), cuda_graphs.captures()
                nxt = next(steps, None)
                if nxt is None:
                    break
                token = nxt
                if spec is not None:
                    stats.draft_k = 0
                    if cuda_graphs.captures() == captured:
                        spec.length.observe(0, 0, time.perf_counter() - t0, 0.0)
                stats.decode_steps += 1
                stats.decode_tokens += 1
                piece = self._take(token)
                if piece:
                    self.text += piece
                    yield piece
                if stats.finish_reason != "interrupted":
                    return None
            if drafts_next:
                return token
            stats.finish_reason = "context"  # the steps ran out before the reply's length: the context is full
            return None
        finally:
            steps.close()  # a forward fed past the reply's end leaves the cache now

    def _history(self, length: int | None = None) -> torch.Tensor | None:
        """The context's (first `length`) token ids, for the repetition penalty."""
        if self.params.repetition_penalty == 1.0:
            return None
        return torch.tensor(self.engine.tokens[:length], device=self.engine.device)

    def _take(self, token: int) -> str:
        """Add a sampled token to the reply; return the text it releases. Sets `stats.finish_reason` when the
        reply is complete."""
        stats, constraint = self.stats, self._constraint
        if constraint is not None:
            constraint.accept(token)
        if token in self._eos or (constraint is not None and constraint.finished):
            stats.finish_reason = "stop"
            return ""
        self.token_ids.append(token)
        stats.new_tokens += 1
        piece = self._stops.feed(self._detok.push(token))
        if self._stops.stopped:
            stats.finish_reason = "stop"
        elif stats.new_tokens >= self.params.max_new_tokens:
            stats.finish_reason = "length"
        return piece

    def _uncount(self, unused: int) -> None:
        """The reply ended `unused` tokens before the end of the last step's (an end token or a stop string inside
        an accepted block): the figures count what the reply used, so those tokens, and the drafts after them,
        come out of them."""
        if not unused or self._last_step is None:
            return
        stats, (drafting, proposed, accepted) = self.stats, self._last_step
        past = unused - 1 + proposed - accepted  # proposals after the reply's last token: accepted or not
        stats.decode_tokens -= unused
        if drafting:
            stats.drafted, stats.accepted = stats.drafted - past, stats.accepted - (unused - 1)
        else:
            stats.forced_proposed, stats.forced = stats.forced_proposed - past, stats.forced - (unused - 1)

    def _step(self, token: int, rng: Randomness) -> list[int]:
        """Feed `token`, the latest sampled one, to the target (with draft tokens after it when speculating);
        return the next tokens: the accepted drafts and the target's own token after them."""
        engine, params, stats, constraint = self.engine, self.params, self.stats, self._constraint
        spec = engine.speculator
        start = len(engine.tokens)
        room = self._room(start, stats.new_tokens)
        forced = [] if constraint is None else constraint.forced_tokens(engine.tokenizer, room)
        drafting = spec is not None and not forced
        proposal, k, t0 = Proposal(forced), 0, time.perf_counter()
        captured = cuda_graphs.captures()
        if drafting:
            k = spec.length.choose(room) if self._chosen is None else self._chosen
            self._chosen = None
            stats.draft_k = k
            if k:
                proposal = spec.drafter.propose(engine.tokens + [token], k, params, rng, constraint)
        t1 = time.perf_counter()
        drafts = proposal.tokens
        logits = engine.forward([token, *drafts], last_only=not drafts)  # (V,), or (1 + K, V) to verify
        if constraint is not None:
            # After the forward is launched: on a GPU, the grammar's masks are made while it runs.
            bitmask, valid = constraint.masks(drafts)  # (1 + valid, W)
            if valid < len(drafts):  # a lookup's draft may stray from the grammar: cut it there
                proposal, drafts, logits = proposal.head(valid), drafts[:valid], logits[: valid + 1]
                if not drafts:
                    logits = logits[0]
            logits = constraint.apply(logits, bitmask)
        history = self._history(start + 1)
        if drafts:
            accepted, nxt = verify(logits, proposal, params, rng, history, position=start + 1,
                                   decide=spec.decide if drafting else None, draws=engine.draws)
        else:
            accepted, nxt = 0, sample(logits, params, rng.at(start + 1), history)
        engine.rollback(start + 1 + accepted)  # rejected drafts (and any cut off above) leave the cache
        if drafting:
            if cuda_graphs.captures() == captured:  # a step that captured a CUDA graph is no step's typical time
                spec.length.observe(len(drafts), accepted, time.perf_counter() - t1, t1 - t0 - proposal.setup_s)
            stats.drafted += len(drafts)
            stats.accepted += accepted
        else:
            stats.forced_proposed += len(drafts)
            stats.forced += accepted
        stats.decode_steps += 1
        stats.decode_tokens += accepted + 1
        self._last_step = (drafting, len(drafts), accepted)
        return [*drafts[:accepted], nxt]
