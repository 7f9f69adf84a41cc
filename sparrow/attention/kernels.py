"""Attention for the three phases of a rollout, in plain PyTorch (CPU or CUDA).

- prefill: dense causal attention over one prompt, whose keys/values are written into the rows that share it;
- decode: one new token per row against the cache, dense or restricted to the selected pages;
- span: several new tokens per row against the cache, densely (the verification of drafted tokens);
- teacher-forced: a whole sequence at once, each position attending as it did when it was decoded.
Outputs follow the transformers attention interface: [batch, tokens, query_heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.cpu import kernel as cpu_kernel

from . import prefix_attention
from .config import SparseConfig
from .kv_cache import DecodeStep, KVCache, SpanStep
from .selection import select_pages


def attend(query, key, value, **kwargs):
    """SDPA of query [B, H, T, D] against fewer KV heads [B, Hkv, S, D]. On CUDA in float32 no fused kernel takes
    `enable_gqa`, and the math backend it falls back to holds every [H, T, S] score (tens of GiB at 32K tokens: BENCHMARKS.md,
    "GPU (H200)"), so the KV heads are repeated to the query heads there."""
    if query.is_cuda and query.dtype == torch.float32 and key.shape[1] != query.shape[1]:
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    return F.scaled_dot_product_attention(query, key, value, enable_gqa=True, **kwargs)


def prefill_attention(query, key, value, cache: KVCache, layer: int, rows: torch.Tensor, scaling: float):
    """Dense causal attention of one prompt [1, H, T, D]; its keys/values go to every row in `rows`."""
    cache.write_prompt(layer, rows, key[0], value[0])
    out = attend(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2)


def decode_attention(query, key, value, cache: KVCache, layer: int, step: DecodeStep, scaling: float):
    """One decode step: query/key/value [B, H, 1, D]; `step` holds the per-row lengths and budgets."""
    batch, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    cache.write_token(layer, key[:, :, 0], value[:, :, 0], step)
    queries = query.view(batch, kv_heads, q_heads // kv_heads, dim)
    sparse = cache.sparse
    dense = not step.sparse or layer in sparse.dense_layers
    if sparse.page_landmark.compiled and cpu_kernel.usable(query):  # dense: every page kept, none scored
        out = cpu_kernel.sparse_decode(queries, cache.keys[layer], cache.values[layer], cache.landmarks[layer],
                                       step.n_pages, step.n_pages if dense else step.budget_pages, step.total,
                                       sparse, scaling)
        return out.reshape(batch, 1, q_heads, dim)
    if dense:
        span = step.dense_mask.shape[-1]
        keys = cache.keys[layer].view(batch, kv_heads, cache.capacity, dim)[:, :, :span]
        values = cache.values[layer].view(batch, kv_heads, cache.capacity, dim)[:, :, :span]
        mask = step.dense_mask
    else:
        ps = sparse.page_size
        used = step.used_pages
        landmarks = [m[:, :, :used] for m in cache.landmarks[layer]]
        scores = sparse.page_landmark.score(queries.unsqueeze(2), *landmarks).squeeze(2)  # [B, Hkv, P]
        pages, valid = select_pages(scores, step.n_pages[:, None], step.budget_pages[:, None],
                                    sparse.sink_pages, sparse.recent_pages, slots=step.selected)
        k = pages.shape[-1]
        row_head = torch.arange(batch * kv_heads, device=pages.device).view(batch, kv_heads, 1)
        flat = (row_head * cache.num_pages + pages).flatten()
        keys = cache.keys[layer].view(-1, ps * dim).index_select(0, flat).view(batch, kv_heads, k * ps, dim)
        values = cache.values[layer].view(-1, ps * dim).index_select(0, flat).view(batch, kv_heads, k * ps, dim)
        slots = pages.unsqueeze(-1) * ps + torch.arange(ps, device=pages.device)
        mask = (valid.unsqueeze(-1) & (slots < step.total.view(batch, 1, 1, 1))).view(batch, kv_heads, 1, k * ps)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, q_heads, dim)


def span_attention(query, key, value, cache: KVCache, layer: int, step: SpanStep, scaling: float):
    """Dense attention of S new tokens per row, query/key/value [B, H, S, D]: their keys/values are written at each
    row's length, then token s attends to the row's cache up to itself. The G query heads of a KV head run as G * S
    queries against that head's keys (no copy of the cache per query head), one pass over the cache for them all."""
    batch, q_heads, span, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    cache.write_span(layer, key, value, step)
    width = step.mask.shape[-1]
    keys = cache.keys[layer].view(batch, kv_heads, cache.capacity, dim)[:, :, :width]
    values = cache.values[layer].view(batch, kv_heads, cache.capacity, dim)[:, :, :width]
    queries = query.reshape(batch, kv_heads, group * span, dim)  # head h = kv * G + g: rows g * S + s
    if cache.sparse.page_landmark.compiled and cpu_kernel.usable(query):  # every page kept, the span's future cut
        n_pages = (step.total + cache.sparse.page_size - 1) // cache.sparse.page_size
        out = cpu_kernel.span_decode(queries, cache.keys[layer], cache.values[layer], cache.landmarks[layer],
                                     n_pages, step.total, span, cache.sparse, scaling)
        return out.view(batch, q_heads, span, dim).transpose(1, 2)
    mask = step.mask.repeat(1, 1, group, 1)  # [B, 1, G * S, width]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling)
    return out.view(batch, q_heads, span, dim).transpose(1, 2)


