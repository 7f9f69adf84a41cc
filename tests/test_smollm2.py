"""Real-model checks on SmolLM2-135M-Instruct (slow: run with `pytest -m slow`; `-s` shows each phase)."""

import functools
import sys

import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import sparse_forward
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.models import load_model
from sparrow.schedules import DENSE, const

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]


def phase(message: str) -> None:
    """One line per phase on stderr, so a slow run shows where it is."""
    print(f"[smollm2] {message}", file=sys.stderr, flush=True)


@functools.cache
def smollm2():
    phase("loading smollm2-135m (the first run converts the GGUF)")
    return load_model("smollm2-135m")


def test_dense_greedy_equals_transformers_generate_over_64_tokens():
    model, tok = smollm2()
    engine = RolloutEngine(model, tok)
    phase(f"dense greedy decode: {len(PROMPTS)} prompts x 64 tokens")
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=64, temperature=0), DENSE,
                           apply_chat_template=True)
    phase("transformers generate on the same prompts, compared token for token")
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        ref = model.generate(ids, max_new_tokens=64, do_sample=False)
        assert ref[0, ids.shape[1]:].tolist() == out.token_ids


def test_aggressive_budget_on_a_long_prompt_changes_the_logits():
    model, tok = smollm2()
    text = " ".join(f"Item {i}: the value of register {i % 7} is {i * 37 % 101}." for i in range(120))
    engine = RolloutEngine(model, tok)
    prompt = engine.encode(text + "\nWhat is the value of register 3 in item 45?", apply_chat_template=True)
    assert len(prompt) > 1500
    phase(f"const:128 decode of 16 tokens on a {len(prompt)}-token prompt, then dense and sparse forward passes")
    out = engine.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0), const(128))[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        dense = sparse_forward(model, ids, torch.tensor([len(prompt)]), DENSE, SparseConfig()).logits[0]
        sparse = sparse_forward(model, ids, torch.tensor([len(prompt)]), const(128), SparseConfig()).logits[0]
    generated = slice(len(prompt), ids.shape[1])
    assert (dense[: len(prompt)] - sparse[: len(prompt)]).abs().max() < 1e-3
    assert (dense[generated] - sparse[generated]).abs().max() > 0.5
    decoded = torch.log_softmax(sparse[len(prompt) - 1: -1].float(), -1)
    got = decoded.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    assert (got - torch.tensor(out.logprobs)).abs().max() < 1e-3


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_teacher_forcing_reproduces_sampled_sparse_rollouts_through_either_path(kernel, monkeypatch):
    """Sampled text at temperature 1 on a 3.3K-token manifest prompt, decoded at const:512: the teacher-forced
    log-probs of the kernel path (each position one decode step) and of the masked-SDPA path are the decode's."""
    from sparrow.tasks import manifest

    model, tok = smollm2()
    engine = RolloutEngine(model, tok)
    prompt = engine.encode(manifest.make_prompts(1, 3000, seed=3, tokenizer=tok, codes=96)[0]["prompt"],
                           apply_chat_template=True)
    phase(f"2 x 128 tokens sampled at const:512 after a {len(prompt)}-token prompt, teacher-forced (kernel={kernel})")
    outs = engine.generate([prompt], SamplingParams(max_new_tokens=128, temperature=1.0, seed=1, ignore_eos=True),
                           const(512), num_samples=2)
    monkeypatch.setenv("SPARROW_CPU_KERNEL", kernel)
    ids = torch.tensor([prompt + o.token_ids for o in outs])
    with torch.no_grad():
        logits = sparse_forward(model, ids, torch.full((2,), len(prompt)), const(512), SparseConfig()).logits
    logp = torch.log_softmax(logits[:, len(prompt) - 1: -1].float(), -1)
    got = logp.gather(-1, ids[:, len(prompt):, None]).squeeze(-1)
    diff = (got - torch.tensor([o.logprobs for o in outs])).abs()
    assert float(diff.mean()) < 1e-4 and float(diff.max()) < 1e-2


def test_exact_mode_returns_dense_samplings_tokens_on_long_prompts():
    """4 manifest prompts of ~3.5K tokens x 4 samples x 128 tokens at temperature 1: exact mode (const:1024
    drafting 4 tokens) gives dense sampling's tokens; the drafts are mostly accepted."""
    from sparrow.engine.exact import exact_summary
    from sparrow.tasks.manifest import make_prompts

    model, tok = smollm2()
    engine = RolloutEngine(model, tok, max_batch_size=16)
    prompts = [ex["prompt"] for ex in make_prompts(4, 3000, 0, tok)]
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, seed=11)
    phase("dense sampling: 4 manifest prompts x 4 samples x 128 tokens")
    dense = engine.generate(prompts, sampling, DENSE, num_samples=4)
    phase("exact mode (const:1024 drafting 4 tokens), the same prompts and seed")
    exact = engine.generate(prompts, sampling, const(1024), num_samples=4, draft_tokens=4)
    differ = [(c.prompt_index, c.sample_index) for c, d in zip(exact, dense) if c.token_ids != d.token_ids]
    assert not differ, f"exact mode left dense sampling at {differ} (a boundary flip would show here)"
    summary = exact_summary(exact)
    assert summary["tokens_per_verify"] > 3 and summary["coupled_acceptance"] > 0.85
