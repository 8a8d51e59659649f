"""Speculative decoding: greedy output identical to plain decoding, sampled output distributed as the target's,
rollback leaving the caches as if the rejected tokens never came, and the drafters' and K-policy's logic."""

import pytest
import torch

from llmrun.errors import LlmrunError, UsageError
from llmrun.generate import Engine
from llmrun.kernels import ref
from llmrun.sampling import Randomness, SamplingParams, token_probs, uniforms
from llmrun.speculative import (
    DraftLength, ModelDrafter, NgramDrafter, Proposal, Speculator, _verify_rows, check_same_vocabulary, make_speculator,
    verify,
)

from .conftest import run_main

PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple,",
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",  # ends on the end-of-turn token
]


class OracleDrafter:
    """Proposes a known continuation (the plain greedy reply), with every `wrong`-th token changed: blocks that
    are accepted whole, cut at a rejection, or cross the end of the reply (the end token, a stop string)."""

    name = "oracle"

    def __init__(self, prompt, reply, wrong=0):
        self.full = list(prompt) + list(reply)
        self.wrong = wrong

    def start(self, context):
        pass

    def would_propose(self, context):
        return len(context) < len(self.full)

    def propose(self, context, k, params, generator, constraint=None):
        at = len(context)
        tokens = self.full[at : at + k]
        if self.wrong:
            tokens = [t ^ 1 if (at + i) % self.wrong == 0 else t for i, t in enumerate(tokens)]  # in the vocabulary
        return Proposal(tokens)


def _generate(engine, prompt, params, speculator=None):
    engine.reset()
    engine.speculator = speculator
    reply = engine.generate(prompt, params)
    text = "".join(reply)
    return reply, text


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, max_len=512)


def _assert_cache_matches_a_fresh_prefill(engine):
    """The valid part of the cache holds exactly what prefilling `engine.tokens` from scratch gives."""
    fresh = engine.sibling(model=engine.model)
    fresh.prefill(engine.tokens + [0])  # the extra token makes the prefill cover every token of the list
    n = len(engine.tokens)
    assert engine.cache.length == n
    for layer in range(engine.model.config.n_layers):
        (k, v), (k_fresh, v_fresh) = engine.cache.contents(layer), fresh.cache.contents(layer)
        assert torch.equal(k, k_fresh[:, :, :n]) and torch.equal(v, v_fresh[:, :, :n])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_emits_exactly_the_plain_greedy_tokens(engine, smollm2, prompt):
    tok = smollm2.tokenizer
    ids = tok.encode(prompt, special=True)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain, plain_text = _generate(engine, ids, params)
    full_reply = plain.token_ids + [2]  # the oracle also proposes the end token after the reply
    drafters = [
        (OracleDrafter(ids, full_reply), DraftLength(6, adaptive=False)),
        (OracleDrafter(ids, full_reply, wrong=3), DraftLength(4, adaptive=False)),
        (OracleDrafter(ids, full_reply, wrong=7), DraftLength(8, adaptive=True)),
        (NgramDrafter(3), DraftLength(5, adaptive=False)),
        (NgramDrafter(2), DraftLength(8, adaptive=True)),
    ]
    for drafter, length in drafters:
        spec, spec_text = _generate(engine, ids, params, Speculator(drafter, length))
        assert spec.token_ids == plain.token_ids, (drafter.name, length.max_k)
        assert spec_text == plain_text and spec.stats.finish_reason == plain.stats.finish_reason
        _assert_cache_matches_a_fresh_prefill(engine)
    engine.speculator = None


