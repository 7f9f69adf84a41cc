"""The plan of one engine step, shared by the CPU and CUDA backends: which requests decode sparsely, their pages and
budgets, and what vLLM's own kernel attends of the others (CPU: a sub-batch of them; CUDA: every request, the sparse
ones one token long).

A request decodes sparsely when it computes one generated token (query length 1 and past its prompt, vLLM's
`is_prefilling`, so a one-token prompt tail left by prefix caching is prefill) and the schedule's budget at its
cached length (counting the new token) is below the pages it holds: our engine's rule.

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
    decodes; the CPU backend): their rows and tokens in the batch and the query starts of the sub-batch (device)."""

    rows: torch.Tensor
    tokens: torch.Tensor
    query_start_loc: torch.Tensor


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


def host_seq_lens(cm: CommonAttentionMetadata) -> np.ndarray:
    """Cached lengths of the step's requests on the host (int64): vLLM's own host copy (exact without speculative
    decoding, which the plugin refuses); the device tensor itself where there is none (CPU runs, tests)."""
    host = cm.seq_lens_cpu_upper_bound
    return (cm.seq_lens if host is None else host)[: cm.num_reqs].cpu().numpy().astype(np.int64)


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
              sub_batch: bool = True) -> SparsePlan | None:
    """The plan of the step `cm` under `schedule` (None: no request decodes sparsely, the step is stock vLLM's);
    `sub_batch`: with the other requests as a sub-batch (`SparsePlan.stock`)."""
    num_reqs = cm.num_reqs
    starts = cm.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
    query_lens = np.diff(starts)
    seq_lens = host_seq_lens(cm)
    prefilling = None if cm.is_prefilling is None else cm.is_prefilling[:num_reqs].cpu().numpy().astype(bool)
    sparse, n_pages, budget = sparse_rows(query_lens, seq_lens, prefilling, schedule, page_size)
    rows = np.flatnonzero(sparse)
    if not rows.size:
        return None
    host = [starts[rows], rows, seq_lens[rows], n_pages[rows], budget[rows]]
    stock_rows = np.flatnonzero(~sparse) if sub_batch else rows[:0]
    with_stock = bool(stock_rows.size)
    if with_stock:
        stock_starts = np.zeros(stock_rows.size + 1, dtype=np.int64)
        np.cumsum(query_lens[stock_rows], out=stock_starts[1:])
        host += [stock_rows, _stock_tokens(starts, rows), stock_starts]
    device = cm.block_table_tensor.device
    moved = torch.from_numpy(np.concatenate(host)).to(device, non_blocking=True).split([a.size for a in host])
    tokens, rows_d, seq_d, n_pages_d, budget_d = moved[:5]
    num_pages = int(n_pages[rows].max())
    blocks = -(-num_pages * page_size // block_size)
    page_table = physical_pages(cm.block_table_tensor[:, :blocks][rows_d], num_pages, block_size, page_size)
    stock = None
    if with_stock:
        stock_rows_d, stock_tokens_d, stock_starts_d = moved[5:]
        stock = StockRows(stock_rows_d, stock_tokens_d, stock_starts_d.to(cm.query_start_loc.dtype))
    return SparsePlan(tokens, page_table, seq_d, n_pages_d, budget_d,
                      torch.from_numpy(np.where(sparse, 1, seq_lens)), stock)


def _stock_tokens(starts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Indices of the step's tokens that are not the single tokens of the sparse `rows`."""
    keep = np.ones(int(starts[-1]), dtype=bool)
    keep[starts[rows]] = False
    return np.flatnonzero(keep)
