"""The plan of one engine step, shared by the CPU and CUDA backends: which requests decode sparsely, their pages and
budgets, and what vLLM's own kernel attends of the others (CPU: a sub-batch of them; CUDA: every request, the sparse
ones one token long).

A request decodes sparsely when it computes one generated token (query length 1 and past its prompt, vLLM's
`is_prefilling`, so a one-token prompt tail left by prefix caching is prefill) and the schedule's budget at its
cached length (counting the new token) is below the pages it holds: our engine's rule.

In exact mode (`drafting`: the drafter's steps under vLLM's speculative decoding, exact_mode.py) the sparse token
of a request is the token the drafter samples from: its only token in a draft step, and in the drafter's first
pass (the verified tokens rewritten, then the token the verification sampled, then the rejected drafts' padding,
whose slots are negative) the last token with a slot. Its cached length ends at that token. The other tokens of
the first pass are the drafter's dense rewrite of the verified tokens: vLLM's kernel attends them, the request one
token shorter. The cached lengths then come from the device copy (vLLM's host copy counts rejected drafts).

The metadata builder makes the plan once per step, for all layers. The decision reads only vLLM's host-side copies
of the step (`query_start_loc_cpu`, `seq_lens_cpu_upper_bound`, `is_prefilling`), with numpy on the host (a numpy
call costs about a microsecond, a torch call ten) and no Python loop over requests; the per-request results travel
to the device in one host-to-device copy, and the page table is gathered there from vLLM's block table. Nothing
is read back from the device. The decision is made here only: the backends read it from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparrow.schedules import Schedule

from .paged import physical_pages

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata


@dataclass
class StockRows:
    """The requests of a step that vLLM's kernel attends as a sub-batch (prefills, chunked-prefill pieces, covered
    decodes, the drafter's rewrite of verified tokens; the CPU backend): their rows and tokens in the batch, the
    query starts and cached lengths of the sub-batch (device)."""

    rows: torch.Tensor
    tokens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class SparsePlan:
    """The sparse decoding requests of a step (S of them, on the device): the index of each one's token in the
    batch, physical pages of its pages [S, P], cached tokens counting the new one, pages held and budget in pages;
    on the host, the cached length vLLM's kernel is given for each request of the step [R] (its own; 1 for a sparse
    request, which vLLM's kernel then attends one token of); `stock` the other requests as a sub-batch (None if
    there are none or none was asked for)."""

    tokens: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    n_pages: torch.Tensor
    budget_pages: torch.Tensor
    stock_seq_lens_cpu: torch.Tensor
    stock: StockRows | None


def host_seq_lens(cm: CommonAttentionMetadata, drafting: bool = False) -> np.ndarray:
    """Cached lengths of the step's requests on the host (int64): vLLM's own host copy, exact outside speculative
    decoding; the device tensor itself where there is none (CPU runs, tests) or when `drafting` (the host copy is an
    upper bound there; on CUDA this reads the device, once per draft step)."""
    host = None if drafting else cm.seq_lens_cpu_upper_bound
    return (cm.seq_lens if host is None else host)[: cm.num_reqs].cpu().numpy().astype(np.int64)


def draft_tokens(starts: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The offset in each request of the token the drafter samples from: the last with a slot (>= 0; the first
    token where none has one)."""
    index = np.where(slots[: starts[-1]] >= 0, np.arange(starts[-1]), -1)
    last = np.maximum.reduceat(index, starts[:-1]) if index.size else np.zeros(0, dtype=np.int64)
    return np.maximum(last - starts[:-1], 0)


def sparse_rows(query_lens: np.ndarray, seq_lens: np.ndarray, is_prefilling: np.ndarray | None,
                schedule: Schedule, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(decodes sparsely [R] bool, pages held [R], budget in pages [R]) of requests with these query and cached
    lengths (int64 host arrays)."""
    n_pages = (seq_lens + page_size - 1) // page_size
    if schedule.is_dense:
        return np.zeros(n_pages.shape, dtype=bool), n_pages, n_pages
    budget = schedule.budget_for(seq_lens) // page_size
    sparse = (query_lens == 1) & (budget < n_pages)
    if is_prefilling is not None:
        sparse &= ~is_prefilling
    return sparse, n_pages, budget


def plan_step(cm: CommonAttentionMetadata, schedule: Schedule, page_size: int, block_size: int,
              sub_batch: bool = True, drafting: bool = False) -> SparsePlan | None:
    """The plan of the step `cm` under `schedule` (None: no request decodes sparsely, the step is stock vLLM's);
    `sub_batch`: with the other tokens as a sub-batch (`SparsePlan.stock`); `drafting`: a drafter's step in exact
    mode (above)."""
    num_reqs = cm.num_reqs
    starts = cm.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
    query_lens = np.diff(starts)
    seq_lens = host_seq_lens(cm, drafting)
    if drafting:
        offset = (draft_tokens(starts, cm.slot_mapping.cpu().numpy()) if (query_lens > 1).any()
                  else np.zeros(num_reqs, dtype=np.int64))
        lengths = seq_lens - (query_lens - 1 - offset)  # the sampled-from token's cached length
        sparse, n_pages, budget = sparse_rows(np.ones_like(query_lens), lengths, None, schedule, page_size)
    else:
        offset, lengths = np.zeros(num_reqs, dtype=np.int64), seq_lens
        prefilling = None if cm.is_prefilling is None else cm.is_prefilling[:num_reqs].cpu().numpy().astype(bool)
        sparse, n_pages, budget = sparse_rows(query_lens, seq_lens, prefilling, schedule, page_size)
    rows = np.flatnonzero(sparse)
    if not rows.size:
        return None
    token_index = starts[rows] + offset[rows]
    host = [token_index, rows, lengths[rows], n_pages[rows], budget[rows]]
    stock_query_lens = query_lens - sparse
    stock_rows = np.flatnonzero(~sparse | (query_lens > 1)) if sub_batch else rows[:0]
    with_stock = bool(stock_rows.size)
    if with_stock:
        stock_starts = np.zeros(stock_rows.size + 1, dtype=np.int64)
        np.cumsum(stock_query_lens[stock_rows], out=stock_starts[1:])
        keep = np.ones(int(starts[-1]), dtype=bool)
        keep[token_index] = False
        host += [stock_rows, np.flatnonzero(keep), stock_starts, (seq_lens - sparse)[stock_rows]]
    device = cm.block_table_tensor.device
    moved = torch.from_numpy(np.concatenate(host)).to(device, non_blocking=True).split([a.size for a in host])
    tokens, rows_d, seq_d, n_pages_d, budget_d = moved[:5]
    num_pages = int(n_pages[rows].max())
    blocks = -(-num_pages * page_size // block_size)
    page_table = physical_pages(cm.block_table_tensor[:, :blocks][rows_d], num_pages, block_size, page_size)
    stock = None
    if with_stock:
        stock_rows_d, stock_tokens_d, stock_starts_d, stock_seq_d = moved[5:]
        stock = StockRows(stock_rows_d, stock_tokens_d, stock_starts_d.to(cm.query_start_loc.dtype),
                          stock_seq_d.to(cm.seq_lens.dtype))
    # CUDA's wrapped kernel attends a one-token sparse request one token deep, a longer one (a drafter's first pass,
    # whose sampled-from row ours then overwrites) whole
    one_token = sparse & (query_lens == 1)
    return SparsePlan(tokens, page_table, seq_d, n_pages_d, budget_d,
                      torch.from_numpy(np.where(one_token, 1, seq_lens)), stock)