def test_greedy_identity_holds_across_stop_strings_and_the_token_budget(engine, smollm2):
    ids = smollm2.tokenizer.encode(PROMPTS[1])
    free, free_text = _generate(engine, ids, SamplingParams(temperature=0, max_new_tokens=30))
    # a stop string that first occurs in the middle of the reply
    at = next(i for i in range(len(free_text) // 2, len(free_text)) if free_text.find(free_text[i : i + 4]) == i)
    stop = free_text[at : at + 4]
    for params in (SamplingParams(temperature=0, max_new_tokens=30, stop=(stop,)),
                   SamplingParams(temperature=0, max_new_tokens=7),
                   SamplingParams(temperature=0, max_new_tokens=30, repetition_penalty=1.3)):
        plain, plain_text = _generate(engine, ids, params)
        # what the target says past the end of the reply too, so drafted blocks run across the stop
        unlimited, _ = _generate(engine, ids, SamplingParams(**{**params.__dict__, "stop": (), "max_new_tokens": 40}))
        oracle = OracleDrafter(ids, unlimited.token_ids)
        spec, spec_text = _generate(engine, ids, params, Speculator(oracle, DraftLength(8, adaptive=False)))
        assert (spec.token_ids, spec_text, spec.stats.finish_reason) == (plain.token_ids, plain_text, plain.stats.finish_reason)
        assert spec.stats.decode_steps <= max(1, len(plain.token_ids) // 3)  # whole blocks were accepted
        # the figures count only what the reply used, not the accepted tokens past a stop inside the last block
        s = spec.stats
        # (a step gives its accepted drafts and the target's token; a last step cut short, only drafts)
        assert s.decode_tokens == plain.stats.decode_tokens
        assert s.context_used == plain.stats.context_used  # the cache holds what plain decoding's would
        assert s.decode_tokens - s.decode_steps <= s.accepted <= s.decode_tokens - s.decode_steps + 1 <= s.drafted + 1
    engine.speculator = None


def _contents(engine):
    return [engine.cache.contents(layer) for layer in range(engine.model.config.n_layers)]


@pytest.mark.parametrize("arch", ["llama", "llama3.1", "qwen2"])
def test_greedy_speculation_over_an_int4_cache_is_plain_greedy(tmp_path, arch):
    """With `--kv int4` each row of a verification block reads the key groups that were full when one-token decoding
    reached its position as codes and the rest exact, so speculation emits plain greedy's tokens and leaves its
    cache bit for bit. 100 new tokens (three key groups fill) after prompts of 10 and 21 tokens, in blocks of up to 33
    (accepted whole, cut at a rejection) from an oracle, a lookup and a draft model. The targets' linear layers
    are 4-bit blocks: their C kernel rounds each row alike however many rows a forward has (fp32 nn.Linear
    need not, and a last-bit difference can move a 4-bit key code)."""
    import dataclasses

    from llmrun.loading import load_model

    from .tiny import CONFIGS, random_model, write_hf_dir

    cfg = CONFIGS[arch]
    loaded = load_model(str(write_hf_dir(tmp_path / "target", random_model(cfg))), "cpu", "fp32")
    small = random_model(dataclasses.replace(cfg, n_layers=1), seed=7)
    draft = load_model(str(write_hf_dir(tmp_path / "draft", small)), "cpu", "fp32")
    engine = Engine(loaded, 256, model=loaded.model.with_int4_weights(), kv_format="int4")
    params = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    for seed, n in enumerate((10, 21)):
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = _generate(engine, ids, params)
        plain_cache = _contents(engine)
        drafters = [
            (OracleDrafter(ids, plain.token_ids), DraftLength(8, adaptive=False)),
            (OracleDrafter(ids, plain.token_ids, wrong=5), DraftLength(16, adaptive=False)),
            (OracleDrafter(ids, plain.token_ids, wrong=13), DraftLength(32, adaptive=False)),
            (NgramDrafter(2), DraftLength(6, adaptive=False)),
            (ModelDrafter(engine.sibling(draft), "tiny"), DraftLength(4, adaptive=False)),
        ]
        for drafter, length in drafters:
            spec, _ = _generate(engine, ids, params, Speculator(drafter, length))
            assert spec.token_ids == plain.token_ids, (drafter.name, length.max_k, seed)
            m = min(len(engine.tokens), len(ids) + len(plain.token_ids) - 1)
            for (k, v), (k_plain, v_plain) in zip(_contents(engine), plain_cache):
                assert torch.equal(k[:, :, :m], k_plain[:, :, :m]) and torch.equal(v[:, :, :m], v_plain[:, :, :m])
    engine.speculator = None


def test_self_drafts_are_lossless_and_report_their_figures(engine, smollm2):
    ids = smollm2.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_new_tokens=24)
    plain, _ = _generate(engine, ids, params)
    for draft in ("self", "self:skip"):
        spec = make_speculator(engine, draft=draft, draft_tokens=4, adaptive=False)
        reply, _ = _generate(engine, ids, params, spec)
        assert reply.token_ids == plain.token_ids, draft
        stats = reply.stats
        assert stats.drafted > 0 and 0 <= stats.acceptance_rate <= 1 and 0 <= stats.draft_k <= 4
        assert stats.tokens_per_step == pytest.approx(1 + stats.accepted / stats.decode_steps)
        draft_engine = spec.drafter.engine
        assert draft_engine.tokens == engine.tokens[: len(draft_engine.tokens)]  # it follows the verified text
    engine.speculator = None


def test_greedy_identity_on_the_plain_pytorch_path(smollm2_dequant):
    """fp32 matmuls of 1 and of K+1 rows need not round alike; at this model's margins the tokens agree."""
    engine = Engine(smollm2_dequant, max_len=256)
    for prompt in PROMPTS[:3]:
        ids = smollm2_dequant.tokenizer.encode(prompt, special=True)
        params = SamplingParams(temperature=0, max_new_tokens=32)
        plain, _ = _generate(engine, ids, params)
        spec, _ = _generate(engine, ids, params, make_speculator(engine, draft="self", draft_tokens=4, adaptive=False))
        assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0


@pytest.mark.gpu
@pytest.mark.embedded
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_speculation_on_a_gpu_emits_the_plain_greedy_tokens(dtype, monkeypatch):
    """On a GPU the embedded model's greedy reply is the same with every drafter: a one-token step and each
    verification length run as graphs of their own, and the Triton kernels give a row the same bits in a block
    of any length (their autotune keys leave the row count out). bf16 with LLMRUN_GEMV_DOT=0 and LLMRUN_GEMV_FLOAT=1:
    by default a bf16 block of 3 or more tokens runs its 4-bit matmuls on the tensor cores and its float ones on
    cuBLAS, whose rows round otherwise than a step's."""
    from llmrun.loading import load_model

    if dtype == "bf16":
        monkeypatch.setenv("LLMRUN_GEMV_DOT", "0")
        monkeypatch.setenv("LLMRUN_GEMV_FLOAT", "1")

    engine = Engine(load_model("smollm2", "cuda", dtype, "auto"), max_len=512)
    assert engine.graphs is not None
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt, special=True)
        params = SamplingParams(temperature=0, max_new_tokens=40)
        plain, _ = _generate(engine, ids, params)
        speculators = [
            Speculator(NgramDrafter(3), DraftLength(5, adaptive=False)),
            Speculator(OracleDrafter(ids, plain.token_ids + [2], wrong=3), DraftLength(8, adaptive=False)),
            Speculator(OracleDrafter(ids, plain.token_ids + [2]), DraftLength(15, adaptive=False)),
            make_speculator(engine, draft="self", draft_tokens=4, adaptive=False),
            make_speculator(engine, draft="self:skip", draft_tokens=6, adaptive=True),
        ]
        for speculator in speculators:
            spec, _ = _generate(engine, ids, params, speculator)
            assert spec.token_ids == plain.token_ids, (prompt, speculator.drafter.name)
    engine.speculator = None


def test_the_int4_self_draft_shares_norms_and_agrees_with_the_target(smollm2_dequant):
    from llmrun.models.quant import QuantLinear

    model = smollm2_dequant.model
    draft = model.with_int4_weights()
    assert isinstance(draft.layers[3].mlp.down, QuantLinear) and isinstance(draft.lm_head, QuantLinear)
    assert draft.layers[3].attn_norm is model.layers[3].attn_norm and draft.embed is model.embed
    assert not isinstance(model.layers[3].mlp.down, QuantLinear) and model.lm_head is None  # the target is untouched
    ids = torch.tensor([smollm2_dequant.tokenizer.encode(PROMPTS[1] * 3)])
    with torch.no_grad():
        agree = (draft(ids).argmax(-1) == model(ids).argmax(-1)).float().mean()
    assert agree > 0.7


def test_a_layer_skipping_view_shares_weights_and_renumbers_its_cache(smollm2):
    model = smollm2.model
    sub = model.with_layers([0, 5, 29])
    assert sub.config.n_layers == 3 and len(model.layers) == 30
    assert [b.attn.layer_idx for b in sub.layers] == [0, 1, 2] and model.layers[5].attn.layer_idx == 5
    assert sub.layers[1].mlp is model.layers[5].mlp


# --- sampling: the target's distribution, exactly ------------------------------------------------------------


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (cells with p > 0)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target can never emit was emitted"
    expected = n * probs[keep]
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_verification_samples_the_target_distribution(draft_kind):
    gen = torch.Generator().manual_seed(0)
    V, trials = 6, 20000
    target = torch.randn(2, V, generator=gen) * 1.5
    draft = torch.randn(V, generator=gen) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5, top_p=1.0, min_p=0.0)
    p = token_probs(target[0], params)
    q = token_probs(draft, params)
    counts = torch.zeros(V)
    for trial in range(trials):
        x = int(torch.multinomial(q, 1, generator=gen)) if draft_kind == "model" else 2
        proposal = Proposal([x], q[None] if draft_kind == "model" else None)
        accepted, nxt = verify(target, proposal, params, Randomness(trial))
        counts[x if accepted else nxt] += 1
    assert _chi_square_p_value(counts, p) > 1e-3
    # The test can fail: the draft's own distribution is far from the target's.
    assert _chi_square_p_value(torch.tensor([(q * trials).round().tolist()]).squeeze(0) * (p > 0), p) < 1e-6


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
@pytest.mark.parametrize("top_k, top_p, min_p", [(40, 0.95, 0.05), (0, 0.9, 0.0), (3, 1.0, 0.0)])
def test_every_row_at_once_decides_as_row_by_row(draft_kind, top_k, top_p, min_p):
    """verify decides a block's rows in one pass over their top-k survivors; the row-by-row rule over each row's
    whole-vocabulary distribution (`_verify_rows`, the path of a penalty or a tie) must decide the same with the
    same draws: the same accepted count and the same next token, over blocks where most drafts are rejected and
    blocks where most are accepted."""
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p)
    gen = torch.Generator().manual_seed(4)
    outcomes = set()
    for trial in range(150):
        K, V = 1 + trial % 6, 300
        logits = torch.randn(K + 1, V, generator=gen) * (1 + trial % 4)
        q = torch.stack([token_probs(r, params) for r in logits[:K] + torch.randn(K, V, generator=gen) * 0.5])
        drafts = [int(torch.multinomial(r, 1, generator=gen)) for r in q]
        if draft_kind == "ngram":
            q = None
        proposal, rng = Proposal(drafts, q), Randomness(trial)
        got = verify(logits, proposal, params, rng, position=7)
        us = [uniforms(rng.at(7 + i)) for i in range(K + 1)]
        assert got == _verify_rows(logits, proposal, params, us, lambda i: None, 7, lambda _, a: a), trial
        outcomes.add(got[0] == K)
    assert outcomes == {True, False}


