"""CPU threads on a machine other processes keep busy.

The CPU kernels and PyTorch's ops share one OpenMP pool, and each parallel region ends at a barrier that waits for
all of its threads. Where another busy process holds one of the cores, a thread of ours loses its core for a
scheduler time slice (milliseconds) at a time, and every region waits for it: a decode step has a few hundred
regions. On the 2-core development VM, beside another process running PyTorch matmuls on both cores, the embedded
model decoded 60 tokens in over 100 s with 2 threads, and at 132 tok/s with 1 (OpenMP's passive wait policy avoids
the collapse but makes free cores 5x slower: 60 against 300 tok/s).

So a `Governor` times the forwards themselves and tries another thread count now and then: every CHECK_S seconds
(while tries fail, up to LONGEST_S apart, or more where they cost more than TRY_SHARE of the time), or at once
when a forward takes SLOWER times the recent ones, it runs forwards with half the threads (or, below the ceiling,
twice as many) and keeps the count under which they took a tenth less than the same kinds of forward (a model and
a number of tokens) did before. A try's forward SLOWER
times the recent ones ends it at once; forwards that together take CHECK_S are enough to judge by, however few.
The ceiling is `--threads` (`set_threads`), else PyTorch's count as anyone else set it. Engines on the C kernels
(packed weights) use it, where a thread count changes no result: each output of a CPU kernel is computed by one
thread, whatever their number (PyTorch's float matmuls round otherwise with another count). LLMRUN_ADAPT_THREADS=0
turns the governor off.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable

CHECK_S = 0.5  # the shortest time between two tries of another thread count
LONGEST_S = 8.0  # the longest, reached while tries keep failing
SLOWER = 3.0  # a forward this many times its kind's recent median tries fewer threads at once
TRIES = 4  # forwards of a kind before a try (and of the kinds it compares, in all, before it is judged)
BETTER = 0.9  # a try wins when its forwards take at most this share of what they took at the count before
RECENT = 8  # forwards of each kind remembered at the current count
TRY_SHARE = 0.05  # the most of the time lost tries may take: a try that took 2 s waits 40 s for the next


class Governor:
    """The thread count of the process's pool, between 1 and the ceiling (`ceiling(n)`, or the count anyone else
    set), chosen by the time forwards take. `start(model, tokens)` before a forward, `stop()` after it (`abort()`
    for one that raised); forwards of one kind (a model and a number of tokens) compare with each other. A try is
    judged on every kind it saw that has recent forwards, weighted by their count (a draft model's forwards and its
    target's blocks together), or, where none has, a token against the same model's kinds as long or longer.
    `get`/`set`: the pool's thread count."""

    def __init__(self, get: Callable[[], int], set: Callable[[int], None],
                 clock: Callable[[], float] = time.perf_counter):
        self.get, self.set, self.clock = get, set, clock
        self.most = self.current = None  # the ceiling, and the count this governor set
        self.recent: dict[Hashable, deque] = {}  # kind -> the latest forwards' seconds at the current count
        self.trial = None  # while trying another count (`stop`)
        self.interval = CHECK_S
        self.due = 0.0  # the first try as soon as a kind's forwards are known
        self.changes = 0  # how many times a try changed the count
        self.latest = deque(maxlen=4 * TRIES)  # the kinds of the latest forwards outside tries
        self._kind, self._t0 = None, 0.0

    def ceiling(self, n: int) -> None:
        """Use n threads from now on, and never more: what is known of the forwards starts over."""
        self.set(n)
        self.most = self.current = n
        self.recent, self.trial, self.interval, self.due = {}, None, CHECK_S, 0.0
        self.latest.clear()

    def start(self, model: Hashable, tokens: int) -> None:
        n = self.get()
        if n != self.current:  # set by someone else since (or at first): the new ceiling, a try dropped
            self.ceiling(n)
        self._kind, self._t0 = (model, tokens), self.clock()

    def abort(self) -> None:
        """The forward started last raised: a try it was part of ends, the count before restored."""
        if self.trial is not None:
            self._decide(self.clock(), won=False, judged=False)

    def stop(self) -> None:
        now = self.clock()
        took, kind = now - self._t0, self._kind
        if self.trial is not None:
            self._try(now, kind, took)
            return
        times = self.recent.setdefault(kind, deque(maxlen=RECENT))
        sudden = len(times) >= TRIES and took > SLOWER * statistics.median(times) and self.current > 1
        times.append(took)
        self.latest.append(kind)
        # a try waits for TRIES forwards of a kind and a full window of latest forwards (to know which kinds recur),
        # or for one-token forwards that together took CHECK_S (slow enough to be worth no more waiting); a
        # prompt's one long chunk starts none: nothing of its kind may follow
        slow = kind[1] == 1 and sum(times) >= CHECK_S
        if not (len(times) >= TRIES and len(self.latest) == self.latest.maxlen or slow):
            return
        if not (sudden or now >= self.due):
            return
        if sudden or self.current == self.most:
            candidate = max(1, self.current // 2)
        else:
            candidate = min(self.most, 2 * self.current)
        if candidate == self.current:  # one thread is all there is
            self.due = now + LONGEST_S
            return
        # the count before, each kind's times at the new one, forwards seen, and the kinds it must see to be judged:
        # those that came more than once among the latest forwards (a draft's tokens and its target's blocks)
        recurring = {k for k in self.latest if self.latest.count(k) > 1}
        self.trial = (self.current, {}, [0], recurring)
        self._use(candidate)

    def _try(self, now: float, kind: Hashable, took: float) -> None:
        """A forward during a try: judged once the kinds it saw with recent forwards add up to TRIES forwards (or
        CHECK_S), on what those forwards took against their kinds' recent means."""
        _, tried, seen, recurring = self.trial
        tried.setdefault(kind, []).append(took)
        seen[0] += 1
        base = self.recent.get(kind)
        if base and took > SLOWER * statistics.median(base):  # one forward says enough
            return self._decide(now, won=False)
        compared = {k: t for k, t in tried.items() if self.recent.get(k)}
        # judged once it saw each kind that recurred before it (or 2 * TRIES forwards: a kind may have stopped)
        if compared and (recurring <= set(tried) or seen[0] >= 2 * TRIES) \
                and _known([x for t in compared.values() for x in t]):
            # means, not medians: a busy machine's cost is its forwards' long tail
            before = sum(statistics.fmean(self.recent[k]) * len(t) for k, t in compared.items())
            return self._decide(now, won=sum(map(sum, compared.values())) <= BETTER * before)
        times = tried[kind]
        others = [statistics.fmean(b) / k[1] for k, b in self.recent.items()
                  if k[0] == kind[0] and k[1] >= kind[1] and b]
        if not base and _known(times) and others:
            # none of its kind before (a prompt's chunks, then decoding): held against the same model's kinds as
            # long or longer a token, where a longer forward takes less, so only a try far better wins (and a loss
            # here says little: tried again once a kind of its own is known)
            won = SLOWER * statistics.fmean(times) / kind[1] <= min(others)
            self._decide(now, won=won, judged=won)
        elif seen[0] >= 4 * TRIES:  # nothing to compare came
            self._decide(now, won=False, judged=False)

    def _decide(self, now: float, won: bool, judged: bool = True) -> None:
        before, tried = self.trial[:2]
        self.trial = None
        if won:
            self.recent = {kind: deque(times, maxlen=RECENT) for kind, times in tried.items()}
            self.interval = CHECK_S
            self.changes += 1
        else:
            self._use(before)
            if judged:  # lost: tried less often, and never more than a share of the time (on a busy CPU one
                # forward of a try can take seconds)
                spent = sum(map(sum, tried.values()))
                self.interval = max(min(2 * self.interval, LONGEST_S), spent / TRY_SHARE)
        self.due = now + self.interval if judged else now

    def _use(self, n: int) -> None:
        self.set(n)
        self.current = n


def _known(times) -> bool:
    """Enough forwards to judge by: TRIES, or fewer that together took CHECK_S (no more waiting)."""
    return len(times) >= TRIES or sum(times) >= CHECK_S


_governor: Governor | bool | None = None  # False: none (turned off)


def governor() -> Governor | None:
    """The process's governor (made at the first call), or None where LLMRUN_ADAPT_THREADS=0."""
    global _governor
    if _governor is None:
        import torch

        off = os.environ.get("LLMRUN_ADAPT_THREADS", "1") == "0"
        _governor = False if off else Governor(torch.get_num_threads, torch.set_num_threads)
    return _governor or None


def most() -> int:
    """The most threads forwards may use: the governor's ceiling, or PyTorch's count where it is off."""
    g = governor()
    if g is None or g.most is None:
        import torch

        return torch.get_num_threads()
    return g.most


def set_threads(n: int) -> None:
    """torch.set_num_threads(n), and the governor's ceiling: `--threads`, a benchmark's setting."""
    g = governor()
    if g is None:
        import torch

        torch.set_num_threads(n)
    else:
        g.ceiling(n)


def reduced() -> tuple[int, int] | None:
    """(threads in use, the ceiling) while the governor keeps fewer threads than it may, else None."""
    g = _governor
    if not g or g.current is None or g.trial is not None or g.current >= g.most:
        return None
    return g.current, g.most
