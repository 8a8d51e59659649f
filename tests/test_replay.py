"""Replaying a pair's acceptance (llmrun.replay): a greedy trace makes another pair take the recorded pair's very
steps; the sampled trace's probability is the rejection rule's, given the emitted token; replayed sampling
accepts as often as the real pair does. Simulating it (no model) takes the steps a real pair takes, and weighs the
draft-length policy on a model draft: one early rejection does not turn a good draft off, a failing one costs
little. Prompt lookup replays from the reply alone: on other weights it takes the real run's steps, greedy or
sampled, and so does its simulation."""

import math

import pytest
import torch

from llmrun.errors import LlmrunError
from llmrun.generate import Engine
from llmrun.replay import (Reply, ReplayedLookup, StepCosts, Trace, record, record_reply, replay_lookups, replayer,
                           simulate, simulate_lookup)
from llmrun.sampling import Randomness, SamplingParams, token_probs
from llmrun.speculative import (DraftLength, ModelDrafter, NgramDrafter, Proposal, Speculator, make_speculator,
                                self_draft_layers, verify)

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _steps(engine, prompt, params, speculator, decide=None):
    """(target forwards, draft tokens, accepted) of one reply."""
    engine.reset()
    if hasattr(speculator.drafter, "engine"):
        speculator.drafter.engine.reset()
    engine.speculator = Speculator(speculator.drafter, DraftLength(speculator.length.max_k, adaptive=False), decide)
    try:
        reply = engine.generate(prompt, params)
        list(reply)
    finally:
        engine.speculator = None
    s = reply.stats
    return s.decode_steps, s.drafted, s.accepted


def test_a_greedy_trace_makes_another_pair_take_the_recorded_pairs_steps(smollm2, smollm2_dequant):
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompt = smollm2.tokenizer.encode(PROMPT)
    # the recorded pair: the fp32 model, drafted by its 4-bit copy (which mostly agrees)
    target = Engine(smollm2_dequant, max_len=256)
    real = make_speculator(target, draft="self", draft_tokens=4, adaptive=False)
    trace = record(target, real.drafter.engine, prompt, params)
    assert len(trace.accept) == 40 and set(trace.accept) == {0.0, 1.0}
    recorded = _steps(target, prompt, params, real)
    assert 0 < recorded[2] < recorded[1]  # some drafts rejected, some accepted: the pattern is worth replaying
    # another pair, whose own acceptance differs: the packed model drafted by itself with layers skipped
    other = Engine(smollm2, max_len=256)
    skip = make_speculator(other, draft="self:skip", draft_tokens=4, adaptive=False)
    assert _steps(other, prompt, params, skip) != recorded
    assert _steps(other, prompt, params, skip, trace.decide(0)) == recorded
    # and no replay on the recorded pair itself changes nothing
    assert _steps(target, prompt, params, real, trace.decide(3)) == recorded


def test_given_the_emitted_token_a_draft_token_was_accepted_with_min_p_q_over_p():
    """The sampled trace's probability: verification's accept/reject, counted by the token it emitted."""
    torch.manual_seed(0)
    vocab, trials = 6, 6000
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p, q = token_probs(torch.randn(vocab) * 1.5, params), token_probs(torch.randn(vocab) * 1.5, params)
    emitted, accepted = torch.zeros(vocab), torch.zeros(vocab)
    logits = torch.stack([p.log(), p.log()])  # (K + 1, V): the target's distribution at both rows
    draws = torch.Generator().manual_seed(1)
    for seed in range(trials):
        x = int(torch.multinomial(q, 1, generator=draws))
        n, token = verify(logits, Proposal([x], q[None]), params, Randomness(seed))
        y = x if n else token
        emitted[y] += 1
        accepted[y] += n
    expect = torch.minimum(p, q) / p
    for y in range(vocab):
        if emitted[y] < 50:
            continue
        rate, sd = accepted[y] / emitted[y], math.sqrt(float(expect[y] * (1 - expect[y]) / emitted[y]))
        assert abs(float(rate - expect[y])) <= 4.5 * sd + 1e-9, (y, float(rate), float(expect[y]))
    # the test can fail: accepted whatever the token, the figure would be sum(min(p, q)) everywhere
    assert float(expect.max() - expect.min()) > 0.3


