"""The thread governor (`llmrun.threads`) on a simulated machine: forwards whose time follows the thread count and
whether another process holds the cores, on a clock of their own; and a reply whose thread count changes every
forward, which must not change a bit of it."""

import pytest
import torch

from llmrun import threads


class Machine:
    """Forwards of `kinds` (model, tokens) taking `cost(threads, kind)` seconds, in turn, on a simulated clock."""

    def __init__(self, cost, most=2):
        self.cost, self.now, self.threads = cost, 0.0, most
        self.gov = threads.Governor(lambda: self.threads, self.set, clock=lambda: self.now)
        self.counts = []  # the thread count of each forward

    def set(self, n):
        self.threads = n

    def run(self, n, kind=("m", 1)):
        for _ in range(n):
            self.gov.start(*kind)
            self.counts.append(self.threads)
            self.now += self.cost(self.threads, kind)
            self.gov.stop()


def free(n, kind):  # two free cores: 2 threads 3 ms a token, 1 thread 5 ms
    return (3e-3 if n == 2 else 5e-3) * kind[1] ** 0.5


def busy(n, kind):  # another process on a core: 2 threads wait at every barrier
    return (0.1 if n == 2 else 6e-3) * kind[1] ** 0.5


def test_free_cores_keep_every_thread():
    m = Machine(free)
    m.run(3000)  # ~9 s: tries of one thread, ever rarer, all lost
    assert m.threads == 2 and m.gov.changes == 0
    assert m.counts.count(1) <= 0.01 * len(m.counts)


def test_a_busy_machine_drops_to_one_thread_and_comes_back():
    m = Machine(busy)
    m.run(20)
    assert m.threads == 1 and m.counts[-10:] == [1] * 10  # within the first few forwards
    m.run(2000)  # ~12 s of busy cores: tries of two threads cost one slow forward each, ever rarer
    assert m.counts[20:].count(2) <= 8
    m.cost = free
    m.run(3000)  # the other process ended: back to two threads within LONGEST_S
    assert m.threads == 2 and m.counts[-2000:].count(1) <= 20


def test_tries_that_cost_seconds_come_rarely():
    """On a busy CPU a forward of two threads can take seconds: tries of them take at most TRY_SHARE of the time."""
    m = Machine(lambda n, kind: 2.0 if n == 2 else 6e-3)
    m.run(30000)  # 180 s at one thread
    tried = m.counts.count(2)
    assert m.threads == 1 and tried * 2.0 <= 1.5 * threads.TRY_SHARE * m.now


def test_sudden_contention_is_tried_at_once():
    m = Machine(free)
    m.run(400)
    m.cost = busy
    m.run(8)
    assert m.threads == 1


def test_the_ceiling_is_what_anyone_else_set():
    def cost(n, kind):  # four threads contend, two do not
        return {4: 0.05, 2: 3e-3, 1: 5e-3}[n]

    m = Machine(cost, most=4)
    m.run(100)
    assert m.threads == 2 and m.gov.most == 4
    m.threads = 1  # --threads 1, or a benchmark's setting: the new ceiling, never exceeded
    m.run(200)
    assert m.gov.most == 1 and set(m.counts[-200:]) == {1}


def test_a_slow_prompt_chunk_then_decoding():
    """A prompt's slow chunks, then decoding: decoding's slow forwards start a try at once and judge it (no chunk of
    their kind follows); on free cores a long chunk changes nothing."""
    m = Machine(lambda n, kind: 1.0 if kind[1] == 4 and n == 2 else busy(n, kind))
    m.run(4, ("m", 4))  # a prompt's chunks (no try: the window of latest forwards is not full)
    m.run(30)  # decoding: slow enough to try at once, and judged on decoding (the chunks stopped coming)
    assert m.threads == 1 and m.counts[-10:] == [1] * 10
    m = Machine(free)
    m.cost = lambda n, kind: 0.6 if kind[1] == 512 else free(n, kind)  # a long chunk on free cores
    m.run(1, ("m", 512))
    m.run(40)
    assert m.threads == 2


