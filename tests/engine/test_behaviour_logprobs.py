"""The behaviour log-prob each rollout token carries under top-p and top-k (docs/metrics.md, "Top-p and top-k in
the correction"): the log-prob of its actor's distribution after temperature and before truncation, for sparse,
dense and exact rollouts; the token itself is drawn from the truncated, renormalised distribution."""

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import shared_prompt_logits, sparse_completion_logits
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.engine.sampling import truncate
from sparrow.measure.batch import RolloutBatch, piece_logits, piece_logprobs
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

SCHEDULE = const(48)
PROMPTS = random_prompts([70, 130], seed=4)
TRUNCATED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.7, top_k=20, seed=3, ignore_eos=True)


def _teacher_forced(model, completions, forward, params):
    """Per rollout token: the rollout's own log-prob, and the untruncated and truncated-renormalised log-probs of
    the same token under `forward`'s logits (the dense policy's or the sparse actor's, teacher-forced)."""
    batch = RolloutBatch.from_completions(completions)
    logged, full, cut = [], [], []
    with torch.no_grad():
        for row in range(len(completions)):
            piece = torch.tensor([row])
            logits, span = piece_logits(model, batch, piece, forward)
            valid = batch.mask[piece, span].bool()
            targets = batch.input_ids[piece, span.start + 1: span.stop + 1]
            scaled = logits.float() / params.logprob_temperature
            kept = truncate(scaled.flatten(0, 1), params).view_as(scaled)
            cut.append(torch.log_softmax(kept, -1).gather(-1, targets[..., None])[..., 0][valid])
            full.append(piece_logprobs(logits, batch, piece, span, params.logprob_temperature)[:, span][valid])
            logged.append(batch.rollout_logprobs[piece, span][valid])
    return torch.cat(logged), torch.cat(full), torch.cat(cut)


def _sparse_actor(model, input_ids, prompt_length):
    return sparse_completion_logits(model, input_ids, prompt_length, SCHEDULE, SparseConfig())


@pytest.mark.parametrize("mode", ["sparse", "dense", "exact"])
def test_the_logged_behaviour_logprob_is_the_untruncated_one_of_the_actor_that_sampled(llama, mode):
    model, tok = llama
    engine = RolloutEngine(model, tok)
    schedule = DENSE if mode == "dense" else SCHEDULE
    out = engine.generate(PROMPTS, TRUNCATED, schedule, num_samples=2,
                          draft_tokens=4 if mode == "exact" else None)
    # the sparse actor sampled sparse rollouts; the dense policy sampled dense ones and verified the exact ones
    forward = _sparse_actor if mode == "sparse" else shared_prompt_logits
    logged, full, cut = _teacher_forced(model, out, forward, TRUNCATED)
    assert torch.isfinite(cut).all()  # every token was drawn inside the top-k / top-p support
    # the logged log-prob: before truncation, as the trainer's recompute (`piece_logprobs`) of pi_old is, so a
    # dense rollout's TIS ratio is 1 under top-p as without it
    assert torch.allclose(logged, full, atol=2e-4)
    assert (cut - logged).min() >= -2e-4 and (cut - logged).mean() > 0.05  # not the renormalised one
    if mode == "exact":
        assert any(any(c.drafted) for c in out)  # drafts were kept, and the log-probs are still the dense policy's
