"""`llmrun bench --ngram/--draft`: speculative decoding against plain decoding of the same target, workload and
sampling settings, in one process.

Both sides run through `Generation` (the path `llmrun generate` takes) with `ignore_eos`, so every run produces
exactly `new_tokens` tokens; the plain side is the same engine with its speculator taken off. After one warm-up
of each, the timed runs alternate plain / speculative, so a drift in the machine's speed (another job, the
clock) falls on both alike. Timed run i samples with seed i (temperature > 0). Every run starts from an empty
KV cache (the draft model's too) and a fresh draft-length policy, as `llmrun generate` does: runs are
independent and the policy's cold start is part of the figure.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from llmrun import bench
from llmrun.speculative import DraftLength, short_draft_note


@dataclass(frozen=True)
class Drafting:
    """What the speculative runs use: the drafter (`draft` or `ngram`), its draft length, the temperature."""

    draft: str | None = None  # a draft model, "self" (a 4-bit copy of the target) or "self:skip"
    ngram: int | None = None  # or prompt lookup with n-grams up to this long
    draft_tokens: int = 8  # the most draft tokens per step (K)
    adaptive: bool = True  # choose K per step from measured acceptance and costs
    temperature: float = 0.0  # 0: greedy; else the default top-k / top-p / min-p of SamplingParams

    def flags(self) -> str:
        """The command-line flags that select this drafting, e.g. `--ngram 3 --draft-tokens 8 --adaptive`."""
        drafter = f"--ngram {self.ngram}" if self.ngram is not None else f"--draft {self.draft}"
        return f"{drafter} --draft-tokens {self.draft_tokens} {'--adaptive' if self.adaptive else '--fixed-k'}"


def open_speculator(engine, drafting: Drafting, settings: bench.Settings):
    """The Speculator for `drafting` on `engine`; a draft model loads as the resolved `settings` say."""
    from llmrun.loading import load_weights, open_model
    from llmrun.speculative import make_speculator

    def load(spec):
        return load_weights(open_model(spec), device=settings.device, dtype=settings.dtype, weights=settings.weights)

    return make_speculator(engine, draft=drafting.draft, ngram=drafting.ngram, draft_tokens=drafting.draft_tokens,
                           adaptive=drafting.adaptive, load=load)


def drafter_name(speculator, drafting: Drafting) -> str:
    return f"ngram {drafting.ngram}" if drafting.ngram is not None else speculator.name


class RecordingLength(DraftLength):
    """The draft-length policy, remembering the last K it chose while the token budget did not limit it (near
    the end of a run K is cut to the tokens left, which says nothing of what the policy settled on)."""

    settled_k: int | None = None

    cap: float = math.inf  # the most draft tokens a step may verify whatever the budget (an evicting cache's)

    def choose(self, room: int) -> int:
        k = super().choose(room)
        if not self.adaptive:  # --fixed-k: the policy's K is known whatever the budget left each step
            self.settled_k = int(min(self.max_k, self.cap))
        elif room >= min(self.max_k, self.cap):
            self.settled_k = k
        return k


@dataclass(frozen=True)
class GenerationRun:
    run: bench.Run
    stats: object  # llmrun.generate.GenerationStats
    token_ids: list[int]
    final_k: int | None  # speculative: the policy's last K that the token budget did not cut


def time_generation(engine, prompt: list[int], params, speculator=None, decide=None) -> GenerationRun:
    """One run through `Generation` from empty caches, speculative when `speculator` is given (its draft-length
    policy starts afresh; `decide` overrules its verification's decisions: `llmrun.replay`)."""
    from llmrun.generate import Generation

    engine.reset()
    if speculator is not None:
        draft_engine = getattr(speculator.drafter, "engine", None)
        if draft_engine is not None:
            draft_engine.reset()
        length = RecordingLength(speculator.length.max_k, speculator.length.adaptive, speculator.length.draft_cost)
        length.cap = engine.max_block - 1
        speculator = dataclasses.replace(speculator, length=length, decide=decide)
    engine.speculator = speculator
    try:
        reply = Generation(engine, prompt, params)
        for _ in reply:
            pass
    finally:
        engine.speculator = None
    s = reply.stats
    final_k = None
    if speculator is not None:  # (nothing drafted: a drafter that proposed nothing, whatever K was chosen)
        final_k = s.draft_k if speculator.length.settled_k is None else speculator.length.settled_k
        final_k = final_k if s.drafted else 0
    return GenerationRun(bench.Run(s.prefill_s, s.ttft_s, s.decode_s, len(prompt), s.new_tokens), s,
                         reply.token_ids, final_k)


def measure_speculative(engine, speculator, workload, drafting: Drafting, replay=None) -> dict:
    """Every figure of `bench.measure`, for the speculative runs, plus `speculative`: the comparison with
    plain decoding on the same engine and workload. `replay(seed) -> decide` (`llmrun.replay.replayer`) makes
    the speculative run of each seed accept what a recorded trace says instead of what the models say."""
    from llmrun.memory import memory_report
    from llmrun.sampling import SamplingParams

    prompt = list(workload.prompt)

    def params(seed: int):
        return SamplingParams(temperature=drafting.temperature, max_new_tokens=workload.new_tokens, ignore_eos=True,
                              seed=seed)

    def decide(seed: int):
        return None if replay is None else replay(seed)

    if workload.warmup:
        time_generation(engine, prompt, params(0))
        time_generation(engine, prompt, params(0), speculator, decide(0))
    bench.reset_peak_memory(engine.device)
    plain, spec = [], []
    for seed in range(workload.repeat):
        plain.append(time_generation(engine, prompt, params(seed)))
        spec.append(time_generation(engine, prompt, params(seed), speculator, decide(seed)))

    stats = [r.stats for r in spec]
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    steps = max(sum(s.decode_steps for s in stats), 1)
    tokens_per_step = sum(s.decode_tokens for s in stats) / steps
    figures = bench.run_figures(engine, workload, [r.run for r in spec], tokens_per_step=tokens_per_step,
                                acceptance_rate=accepted / drafted if drafted else None)
    plain_tok_s = statistics.median(r.run.decode_tok_s for r in plain)
    spec_tok_s = statistics.median(r.run.decode_tok_s for r in spec)
    engine.speculator = speculator  # for memory_report's draft figures
    try:
        memory = memory_report(engine)
    finally:
        engine.speculator = None
    figures["speculative"] = {
        "drafter": drafter_name(speculator, drafting),
        "flags": drafting.flags(),
        "max_k": drafting.draft_tokens,
        "adaptive": drafting.adaptive,
        "temperature": drafting.temperature,
        "seeds": list(range(workload.repeat)),
        "mean_final_k": round(statistics.mean(float(r.final_k) for r in spec), 2),
        "mean_k": round(drafted / steps, 2),  # draft tokens per step, plain steps (K = 0) included
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "plain_decode_tok_s": round(plain_tok_s, 2),
        "speculative_decode_tok_s": round(spec_tok_s, 2),
        "speedup": round(spec_tok_s / plain_tok_s, 3),
        # greedy: speculative decoding must give plain decoding's tokens; sampling: only the same distribution
        # (a replay decides against the models: its tokens are not the point)
        "same_output": all(p.token_ids == s.token_ids for p, s in zip(plain, spec))
        if drafting.temperature == 0 and replay is None else None,
        "draft_weight_bytes": memory.get("draft_weights"),  # None: no draft model (n-gram lookup)
        "draft_kv_bytes": memory.get("draft_kv_allocated"),
    }
    note = short_draft_note(engine, speculator)
    if note is not None:
        figures["notes"].append(note)
    if figures["speculative"]["same_output"] is False:
        figures["notes"].append("greedy speculative decoding gave different tokens from plain greedy decoding" + (
            " (expected with --kv-evict: a verification block evicts earlier than one-token steps do)"
            if engine.eviction is not None else ""))
    return figures


def measure_speculative_settings(files, settings: bench.Settings, workload, drafting: Drafting) -> dict:
    """Load `files` as a resolved `settings` says, attach the drafter, measure, free both models."""
    with bench.torch_threads(settings.threads):
        engine = bench.open_engine(files, settings)
        try:
            speculator = open_speculator(engine, drafting, settings)
            return measure_speculative(engine, speculator, workload, drafting)
        finally:
            del engine
            bench.release(settings.device)