def test_a_busy_benchmark_run():
    """A prompt chunk, then decoding (as `llmrun bench` runs): one chunk starts no try (nothing of its kind may
    follow); decoding's first forwards do, and it wins."""
    m = Machine(busy)
    m.run(1, ("m", 134))  # ~1.2 s a chunk at 2 threads: 8.6 ms a token, where decoding at 1 takes 6 ms a token
    m.run(10)
    assert m.threads == 1 and m.counts[-5:] == [1] * 5 and m.gov.interval == threads.CHECK_S


def test_a_count_set_during_a_try_is_the_new_ceiling():
    """--threads or a benchmark's setting in the middle of a try: kept, not overwritten by the try's loss."""
    m = Machine(free)
    m.run(4 * threads.TRIES)
    assert m.gov.trial is not None and m.threads == 1  # the first try: one thread
    m.threads = 2  # set by someone else (here the count the try left)
    m.run(1)
    m.gov.ceiling(1)  # set_threads(1): the ceiling even where the count already is 1
    m.run(300)
    assert m.gov.most == 1 and set(m.counts[-300:]) == {1}


def test_speculation_is_judged_on_the_draft_and_the_target_together():
    """A draft model's one-token forwards a little faster on one thread, its target's 5-token blocks twice as slow:
    the try is judged on both, weighted by their forwards' time, and the target keeps two threads."""
    def cost(n, kind):
        return {("draft", 1): {1: 1.7e-3, 2: 2.0e-3}, ("target", 5): {1: 38e-3, 2: 20e-3}}[kind][n]

    m = Machine(cost)
    for _ in range(300):  # ~8 s: steps of 4 draft tokens and a verification block
        m.run(4, ("draft", 1))
        m.run(1, ("target", 5))
    targets = m.counts[4::5]
    assert m.threads == 2 and targets.count(1) <= 0.05 * len(targets)


def test_a_long_chunk_in_a_try_is_not_held_against_shorter_forwards():
    """A try started by decoding that sees only prompt chunks (cheaper a token than decoding): no verdict, the count
    before restored."""
    m = Machine(free)
    m.run(4 * threads.TRIES)
    assert m.gov.trial is not None
    m.run(20, ("m", 512))
    m.run(20)
    assert m.threads == 2 and m.gov.changes == 0


def test_a_forward_that_raises_ends_the_try():
    m = Machine(free)
    m.run(4 * threads.TRIES)
    assert m.gov.trial is not None and m.threads == 1
    m.gov.start("m", 1)
    m.gov.abort()  # Ctrl-C inside the forward
    assert m.gov.trial is None and m.threads == 2


def test_thread_counts_change_no_result(smollm2, monkeypatch):
    """Greedy decoding with the thread count changed before every forward (1, 2, 1, ...) gives the fixed count's
    logits bit for bit: every output of the CPU kernels is one thread's."""
    from llmrun.generate import Engine
    from llmrun.sampling import SamplingParams

    before = torch.get_num_threads()

    def reply():
        engine = Engine(smollm2, 256)
        gen = engine.generate(smollm2.tokenizer.encode("The history of Rome"), SamplingParams(temperature=0,
                                                                                              max_new_tokens=24))
        text = "".join(gen)
        return text, engine.forward(engine.tokens[-1:])

    class Flipping:
        def __init__(self):
            self.calls = 0

        def start(self, model, tokens):
            self.calls += 1
            torch.set_num_threads(1 + self.calls % 2)

        def stop(self):
            pass

        def abort(self):
            pass

    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "_governor", False)
        fixed = reply()
        flipping = Flipping()
        monkeypatch.setattr(threads, "_governor", flipping)
        flipped = reply()
    finally:
        torch.set_num_threads(before)
    assert flipping.calls > 20
    assert flipped[0] == fixed[0] and torch.equal(flipped[1], fixed[1])


def test_llmrun_adapt_threads_0_turns_it_off(monkeypatch):
    monkeypatch.setattr(threads, "_governor", None)
    monkeypatch.setenv("LLMRUN_ADAPT_THREADS", "0")
    assert threads.governor() is None
    monkeypatch.setattr(threads, "_governor", None)
    monkeypatch.delenv("LLMRUN_ADAPT_THREADS")
    assert isinstance(threads.governor(), threads.Governor)
