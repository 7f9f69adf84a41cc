"""The sparse decode step in a form CUDA graphs can capture: shapes fixed per batch size, nothing read back to the host.

vLLM captures a decode step as one CUDA graph when every request of the batch computes one token (the backend
declares UNIFORM_SINGLE_TOKEN_DECODE) and replays it for every later batch of that size, so the captured code may
not depend on which requests decode sparsely. The metadata builder writes, per request, into buffers whose
addresses never change (`DecodeGraphBuffers`): the budget in pages, 0 for a request that decodes densely (covered,
in its prompt, padding), and the cached length vLLM's kernel is given, 1 for a request our kernel attends (so
vLLM's kernel does one token of work for it). The captured forward runs vLLM's kernel and ours on the whole batch
and keeps each request's row from the one that owns it. Ours scores every page slot of the block table
(`page_scores`, landmarks read in place, pages past a request's length at -inf) and keeps `slots` pages per
(request, KV head) by the one selection rule (`selection.select_pages`, its count of slots fixed): the largest
budget of the schedule in force when the engine started, the slots past a request's own budget masked (-1), so a
later schedule with a larger budget is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from sparrow.attention.config import SparseConfig
from sparrow.attention.selection import select_pages
from sparrow.errors import SparrowError
from sparrow.schedules import Schedule

from .paged import PageLandmarks, physical_pages
from .triton_decode import paged_sparse_attention

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata

BLOCK_PAGES = 32  # pages one program of the scoring kernel scores
_SCORED_IN_KERNEL = ("centroid", "quest")


@triton.jit
def _page_scores_kernel(q_ptr, lo_ptr, hi_ptr, table_ptr, n_pages_ptr, out_ptr, kv_heads, group, dim, num_pages,
                        stride_qr, stride_qh, stride_qg, stride_qd, stride_mp, stride_mh, stride_md,
                        stride_tr, stride_tp, QUEST: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """Scores of one (request, KV head) for BLOCK_P page slots into out [R, Hkv, P]: centroid (group-mean query
    . mean key, landmark in lo) or Quest (max over the group of sum_c max(q_c hi_c, q_c lo_c)); -inf past the
    request's pages."""
    rh = tl.program_id(0)
    r = rh // kv_heads
    h = rh % kv_heads
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < dim
    live = offs_p < tl.load(n_pages_ptr + r)
    phys = tl.load(table_ptr + r * stride_tr + offs_p * stride_tp, mask=live, other=0).to(tl.int64)
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    mark = phys[:, None] * stride_mp + h * stride_mh + offs_d[None, :] * stride_md
    m_mask = live[:, None] & d_mask[None, :]
    lo = tl.load(lo_ptr + mark, mask=m_mask, other=0.0).to(tl.float32)
    if QUEST:
        hi = tl.load(hi_ptr + mark, mask=m_mask, other=0.0).to(tl.float32)
        bound = (tl.dot(tl.maximum(q, 0.0), tl.trans(hi), input_precision="ieee")
                 + tl.dot(tl.minimum(q, 0.0), tl.trans(lo), input_precision="ieee"))
        score = tl.max(tl.where(g_mask[:, None], bound, float("-inf")), axis=0)
    else:
        mean_q = tl.sum(q, axis=0) / group
        score = tl.sum(mean_q[None, :] * lo, axis=1)
    tl.store(out_ptr + rh * num_pages + offs_p, tl.where(live, score, float("-inf")), mask=offs_p < num_pages)


def reference_page_scores(queries: torch.Tensor, landmarks: PageLandmarks, page_table: torch.Tensor,
                          n_pages: torch.Tensor, sparse: SparseConfig) -> torch.Tensor:
    """`page_scores` in PyTorch: gather the landmarks of every slot, score, mask the slots past each request."""
    marks = [m.float() for m in landmarks.gather(page_table)]
    scores = sparse.page_landmark.score(queries.float().unsqueeze(2), *marks).squeeze(2)  # [R, Hkv, P]
    slot = torch.arange(page_table.shape[1], device=queries.device)
    return scores.masked_fill(slot >= n_pages.view(-1, 1, 1), float("-inf"))