def _sequence_probs(model, prompt, params, length, eos):
    """Exact probability of every reply of up to `length` tokens (ending early at eos), by full forwards."""
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, pr in out.items():
            if seq and seq[-1] == eos:
                nxt[seq] = pr
                continue
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)]))[0, -1]
            for t, pt in enumerate(token_probs(logits, params).tolist()):
                if pt > 0:
                    nxt[seq + (t,)] = pr * pt
        out = nxt
    return out


def test_sampled_speculation_matches_the_target_distribution_end_to_end(tiny_pair):
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, max_new_tokens=4)
    prompt = [5, 17, 42]
    exact = _sequence_probs(target.model, prompt, params, 4, target.tokenizer.eos_id)
    wrong = _sequence_probs(draft.model, prompt, params, 4, target.tokenizer.eos_id)
    cells = sorted(set(exact) | set(wrong))
    engine = Engine(target, 32)
    engine.speculator = Speculator(ModelDrafter(Engine(draft, 32), "tiny"), DraftLength(2, adaptive=False))
    counts, runs = torch.zeros(len(cells)), 1500
    for seed in range(runs):
        reply = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}))
        for _ in reply:
            pass
        ids = tuple(reply.token_ids) + ((target.tokenizer.eos_id,) if reply.stats.finish_reason == "stop" else ())
        counts[cells.index(ids)] += 1
    assert engine.speculator is not None and reply.stats.drafted > 0
    probs = torch.tensor([exact.get(c, 0.0) for c in cells], dtype=torch.float64)
    assert _chi_square_p_value(counts.double(), probs) > 1e-3
    # power: the draft alone would be told apart from the target
    wrong_counts = torch.tensor([wrong.get(c, 0.0) for c in cells], dtype=torch.float64) * runs
    assert any(wrong.get(c, 0) > 0 and exact.get(c, 0) == 0 for c in cells) or \
        _chi_square_p_value(wrong_counts.round(), probs) < 1e-6


