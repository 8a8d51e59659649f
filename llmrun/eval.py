"""Quality measures: perplexity over a sliding window, and the KL divergence of one configuration's next-token
distributions from a reference configuration's (how llama.cpp judges its quantizations).

Every logit comes from `Engine.forward` through the KV cache, fed in chunks of at most `PREFILL_CHUNK`, so what
is measured is what `chat` and `generate` run: the weight format, dtype and KV-cache options included.

Windows: with N tokens there are N - 1 predictions to score (token t from tokens < t). Window k feeds the
tokens [k·stride, k·stride + ctx) (cut at N - 1: the last token is never an input) and scores the predictions
no earlier window made: the first window all of its own, each later one its last `stride` at most. Every
token after the first is scored exactly once, with at least ctx - stride tokens of context outside the first
window.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmrun.errors import LlmrunError, not_finite, read_text_file

DEFAULT_CTX = 512  # window length when --ctx is not given (or the model's context, if shorter)


@dataclass(frozen=True)
class Window:
    start: int  # first input token
    end: int  # one past the last input token
    first_scored: int  # the first position whose token this window scores; it scores [first_scored, end]


def sliding_windows(n_tokens: int, ctx: int, stride: int) -> list[Window]:
    """The windows that score tokens 1..n_tokens-1 of a text exactly once (see the module docstring)."""
    if not 1 <= stride <= ctx:
        raise ValueError(f"stride {stride} must be in [1, ctx={ctx}]")
    if n_tokens < 2:
        return []
    windows, scored_to = [], 0  # tokens 1..scored_to are scored
    for start in range(0, n_tokens - 1, stride):
        end = min(start + ctx, n_tokens - 1)
        windows.append(Window(start, end, scored_to + 1))
        scored_to = end
        if end == n_tokens - 1:
            break
    return windows


@dataclass
class KLStats:
    mean: float  # mean over scored positions of KL(P_ref || P) in nats
    max: float
    p99: float
    top1_agreement: float  # fraction of positions where both configurations' most likely token is the same
    ppl_reference: float | None  # None past float64's range (`perplexity`)


@dataclass
class EvalResult:
    tokens: int  # tokens of the text evaluated
    evaluated: int  # predictions scored (tokens - 1)
    windows: int
    nll: float  # mean negative log-likelihood in nats
    seconds: float  # scoring time (both configurations with a reference)
    kl: KLStats | None = None

    @property
    def ppl(self) -> float | None:
        return perplexity(self.nll)

    @property
    def tok_s(self) -> float:
        return self.evaluated / self.seconds if self.seconds else 0.0


def perplexity(nll: float) -> float | None:
    """exp(mean NLL); None past float64's range (a mean NLL above ~709.8 nats: weights that put next to no mass on
    the text)."""
    try:
        return math.exp(nll)
    except OverflowError:
        return None


def read_text(spec: str) -> str:
    """The text of `--ppl SPEC`: `canterbury[:NAME]` (see llmrun.corpus) or a UTF-8 text file; line endings are
    made `\\n` (the Canterbury texts have CRLF) and a byte-order mark, as some editors write, is dropped."""
    from llmrun import corpus

    if not spec.strip():  # (as a Path, "" would be the working directory)
        raise LlmrunError("the text file's name is empty; give a UTF-8 text file or 'canterbury'")
    path = corpus.corpus_path(spec) if corpus.is_corpus_spec(spec) else Path(spec)
    text = read_text_file(path, str(path), "; give a UTF-8 text file or 'canterbury'")
    if "\x00" in text:
        raise LlmrunError(f"{path} looks binary (it holds NUL bytes); give a plain text file")
    if not text:
        raise LlmrunError(f"{path} is empty; give a file with some text in it")
    return text.replace("\r\n", "\n")


def _window_logits(engine, ids: list[int], window: Window, chunk: int):
    """Feed the window through the cache `chunk` tokens at a time; yield (position of the first row, logits (T, V)
    fp32) per chunk."""
    engine.reset()
    for pos in range(window.start, window.end, chunk):
        yield pos, engine.forward(ids[pos : min(pos + chunk, window.end)], last_only=False).float()


def evaluate(engine, ids: list[int], ctx: int, stride: int, reference=None,
             on_window: Callable[[int, int], None] | None = None) -> EvalResult:
    """Perplexity of `ids` under `engine`; with a `reference` engine (same vocabulary), the KL statistics too.

    Memory stays bounded by one chunk of full-vocabulary logits per engine: only per-position numbers are kept.
    `on_window(done, total)` is called after each window (for a progress bar).
    """
    import torch
    import torch.nn.functional as F

    windows = sliding_windows(len(ids), ctx, stride)
    if not windows:
        raise LlmrunError(f"the text has {len(ids)} token(s); at least 2 are needed to score one")
    targets = torch.tensor(ids, dtype=torch.long)
    # One chunking for both, so their rows pair up (an evicting cache takes smaller pieces)
    chunk = min(e.prefill_chunk for e in (engine, reference) if e is not None)
    nll, nll_ref, kl, same_top1 = [], [], [], []  # per chunk, (T,) each
    t0 = time.perf_counter()
    for done, window in enumerate(windows, 1):
        theirs = _window_logits(reference, ids, window, chunk) if reference is not None else itertools.repeat((None, None))
        for (pos, logits), (_, ref_logits) in zip(_window_logits(engine, ids, window, chunk), theirs):
            # row i predicts the token at pos + i + 1; keep the rows whose prediction this window scores
            skip = max(0, window.first_scored - 1 - pos)
            logp = F.log_softmax(logits[skip:], dim=-1)  # (T', V)
            y = targets[pos + skip + 1 : pos + len(logits) + 1].to(logp.device)  # (T',)
            nll.append(-logp.gather(1, y[:, None])[:, 0].cpu())
            if ref_logits is None:
                continue
            logp_ref = F.log_softmax(ref_logits[skip:].to(logp.device), dim=-1)  # (T', V)
            nll_ref.append(-logp_ref.gather(1, y[:, None])[:, 0].cpu())
            kl.append((logp_ref.exp() * (logp_ref - logp)).sum(-1).cpu())  # KL(P_ref || P) per position
            same_top1.append((logp_ref.argmax(-1) == logp.argmax(-1)).cpu())
        if on_window is not None:
            on_window(done, len(windows))
    seconds = time.perf_counter() - t0
    nll_all = torch.cat(nll).double()
    nll_ref_all = torch.cat(nll_ref).double() if nll_ref else None
    for e, scores in ((engine, nll_all), (reference, nll_ref_all)):
        if scores is not None and not bool(torch.isfinite(scores).all()):  # NaN logits make NaN scores
            raise not_finite(e.loaded.dtype)
    result = EvalResult(len(ids), len(nll_all), len(windows), nll_all.mean().item(), seconds)
    if reference is not None:
        kl_all = torch.cat(kl).double()
        result.kl = KLStats(
            mean=kl_all.mean().item(), max=kl_all.max().item(), p99=torch.quantile(kl_all, 0.99).item(),
            top1_agreement=torch.cat(same_top1).double().mean().item(),
            ppl_reference=perplexity(nll_ref_all.mean().item()),
        )
    return result