def page_scores(queries: torch.Tensor, landmarks: PageLandmarks, page_table: torch.Tensor, n_pages: torch.Tensor,
                sparse: SparseConfig) -> torch.Tensor:
    """Float32 scores [R, Hkv, P] of each request's page slots (queries [R, Hkv, G, D], page_table [R, P]), -inf
    past its `n_pages`; landmarks read in place through the page table (a landmark the kernel does not know:
    gathered, `reference_page_scores`)."""
    if sparse.landmark not in _SCORED_IN_KERNEL:
        return reference_page_scores(queries, landmarks, page_table, n_pages, sparse)
    requests, kv_heads, group, dim = queries.shape
    num_pages = page_table.shape[1]
    out = torch.empty(requests, kv_heads, num_pages, dtype=torch.float32, device=queries.device)
    if not out.numel():
        return out
    lo, hi = landmarks.tensors[0], landmarks.tensors[-1]
    _page_scores_kernel[(requests * kv_heads, triton.cdiv(num_pages, BLOCK_PAGES))](
        queries, lo, hi, page_table, n_pages, out, kv_heads, group, dim, num_pages, *queries.stride(), *lo.stride(),
        *page_table.stride(), QUEST=sparse.landmark == "quest", BLOCK_P=BLOCK_PAGES,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(dim)))
    return out


def graph_sparse_decode(queries: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, landmarks: PageLandmarks, seq_lens: torch.Tensor,
                        budget_pages: torch.Tensor, sparse: SparseConfig, scale: float, slots: int) -> torch.Tensor:
    """`triton_decode.sparse_decode` over every page slot of the block table [R, blocks] with `slots` pages kept:
    queries [R, Hkv, G, D], seq_lens and budget_pages [R] -> [R, Hkv, G, D] (rows of budget 0 undefined)."""
    ps = sparse.page_size
    block = key_cache.shape[1]
    page_table = physical_pages(block_table, block_table.shape[1] * (block // ps), block, ps)
    n_pages = (seq_lens.long() + ps - 1) // ps
    scores = page_scores(queries, landmarks, page_table, n_pages, sparse)
    pages, valid = select_pages(scores, n_pages[:, None], budget_pages[:, None], sparse.sink_pages,
                                sparse.recent_pages, slots=min(slots, page_table.shape[1]))
    pages = torch.where(valid, pages, -1)  # a budget of 0 attends nothing
    return paged_sparse_attention(queries, key_cache, value_cache, page_table, pages, seq_lens, ps, scale)


@dataclass
class DecodeGraphPlan:
    """A uniform decode step's per-request inputs (views of `DecodeGraphBuffers`): budget in pages (0: vLLM's
    kernel attends the request) and the cached lengths vLLM's kernel is given; `slots` kept per (request, head)."""

    budget_pages: torch.Tensor
    stock_seq_lens: torch.Tensor
    slots: int


def largest_budget_pages(schedule: Schedule, page_size: int) -> int:
    return 0 if schedule.is_dense else max(schedule.budgets) // page_size


class DecodeGraphBuffers:
    """The buffers a captured decode step reads, one entry per request slot of the engine, rewritten each step."""

    def __init__(self, max_requests: int, slots: int, device):
        self.slots = slots
        self.budget_pages = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.stock_seq_lens = torch.zeros(max_requests, dtype=torch.int32, device=device)

    def fill(self, cm: CommonAttentionMetadata, schedule: Schedule, page_size: int) -> DecodeGraphPlan:
        """Write the step `cm` (every query one token) under `schedule`, on the device: no host read."""
        if largest_budget_pages(schedule, page_size) > self.slots:
            raise SparrowError(f"schedule {schedule.name!r} keeps up to {max(schedule.budgets)} tokens but vLLM's "
                               f"CUDA graphs were captured for {self.slots * page_size} (the largest budget of the "
                               "schedule the engine started with): start the engine with the schedule of largest "
                               "budget (SPARROW_VLLM_SCHEDULE), or pass enforce_eager=True")
        num_reqs = cm.num_reqs
        seq_lens = cm.seq_lens[:num_reqs]
        budget = torch.zeros_like(seq_lens)
        if not schedule.is_dense:
            n_pages = (seq_lens + page_size - 1) // page_size
            wanted = (schedule.budget_for(seq_lens) // page_size).to(seq_lens.dtype)
            sparse = wanted < n_pages
            if cm.is_prefilling is not None:
                sparse &= ~cm.is_prefilling[:num_reqs].to(seq_lens.device, non_blocking=True)
            budget = torch.where(sparse, wanted, 0)
        self.budget_pages[:num_reqs].copy_(budget)
        self.stock_seq_lens[:num_reqs].copy_(torch.where(budget > 0, 1, seq_lens))
        return DecodeGraphPlan(self.budget_pages[:num_reqs], self.stock_seq_lens[:num_reqs], self.slots)
