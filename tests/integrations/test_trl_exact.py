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


def test_trls_classes_are_trls_own_once_the_trainer_is_built(exact_run):
    """The exact (and CPU) engine is the trainer's alone: TRL's `LLM` and `VLLMGeneration.sync_weights` are TRL's
    again once it is built, its own engine syncs through vLLM's `reload_weights`."""
    import vllm
    from trl.generation import vllm_generation

    from sparrow.integrations import trl_cpu

    trainer, _ = exact_run
    assert vllm_generation.LLM is vllm.LLM
    assert vllm_generation.VLLMGeneration.sync_weights.__module__ == "trl.generation.vllm_generation"
    assert trainer.vllm_generation.sync_weights.__func__ is trl_cpu._sync_weights


@pytest.mark.parametrize("cpu", [True, False])
def test_the_engine_is_built_as_sparrow_needs_and_trls_llm_comes_back_unstacked(monkeypatch, cpu):
    """Exact, exact again, then sparse, as trainers built one after another in one process: each builds its engine
    from TRL's own `LLM` (an exact engine's drafting is given once, a sparse one after it drafts nothing), and TRL's
    `LLM` is back after each, after a failed build too; server mode leaves it alone."""
    pytest.importorskip("trl")
    from trl.generation import vllm_generation

    import sparrow.integrations.trl as trl_module

    def original(*args, **kwargs):
        return kwargs

    monkeypatch.setattr(vllm_generation, "LLM", original)
    monkeypatch.setattr(trl_module, "on_cpu", lambda: cpu)
    exact = SparrowConfig(schedule="const:64", rollout_mode="exact", draft_tokens=3)
    for config in (exact, exact, SparrowConfig(schedule="const:64")):
        with trl_module.colocated_engine(config, "colocate") as reload:
            built = vllm_generation.LLM(model="/m")
        assert vllm_generation.LLM is original and reload == (cpu or config.exact)
        assert built["model"] == "/m" and (built.get("dtype"), built.get("enforce_eager")) == (
            ("float32", True) if cpu else (None, None))
        drafts = built.get("speculative_config", {}).get("num_speculative_tokens")
        assert drafts == (3 if config.exact else None)
    with pytest.raises(RuntimeError), trl_module.colocated_engine(exact, "colocate"):
        raise RuntimeError("TRL failed to build its engine")
    assert vllm_generation.LLM is original
    with trl_module.colocated_engine(exact, "server") as reload:
        assert vllm_generation.LLM is original and not reload


def test_the_reload_sync_is_one_engines_own():
    pytest.importorskip("trl")
    from trl.generation.vllm_generation import VLLMGeneration

    from sparrow.integrations import trl_cpu

    trls = VLLMGeneration.sync_weights
    ours, other = VLLMGeneration.__new__(VLLMGeneration), VLLMGeneration.__new__(VLLMGeneration)
    trl_cpu.reload_sync(ours)
    trl_cpu.reload_sync(ours)  # twice: still one sync, not one wrapped in another
    assert ours.sync_weights.__func__ is trl_cpu._sync_weights and ours.sync_weights.__self__ is ours
    assert VLLMGeneration.sync_weights is trls and other.sync_weights.__func__ is trls
