"""Rollouts packed for training: alignment with the logits, and the dense recompute of their log-probs."""

import torch

from sparrow.attention.teacher_forced import SharedPrompt, sparse_forward
from sparrow.engine import Completion, RolloutEngine, SamplingParams
from sparrow.measure.batch import RolloutBatch, piece_logits, piece_logprobs, shared_prompt_pieces
from sparrow.measure.bounds import acceptance_bounds
from sparrow.metrics.divergence import acceptance_rate
from sparrow.models import load_model
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts
from tests.reference import token_logprobs


def _batch(llama, schedule):
    engine = RolloutEngine(*llama)
    sampling = SamplingParams(max_new_tokens=12, seed=3, num_logprobs=5)
    completions = engine.generate(random_prompts([40, 75], seed=9), sampling, schedule, num_samples=2)
    return completions, RolloutBatch.from_completions(completions)


def _group(prompt: torch.Tensor, lengths: list[int]) -> RolloutBatch:
    """One group of random completions of `lengths` tokens after `prompt` [1, P], packed."""
    return RolloutBatch.from_completions([
        Completion(prompt_index=0, sample_index=i, prompt_token_ids=prompt[0].tolist(),
                   token_ids=torch.randint(3, 200, (n,)).tolist(), logprobs=[-1.0] * n,
                   top_token_ids=[[1]] * n, top_logprobs=[[-1.0]] * n, kv_budget=[0] * n)
        for i, n in enumerate(lengths)
    ])


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


def test_shared_prompt_forward_equals_full_forwards_in_values_and_gradients():
    """One prompt computed once for a group gives the same log-probs and gradients as G full forwards."""
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-qwen3")
    RolloutEngine(model, tokenizer)  # the trainer's model has Sparrow's attention registered; its dense path serves
    prompt = torch.randint(3, 200, (1, 37))
    lengths = [5, 9, 1]
    batch = _group(prompt, lengths)
    rows = torch.arange(3)
    assert [p.tolist() for p in shared_prompt_pieces(batch, rows, max_rows=2)] == [[0, 1], [2]]

    full = token_logprobs(model(input_ids=batch.input_ids).logits, batch.input_ids)
    (full * batch.mask).sum().backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits, span = piece_logits(model, batch, rows)
    shared = piece_logprobs(logits, batch, rows, span)
    (shared * batch.mask).sum().backward()
    assert logits.shape[1] == max(lengths)  # logits only where completion tokens are predicted
    assert torch.allclose(shared * batch.mask, full * batch.mask, atol=1e-5)
    for got, want in zip((p.grad for p in model.parameters()), full_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_a_prompt_shared_by_micro_batches_gives_the_gradients_of_full_forwards():
    """The update's micro-batches of one group share one prompt forward (`SharedPrompt`): the same log-probs,
    and after its one backward the same gradients as full forwards; without that backward the prompt's share is
    missing."""
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-llama")
    RolloutEngine(model, tokenizer)
    prompt = torch.randint(3, 200, (1, 41))
    batch = _group(prompt, [6, 3, 8, 1])
    full = token_logprobs(model(input_ids=batch.input_ids).logits, batch.input_ids)
    (full * batch.mask).sum().backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    shared = SharedPrompt(model, batch.input_ids[:1, :41])
    assert shared.supported
    for micro in shared_prompt_pieces(batch, torch.arange(4), max_rows=2):
        logits, span = piece_logits(model, batch, micro, forward=shared.logits)
        logp = piece_logprobs(logits, batch, micro, span)
        assert torch.allclose(logp * batch.mask[micro], full[micro] * batch.mask[micro], atol=1e-5)
        (logp * batch.mask[micro]).sum().backward()
    embed = model.get_input_embeddings().weight
    prompt_rows = prompt[0].unique()
    index = next(i for i, p in enumerate(model.parameters()) if p is embed)
    assert not torch.allclose(embed.grad[prompt_rows], full_grads[index][prompt_rows], atol=1e-5)
    shared.backward()
    for got, want in zip((p.grad for p in model.parameters()), full_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
