"""`sparrow train --backend vllm`'s weight sync (`VLLMBackend.sync_weights`) is exact on a tiny Llama whose LM head
is tied to its token embedding: after every parameter is perturbed and synced, vLLM's prompt log-probs equal the
model's (float32, within 1e-4), and so do the log-probs it samples after a prompt it had cached before the sync
(the prefix cache, holding KV computed with the old weights, is reset), under the dense schedule and under a sparse
one (const:64: the cached prompt's pages are selected by landmarks of its keys, which must be the new weights').

No LoRA variant: `--backend vllm` refuses a run with an adapter before the engine starts (rollout/factory.py:
DistillSparse's adapter would have to act in the sparse actor only, which vLLM does not build), so this sync never
sees one. TRL's LoRA path (the adapter merged into what vLLM samples with) is tested in test_trl_weight_sync.py."""

import pytest

from sparrow.attention import SparseConfig
from sparrow.engine import SamplingParams
from sparrow.schedules import parse_schedule
from tests.conftest import save_tiny_for_vllm
from tests.integrations.weight_sync import (PROMPT, FailedLoads, completion_logprob_gap, perturb_every_parameter,
                                            prompt_logprob_gap)

pytest.importorskip("vllm")

EXACT = 1e-4


@pytest.fixture(scope="module")
def tied_backend(tmp_path_factory):
    from sparrow.models import load_model
    from sparrow.rollout.vllm_backend import VLLMBackend

    path = save_tiny_for_vllm(tmp_path_factory.mktemp("backend-sync") / "tiny-tied", tied=True)
    model, tok = load_model(str(path))
    backend = VLLMBackend(path, tok, SparseConfig(), max_model_len=1024, kv_cache_gib=1, log=lambda *_: None)
    yield backend, model
    backend.close()


def sampled_logprob_gap(backend, model, prompt, schedule: str, teacher: str | None = None) -> float:
    """Largest |log p_vLLM - log p_model| over the tokens vLLM samples after `prompt` (temperature 1) under
    `schedule`, the model teacher-forced under the same schedule (or `teacher`)."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, ignore_eos=True)
    done = backend.generate([prompt], sampling, parse_schedule(schedule))[0]
    return completion_logprob_gap(model, done.prompt_token_ids, done.token_ids, done.logprobs, teacher or schedule)


@pytest.mark.parametrize("schedule", ["dense", "const:64"])
def test_perturbing_every_parameter_tied_embedding_included_then_sync_leaves_vllm_exact(tied_backend, schedule):
    backend, model = tied_backend
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    cached = PROMPT[:150]  # 10 pages: const:64 attends 4 of them (sink, 2 recent, 1 by landmark) at each step
    assert sampled_logprob_gap(backend, model, cached, schedule) < EXACT  # its blocks now sit in the prefix cache
    if schedule != "dense":  # vLLM decoded sparsely: the dense model disagrees
        assert sampled_logprob_gap(backend, model, cached, schedule, teacher="dense") > 1e-3
    perturb_every_parameter(model)
    with FailedLoads() as failed:
        backend.sync_weights(model)
    gap = prompt_logprob_gap(backend.llm, model)
    assert gap < EXACT, f"vLLM's prompt log-probs are {gap:.3g} nats off the perturbed model's after the sync"
    gap = sampled_logprob_gap(backend, model, cached, schedule)
    assert gap < EXACT, f"after a prompt cached before the sync, vLLM's {schedule} log-probs are {gap:.3g} nats off"
    assert failed == []
