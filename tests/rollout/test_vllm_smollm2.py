"""vLLM with Sparrow's plugin on SmolLM2-135M (slow: `pytest -m slow`): sparse samples of ~2-3.5K-token prompts,
several concurrent requests of different lengths with prefix caching, teacher-forced through our sparse forward."""

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import sparse_completion_logits
from sparrow.engine import SamplingParams
from sparrow.models import load_model
from sparrow.schedules import const
from sparrow.tasks.passkey import make_prompts

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")


@pytest.mark.parametrize("landmark", ["centroid", "quest"])
def test_smollm2_sparse_samples_teacher_force_to_vllms_log_probs(landmark):
    from sparrow.rollout.vllm_backend import VLLMBackend, model_directory

    model, tok = load_model("smollm2-135m")
    prompts = [make_prompts(1, n, seed, tok)[0]["prompt"] for seed, n in ((0, 3000), (1, 2000), (2, 3500))]
    sparse = SparseConfig(landmark=landmark)
    backend = VLLMBackend(model_directory("smollm2-135m"), tok, sparse, max_model_len=4096, kv_cache_gib=2)
    try:
        schedule = const(256)
        rollouts = backend.generate(prompts, SamplingParams(max_new_tokens=48, seed=4, ignore_eos=True), schedule, 2)
    finally:
        backend.close()
    close = total = 0
    for c in rollouts:
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logits = sparse_completion_logits(model, ids, len(c.prompt_token_ids), schedule, sparse)[0]
        ours = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        diff = (ours - torch.tensor(c.logprobs)).abs()
        close += int((diff < 1e-3).sum())
        total += diff.numel()
    assert min(len(c.prompt_token_ids) for c in rollouts) > 1900
    assert close / total >= 0.99, f"{close}/{total} tokens within 1e-3"


def test_smollm2_exact_mode_in_vllm_returns_dense_greedy_tokens():
    """Exact mode inside vLLM on the real model: greedy, drafts at const:256 over 2-3K-token passkey prompts, the
    tokens equal vLLM's dense greedy decoding (a float flip between the verification's multi-token forward and a
    one-token step would show as a late first difference), and most tokens are accepted drafts."""
    from sparrow.rollout.vllm_backend import VLLMBackend, model_directory
    from sparrow.schedules import DENSE

    model, tok = load_model("smollm2-135m")
    prompts = [make_prompts(1, n, seed, tok)[0]["prompt"] for seed, n in ((0, 3000), (1, 2000))]
    greedy = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    outputs = {}
    for drafts in (None, 3):
        backend = VLLMBackend(model_directory("smollm2-135m"), tok, SparseConfig(), max_model_len=4096,
                              kv_cache_gib=2, draft_tokens=drafts, log=lambda _: None)
        try:
            outputs[drafts] = backend.generate(prompts, greedy, DENSE if drafts is None else const(256),
                                               draft_tokens=drafts)
        finally:
            backend.close()
    assert [c.token_ids for c in outputs[3]] == [c.token_ids for c in outputs[None]]
    assert sum(sum(c.drafted) for c in outputs[3]) > 0.5 * sum(len(c.token_ids) for c in outputs[3])
