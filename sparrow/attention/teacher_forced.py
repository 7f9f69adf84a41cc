"""Teacher-forced sparse forward: the logits the sparse actor had for every token of given sequences."""

from __future__ import annotations

import torch

from sparrow.schedules import Schedule

from .config import SparseConfig
from .interface import CONTEXT_KEY, AttentionContext, base_model, can_route_attention, enable_sparse_attention


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


def shared_prompt_logits(model, input_ids: torch.Tensor, prompt_length: int, **continuation_kwargs) -> torch.Tensor:
    """Logits [G, T - P, V] predicting tokens P .. T-1 of G right-padded sequences that share their first P tokens.

    The prompt runs once, with the model's own dense attention (as the rollout's prefill did), and its KV cache
    is repeated for the G rows; `continuation_kwargs` go to the completions' forward (e.g. a Sparrow attention
    context). Gradients flow through the shared cache, so values and gradients equal those of G full forwards,
    at the cost of one prompt per group; logits are computed only where tokens are predicted.
    """
    first = model(input_ids=input_ids[:1, :prompt_length], use_cache=True, logits_to_keep=1)

    def repeated(g: int):
        first.past_key_values.batch_repeat_interleave(g)
        return first.past_key_values

    return _completion_logits(model, first.logits, repeated, input_ids, prompt_length, **continuation_kwargs)


def plain_cache(model) -> bool:
    """Whether every layer of `model`'s cache is a plain dynamic one (no sliding window): its completions may be
    teacher-forced after a shared prompt cache with Sparrow's attention."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=base_model(model).config).layers)


def _dense_context(model, rows: int, prompt_length: int, device) -> AttentionContext:
    """The dense teacher-forced context: right-padded completions after a shared prompt attend causally, which
    `prefix_attention` does without a mask on CPU (right padding changes only the padded positions' outputs)."""
    enable_sparse_attention(model)
    lengths = torch.full((rows,), prompt_length, device=device)
    return AttentionContext("teacher_forced", SparseConfig(), prompt_lengths=lengths)


def _completion_logits(model, first_logits: torch.Tensor, cache_for, input_ids: torch.Tensor, prompt_length: int,
                       **continuation_kwargs) -> torch.Tensor:
    """The prompt's last logits [1, 1, V] for every row, then the completions' forward over `cache_for(G)` (the
    prompt's KV cache for G rows, built only when there is a completion token to feed)."""
    g, length = input_ids.shape
    logits = first_logits.expand(g, -1, -1)
    if length - 1 <= prompt_length:
        return logits
    if CONTEXT_KEY not in continuation_kwargs and can_route_attention(model) and plain_cache(model):
        continuation_kwargs[CONTEXT_KEY] = _dense_context(model, g, prompt_length, input_ids.device)
    rest = model(input_ids=input_ids[:, prompt_length:-1], past_key_values=cache_for(g), use_cache=True,
                 **continuation_kwargs)
    return torch.cat([logits, rest.logits], dim=1)


class SharedPrompt:
    """One prompt's forward with gradients, shared by every micro-batch of its completions.

    `shared_prompt_logits` computes the prompt once per call, so an update in micro-batches of m rows runs a
    group's prompt forward and backward n/m times. Here it runs once: the prompt's KV cache and first logits are
    kept as detached leaves, each micro-batch (`logits`, the same contract as `shared_prompt_logits`) backpropagates
    into them, and `backward()` sends their summed gradients through the prompt in one pass. The gradients equal
    the per-micro-batch path's up to summation order. Models whose cache is not made of plain dynamic layers
    (sliding windows) keep the per-call path: `supported` is False and `logits` recomputes the prompt.
    """

    def __init__(self, model, prompt_ids: torch.Tensor):
        self.supported = plain_cache(model)
        self._roots, self._leaves = [], []
        if self.supported:
            first = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1)
            layers = first.past_key_values.layers
            self._roots = [first.logits] + [t for layer in layers for t in (layer.keys, layer.values)]
            self._leaves = [t.detach().requires_grad_(torch.is_grad_enabled()) for t in self._roots]

    def logits(self, model, input_ids: torch.Tensor, prompt_length: int, **continuation_kwargs) -> torch.Tensor:
        """`shared_prompt_logits` with this prompt's forward; `continuation_kwargs` as there."""
        if not self.supported:
            return shared_prompt_logits(model, input_ids, prompt_length, **continuation_kwargs)
        from transformers.cache_utils import DynamicCache

        first, *kv = self._leaves

        def expanded(g: int):
            return DynamicCache(ddp_cache_data=[(k.expand(g, -1, -1, -1), v.expand(g, -1, -1, -1))
                                                for k, v in zip(kv[::2], kv[1::2], strict=True)])

        return _completion_logits(model, first, expanded, input_ids, prompt_length, **continuation_kwargs)

    def backward(self) -> None:
        """The prompt's share of the gradients, once, from what the micro-batches left on the leaves."""
        pairs = [(root, leaf.grad) for root, leaf in zip(self._roots, self._leaves, strict=True)
                 if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        self._roots = self._leaves = []


def sparse_completion_logits(model, input_ids: torch.Tensor, prompt_length: int, schedule: Schedule,
                             sparse: SparseConfig | None = None, prompt: SharedPrompt | None = None) -> torch.Tensor:
    """The sparse actor's `shared_prompt_logits`: `sparse_forward` restricted to the completion positions, the
    prompt's dense prefill run once for the group, or taken from `prompt` (a `SharedPrompt` the same weights made,
    e.g. for the dense forward of the same rows: the prefill is dense, so its keys and values are the same)."""
    sparse = sparse or SparseConfig()
    enable_sparse_attention(model)
    g, length = input_ids.shape
    budget = None
    if not schedule.is_dense:
        schedule.validate(sparse.page_size, sparse.always_kept_pages)
        cached = torch.arange(prompt_length + 1, length, device=input_ids.device)
        budget = (schedule.budget_for(cached) // sparse.page_size).expand(g, -1)
    lengths = torch.full((g,), prompt_length, device=input_ids.device)
    ctx = AttentionContext("teacher_forced", sparse, budget_pages=budget, prompt_lengths=lengths)
    forward = shared_prompt_logits if prompt is None else prompt.logits
    return forward(model, input_ids, prompt_length, **{CONTEXT_KEY: ctx})
