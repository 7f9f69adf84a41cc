"""Checkpointed decoder layers with the KV cache on: same logits and gradients, far fewer saved activations."""

import copy

import pytest
import torch

from sparrow.attention.teacher_forced import SharedPrompt, sparse_completion_logits
from sparrow.rl.activation_checkpointing import checkpointed_layers, decoder_layers
from sparrow.schedules import const
from tests.conftest import pad_sequences, random_prompts

PROMPT = 40


def _batch(seed=0):
    prompt = random_prompts([PROMPT], seed=seed)[0]
    tails = random_prompts([23, 31, 17], seed=seed + 1)
    return pad_sequences([prompt + t for t in tails])


def _grads(model, backward_of, enabled):
    model.zero_grad(set_to_none=True)
    with checkpointed_layers(model, enabled):
        logits = backward_of(model)
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _shared_prompt(model):
    """The update's path: one shared prompt forward, completions in two micro-batches, the prompt's backward last."""
    ids = _batch()
    prompt = SharedPrompt(model, ids[:1, :PROMPT])
    assert prompt.supported
    parts = []
    for rows in (torch.tensor([0, 1]), torch.tensor([2])):
        logits = prompt.logits(model, ids[rows], PROMPT)
        (logits.float().logsumexp(-1).mean() * len(rows)).backward()
        parts.append(logits.detach())
    prompt.backward()
    return torch.cat(parts)


def _sparse(model):
    """The adapter update's path: the sparse actor's completions at a budget below the sequence length."""
    ids = _batch(seed=3)
    logits = sparse_completion_logits(model, ids, PROMPT, const(48))
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach()


@pytest.mark.parametrize("known_index", [True, False], ids=["own-cache-layer", "all-cache-layers"])
@pytest.mark.parametrize("backward_of", [_shared_prompt, _sparse], ids=["shared-prompt", "sparse"])
def test_checkpointed_layers_give_the_same_logits_and_gradients(tiny, backward_of, known_index, monkeypatch):
    """Also for layers whose cache index is unknown: then every cache layer is restored before a recompute."""
    if not known_index:
        monkeypatch.setattr("sparrow.rl.activation_checkpointing._cache_index", lambda layer: None)
    model = copy.deepcopy(tiny[0]).float().train()
    plain_logits, plain = _grads(model, backward_of, enabled=False)
    logits, grads = _grads(model, backward_of, enabled=True)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=0)
    assert plain.keys() == grads.keys() and len(grads) > 10
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _saved_bytes(model, enabled):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    ids = _batch()[:1]
    with checkpointed_layers(model, enabled), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return sum(saved)


def test_checkpointed_layers_save_a_fraction_of_the_activations(llama):
    model = llama[0]
    plain, checkpointed = _saved_bytes(model, False), _saved_bytes(model, True)
    assert checkpointed < plain / 4, (checkpointed, plain)


def test_layers_are_restored_and_no_grad_is_untouched(llama):
    model = llama[0]
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    ids = _batch()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with checkpointed_layers(model):
            assert all("forward" in vars(layer) for layer in layers)
            inside = model(input_ids=ids).logits
    assert all("forward" not in vars(layer) for layer in layers)
    torch.testing.assert_close(inside, before, rtol=0, atol=0)


def test_a_model_without_decoder_layers_is_refused():
    from sparrow.errors import SparrowError

    with pytest.raises(SparrowError, match="gradient_checkpointing: Linear has no transformers decoder layers"):
        with checkpointed_layers(torch.nn.Linear(2, 2)):
            pass
