"""Exact acceptance of finished rollouts: teacher-forced equals the lockstep decode replay and the engine's own
lockstep reference, on the tokens of real sparse rollouts, for both landmarks and every tiny architecture."""

import numpy as np
import pytest

from sparrow.attention import SparseConfig
from sparrow.attention.landmarks import LANDMARKS
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.measure import lockstep_acceptance, teacher_forced_acceptance
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts


@pytest.mark.parametrize("landmark", LANDMARKS)
def test_teacher_forced_acceptance_equals_the_lockstep_replay(tiny, landmark):
    model, tok = tiny
    sparse = SparseConfig(landmark=landmark)
    engine = RolloutEngine(model, tok, sparse)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    schedule = const(48)
    completions = engine.generate(random_prompts([150, 97], seed=5), sampling, schedule, num_samples=2)
    forced = teacher_forced_acceptance(model, completions, schedule, sparse, temperature=1.0)
    for c, alpha in zip(completions, forced):
        replay = lockstep_acceptance(engine, c, schedule, temperature=1.0)
        assert len(alpha) == len(c.token_ids) == len(replay)
        np.testing.assert_allclose(alpha, replay, atol=1e-5)
        assert min(alpha) < 0.999  # the budget really is sparse here
        assert abs(alpha[0] - 1.0) < 1e-6  # the first token comes from the dense prefill


def test_acceptance_is_one_for_dense_rollouts(llama):
    model, tok = llama
    engine = RolloutEngine(model, tok)
    sampling = SamplingParams(max_new_tokens=12, seed=0, ignore_eos=True)
    completions = engine.generate(random_prompts([80, 40], seed=1), sampling, DENSE, num_samples=2)
    for alpha in teacher_forced_acceptance(model, completions, DENSE, SparseConfig(), temperature=1.0):
        np.testing.assert_allclose(alpha, 1.0, atol=1e-5)


def test_the_sparse_forward_reuses_the_dense_forwards_prompt(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1, ignore_eos=True)
    completions = engine.generate(random_prompts([120], seed=2), sampling, const(48), num_samples=3)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        shared = teacher_forced_acceptance(model, completions, const(48), SparseConfig(), temperature=1.0)
    finally:
        hook.remove()
    assert seen.count(len(completions[0].prompt_token_ids)) == 1  # dense and sparse share one prompt forward
    for c, alpha in zip(completions, shared):
        np.testing.assert_allclose(alpha, lockstep_acceptance(engine, c, const(48), temperature=1.0), atol=1e-5)
