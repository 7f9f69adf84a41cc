"""Sparrow's sparse decode over vLLM's CUDA paged cache: a Triton kernel (flash-decoding).

vLLM's Triton and FlashAttention backends give each layer a cache of logical shape [blocks, Hkv, block, 2 D] (keys
then values on the last axis; the physical strides follow vLLM's KV cache layout, NHD by default), and
`kv_cache.transpose(1, 2).split(D, -1)` the key and value caches [blocks, block, Hkv, D] these functions take.
They read them through their strides, so every layout works, in place. Our page p of a request is physical page
`page_table[r, p]` (`paged.physical_pages`): block `phys // per`, slots `(phys % per) * page_size + [0, page_size)`
with `per = block // page_size`.

Page selection stays in PyTorch (`paged.select_decode_pages` on the gathered landmarks); the kernel attends the
selected pages: one program per (request, KV head, split of the selected pages) with all G query heads of the
group, an online softmax over `PAGES_PER_STEP` pages at a time, and the splits merged by their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError

from .paged import PageLandmarks, select_decode_pages

PAGES_PER_STEP = 4  # pages one loop iteration of the kernel reads (64 tokens at page size 16)
TARGET_PROGRAMS = 512  # splits are added until the grid has about this many programs


@triton.jit
def _paged_sparse_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pages_ptr, seq_lens_ptr, o_ptr, lse_ptr,
                         kv_heads, group, dim, num_slots, slots_per_split, pages_per_block, scale_log2,
                         stride_qr, stride_qh, stride_qg, stride_qd,
                         stride_kb, stride_kn, stride_kh, stride_kd,
                         stride_vb, stride_vn, stride_vh, stride_vd,
                         stride_tr, stride_tp, stride_pr, stride_ph, stride_pk,
                         PAGE: tl.constexpr, PAGES_PER_STEP: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Partial attention of one (request, KV head) over one split of its selected pages: the output normalised
    within the split [G, D] and its log2-sum-exp [G], into o [splits, R, Hkv, G, D] and lse [splits, R, Hkv, G]
    (contiguous). Slots holding a negative page are skipped; tokens at or past the request's length are masked."""
    rh = tl.program_id(0)
    split = tl.program_id(1)
    num_rh = tl.num_programs(0)
    r = rh // kv_heads
    h = rh % kv_heads
    seq_len = tl.load(seq_lens_ptr + r)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < dim
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    offs_t = tl.arange(0, PAGES_PER_STEP * PAGE)
    step_slot = offs_t // PAGE
    token = offs_t % PAGE
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    start = split * slots_per_split
    end = tl.minimum(start + slots_per_split, num_slots)
    for first in tl.range(start, end, PAGES_PER_STEP):
        slot = first + step_slot
        page = tl.load(pages_ptr + r * stride_pr + h * stride_ph + slot * stride_pk, mask=slot < end, other=-1)
        live = page >= 0
        page = tl.where(live, page, 0)
        phys = tl.load(table_ptr + r * stride_tr + page * stride_tp, mask=live, other=0).to(tl.int64)
        block = phys // pages_per_block
        row = (phys % pages_per_block) * PAGE + token
        present = live & (page * PAGE + token < seq_len)
        kv_mask = present[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + row[:, None] * stride_kn + h * stride_kh
                    + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(present[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + row[:, None] * stride_vn + h * stride_vh
                    + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    filled = l_i > 0
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
    row_g = (split * num_rh + rh) * group + offs_g
    tl.store(o_ptr + row_g[:, None] * dim + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + row_g, lse, mask=g_mask)


def _check_shapes(queries, key_cache, value_cache, page_table, pages, seq_lens, page_size: int) -> None:
    requests, kv_heads, _, dim = queries.shape
    _, block, cache_heads, cache_dim = key_cache.shape
    if value_cache.shape != key_cache.shape or (cache_heads, cache_dim) != (kv_heads, dim):
        raise SparrowError(f"paged sparse attention: key cache {tuple(key_cache.shape)} and value cache "
                           f"{tuple(value_cache.shape)} must both be [blocks, block, {kv_heads}, {dim}] for queries "
                           f"{tuple(queries.shape)}")
    if block % page_size:
        raise SparrowError(f"paged sparse attention: page size {page_size} does not divide the block size {block}")
    if pages.shape[:2] != (requests, kv_heads) or page_table.shape[0] != requests or seq_lens.shape != (requests,):
        raise SparrowError(f"paged sparse attention: pages {tuple(pages.shape)}, page table "
                           f"{tuple(page_table.shape)} and seq_lens {tuple(seq_lens.shape)} must be [{requests}, "
                           f"{kv_heads}, K], [{requests}, P] and [{requests}]")


def paged_sparse_attention(queries: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           page_table: torch.Tensor, pages: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                           scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Softmax attention of each group's query heads over its selected pages, read in place (Triton).

    queries [R, Hkv, G, D]; key_cache, value_cache [blocks, block, Hkv, D] (any strides); page_table [R, P]:
    physical page of each logical page; pages [R, Hkv, K]: the logical pages each (request, KV head) attends, -1
    in unused slots (the logical index masks the partial last page); seq_lens [R]: cached tokens, the new one
    included. num_splits: splits of the K slots run in parallel (None: enough to fill the GPU). -> [R, Hkv, G, D].
    """
    _check_shapes(queries, key_cache, value_cache, page_table, pages, seq_lens, page_size)
    requests, kv_heads, group, dim = queries.shape
    if requests == 0:
        return queries.new_empty(queries.shape)
    slots = pages.shape[-1]
    steps = triton.cdiv(max(slots, 1), PAGES_PER_STEP)
    if num_splits is None:
        num_splits = triton.cdiv(TARGET_PROGRAMS, max(requests * kv_heads, 1))
    num_splits = max(1, min(num_splits, steps))
    slots_per_split = triton.cdiv(steps, num_splits) * PAGES_PER_STEP
    num_splits = triton.cdiv(max(slots, 1), slots_per_split)
    partial = torch.empty(num_splits, requests, kv_heads, group, dim, dtype=torch.float32, device=queries.device)
    lse = torch.empty(num_splits, requests, kv_heads, group, dtype=torch.float32, device=queries.device)
    _paged_sparse_kernel[(requests * kv_heads, num_splits)](
        queries, key_cache, value_cache, page_table, pages, seq_lens, partial, lse,
        kv_heads, group, dim, slots, slots_per_split, key_cache.shape[1] // page_size, scale * 1.4426950408889634,
        *queries.stride(), *key_cache.stride(), *value_cache.stride(), *page_table.stride(), *pages.stride(),
        PAGE=page_size, PAGES_PER_STEP=PAGES_PER_STEP, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        DOT_PRECISION="ieee" if queries.dtype == torch.float32 else "tf32")
    if num_splits == 1:
        return partial[0].to(queries.dtype)
    top = lse.amax(dim=0)
    weight = torch.exp2(lse - torch.where(torch.isfinite(top), top, 0.0))
    out = (weight.unsqueeze(-1) * partial).sum(dim=0) / weight.sum(dim=0).unsqueeze(-1)
    return out.to(queries.dtype)


def page_reader(key_cache: torch.Tensor, value_cache: torch.Tensor, page_size: int):
    """Reader of physical pages of key and value caches [blocks, block, Hkv, D] (a `paged.PageReader`):
    read(phys [...]) -> (keys, values) [..., Hkv, page_size, D]."""
    per = key_cache.shape[1] // page_size
    offsets = torch.arange(page_size, device=key_cache.device)

    def read(phys: torch.Tensor):
        block = torch.div(phys, per, rounding_mode="floor").unsqueeze(-1)
        row = (phys % per).unsqueeze(-1) * page_size + offsets
        return key_cache[block, row].transpose(-3, -2), value_cache[block, row].transpose(-3, -2)

    return read


def sparse_decode(queries: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  page_table: torch.Tensor, landmarks: PageLandmarks, seq_lens: torch.Tensor,
                  budget_pages: torch.Tensor, sparse: SparseConfig, scale: float,
                  attend=paged_sparse_attention) -> torch.Tensor:
    """One sparse decode step of R requests (as `paged.reference_decode`): queries [R, Hkv, G, D], page_table
    [R, P], seq_lens and budget_pages [R] -> [R, Hkv, G, D]. Pages are selected in PyTorch from the landmarks of
    the request's pages, then `attend` (the kernel, or a reference in the tests) reads only those."""
    ps = sparse.page_size
    n_pages = (seq_lens.long() + ps - 1) // ps
    marks = [m.to(queries.dtype) for m in landmarks.gather(page_table)]
    pages, valid = select_decode_pages(queries, marks, n_pages, budget_pages, sparse)
    return attend(queries, key_cache, value_cache, page_table, torch.where(valid, pages, -1), seq_lens, ps, scale)
