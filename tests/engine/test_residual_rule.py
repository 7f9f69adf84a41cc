"""Exact mode's residual rule (`--exact-rule residual`): speculative sampling's rejection rule keeps the dense
policy's distribution (not its tokens for the seed) and keeps more drafts than the coupling."""

import numpy as np
import pytest
import torch
from scipy import stats

from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.engine.exact import exact_summary
from sparrow.engine.sampling import residual_rule, truncate
from sparrow.errors import SparrowError
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

SCHEDULE = const(48)
PROMPTS = random_prompts([70, 130, 45, 200, 96], seed=11)


def _gumbel(shape, generator):
    return -torch.log(-torch.log(torch.rand(shape, generator=generator)))


def _rule_draws(p_logits, q_logits, params, n, seed):
    """n independent single-draft rounds: the draft drawn from q, judged against p. Returns (committed tokens [n],
    accepted [n])."""
    g = torch.Generator().manual_seed(seed)
    vocab = p_logits.shape[-1]
    dense, draft = p_logits.expand(n, 1, vocab), q_logits.expand(n, 1, vocab)
    drafts = (truncate(draft.reshape(n, vocab), params).view(n, 1, vocab) + _gumbel((n, 1, vocab), g)).argmax(-1)
    accepted, redraw = residual_rule(draft, dense, drafts, torch.rand(n, 1, generator=g), _gumbel((n, 1, vocab), g),
                                     params)
    return torch.where(accepted == 1, drafts[:, 0], redraw[:, 0]), accepted, drafts[:, 0]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_the_residual_rule_draws_from_the_dense_distribution(top_p):
    params = SamplingParams(top_p=top_p)
    p_logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, -1.0, 0.8, 1.1])
    q_logits = torch.tensor([0.5, 2.2, 0.9, -1.0, 0.4, -0.2, 1.6, -0.4])  # far from p: alpha ~0.65
    n = 40_000
    tokens, accepted, drafts = _rule_draws(p_logits, q_logits, params, n, seed=0)
    p = truncate(p_logits[None], params).softmax(-1)[0]
    q = truncate(q_logits[None], params).softmax(-1)[0]
    support = p > 0
    counts = torch.bincount(tokens, minlength=8).double()
    expected = (n * p[support].double() / p[support].double().sum()).numpy()
    assert counts[~support].sum() == 0  # nothing outside the dense nucleus
    assert stats.chisquare(counts[support].numpy(), expected).pvalue > 1e-4
    alpha = float(torch.minimum(p, q).sum())
    assert abs(float(accepted.double().mean()) - alpha) < 4.5 * (alpha * (1 - alpha) / n) ** 0.5
    # the control, keeping every draft: q's sample, which the same test tells from p (or which leaves p's nucleus)
    draft_counts = torch.bincount(drafts, minlength=8).double()
    outside = draft_counts[~support].sum() > 0
    assert outside or stats.chisquare(draft_counts[support].numpy(), expected).pvalue < 1e-9


def test_with_a_budget_covering_every_length_the_residual_rule_keeps_every_draft_and_dense_tokens(llama):
    """q equals p (to rounding) when the schedule covers the sequence: u q(x) <= p(x) keeps every draft, and the
    drafts are the Gumbel-max draws of dense sampling."""
    model, tok = llama
    engine = RolloutEngine(model, tok, max_batch_size=10)
    sampled = SamplingParams(max_new_tokens=21, temperature=1.0, seed=5, ignore_eos=True)
    dense = engine.generate(PROMPTS, sampled, DENSE, num_samples=2)
    residual = SamplingParams(max_new_tokens=21, temperature=1.0, seed=5, ignore_eos=True, exact_rule="residual")
    exact = engine.generate(PROMPTS, residual, const(4096), num_samples=2, draft_tokens=4)
    assert [c.token_ids for c in exact] == [c.token_ids for c in dense]
    assert exact_summary(exact)["coupled_acceptance"] == 1.0


def _exact_runs(engine, rule, seed):
    sampled = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed, ignore_eos=True, exact_rule=rule)
    return engine.generate(PROMPTS, sampled, SCHEDULE, num_samples=4, draft_tokens=4)


def test_the_residual_rule_keeps_drafts_at_the_rate_alpha_above_the_coupling(llama):
    model, tok = llama
    engine = RolloutEngine(model, tok, max_batch_size=20)
    coupled, residual = (_exact_runs(engine, rule, seed=3) for rule in ("coupled", "residual"))
    kept = exact_summary(residual)["coupled_acceptance"]  # accepted over judged drafts
    assert kept > exact_summary(coupled)["coupled_acceptance"]
    judged = sum(sum(c.drafted) + c.rejections for c in residual)
    alpha = exact_summary(residual)["mean_alpha"]  # the kept drafts' alpha: a little above the judged ones'
    assert abs(kept - alpha) < 4.5 * (alpha * (1 - alpha) / judged) ** 0.5 + 0.02


def test_the_residual_rule_logs_the_dense_policys_log_probs_of_its_tokens(llama):
    """Each committed token's log-prob is the dense policy's, as a dense prefill of the finished sequence gives."""
    model, tok = llama
    engine = RolloutEngine(model, tok)
    exact = _exact_runs(engine, "residual", seed=4)[:3]
    for c in exact:
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(c.prompt_token_ids) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert np.abs(np.asarray(c.logprobs) - want.numpy()).max() < 1e-4


def test_the_residual_rule_needs_exact_mode_and_a_known_name():
    from sparrow.options import SamplingSection

    with pytest.raises(SparrowError, match="unknown exact rule 'optimal': expected one of coupled, residual"):
        SamplingParams(exact_rule="optimal")
    with pytest.raises(SparrowError, match="--exact-rule residual judges exact mode's drafts: it needs --rollout-mode exact"):
        SamplingSection(exact_rule="residual").check_exact_rule(exact=False)
    SamplingSection(exact_rule="residual").check_exact_rule(exact=True)