def test_a_draft_with_a_shorter_context_falls_back_to_plain_steps(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, 64)
    engine.speculator = Speculator(ModelDrafter(Engine(draft, 8), "short"), DraftLength(3, adaptive=False))
    reply = engine.generate(list(range(1, 12)), SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    list(reply)
    assert reply.stats.new_tokens == 6 and reply.stats.drafted == 0


@pytest.fixture(scope="module")
def other_widths(tiny_pair):
    """Drafts for tiny_pair's target (128 tokens) whose embedding tables are wider (160, its head favouring the
    rows past the target's) and narrower (100)."""
    import dataclasses

    from .tiny import random_model

    cfg = tiny_pair[0].model.config
    wide, narrow = (random_model(dataclasses.replace(cfg, n_layers=1, vocab_size=v), seed=7) for v in (160, 100))
    with torch.no_grad():
        wide.lm_head.weight[cfg.vocab_size:] *= 50
    return wide, narrow


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_k=0, seed=3, max_new_tokens=24,
                                                   ignore_eos=True)])
def test_a_draft_of_another_vocabulary_size_proposes_only_the_targets_tokens(tiny_pair, other_widths, params):
    """A wider draft never proposes an id past the target's embedding (the target would read past its table); a
    narrower one proposes nothing once the context holds an id past its own. The reply is the plain one."""
    target = tiny_pair[0]
    prompt = [5, 99, 120, 7]  # (120: past the narrow draft's table)
    plain = Engine(target, 64)
    expected = plain.generate(prompt, params)
    list(expected)
    for draft, drafts in zip(other_widths, (True, False)):
        engine = Engine(target, 64)
        drafter = ModelDrafter(engine.sibling(model=draft), "other", vocab=target.model.config.vocab_size)
        engine.speculator = Speculator(drafter, DraftLength(4, adaptive=False))
        reply = engine.generate(prompt, params)
        list(reply)
        assert (reply.stats.drafted > 0) == drafts
        if params.greedy:
            assert reply.token_ids == expected.token_ids
        assert max(reply.token_ids) < target.model.config.vocab_size


def test_a_budget_past_the_drafts_context_gives_the_draft_a_cache_of_its_context(tiny_pair):
    """--kv-budget 128 with a draft of 64 positions (it was refused): the draft's own cache keeps its last 64 tokens
    (said in a note) and it drafts past them; a reply the target's cache holds whole is plain greedy's. A draft whose
    context is below the least budget is one error naming it."""
    import dataclasses

    from llmrun.errors import UsageError
    from llmrun.kv_cache import Eviction
    from llmrun.speculative import short_draft_note

    from .tiny import random_model

    target = tiny_pair[0]
    short = random_model(dataclasses.replace(target.model.config, n_layers=1, max_seq_len=64))
    params = SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True)
    prompt = [5, 9, 17, 33, 2, 8, 70, 12, 19, 4]  # + 80: under 128, the target's cache evicts nothing
    plain = Engine(target, eviction=Eviction("window", 128))
    expected = plain.generate(prompt, params)
    list(expected)
    engine = Engine(target, eviction=Eviction("window", 128))
    draft = engine.sibling(model=short)
    assert draft.eviction == Eviction("window", 64)
    engine.speculator = Speculator(ModelDrafter(draft, "short"), DraftLength(4, adaptive=False))
    assert short_draft_note(engine, engine.speculator) == ("draft: its context holds 64 positions, fewer than "
                                                           "--kv-budget 128: its own cache keeps the last 64 tokens")
    reply = engine.generate(prompt, params)
    list(reply)
    assert reply.token_ids == expected.token_ids and reply.stats.drafted > 0 and draft.cache.evicted > 0
    # more --kv-sinks than a quarter of its context: the draft keeps fewer (it was refused, --kv-budget blamed)
    many_sinks = Engine(target, eviction=Eviction("window", 128, 20))
    assert many_sinks.sibling(model=short).eviction == Eviction("window", 64, 16)
    shorter = random_model(dataclasses.replace(target.model.config, n_layers=1, max_seq_len=32))
    with pytest.raises(UsageError, match=r"^--kv-evict: the draft's context \(32\) is shorter than the least budget "
                                         r"an evicting cache takes \(64\)$"):
        engine.sibling(model=shorter)


def test_an_id_past_the_embedding_is_one_error(tiny_pair):
    from llmrun.errors import OutsideVocabularyError

    with pytest.raises(OutsideVocabularyError, match="token id 130 is past the model's embedding of 128 tokens"):
        Engine(tiny_pair[0], 64).prefill([1, 2, 130])


