"""Teacher-forced sparse forward: the logits the sparse actor had for every token of given sequences."""

from __future__ import annotations

import torch

from sparrow.schedules import Schedule

from .config import SparseConfig
from .interface import CONTEXT_KEY, AttentionContext, enable_sparse_attention


def sparse_forward(model, input_ids: torch.Tensor, prompt_lengths: torch.Tensor, schedule: Schedule,
                   sparse: SparseConfig | None = None, **model_kwargs):
    """Run `model` on right-padded sequences [B, T] with the rollout's attention at every position.

    Positions before `prompt_lengths[b]` attend densely (they were the prefill); position t >= prompt length
    attends as the decode step that consumed token t did: budget `schedule(t + 1)`, pages selected from the t+1
    cached tokens. Returns the model output (logits [B, T, V]); gradients flow, so this also trains adapters.
    """
    sparse = sparse or SparseConfig()
    enable_sparse_attention(model)
    length = input_ids.shape[1]
    budget = None
    if not schedule.is_dense:
        schedule.validate(sparse.page_size, sparse.always_kept_pages)
        cached = torch.arange(1, length + 1, device=input_ids.device)
        budget = (schedule.budget_for(cached) // sparse.page_size).expand(input_ids.shape[0], length)
    ctx = AttentionContext("teacher_forced", sparse, budget_pages=budget,
                           prompt_lengths=prompt_lengths.to(input_ids.device))
    return model(input_ids=input_ids, use_cache=False, **model_kwargs, **{CONTEXT_KEY: ctx})


def sparse_completion_logits(model, input_ids: torch.Tensor, prompt_length: int, schedule: Schedule,
                             sparse: SparseConfig | None = None) -> torch.Tensor:
    """The sparse actor's logits [G, T - P, V] predicting tokens P .. T-1 of G right-padded sequences that share
    their first P tokens: `sparse_forward` restricted to the completion positions, with the prompt's dense prefill
    run once and its KV cache shared by the G rows (gradients flow through it, as in a full forward)."""
    sparse = sparse or SparseConfig()
    enable_sparse_attention(model)
    g, length = input_ids.shape
    first = model(input_ids=input_ids[:1, :prompt_length], use_cache=True, logits_to_keep=1)
    logits = first.logits.expand(g, -1, -1)
    if length - 1 <= prompt_length:
        return logits
    cache = first.cache
    cache.batch_repeat_interleave(g)
    budget = None
    if not schedule.is_dense:
        schedule.validate(sparse.page_size, sparse.always_kept_pages)
        cached = torch.arange(prompt_length + 1, length, device=input_ids.device)
        budget = (schedule.budget_for(cached) // sparse.page_size).expand(g, length - 1 - prompt_length)
    lengths = torch.full((g,), prompt_length, device=input_ids.device)
    ctx = AttentionContext("teacher_forced", sparse, budget_pages=budget, prompt_lengths=lengths)
    rest = model(input_ids=input_ids[:, prompt_length:-1], cache=cache, use_cache=True, **{CONTEXT_KEY: ctx})
    return torch.cat([logits, rest.logits], dim=1)