def test_replayed_sampling_accepts_as_often_as_the_real_pair(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, 64)
    real = Speculator(ModelDrafter(Engine(draft, 64), "tiny"), DraftLength(3, adaptive=False))
    prompt, runs = [5, 17, 42, 9], 120

    def params(seed):
        return SamplingParams(temperature=2.5, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=16, ignore_eos=True,
                              seed=seed)

    traces = [record(engine, real.drafter.engine, prompt, params(seed)) for seed in range(runs)]
    replay = replayer(traces)
    own = [_steps(engine, prompt, params(seed), real) for seed in range(runs)]
    replayed = [_steps(engine, prompt, params(seed + runs), real, replay(seed)) for seed in range(runs)]
    rates = [sum(r[2] for r in rows) / sum(r[1] for r in rows) for rows in (own, replayed)]
    drafted = sum(r[1] for r in own)
    assert 0.2 < rates[0] < 0.8  # the draft is neither the target nor unrelated to it
    assert abs(rates[0] - rates[1]) < 4.5 * math.sqrt(2 * rates[0] * (1 - rates[0]) / drafted), rates


def test_a_trace_round_trips_and_refuses_what_it_cannot_replay():
    trace = Trace((1, 2, 3), (0.0, 1.0, 0.25), 0.8, 7)
    assert Trace.from_dict(trace.as_dict()) == trace
    decide = trace.decide(0)
    assert decide(4, False) is True and decide(3, True) is False  # positions 3, 4 hold reply tokens 0, 1
    with pytest.raises(LlmrunError, match="holds 3"):
        decide(6, True)
    with pytest.raises(LlmrunError, match=r"\[0, 1\]"):
        Trace.from_dict({**trace.as_dict(), "accept": [1.5]})
    with pytest.raises(LlmrunError, match="no trace"):
        replayer([])


# A code edit: the embedded model's replies copy from it, some lookups right and some wrong
LOOKUP_TEXT = ("def total(items):\n    s = 0\n    for item in items:\n        s += item.price * item.count\n"
               "    return s\n\nRewrite this function with `item.qty` in place of `item.count`.")


@pytest.mark.parametrize("temperature", [0, 0.9])
@pytest.mark.parametrize("pipeline", [False, True], ids=["", "pipelined"])
def test_a_replayed_lookup_takes_the_real_lookups_steps_on_other_weights(smollm2, temperature, pipeline):
    """Pipelined (a GPU's loop, forced here), steps without a lookup match run as plain ones fed from the device."""
    target = Engine(smollm2, 256)
    other = Engine(smollm2, 256, model=smollm2.model.with_layers(self_draft_layers(smollm2.model.config.n_layers)))
    target.pipeline = other.pipeline = pipeline
    prompt = target.tokenizer.encode_chat([{"role": "user", "content": LOOKUP_TEXT}])
    for k, seed in ((2, 0), (5, 1)):
        params = SamplingParams(temperature=temperature, max_new_tokens=40, ignore_eos=True, seed=seed)
        real = _steps(target, prompt, params, Speculator(NgramDrafter(3), DraftLength(k)))
        assert 0 < real[2] < real[1]  # drafts taken and drafts refused: a pattern worth replaying
        reply = record_reply(target, prompt, params)
        assert len(reply.tokens) == 40
        own = _steps(other, prompt, params, Speculator(NgramDrafter(3), DraftLength(k)))
        drafter = ReplayedLookup(3)
        replayed = _steps(other, prompt, params, Speculator(drafter, DraftLength(k)), drafter.follow(reply))
        assert replayed == real != own
        if not pipeline:  # the simulation's loop (a pipelined one asks the lookup about the context before)
            simulated = simulate_lookup(reply, StepCosts({1: 1.0}, {}), DraftLength(k, adaptive=False))
            assert (simulated.steps, simulated.drafted, simulated.accepted) == real


