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