def teacher_forced_attention(query, key, value, layer: int, sparse: SparseConfig,
                             budget_pages: torch.Tensor | None, prompt_lengths: torch.Tensor, scaling: float,
                             chunk: int = 256):
    """Sparse attention for whole sequences, reproducing the decode-time selection.

    query [B, H, Tq, D] holds the last Tq of the Tk positions whose keys/values [B, Hkv, Tk, D] are given (Tq < Tk
    when the first Tk - Tq come from a shared prompt's cache). Position t of row b was decoded with t+1 cached
    tokens and the budget `budget_pages[b, t - (Tk - Tq)]`; positions before `prompt_lengths[b]` came from the
    dense prefill. Landmarks of the pages filled by then are built from the same keys as at decode, so each
    position selects the pages it selected when decoding. Queries run in chunks of `chunk` to bound memory.
    """
    batch, q_heads, q_len, dim = query.shape
    length = key.shape[2]
    offset = length - q_len
    position = torch.arange(offset, length, device=query.device)
    if budget_pages is None or layer in sparse.dense_layers:
        if offset and prefix_attention.usable(query):
            return prefix_attention.prefix_causal_attention(query, key, value, scaling).transpose(1, 2)
        causal = torch.arange(length, device=query.device) <= position[:, None] if offset else None
        out = attend(query, key, value, attn_mask=causal, is_causal=not offset, scale=scaling)
        return out.transpose(1, 2)
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    ps = sparse.page_size
    full = length // ps
    landmark = sparse.page_landmark
    marks = landmark.build(key[:, :, : full * ps].reshape(batch, kv_heads, full, ps, dim))
    num_pages = -(-length // ps)
    marks = [F.pad(m, (0, 0, 0, num_pages - full)) for m in marks]
    pages_held = (position + ps) // ps  # [Tq]: pages holding position t's t+1 tokens
    budget = torch.where(position[None, :] < prompt_lengths[:, None], pages_held, budget_pages)  # [B, Tq]
    if landmark.compiled and cpu_kernel.usable(query) and not (torch.is_grad_enabled() and query.requires_grad):
        return _teacher_forced_kernel(query, key, value, marks, position, pages_held, budget, sparse, scaling)
    queries = query.view(batch, kv_heads, group, q_len, dim)
    outputs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        pos = position[start:end]
        stop = offset + end  # keys up to the chunk's last position
        n_pages = pages_held[start:end]
        q_chunk = queries[:, :, :, start:end]
        used = int(n_pages.max())
        scores = landmark.score(q_chunk.transpose(2, 3), *[m[:, :, :used] for m in marks])  # [B, Hkv, Tc, P]
        pages, valid = select_pages(scores, n_pages.view(1, 1, -1), budget[:, None, start:end],
                                    sparse.sink_pages, sparse.recent_pages)
        page_mask = torch.zeros(scores.shape, dtype=torch.bool, device=query.device)
        page_mask.scatter_(-1, pages, valid)
        token_mask = page_mask.repeat_interleave(ps, dim=-1)[..., :stop]
        token_mask &= torch.arange(stop, device=query.device) <= pos[:, None]
        tc = end - start
        mask = token_mask.unsqueeze(2).expand(batch, kv_heads, group, tc, stop)
        mask = mask.reshape(batch, kv_heads, group * tc, stop)
        out = F.scaled_dot_product_attention(
            q_chunk.reshape(batch, kv_heads, group * tc, dim), key[:, :, :stop], value[:, :, :stop],
            attn_mask=mask, scale=scaling,
        )
        outputs.append(out.view(batch, kv_heads, group, tc, dim).reshape(batch, q_heads, tc, dim))
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _teacher_forced_kernel(query, key, value, marks, position, pages_held, budget, sparse: SparseConfig,
                           scaling: float, chunk: int = 1024):
    """`teacher_forced_attention` through the compiled decode kernel (no gradients): every position is one decode
    step of its own, reading the row's pages in place through a page table (the vLLM-layout reader), so each
    query scores and attends only the pages it selects, as the rollout's decode did."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    ps, num_pages = sparse.page_size, marks[0].shape[2]
    pad = num_pages * ps - length
    keys = F.pad(key, (0, 0, 0, pad)).view(batch, kv_heads, num_pages, ps, dim).permute(0, 2, 1, 4, 3)
    values = F.pad(value, (0, 0, 0, pad)).view(batch, kv_heads, num_pages, ps, dim).transpose(1, 2)
    cache = torch.cat([keys.reshape(batch, num_pages, kv_heads, ps * dim),
                       values.reshape(batch, num_pages, kv_heads, ps * dim)], dim=-1)
    cache = cache.view(batch * num_pages, kv_heads, ps, 2 * dim)
    paged_marks = [m.transpose(1, 2).reshape(batch * num_pages, kv_heads, dim).contiguous() for m in marks]
    queries = query.transpose(1, 2).reshape(batch, q_len, kv_heads, q_heads // kv_heads, dim)
    first_page = (torch.arange(batch, device=query.device) * num_pages).view(batch, 1, 1)
    outputs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        total = (position[start:end] + 1).expand(batch, -1)  # t + 1 cached tokens
        n_pages = pages_held[start:end].expand(batch, -1)
        pages = (first_page + torch.arange(int(n_pages.max()), device=query.device)).expand(-1, end - start, -1)
        out = cpu_kernel.paged_sparse_decode(
            queries[:, start:end].reshape(-1, kv_heads, q_heads // kv_heads, dim), cache,
            pages.reshape(-1, pages.shape[-1]), paged_marks, n_pages.reshape(-1), budget[:, start:end].reshape(-1),
            total.reshape(-1), sparse, scaling)
        outputs.append(out.view(batch, end - start, q_heads, dim))
    return torch.cat(outputs, dim=1)