def test_a_reply_round_trips_and_refuses_what_it_cannot_replay():
    reply = Reply((1, 2, 3), (7, 8), 0.8, 4)
    assert Reply.from_dict(reply.as_dict()) == reply
    assert reply.context(4) == [1, 2, 3, 7] and reply.token(4) == 8
    with pytest.raises(LlmrunError, match="holds 2"):
        reply.context(6)
    with pytest.raises(LlmrunError, match="prompt token"):
        reply.token(2)
    drafter = ReplayedLookup(2)
    replay = replay_lookups(drafter, [reply, Reply((1, 2, 3), (9, 9), 0.8, 5)])
    assert replay(1) is not None and drafter.reply.tokens == (9, 9)  # no reply of seed 1: the second
    replay(4)
    assert drafter.reply is reply  # the reply drawn with that seed
    with pytest.raises(LlmrunError, match="no reply"):
        replay_lookups(drafter, [])
    with pytest.raises(LlmrunError, match="each model"):
        StepCosts.from_dict({"target": {"2": 1.0}})
    assert StepCosts.from_dict({"target": {"1": 1.0}}).draft == {}


# Step times measured on a 2-core CPU (bench/runs/2026-11-25-cpu2-replay-costs-gguf.json: Qwen2.5-Coder 1.5B
# verifying, 0.5B drafting), and a GPU's shape of them: memory-bound blocks nearly as cheap as one token.
CPU_COSTS = StepCosts({1: .022753, 2: .027656, 3: .031412, 5: .043296, 9: .073387},
                      {1: .00937, 2: .011173, 3: .014067, 5: .018199, 9: .034266})
GPU_COSTS = StepCosts({1: .010, 2: .0102, 3: .0104, 5: .0108, 9: .0116}, {1: .006, 2: .0061, 3: .0062, 5: .0064, 9: .0068})


def test_a_simulated_reply_takes_the_steps_a_real_pair_takes(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, 64)
    prompt = [5, 17, 42, 9]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    trace = Trace(tuple(prompt), (1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 1), 0.0, -1)
    for k in (1, 3, 5):
        real = Speculator(ModelDrafter(Engine(draft, 64), "tiny"), DraftLength(k))
        steps = simulate(trace, CPU_COSTS, DraftLength(k, adaptive=False))
        assert _steps(engine, prompt, params, real, trace.decide(0)) == (steps.steps, steps.drafted, steps.accepted)
        assert 0 < steps.accepted < steps.drafted


def test_a_simulated_clock_counts_what_each_step_costs():
    costs = StepCosts({1: 1.0, 2: 1.5, 9: 5.0}, {1: 0.25, 2: 0.3, 9: 1.0})
    assert costs.seconds("target", 4) == 2.5 and costs.seconds("draft", 11) == pytest.approx(1.2)  # line on
    r = simulate(Trace((1, 2), (1.0,) * 13, 0.0, -1), costs, DraftLength(3, adaptive=False))
    # 3 steps of K = 3, all accepted: each verifies 4 tokens (2.5); the draft runs 3 one-token steps the first
    # time, then catches up with the 2 tokens it has not seen (the last draft and the bonus token) and runs 2
    assert (r.steps, r.drafted, r.accepted) == (3, 9, 9)
    assert r.speculative_s == pytest.approx(3 * 2.5 + 3 * 0.25 + 2 * (0.3 + 2 * 0.25))
    assert r.plain_s == 12.0 and r.speedup == pytest.approx(12 / 9.85)
    with pytest.raises(LlmrunError, match="T = 1"):
        StepCosts.from_dict({"target": {"2": 1.0}, "draft": {"1": 1.0}})


def test_step_costs_reshaped_into_another_machines():
    costs = StepCosts({1: 1.0, 2: 1.5, 9: 5.0}, {1: 0.25, 2: 0.3, 9: 1.0})
    assert costs.reshaped() == costs
    flat = costs.reshaped(block_cost=0.1)
    assert flat.target == {1: 1.0, 2: 1.1, 9: pytest.approx(1.8)} and flat.draft == {1: 0.25, 2: 0.275, 9: 0.45}
    cheap = costs.reshaped(draft_ratio=0.1)
    assert cheap.target == costs.target and cheap.draft == {1: 0.1, 2: pytest.approx(0.12), 9: pytest.approx(0.4)}
    both = costs.reshaped(0.1, 0.5)
    assert both.draft[1] == 0.5 and both.draft[9] == pytest.approx(0.9)


