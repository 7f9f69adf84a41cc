"""Activation checkpointing that keeps the KV cache: one decoder layer's activations alive at a time in backward.

A forward with gradients over a long prompt keeps every layer's activations until backward (about 1.5 GB per 1K
tokens for SmolLM2-135M), and the update needs that forward's KV cache as an output for the completions.
transformers' own gradient checkpointing switches the cache off, so here each decoder layer runs under
`torch.utils.checkpoint` (non-reentrant) with the cache left on. Recomputing a layer in backward must see the
cache as its first run did, not with its own keys appended a second time, so each run starts by restoring its
cache layer's state from before the first run (only its own layer's: the others' earlier states would stay
alive). Values and gradients equal those of the plain forward; the price is a second forward of every layer in
backward.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from sparrow.errors import SparrowError


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules transformers marks as checkpointable."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _cache_of(kwargs: dict):
    cache = kwargs.get("past_key_values")
    return cache if cache is not None and hasattr(cache, "layers") else None


def _cache_index(layer) -> int | None:
    """The cache layer a decoder layer writes (Llama, Qwen and most transformers models name it on self_attn)."""
    return getattr(getattr(layer, "self_attn", None), "layer_idx", None)


def _checkpointed(forward, index: int | None):
    """`forward` of decoder layer `index` (its cache layer; None: unknown, so every cache layer is restored)."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        cache = _cache_of(kwargs)
        layers = [] if cache is None else cache.layers
        own = index is not None and index < len(layers)
        kept = {i: dict(vars(layers[i])) for i in ([index] if own else range(len(layers)))}
        count = len(layers)

        def again(*a, **k):
            if not own:
                del layers[count:]
            for i, state in kept.items():
                vars(layers[i]).clear()
                vars(layers[i]).update(state)
            return forward(*a, **k)

        return checkpoint(again, *args, use_reentrant=False, **kwargs)

    return run


@contextlib.contextmanager
def checkpointed_layers(model, enabled: bool = True):
    """Inside, forwards with gradients keep only each decoder layer's inputs and recompute the rest in backward.

    Tensors built inside keep their recipe after the context exits, so a backward that runs later (a shared
    prompt's, after its micro-batches) recomputes correctly. `enabled=False` is a no-op, for config switches.
    """
    layers = decoder_layers(model) if enabled else []
    if enabled and not layers:
        raise SparrowError(f"gradient_checkpointing: {type(model).__name__} has no transformers decoder layers to "
                           "checkpoint; turn gradient_checkpointing off for this model")
    own = [vars(layer).get("forward") for layer in layers]
    for layer in layers:
        layer.forward = _checkpointed(layer.forward, _cache_index(layer))
    try:
        yield
    finally:
        for layer, forward in zip(layers, own, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
