"""`SparrowGRPOTrainer` with `SparrowConfig(rollout_mode="exact")`: TRL's colocated engine drafts with the policy
under the sparse schedule and verifies densely (sparrow/vllm/exact_mode.py); one GRPO step on a tiny model."""

import numpy as np
import pytest
import torch

from sparrow.errors import SparrowError
from sparrow.integrations.config import SparrowConfig
from tests.integrations.test_trl_setup import one_trl_step


def test_exact_mode_takes_a_fixed_sparse_schedule_and_a_draft_length():
    assert SparrowConfig(schedule="const:64", rollout_mode="exact", draft_tokens=2).exact
    for bad, match in ((dict(schedule="adaptive"), "fixed sparse schedule"),
                       (dict(schedule="dense"), "fixed sparse schedule"),
                       (dict(schedule="const:64", draft_tokens=0), "draft_tokens must be an integer >= 1"),
                       (dict(schedule="const:64", draft_tokens=65), "at most 64"),
                       (dict(schedule="const:64", rollout_mode="fast"), "expected 'sparse' or 'exact'")):
        with pytest.raises(SparrowError, match=match):
            SparrowConfig(**{"rollout_mode": "exact", **bad})


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    config = SparrowConfig(schedule="const:64", rollout_mode="exact", draft_tokens=2)
    with one_trl_step(tmp_path_factory.mktemp("trl-exact"), config, "count the pages " * 30, learning_rate=1e-2,
                      max_completion_length=12, vllm_max_model_length=1024) as run:
        yield run


def test_one_exact_step_drafts_sparsely_verifies_and_says_the_weights_are_one(exact_run):
    trainer, lines = exact_run
    config = trainer.vllm_generation.llm.llm_engine.vllm_config.speculative_config
    assert config.method == "draft_model" and config.num_speculative_tokens == 2
    logged = {k: v for row in trainer.state.log_history for k, v in row.items()}
    assert 1 <= logged["rollout/tokens_per_verify"] <= 3 and logged["rollout/verifications"] > 0
    assert 0 <= logged["rollout/kept_first_2"] <= logged["rollout/kept_first_1"] <= 1
    assert not any(key.startswith("mismatch/exact") for key in logged)  # nothing teacher-forced
    assert any("exact mode" in message and "importance weights are 1" in message for _, message in lines)
    assert np.isfinite(logged["loss"])


def test_trls_weight_sync_reaches_the_drafter(exact_run):
    """After the step's update, TRL's sync puts the new weights into the target and the drafter alike."""
    trainer, _ = exact_run
    generation = trainer.vllm_generation
    generation.sync_weights()
    runner = generation.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    name = "model.layers.1.input_layernorm.weight"
    trained = dict(trainer.model.named_parameters())[name].detach()
    target = dict(runner.model.named_parameters())[name]
    drafter = dict(runner.drafter.model.named_parameters())[name]
    assert not torch.equal(trained, torch.ones_like(trained))  # the update moved it (initialised to ones)
    assert torch.equal(target, trained) and torch.equal(drafter, trained)


def test_a_sparse_trainer_after_an_exact_one_gets_trls_plain_engine(monkeypatch):
    pytest.importorskip("trl")
    from trl.generation import vllm_generation

    from sparrow.integrations.trl_exact import exact_engine, plain_engine

    def original(*args, **kwargs):
        return kwargs

    monkeypatch.setattr(vllm_generation, "LLM", original)
    monkeypatch.setattr(vllm_generation.VLLMGeneration, "sync_weights", vllm_generation.VLLMGeneration.sync_weights)
    exact_engine(3)
    built = vllm_generation.LLM(model="/m", dtype="float32")
    assert built["speculative_config"]["num_speculative_tokens"] == 3 and built["model"] == "/m"
    exact_engine(2)  # wrapped once, with the new length
    assert vllm_generation.LLM(model="/m")["speculative_config"]["num_speculative_tokens"] == 2
    plain_engine()
    assert vllm_generation.LLM is original
