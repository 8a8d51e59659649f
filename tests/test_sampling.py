"""Sampling filters on hand-built distributions, seeded reproducibility, repetition penalty."""

import math

import pytest
import torch

from llmrun.errors import LlmrunError
from llmrun.sampling import (SamplingParams, apply_repetition_penalty, draw, draw_at, filter_logits, pick, sample,
                            survivors, token_probs)

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05
PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
LOGITS = PROBS.log()


def kept(logits):
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_top_k():
    assert kept(filter_logits(LOGITS, 2, 1.0, 0.0)) == {0, 1}
    assert kept(filter_logits(LOGITS, 0, 1.0, 0.0)) == {0, 1, 2, 3, 4}
    assert kept(filter_logits(LOGITS, 99, 1.0, 0.0)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("top_p, expected", [(0.4, {0}), (0.5, {0, 1}), (0.7, {0, 1}), (0.71, {0, 1, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert kept(filter_logits(LOGITS, 0, top_p, 0.0)) == expected


def test_top_p_works_on_unsorted_vocab():
    perm = torch.tensor([3, 0, 4, 2, 1])
    out = filter_logits(LOGITS[perm], 0, 0.71, 0.0)
    assert kept(out) == {i for i, p in enumerate(perm.tolist()) if p in {0, 1, 2}}


@pytest.mark.parametrize("min_p, expected", [(0.0, {0, 1, 2, 3, 4}), (0.25, {0, 1, 3, 2}), (0.3, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_is_relative_to_the_top_token(min_p, expected):
    assert kept(filter_logits(LOGITS, 0, 1.0, min_p)) == expected


def test_filtered_distribution_renormalizes():
    probs = token_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    torch.testing.assert_close(probs, torch.tensor([0.4, 0.3, 0, 0, 0]) / 0.7)


def test_temperature_sharpens_and_greedy_is_one_hot():
    hot = token_probs(LOGITS, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    expected = PROBS**2 / (PROBS**2).sum()
    torch.testing.assert_close(hot, expected)
    assert token_probs(LOGITS, SamplingParams(temperature=0)).tolist() == [1, 0, 0, 0, 0]


def test_repetition_penalty_lowers_seen_tokens_both_signs():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 0]), 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # input untouched


def test_greedy_with_penalty_changes_argmax():
    logits = torch.tensor([2.0, 1.5, 0.0])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, params, None, torch.tensor([0])) == 1


def test_seeded_sampling_is_reproducible_and_matches_distribution():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

    def draw(seed, n=4000):
        g = torch.Generator().manual_seed(seed)
        return [sample(LOGITS, params, g) for _ in range(n)]

    a, b = draw(5), draw(5)
    assert a == b
    assert draw(6) != a
    counts = torch.bincount(torch.tensor(a), minlength=5).float()
    # chi-square goodness of fit, 4 degrees of freedom: 18.47 is the 0.1% critical value
    expected = PROBS * len(a)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.47, chi2
    assert not math.isnan(chi2)


def full_vocabulary_probs(logits, params):
    """The filters applied over the whole vocabulary, as the definition reads: what token_probs must give."""
    return filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p).softmax(-1)


@pytest.mark.parametrize("top_k, top_p, min_p", [(40, 0.95, 0.05), (40, 1.0, 0.0), (7, 0.5, 0.0), (200, 0.9, 0.1),
                                                 (1, 0.95, 0.05), (40, 0.95, 0.9)])
def test_top_k_first_gives_the_distribution_of_the_whole_vocabulary(top_k, top_p, min_p):
    """token_probs runs top-p and min-p on the top-k survivors only: the same tokens kept, the same probabilities."""
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    for seed in range(5):
        logits = torch.randn(5000, generator=torch.Generator().manual_seed(seed)) * 3
        got, want = token_probs(logits, params), full_vocabulary_probs(logits, params)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_fewer_allowed_tokens_than_k_as_under_a_grammar_mask():
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(9)) * 3
    logits[torch.randperm(5000, generator=torch.Generator().manual_seed(9))[:4990]] = float("-inf")  # 10 allowed
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)
    got, want = token_probs(logits, params), full_vocabulary_probs(logits, params)
    assert torch.equal(got > 0, want > 0) and 0 < int((got > 0).sum()) <= 10
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_tie_at_the_kth_token_keeps_every_tied_token():
    logits = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 0.0])  # top-2 ... top-3 cuts through three equal values
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    probs = token_probs(logits, params)
    assert (probs > 0).tolist() == [True, True, True, True, True, False]
    torch.testing.assert_close(probs, full_vocabulary_probs(logits, params))


def test_draw_takes_only_tokens_with_weight_and_follows_the_weights():
    weights = torch.zeros(1000)
    weights[[3, 500, 999]] = torch.tensor([1.0, 2.0, 5.0])  # unnormalised
    g = torch.Generator().manual_seed(0)
    tokens = torch.tensor([draw(weights, g) for _ in range(4000)])
    assert set(tokens.tolist()) <= {3, 500, 999}
    counts = torch.stack([(tokens == t).sum() for t in (3, 500, 999)]).float()
    expected = torch.tensor([1.0, 2.0, 5.0]) / 8 * len(tokens)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.82, chi2  # 2 degrees of freedom, 0.1% critical value


# --- the draw: device work over the survivors, one wait ----------------------------------------------------------


def test_pick_inverts_the_cumulative_weights_in_token_id_order():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]])  # shares: id 1 [0, .5), id 3 [.5, .75), id 4 [.75, 1)
    for u, want in [(0.0, 1), (0.49, 1), (0.5, 3), (0.74, 3), (0.75, 4), (1 - 2**-53, 4)]:
        assert pick(None, weights, u)[0].tolist() == [want], u
    ids = torch.tensor([[40, 7, 12]])  # the same shares at ids given out of order: id order decides
    assert [pick(ids, torch.tensor([[1.0, 2.0, 1.0]]), u)[0].item() for u in (0.2, 0.6, 0.9)] == [7, 12, 40]


