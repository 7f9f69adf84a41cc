"""Hooks Sparrow's attention into any transformers model that uses the attention interface.

`enable_sparse_attention(model)` switches the model to the registered "sparrow" implementation. A forward call
that carries `sparrow_ctx=AttentionContext(...)` runs our prefill / decode / teacher-forced attention; a call
without it runs transformers' own SDPA attention unchanged, so the same model also serves dense training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sparrow.errors import SparrowError

from .config import SparseConfig
from .kernels import decode_attention, prefill_attention, span_attention, teacher_forced_attention
from .kv_cache import DecodeStep, KVCache, SpanStep

IMPLEMENTATION = "sparrow"
CONTEXT_KEY = "sparrow_ctx"
MODES = ("prefill", "decode", "span", "teacher_forced")


@dataclass
class AttentionContext:
    """What one forward call should do.

    prefill: `cache` and the `rows` sharing the prompt; decode: `cache` and the `step` from cache.begin_step;
    span: `cache` and the `step` from cache.begin_span; teacher-forced: `budget_pages` [B, T] (None = dense) and `prompt_lengths` [B].
    """

    mode: str
    sparse: SparseConfig
    cache: KVCache | None = None
    rows: torch.Tensor | None = None
    step: DecodeStep | SpanStep | None = None
    budget_pages: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise SparrowError(f"unknown attention mode {self.mode!r}: expected one of {MODES}")


def sparrow_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered with transformers' AttentionInterface."""
    ctx: AttentionContext | None = kwargs.pop(CONTEXT_KEY, None)
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = module.layer_idx
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if ctx.mode == "prefill":
        return prefill_attention(query, key, value, ctx.cache, layer, ctx.rows, scaling), None
    if ctx.mode == "decode":
        return decode_attention(query, key, value, ctx.cache, layer, ctx.step, scaling), None
    if ctx.mode == "span":
        return span_attention(query, key, value, ctx.cache, layer, ctx.step, scaling), None
    return teacher_forced_attention(query, key, value, layer, ctx.sparse, ctx.budget_pages, ctx.prompt_lengths,
                                    scaling), None


AttentionInterface.register(IMPLEMENTATION, sparrow_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def base_model(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def can_route_attention(model) -> bool:
    """Whether `enable_sparse_attention` can route the model's attention through Sparrow."""
    inner = base_model(model)
    return (inner.config._attn_implementation == IMPLEMENTATION
            or getattr(inner, "_can_set_attn_implementation", lambda: False)())


def enable_sparse_attention(model) -> None:
    """Route the model's attention through Sparrow (idempotent); fails clearly for models that cannot."""
    inner = base_model(model)
    if inner.config._attn_implementation == IMPLEMENTATION:
        return
    if not can_route_attention(model):
        raise SparrowError(
            f"{type(inner).__name__} does not route attention through the transformers attention interface, "
            "so Sparrow cannot make it sparse"
        )
    inner.set_attn_implementation(IMPLEMENTATION)
    if inner.config._attn_implementation != IMPLEMENTATION:
        raise SparrowError(f"could not switch {type(inner).__name__} to Sparrow attention")