def test_sampled_lookup_speculation_draws_the_plain_samplers_tokens(engine, smollm2):
    """Each position draws from a stream of its own and a lookup's draft is checked by drawing that position's
    token: for a seed, sampled speculation gives exactly the plain sampled reply, whatever K, fixed or adaptive
    (which chooses K from timings, so that runs differ in their blocks)."""
    ids = smollm2.tokenizer.encode(PROMPTS[0], special=True)
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=0.8, seed=seed, max_new_tokens=40)
        plain, plain_text = _generate(engine, ids, params)
        for drafter, length in [(NgramDrafter(3), DraftLength(8, adaptive=True)),
                                (NgramDrafter(2), DraftLength(3, adaptive=False)),
                                (OracleDrafter(ids, plain.token_ids, wrong=5), DraftLength(6, adaptive=False))]:
            spec, spec_text = _generate(engine, ids, params, Speculator(drafter, length))
            assert (spec.token_ids, spec_text) == (plain.token_ids, plain_text), (seed, drafter.name, length.max_k)
        assert 0 < spec.stats.accepted < spec.stats.drafted  # the oracle's blocks were taken, up to its wrong tokens
    engine.speculator = None


def test_same_seed_same_speculative_sample(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, 64)
    engine.speculator = Speculator(ModelDrafter(Engine(draft, 64), "tiny"), DraftLength(3, adaptive=False))
    params = SamplingParams(temperature=0.9, seed=11, max_new_tokens=20)
    first = engine.generate([1, 2, 3], params)
    list(first)
    second = engine.generate([1, 2, 3], params)
    list(second)
    assert first.token_ids == second.token_ids


def drafting_engine(target, draft, ctx: int, pipeline: bool, eviction=None):
    """An engine of `target` drafting 4 tokens a step with `draft` (its engine pipelined or not) -> (engine,
    drafter)."""
    engine = Engine(target, ctx, eviction=eviction)
    drafter = ModelDrafter(engine.sibling(draft), "tiny")
    drafter.engine.pipeline = pipeline
    engine.speculator = Speculator(drafter, DraftLength(4, adaptive=False))
    return engine, drafter


@pytest.mark.parametrize("params, evict", [
    (SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True), False),
    (SamplingParams(temperature=1.0, seed=3, max_new_tokens=24, ignore_eos=True), False),
    (SamplingParams(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=5, max_new_tokens=24, ignore_eos=True),
     False),
    (SamplingParams(temperature=1.0, seed=3, max_new_tokens=100, ignore_eos=True), True),
])
def test_a_draft_fed_on_the_device_drafts_as_one_fed_from_the_host(tiny_pair, params, evict):
    """A model draft on a pipelined engine (a GPU) feeds each draft token to its next forward from the device and
    reads the k at the end: the same proposals (tokens and q), hence the same reply, and a draft cache holding the
    same tokens, as a draft fed from the host; over window caches too (the draft's room made before it drafts)."""
    from llmrun.kv_cache import Eviction

    target, draft = tiny_pair
    runs = []
    for pipeline in (False, True):
        engine, drafter = drafting_engine(target, draft, 64, pipeline, Eviction("window", 64) if evict else None)
        proposals = []
        propose = drafter.propose
        drafter.propose = lambda *a, **kw: proposals.append(propose(*a, **kw)) or proposals[-1]
        reply = engine.generate([5, 17, 42, 8], params)
        list(reply)
        runs.append((reply, proposals, drafter.engine.tokens))
    (a, pa, ta), (b, pb, tb) = runs
    assert a.token_ids == b.token_ids and (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)
    assert a.stats.drafted > 0 and ta == tb and -1 not in tb
    assert not evict or drafter.engine.cache.evicted > 0
    assert len(pa) == len(pb) and [p.tokens for p in pa] == [p.tokens for p in pb]
    assert all((x.probs is None) == (y.probs is None) and (x.probs is None or torch.equal(x.probs, y.probs))
               for x, y in zip(pa, pb))
    assert params.greedy or all(p.probs.shape == (len(p.tokens), 128) for p in pb)


def test_a_draft_fed_on_the_device_ends_at_a_draw_over_the_whole_vocabulary(tiny_pair, monkeypatch):
    """Where a draft's draw needs the whole vocabulary (a tie at top-k's edge: forced here at every draw), the token
    fed after it on the device was another: the proposal ends with that draw (the host-fed draft's first token,
    and its q), and the forwards fed after it leave the draft's cache."""
    from llmrun import sampling

    def inexact(logits, params, f=sampling.survivors):
        rows = f(logits, params)
        return sampling.Survivors(rows.ids, rows.probs, torch.zeros_like(rows.exact))

    monkeypatch.setattr(sampling, "survivors", inexact)
    _, draft = tiny_pair
    context, params = [5, 17, 42, 8, 99], SamplingParams(temperature=1.0, top_k=5)
    got = []
    for pipeline in (False, True):
        drafter = ModelDrafter(Engine(draft, 64), "tiny")
        drafter.engine.pipeline = pipeline
        drafter.start(context[:-1])
        got.append((drafter.propose(context, 4, params, Randomness(9)), drafter.engine.tokens))
    (host, host_tokens), (ahead, ahead_tokens) = got
    assert len(host.tokens) == 4 and ahead.tokens == host.tokens[:1]
    assert torch.equal(ahead.probs, host.probs[:1])
    assert host_tokens == context + host.tokens[:3] and ahead_tokens == context