@pytest.mark.parametrize("costs", [CPU_COSTS, GPU_COSTS], ids=["cpu-costs", "h100-like-costs"])
def test_one_early_rejection_does_not_turn_a_good_model_draft_off(costs):
    """HumanEval/2 on the Qwen pair: the first probe's draft misses the reply's fourth token, and every other one
    agrees. On one step's evidence (1 of 4 accepted) the draft looks unprofitable; it must keep drafting."""
    trace = Trace(tuple(range(100)), tuple(0.0 if i == 3 else 1.0 for i in range(128)), 0.0, -1)
    r = simulate(trace, costs, DraftLength(8, draft_cost=costs.draft[1] / costs.target[1]))
    assert r.drafted > 90 and r.speedup > 1.25, r


@pytest.mark.parametrize("costs", [CPU_COSTS, GPU_COSTS], ids=["cpu-costs", "h100-like-costs"])
@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.5])
def test_a_failing_model_draft_is_turned_off_at_little_cost(costs, acceptance):
    import random

    for seed in range(4):
        draws = random.Random(seed)
        trace = Trace(tuple(range(100)), tuple(float(draws.random() < acceptance) for _ in range(128)), 0.0, -1)
        r = simulate(trace, costs, DraftLength(8, draft_cost=costs.draft[1] / costs.target[1]))
        assert r.drafted < 16 and r.speedup > 0.97, r


@pytest.fixture
def script(bench_script):
    """bench/replay.py, imported as when run (its `import speculative` finds bench/speculative.py)."""
    return bench_script("replay")