def test_pick_flags_rows_whose_weights_are_not_finite():
    weights = torch.tensor([[0.5, 0.5], [float("nan"), 1.0], [0.0, 0.0], [float("inf"), 1.0]])
    tokens, finite = pick(None, weights, torch.full((4, 1), 0.3, dtype=torch.float64))
    assert finite.tolist() == [True, False, False, False]
    assert ((0 <= tokens) & (tokens < 2)).all()  # an index a gather can take, whatever the row held
    with pytest.raises(LlmrunError, match="not finite"):
        sample(torch.tensor([1.0, float("nan"), 0.0]), SamplingParams(temperature=1.0, top_k=2), None)


@pytest.mark.parametrize("top_k, top_p, min_p", [(40, 0.95, 0.05), (7, 1.0, 0.0), (0, 0.9, 0.0), (5000, 1.0, 0.1)])
def test_a_draw_from_the_survivors_is_the_draw_from_the_whole_distribution(top_k, top_p, min_p):
    """`sample` draws among the top-k survivors, `draw` over the dense vector `token_probs` gives: for the same
    uniform they pick the same token (a plain step and a speculative row draw alike)."""
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        logits = torch.randn(5000, generator=gen) * 4
        rows = survivors(logits[None], params)
        probs = token_probs(logits, params)
        for u in torch.rand(5, generator=gen, dtype=torch.float64).tolist():
            sparse = pick(rows.ids, rows.probs, u)[0].item()
            assert sparse == draw_at(probs, u) and probs[sparse] > 0, (trial, u)
        assert sample(logits, params, torch.Generator().manual_seed(trial)) == \
            draw(probs, torch.Generator().manual_seed(trial))


def test_rows_at_once_are_each_row_alone():
    """verify filters every row of a block in one pass: each row's survivors as the row's own."""
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * 3
    rows = survivors(logits, params)
    for i in range(6):
        alone = survivors(logits[i : i + 1], params)
        assert torch.equal(rows.ids[i], alone.ids[0]) and torch.equal(rows.probs[i], alone.probs[0])
        assert torch.equal(rows.dense(3000)[i], token_probs(logits[i], params))


def test_a_tie_past_the_candidates_draws_from_the_definition():
    logits = torch.tensor([3.0, 2.0] + [1.0] * 8 + [0.0, 0.0])  # top-3 cuts through eight equal values: past 2k
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    assert survivors(logits[None], params).exact.tolist() == [False]
    probs = full_vocabulary_probs(logits, params)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(logits, params, g) for _ in range(4000)]), minlength=12).float()
    assert (counts[10:] == 0).all() and (counts[:10] > 0).all()  # every tied token drawn: the definition keeps all
    chi2 = ((counts[:10] - probs[:10] * 4000) ** 2 / (probs[:10] * 4000)).sum().item()
    assert chi2 < 27.88, chi2  # 9 degrees of freedom, 0.1% critical value