def test_a_speculator_that_can_never_pay_leaves_the_reply_to_plain_decoding(engine, smollm2, monkeypatch):
    """Once the policy finds that no draft length could beat a plain step (`hopeless`), the reply goes on by plain
    decoding, pipelined where the engine is (here forced on the CPU): plain greedy's tokens, no proposal asked for,
    K reported as 0."""
    ids = smollm2.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_new_tokens=20)
    plain, _ = _generate(engine, ids, params)
    drafter = NgramDrafter(3)
    monkeypatch.setattr(drafter, "propose", lambda *a, **kw: pytest.fail("a hopeless speculator drafted"))
    length = DraftLength(4)
    length.hopeless = True
    steps = []
    monkeypatch.setattr(engine, "plain_steps", lambda *a, f=engine.plain_steps: steps.append(a) or f(*a))
    monkeypatch.setattr(engine, "pipeline", True)
    reply, _ = _generate(engine, ids, params, Speculator(drafter, length))
    assert reply.token_ids == plain.token_ids and len(steps) == 1
    assert reply.stats.draft_k == 0 and reply.stats.drafted == 0
    assert reply.stats.decode_steps == plain.stats.decode_steps
    engine.speculator = None


class ScriptedLength(DraftLength):
    """The K policy as a script (cycled), recording what it was asked (room, K) and told (drafted, accepted)."""

    def __init__(self, script):
        super().__init__(8, adaptive=False)
        self.script, self.calls, self.observed = script, [], []

    def choose(self, room):
        self.k = min(self.script[len(self.calls) % len(self.script)], max(room, 0))
        self.calls.append((room, self.k))
        return self.k

    def observe(self, drafted, accepted, target_s, draft_s):
        self.observed.append((drafted, accepted))


def feeds(engine, monkeypatch, pipeline: bool) -> list[bool]:
    """The engine pipelined or not (forced), and whether each forward it runs from now on is fed from the device
    (its tokens a tensor), in order."""
    monkeypatch.setattr(engine, "pipeline", pipeline)
    fed = []
    monkeypatch.setattr(engine, "forward", lambda ids, *a, f=Engine.forward.__get__(engine), **kw: (
        fed.append(torch.is_tensor(ids)) or f(ids, *a, **kw)))
    return fed


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_paused_drafting_runs_pipelined_plain_steps(engine, smollm2, monkeypatch, temperature):
    """On a pipelined engine (forced here on the CPU) the plain steps of a speculative reply, where the policy drafts
    nothing, run as pipelined plain decoding until the policy drafts again: the same steps, K for K (the policy asked
    with the same room, told the same outcomes), the same figures, and the plain reply's tokens (a fixed draft's
    blocks take the plain sampler's very tokens, sampled too); the cache ends consistent."""
    from llmrun.generate import UNREAD

    ids = smollm2.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=temperature, seed=7, max_new_tokens=40)
    plain, plain_text = _generate(engine, ids, params)
    runs = []
    for pipeline in (False, True):
        fed_ahead = feeds(engine, monkeypatch, pipeline)
        length = ScriptedLength([0, 0, 0, 3, 0, 2, 0, 0, 0, 0, 4, 1, 0])
        reply, text = _generate(engine, ids, params, Speculator(OracleDrafter(ids, plain.token_ids, wrong=5), length))
        runs.append((reply, text, length, sum(fed_ahead)))
        assert engine.cache.length == len(engine.tokens) and UNREAD not in engine.tokens
    (a, text_a, la, ahead_a), (b, text_b, lb, ahead_b) = runs
    assert a.token_ids == b.token_ids == plain.token_ids and text_a == text_b == plain_text
    assert la.observed == lb.observed and la.calls == lb.calls[: len(la.calls)]
    for key in ("drafted", "accepted", "decode_steps", "decode_tokens", "new_tokens", "finish_reason"):
        assert getattr(a.stats, key) == getattr(b.stats, key), key
    assert 0 < a.stats.accepted < a.stats.drafted and sum(d == 0 for d, _ in la.observed) > 10
    assert ahead_a == 0 and ahead_b > 10  # the plain runs fed their tokens from the device
    for n in (2, 5, 11):  # Ctrl-C after n pieces: the same conversation kept either way
        states = []
        for pipeline in (False, True):
            monkeypatch.setattr(engine, "pipeline", pipeline)
            engine.reset()
            engine.speculator = Speculator(OracleDrafter(ids, plain.token_ids, wrong=5),
                                           ScriptedLength([0, 0, 0, 3, 0, 2, 0, 0, 0, 0, 4, 1, 0]))
            reply = engine.generate(ids, params)
            pieces = iter(reply)
            for _ in range(n):
                next(pieces)
            pieces.close()
            states.append((reply.token_ids, list(engine.tokens), engine.cache.length))
        assert states[0] == states[1] and states[1][2] == len(states[1][1]), n
    engine.speculator = None


class RecordingLookup(NgramDrafter):
    """An n-gram drafter that records each proposal's context and how many tokens it proposed."""

    def __init__(self, n):
        super().__init__(n)
        self.proposed = []

    def propose(self, context, k, params, rng, constraint=None):
        proposal = super().propose(context, k, params, rng, constraint)
        self.proposed.append((list(context), len(proposal.tokens)))
        return proposal


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_pipelined_lookup_feeds_the_device_while_it_has_no_match(engine, smollm2, monkeypatch, temperature):
    """On a pipelined engine (forced here on the CPU) an n-gram drafter's reply goes on by plain steps fed from the
    device wherever the lookup finds nothing, not by steps that propose nothing and wait for the host (as an engine
    that waits for every token runs them): a lookup comes back empty only where the context up to the token before
    it matched (the token after a match was in flight, unknown), and the reply is the plain reply, token for
    token."""
    ids = smollm2.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=48)
    plain, plain_text = _generate(engine, ids, params)
    runs = []
    for pipeline in (False, True):
        fed = feeds(engine, monkeypatch, pipeline)
        drafter = RecordingLookup(3)
        reply, text = _generate(engine, ids, params, Speculator(drafter, DraftLength(4, adaptive=False)))
        assert (reply.token_ids, text) == (plain.token_ids, plain_text), pipeline
        runs.append(([context for context, n in drafter.proposed if n == 0], sum(fed)))
    (waited, from_device_then), (empty, from_device) = runs
    assert from_device_then == 0 and from_device > 20
    assert len(waited) > 20 and len(empty) <= 4, (len(waited), len(empty))
    assert all(NgramDrafter(3).would_propose(context[:-1]) for context in empty), empty
    engine.speculator = None

