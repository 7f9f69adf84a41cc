"""Shared fixtures: tiny random models (seconds to build) and helpers to pad sequences."""

import functools

import pytest
import torch

from sparrow.models import load_model


@functools.cache
def _tiny(name):
    return load_model(name)


@pytest.fixture(params=["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def tiny(request):
    """(model, tokenizer) for each tiny architecture; cached, so tests must not train it."""
    return _tiny(request.param)


@pytest.fixture
def llama():
    return _tiny("tiny-llama")


def pad_sequences(sequences: list[list[int]]) -> torch.Tensor:
    """Right-pad token lists with 0 into one [B, T] tensor."""
    width = max(len(s) for s in sequences)
    out = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq)
    return out


def random_prompts(lengths, vocab=250, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
