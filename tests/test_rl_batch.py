"""Rollouts packed for training: alignment with the logits, and the dense recompute of their log-probs."""

import torch

from sparrow.attention.teacher_forced import sparse_forward
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.metrics import acceptance_bounds, acceptance_rate
from sparrow.rl.batch import RolloutBatch, token_logprobs
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts


def _batch(llama, schedule):
    engine = RolloutEngine(*llama)
    sampling = SamplingParams(max_new_tokens=12, seed=3, num_logprobs=5)
    completions = engine.generate(random_prompts([40, 75], seed=9), sampling, schedule, num_samples=2)
    return completions, RolloutBatch.from_completions(completions)


def test_dense_recompute_matches_dense_rollout_logprobs_token_for_token(llama):
    model, _ = llama
    completions, batch = _batch(llama, DENSE)
    assert batch.mask.sum() == sum(len(c.token_ids) for c in completions)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    recomputed = token_logprobs(logits, batch.input_ids, chunk=7)
    valid = batch.mask.bool()
    assert (recomputed[valid] - batch.rollout_logprobs[valid]).abs().max() < 1e-4
    targets = batch.input_ids[:, 1:][valid]
    assert torch.equal(targets, torch.tensor([t for c in completions for t in c.token_ids]))


def test_bounds_from_packed_top_k_contain_the_exact_sparse_dense_acceptance(llama):
    model, _ = llama
    _, batch = _batch(llama, const(48))
    with torch.no_grad():
        dense = model(input_ids=batch.input_ids).logits[:, :-1]
        sparse = sparse_forward(model, batch.input_ids, batch.prompt_lengths, const(48)).logits[:, :-1]
    valid = batch.mask.bool()
    lower, upper = acceptance_bounds(batch.top_ids[valid], batch.top_logprobs[valid], dense[valid])
    exact = acceptance_rate(sparse[valid], dense[valid])
    assert torch.all(lower <= exact + 1e-4) and torch.all(exact <= upper + 1e-4)
    assert (exact < 0.999).any()  # the budget really bites on some tokens
    assert batch.kv_budget[valid].max() == 75 and 48 in batch.kv_budget[valid].tolist()
