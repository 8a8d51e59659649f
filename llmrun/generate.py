"""The generation loop: prefill, decode step by step, sample, detokenize for streaming, stop.

An `Engine` owns one model and one KV cache, and remembers which tokens the cache holds, so a new prompt that
extends the previous one (the next chat turn) prefills only its new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmrun.errors import ContextOverflowError, LlmrunError
from llmrun.kv_cache import KVCache
from llmrun.loading import LoadedModel
from llmrun.sampling import SamplingParams, make_generator, sample
from llmrun.tokenizer import StreamDecoder

PREFILL_CHUNK = 512  # prompt tokens per forward: bounds the (T, S) attention scores of long prompts


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose K/V were already cached (earlier turns)
    new_tokens: int = 0
    decode_steps: int = 0  # forwards of one token (the first token comes from the prefill's logits)
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
        return self.decode_steps / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
            "new_tokens": self.new_tokens, "ttft_s": round(self.ttft_s, 4),
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "prefill_tok_s": round(self.prefill_tok_s, 2), "decode_tok_s": round(self.decode_tok_s, 2),
            "context_used": self.context_used, "context_max": self.context_max,
            "finish_reason": self.finish_reason,
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
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Engine:
    def __init__(self, loaded: LoadedModel, max_len: int | None = None):
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        self.cache = KVCache.for_model(cfg, self.max_len, loaded.dtype, loaded.device)
        self.tokens: list[int] = []  # the tokens whose K/V the cache holds, in order

    def reset(self) -> None:
        self.cache.truncate(0)
        self.tokens = []

    @torch.inference_mode()
    def forward(self, ids: list[int], last_only: bool = True) -> torch.Tensor:
        """Run ids after the cached tokens; return the logits (V,) of the last one (or (T, V))."""
        start = self.cache.length
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits = self.model(x, start_pos=start, cache=self.cache, last_only=last_only)
        # Only now, with the forward complete, do the cache and the token list advance (Ctrl-C safe).
        self.cache.length = start + len(ids)
        self.tokens.extend(ids)
        return logits[0, -1] if last_only else logits[0]

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Make the cache hold `prompt`, reusing the longest cached prefix; return the last logits (V,) and the
        number of reused tokens."""
        if not prompt:
            raise LlmrunError("the prompt is empty: there is nothing to continue")
        if len(prompt) >= self.max_len:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.max_len}; shorten it or raise --ctx"
            )
        common = 0
        for a, b in zip(self.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # always run at least one token to get its logits
        self.cache.truncate(common)
        del self.tokens[common:]
        for i in range(common, len(prompt), PREFILL_CHUNK):
            logits = self.forward(prompt[i : i + PREFILL_CHUNK])
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
    """

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams):
        self.engine, self.prompt, self.params = engine, prompt, params
        # "interrupted" until the loop ends on its own (also when it is closed before it starts)
        self.stats = GenerationStats(prompt_tokens=len(prompt), context_max=engine.max_len, finish_reason="interrupted")
        self.token_ids: list[int] = []
        self.text = ""

    def __iter__(self):
        engine, params, stats = self.engine, self.params, self.stats
        eos = engine.tokenizer.eos_ids
        generator = make_generator(params.seed, engine.device)
        detok = StreamDecoder(engine.tokenizer)
        stops = StopMatcher(params.stop)
        penalize = params.repetition_penalty != 1.0
        t0 = time.perf_counter()
        logits, stats.reused_tokens = engine.prefill(self.prompt)
        stats.prefill_s = time.perf_counter() - t0
        t_first = None
        try:
            while True:
                history = torch.tensor(engine.tokens, device=engine.device) if penalize else None
                token = sample(logits, params, generator, history)
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                if token in eos:
                    stats.finish_reason = "stop"
                    break
                self.token_ids.append(token)
                stats.new_tokens += 1
                piece = stops.feed(detok.push(token))
                if piece:
                    self.text += piece
                    yield piece
                if stops.stopped:
                    stats.finish_reason = "stop"
                    break
                if stats.new_tokens >= params.max_new_tokens:
                    stats.finish_reason = "length"
                    break
                if engine.cache.length >= engine.max_len:
                    stats.finish_reason = "context"
                    break
                logits = engine.decode(token)
                stats.decode_steps += 1
            if not stops.stopped:
                tail = stops.feed(detok.flush())
                tail += "" if stops.stopped else stops.flush()
                if tail:
                    self.text += tail
                    yield tail
        finally:
            stats.context_used = engine.cache.length
            if t_first is not None:
                stats.decode_s = time.perf_counter() - t_first
