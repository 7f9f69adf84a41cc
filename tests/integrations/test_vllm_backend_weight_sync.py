"""`sparrow train --backend vllm`'s weight sync (`VLLMBackend.sync_weights`) is exact on a tiny Llama whose LM head
is tied to its token embedding: after every parameter is perturbed and synced, vLLM's prompt log-probs equal the
model's (float32, within 1e-4), and so do the log-probs it samples after a prompt it had cached before the sync
(the prefix cache, holding KV computed with the old weights, is reset)."""

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.engine import SamplingParams
from sparrow.schedules import parse_schedule
from tests.conftest import save_tiny_for_vllm
from tests.integrations.weight_sync import PROMPT, FailedLoads, perturb_every_parameter, prompt_logprob_gap

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


def sampled_logprob_gap(backend, model, prompt) -> float:
    """Largest |log p_vLLM - log p_model| over the tokens vLLM samples after `prompt` (temperature 1)."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, ignore_eos=True)
    done = backend.generate([prompt], sampling, parse_schedule("dense"))[0]
    ids = torch.tensor([done.prompt_token_ids + done.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(done.prompt_token_ids) - 1:-1].float()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(done.token_ids)[:, None])[:, 0]
    return float((ours - torch.tensor(done.logprobs)).abs().max())


def test_perturbing_every_parameter_tied_embedding_included_then_sync_leaves_vllm_exact(tied_backend):
    backend, model = tied_backend
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    cached = PROMPT[:150]
    assert sampled_logprob_gap(backend, model, cached) < EXACT  # its blocks now sit in vLLM's prefix cache
    perturb_every_parameter(model)
    with FailedLoads() as failed:
        backend.sync_weights(model)
    gap = prompt_logprob_gap(backend.llm, model)
    assert gap < EXACT, f"vLLM's prompt log-probs are {gap:.3g} nats off the perturbed model's after the sync"
    gap = sampled_logprob_gap(backend, model, cached)
    assert gap < EXACT, f"after a prompt cached before the sync, vLLM's log-probs are {gap:.3g} nats off"
    assert failed == []