def test_the_replay_script_measures_a_trace_on_random_weights(script, tmp_path, capsys):
    import json

    prompt = list(range(300, 310))
    traces = [{"prompt_label": "p", **Trace(tuple(prompt), (1.0,) * 12, 0.0, -1).as_dict()},
              {"prompt_label": "p", **Trace(tuple(prompt), (0.0,) * 12, 0.8, 0).as_dict()}]
    doc = {"date": "2026-01-01", "target": {"file": "t.gguf", "shape": "smollm2-360m"},
           "draft": {"file": "d.gguf", "shape": "smollm2-135m"}, "traces": traces}
    path, out = tmp_path / "trace.json", tmp_path / "m.json"
    traces.append({"prompt_label": "q", **Trace((1, 2, 3), (1.0,) * 12, 0.0, -1).as_dict()})  # left out: --prompts 1
    path.write_text(json.dumps(doc))
    assert script.main(["measure", "--trace", str(path), "--repeat", "1", "--threads", "1", "--prompts", "1",
                        "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["replayed_on"] == {"target": "random:smollm2-360m", "draft": "random:smollm2-135m"}
    assert run["settings"]["weights"] == "int4" and run["environment"]["device_name"]
    greedy, sampled = run["results"]  # prompt p only
    assert greedy["temperature"] == 0 and greedy["trace_acceptance"] == 1.0
    assert greedy["figures"]["acceptance_rate"] == 1.0  # every draft token accepted, as the trace says
    assert greedy["workload"]["prompt_tokens"] == 10 and greedy["workload"]["new_tokens"] == 12
    assert sampled["figures"]["speculative"]["accepted_tokens"] == 0  # none, as the trace says
    assert set(run["step_seconds"]) == {"target", "draft"} and set(run["step_seconds"]["draft"]) == {"1", "2", "3", "5", "9"}
    assert all(v > 0 for c in run["step_seconds"].values() for v in c.values())
    table = out.with_suffix(".md").read_text()
    assert "One forward of T tokens, in one-token target steps" in table and "T=9" in table
    assert "| p | 0 |" in table and "(100%)" in table and table in capsys.readouterr().out
    # the policy on the same traces, on a clock of the step times just measured
    assert script.main(["simulate", "--costs", str(out), "--trace", str(path), "--seeds", "2"]) == 0
    printed = capsys.readouterr().out
    import re

    speedup = {row: float(x) for row, x in re.findall(r"^\| (\w \| [\d.]+) \| \*\*([\d.]+)x\*\*", printed, re.M)}
    assert set(speedup) == {"p | 0", "p | 0.8", "q | 0"}
    assert speedup["p | 0"] > speedup["p | 0.8"]  # every draft accepted against none
    assert "| p | 0.8 | **" in printed and "| 0% |" in printed
    # another machine's costs: verification nearly free, the draft a given share of a target step
    ratios = {}
    for ratio in (0.9, 0.2):
        assert script.main(["simulate", "--costs", str(out), "--trace", str(path), "--block-cost", "0.02",
                            "--draft-ratio", str(ratio)]) == 0
        printed = capsys.readouterr().out
        assert f"reshaped (--block-cost 0.02, --draft-ratio {ratio:g})" in printed
        ratios[ratio] = float(re.search(r"^\| p \| 0 \| \*\*([\d.]+)x", printed, re.M).group(1))
    # all 12 tokens accepted: a draft at 0.9 of a target step barely pays, one at 0.2 more than doubles the speed
    assert ratios[0.9] < 1.3 and ratios[0.2] > 2.0
    with pytest.raises(SystemExit, match="holds no step times"):
        script.main(["simulate", "--costs", str(path), "--trace", str(path)])
    # a file that holds no traces: one line
    for bad in ({}, {**doc, "traces": []}, {**doc, "target": {}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match="no trace file"):
            script.main(["measure", "--trace", str(path)])


def test_the_replay_script_replays_a_lookups_replies_on_random_weights(script, tmp_path, capsys):
    import json

    prompt = list(range(300, 310)) * 2
    copied = Reply(tuple(prompt), tuple(range(300, 310)) + (300, 301), 0.0, -1)  # every lookup right
    new = Reply(tuple(prompt), tuple(range(500, 512)), 0.8, 0)  # nothing to look up
    doc = {"date": "2026-01-01", "target": {"file": "t.gguf", "shape": "smollm2-135m"}, "draft": {"ngram": 3},
           "traces": [{"prompt_label": "p", **copied.as_dict()}, {"prompt_label": "p", **new.as_dict()}]}
    path, out = tmp_path / "replies.json", tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    assert script.main(["measure", "--trace", str(path), "--repeat", "1", "--threads", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["replayed_on"] == {"target": "random:smollm2-135m", "draft": "ngram 3"}
    assert set(run["step_seconds"]) == {"target"}
    greedy, sampled = run["results"]
    assert greedy["figures"]["acceptance_rate"] == 1.0 and greedy["figures"]["tokens_per_step"] > 2
    assert greedy["figures"]["speculative"]["drafter"] == "ngram 3"
    assert sampled["figures"]["speculative"]["drafted_tokens"] == 0  # no match: plain steps
    table = out.with_suffix(".md").read_text()
    assert "prompt lookup (--ngram 3)" in table and "draft's one-token step" not in table
    capsys.readouterr()
    assert script.main(["simulate", "--costs", str(out), "--trace", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "prompt lookup (--ngram 3) drafting" in printed and "| p | 0 | **" in printed and "| 100% |" in printed
    # a pair's traces need the draft's step times, which a lookup's run has not
    with pytest.raises(SystemExit, match="no draft model's step times"):
        script.main(["simulate", "--costs", str(out)])
    # a run stopped midway (a lease's time limit) keeps the rows it measured, marked partial; a whole one is not
    assert "partial" not in run
    measured = script.measure_speculative
    calls = []

    def stopped(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise LlmrunError("stopped")
        return measured(*args, **kwargs)

    script.measure_speculative = stopped
    try:
        assert script.main(["measure", "--trace", str(path), "--repeat", "1", "--threads", "1", "--out", str(out)]) == 1
    finally:
        script.measure_speculative = measured
    cut = json.loads(out.read_text())
    assert cut["partial"] is True and [r["temperature"] for r in cut["results"]] == [0]


def test_the_replay_script_records_only_with_the_models_at_hand(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["measure", "--real"])
    assert "--real needs the real model files" in capsys.readouterr().err
    for lookup in ([], ["--lookup", "3"]):
        with pytest.raises(SystemExit, match="bench/fetch_models.py"):
            script.main(["record", "--models", str(tmp_path), "--out", str(tmp_path / "t.json"), *lookup])
    assert not (tmp_path / "t.json").exists()