# --- drafters and the K policy ---------------------------------------------------------------------------------


def test_ngram_drafter_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter(3)
    params = SamplingParams(temperature=0)
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(ctx, 3, params, None).tokens == [4, 5, 9]  # "1 2 3": the longest match beats a later "2 3"
    assert NgramDrafter(2).propose(ctx, 3, params, None).tokens == [7, 8, 1]  # "2 3": the latest occurrence
    assert d.propose(ctx + [4], 2, params, None).tokens == [5, 9]
    assert d.propose([6, 6, 6], 4, params, None).tokens == [6]  # a continuation reaching the query itself
    assert d.propose([1, 2, 3, 10, 11], 4, params, None).tokens == []  # nothing to look up: a plain step
    assert NgramDrafter(1).propose([4, 8, 4], 1, params, None).tokens == [8]


def test_ngram_index_follows_rollbacks_and_new_conversations():
    d = NgramDrafter(2)
    params = SamplingParams(temperature=0)
    d.start([1, 2, 3, 1, 2, 9])
    assert d.propose([1, 2, 3, 1, 2], 2, params, None).tokens == [3, 1]  # the context shrank: re-indexed
    assert d.propose([7, 8, 9, 7, 8], 1, params, None).tokens == [9]  # another text altogether
    # a context growing a token a step (a reply) is indexed as a whole one would be, checked at its tail only
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 6, (300,), generator=g).tolist()
    d = NgramDrafter(3)
    d.start(ctx[:50])
    for end in range(51, 300):
        fresh = NgramDrafter(3).propose(ctx[:end], 4, params, None).tokens
        assert d.propose(ctx[:end], 4, params, None).tokens == fresh
    edited = ctx[:-3] + [9, 9, 8, 9, 9]  # an edit within the tail: re-indexed
    assert d.propose(edited, 2, params, None).tokens == [8, 9]
    edited = [7] + ctx[1:]  # before the tail: noticed by the next reply's start, which compares every token
    d.start(edited)
    assert d._indexed == edited[:-1]


def _simulate(length, steps, accept, target_s, draft_s):
    """Run the policy against a simulated drafter: k -> accepted tokens, step time, drafting time."""
    ks = []
    for _ in range(steps):
        k = length.choose(100)
        ks.append(k)
        length.observe(k, accept(k), target_s(k), draft_s(k))
    return ks


def test_draft_length_stops_probing_a_drafter_that_could_never_pay():
    length = DraftLength(8)
    # each draft token costs a whole target step: even with every token accepted, no K beats plain steps
    ks = _simulate(length, 40, accept=lambda k: k, target_s=lambda k: 0.010 * (1 + 0.1 * k), draft_s=lambda k: 0.010 * k)
    assert ks[0] == 0 and length.hopeless and ks[-30:] == [0] * 30


def test_draft_length_turns_off_a_failing_cheap_drafter_and_probes_again():
    length = DraftLength(8)
    ks = _simulate(length, 60, accept=lambda k: 0, target_s=lambda k: 0.010 * (1 + 0.1 * k), draft_s=lambda k: 0.0)
    assert not length.hopeless and ks[-30:].count(0) >= 25  # mostly off ...
    assert any(k > 0 for k in ks[-30:])  # ... with the odd probe
    # the text turns copyable: the probes notice and K grows back
    ks = _simulate(length, 200, accept=lambda k: k, target_s=lambda k: 0.010 * (1 + 0.1 * k), draft_s=lambda k: 0.0)
    assert ks[-1] == 8


def test_a_model_draft_that_stopped_paying_is_probed_once_per_reply():
    length = DraftLength(8, draft_cost=0.5)
    ks = _simulate(length, 50, accept=lambda k: 0, target_s=lambda k: 0.010 * (1 + 0.1 * k), draft_s=lambda k: 0.005 * k)
    assert not length.hopeless and ks[-40:] == [0] * 40  # no probes within the reply: each would catch up first
    length.begin_reply()
    assert length.choose(100) == 1 and length.choose(100) == 0


def test_draft_length_learns_that_long_verifications_are_cheap():
    """Memory-bound steps: 9 tokens cost about what 2 do. The policy must find K = 8 though 2 tokens cost 1.6x 1."""
    cost = {1: 0.010, 2: 0.016, 3: 0.0165, 4: 0.017, 5: 0.0175, 6: 0.018, 7: 0.0185, 8: 0.019, 9: 0.0195}
    length = DraftLength(8)
    ks = _simulate(length, 30, accept=lambda k: k, target_s=lambda k: cost[k + 1], draft_s=lambda k: 0.0005 * k)
    assert ks[-5:] == [8] * 5