@pytest.mark.parametrize("top_k, top_p, min_p", [(40, 0.95, 0.05), (40, 0.5, 0.0), (7, 0.9, 0.1), (40, 1.0, 0.0)])
def test_logits_in_16_bits_tie_often_and_stay_exact(top_k, top_p, min_p):
    """Logits that come in bf16 tie at the k-th value in most rows (the embedded model's, rounded so: 40% of its
    sampled steps at k = 40): the top 2k candidates keep the tied tokens, so the rows are exact, with the
    definition's tokens and probabilities (top-p too, which keeps or drops a tie group whole)."""
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = (torch.randn(64, 49152, generator=torch.Generator().manual_seed(7)) * 2.5).to(torch.bfloat16).float()
    kth = logits.topk(top_k).values[:, -1:]
    assert ((logits >= kth).sum(-1) > top_k).sum() >= 10  # ties at the k-th value, in many rows
    rows = survivors(logits, params)
    assert rows.exact.all()
    for i, got in enumerate(rows.dense(logits.shape[-1])):
        want = full_vocabulary_probs(logits[i], params)
        assert torch.equal(got > 0, want > 0), i
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_top_p_keeps_or_drops_tied_tokens_together():
    """The definition itself: a top-p cut that falls inside a group of equal logits keeps the whole group (the
    tokens more likely than them fall short of p), whatever their order; and drops it whole once they reach p."""
    logits = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.0, 1.0, -1.0])
    p_top = torch.softmax(logits, -1).sort(descending=True).values
    for top_p, kept in ((p_top[:2].sum().item() + 0.01, 5), (p_top[:2].sum().item() - 0.01, 2)):
        for order in (torch.arange(7), torch.tensor([6, 5, 4, 3, 2, 1, 0])):
            probs = filter_logits(logits[order], 0, top_p, 0.0).softmax(-1)[order.argsort()]
            assert int((probs > 0).sum()) == kept and bool(probs[[2, 4, 5]].gt(0).all()) == (kept == 5), (top_p, order)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.2, top_k=0, top_p=0.8, min_p=0.0),
                                    SamplingParams(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0)])
def test_a_token_drawn_ahead_is_samples_token(params):
    """`Ahead` (a draw left on the device for the next forward to read) reads back `sample`'s token for the same
    generator: random logits, and rows whose k-th value ties (the whole vocabulary's draw, flagged as not the
    token fed ahead)."""
    from llmrun.sampling import Ahead

    gen, ties = torch.Generator().manual_seed(5), 0
    for trial in range(60):
        # a third of the rows tie far past the 2k candidates: ~30% of the tokens share the top value
        logits = torch.randn(3000, generator=gen)
        if trial % 3 == 0:
            logits = logits.round().clamp(max=1)
        ahead = Ahead(logits, params, torch.Generator().manual_seed(trial))
        token, fed_right = ahead.read()
        assert token == sample(logits, params, torch.Generator().manual_seed(trial)), trial
        assert fed_right == (params.greedy or survivors(logits[None], params).exact.item())
        assert token == ahead.token.item() or not fed_right
        ties += not fed_right
    assert params.greedy or params.top_k == 0 or ties >= 10
    with pytest.raises(LlmrunError, match="not finite"):
        Ahead(torch.tensor([1.0, float("nan"), 0.0]), SamplingParams(temperature=1.0, top_k=2), None).read()


@pytest.mark.gpu
def test_a_sampled_token_waits_for_the_device_once():
    """On a GPU nothing in sampling synchronizes but `fetch`'s wait on its own copy: under the sync debug mode
    every implicit wait (`.item()`, `nonzero`, a pageable copy) raises. A draw replayed from its graph neither."""
    from llmrun.sampling import Ahead, Randomness
    from llmrun.speculative import Proposal, verify

    from llmrun.cuda_graphs import DrawGraphs

    logits = torch.randn(9, 49152, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    params = SamplingParams(temperature=0.8, seed=1)
    drafts = logits[1:].argmax(-1).tolist()
    q = torch.softmax(logits[:8].roll(1, -1), -1)
    draws = DrawGraphs(logits.device)  # captured here (a capture synchronizes), replayed below
    Ahead(logits[0], params, torch.Generator().manual_seed(2), draws=draws).read()
    verify(logits, Proposal(drafts), params, Randomness(3), position=10, draws=draws)  # a block's rows' graph
    verify(logits, Proposal(drafts, q), params, Randomness(3), position=10, draws=draws)  # a model draft's rule's
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            sample(logits[0], params, torch.Generator().manual_seed(2))
            sample(logits[0], SamplingParams(temperature=0), None)
            verify(logits, Proposal(drafts), params, Randomness(3), position=10)
            verify(logits, Proposal(drafts, q), params, Randomness(3), position=10)
            for p in (params, SamplingParams(temperature=0)):  # a draw left on the device, read later
                Ahead(logits[0], p, torch.Generator().manual_seed(2)).read()
            Ahead(logits[0], params, torch.Generator().manual_seed(2), draws=draws).read()  # a replayed draw
            verify(logits, Proposal(drafts), params, Randomness(3), position=10, draws=draws)  # replayed rows
            verify(logits, Proposal(drafts, q), params, Randomness(3), position=10, draws=draws)  # replayed rule
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("top_k", [0, 3])
def test_a_top_p_fp32_rounds_to_zero_keeps_the_top_token(top_k):
    """A top_p below fp32's smallest number (1e-46) keeps the top token, as any tiny top_p does: the probabilities'
    fp32 compare read it as 0 and dropped every token, which read as a model whose output is not finite."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    for top_p in (1e-46, 1e-40, 1e-6):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=0.0)
        assert torch.equal(token_probs(logits, params), torch.nn.functional.one_hot(logits.argmax(), 50).float())
        assert all(sample(logits, params, torch.Generator().manual_seed(s)) == int(logits.argmax()) for s in range(5))