def test_draft_length_finds_the_best_block_past_a_jump_in_cost():
    """A verification cost that is no straight line in the block's length, as on a CPU: a jump at 5 tokens, cheap
    again up to 8, a jump at 9. With every draft accepted, 8 tokens a step (K = 7) is best; a policy that measured
    only 5 and 9 and drew a line between them would settle at K = 4."""
    cost = {1: 0.022, 2: 0.027, 3: 0.030, 4: 0.033, 5: 0.048, 6: 0.053, 7: 0.057, 8: 0.061, 9: 0.090}
    length = DraftLength(8)
    ks = _simulate(length, 30, accept=lambda k: k, target_s=lambda k: cost[k + 1], draft_s=lambda k: 0.0)
    assert ks[-5:] == [7] * 5


def test_draft_length_grows_with_acceptance_and_respects_the_room():
    length = DraftLength(8)
    length.choose(100)
    length.observe(0, 0, 0.010, 0.0)
    for _ in range(10):
        k = length.choose(100)
        length.observe(k, k, target_s=0.011 + 0.001 * k, draft_s=0.0)  # cheap, always accepted
    assert length.choose(100) == 8 and length.acceptance > 0.9
    assert length.choose(3) == 3 and length.choose(0) == 0
    assert DraftLength(5, adaptive=False).choose(100) == 5


# --- wiring and errors -----------------------------------------------------------------------------------------


def test_mismatched_tokenizers_are_rejected(smollm2, tiny_pair):
    with pytest.raises(LlmrunError, match="tokenizer differs"):
        check_same_vocabulary(smollm2.tokenizer, tiny_pair[0].tokenizer)
    engine = Engine(smollm2, 64)
    with pytest.raises(LlmrunError, match="tokenizer differs"):
        make_speculator(engine, draft="other", load=lambda spec: tiny_pair[0])
    check_same_vocabulary(smollm2.tokenizer, smollm2.tokenizer)


def test_cli_speculative_json_reports_acceptance(monkeypatch, capsys):
    import json

    code, out, err = run_main(["generate", "--json", "--temperature", "0", "-n", "24", "--ngram",
                               "one two three four one two three four one two"], monkeypatch, capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["drafted_tokens"] >= 0 and doc["draft_k"] is not None and doc["tokens_per_step"] >= 1
    plain_code, plain_out, _ = run_main(["generate", "--json", "--temperature", "0", "-n", "24",
                                         "one two three four one two three four one two"], monkeypatch, capsys)
    assert plain_code == 0 and json.loads(plain_out)["text"] == doc["text"]
    assert json.loads(plain_out)["draft_k"] is None


def test_cli_draft_model_from_a_file_is_lossless(monkeypatch, capsys, embedded_path):
    args = ["generate", "--temperature", "0", "-n", "16", "--quiet", "The capital of France is"]
    code, plain, _ = run_main(args, monkeypatch, capsys)
    code2, spec, err = run_main([*args[:-1], "--draft", str(embedded_path), "--fixed-k", "--draft-tokens", "3", args[-1]],
                                monkeypatch, capsys)
    assert code == code2 == 0, err
    assert spec == plain


@pytest.mark.parametrize("args, message", [
    (["--draft", "self", "--ngram", "2"], "pass one of them"),
    (["--ngram", "0"], "--ngram 0"),
    (["--draft-tokens", "0", "--ngram"], "--draft-tokens"),
    (["--draft", "missing-draft.gguf"], "--draft missing-draft.gguf: no such file"),
])
def test_cli_speculative_bad_options_give_one_line_errors(monkeypatch, capsys, args, message):
    code, out, err = run_main(["chat", "-p", "hi", "-n", "4", *args], monkeypatch, capsys)
    assert code != 0 and out == ""
    assert message in err and "Traceback" not in err


def test_a_draft_that_fails_to_load_is_named_as_the_draft(monkeypatch, capsys, tmp_path):
    """The draft's load error says it is the draft's (it read as the target's: 'unsupported architecture'), and so
    does its cache's: a --kv format the target takes and the draft's heads do not."""
    import dataclasses

    from .tiny import CONFIGS, random_model, write_hf_dir

    (tmp_path / "config.json").write_text("{}")
    code, out, err = run_main(["generate", "-n", "2", "--draft", tmp_path, "hi"], monkeypatch, capsys)
    assert (code, out) == (1, "") and err.startswith(f"error: --draft {tmp_path}: unsupported architecture '?'"), err
    target = write_hf_dir(tmp_path / "t", random_model(CONFIGS["llama"]))
    draft = write_hf_dir(tmp_path / "d", random_model(dataclasses.replace(CONFIGS["llama"], head_dim=24)))
    code, out, err = run_main(["generate", target, "w1", "-n", "2", "--kv", "int8", "--draft", draft, "--threads", "1"],
                              monkeypatch, capsys)
    assert (code, out) == (1, "") and err.startswith(f"error: --draft {draft}: an int8 KV cache needs a head size "
                                                     "divisible by 16"), err


def test_the_clis_draft_tokens_bound_is_the_speculators():
    """--draft-tokens' range (the CLI's, which imports no torch) is the one the speculator and INT4's rollback take."""
    from llmrun.cli.options import _SPECULATIVE
    from llmrun.speculative import MAX_DRAFT_TOKENS

    option = next(opt for name, *_, opt in _SPECULATIVE if name == "draft_tokens")
    assert (option.min, option.max) == (1, MAX_DRAFT_TOKENS) == (1, ref.ROLLBACK)
    with pytest.raises(UsageError, match=f"choose 1 to {MAX_DRAFT_TOKENS} tokens"):
        make_speculator(None, ngram=2, draft_tokens=MAX_DRAFT_TOKENS + 1)
