"""Sparrow's decode rule over a paged KV cache (vLLM's), in plain PyTorch: the reference the kernels are tested
against, and the path for dtypes the compiled kernel does not take.

A vLLM block holds `block_size // page_size` of our 16-token pages. Page p of a request (its tokens
[16 p, 16 p + 16)) lives in block `block_table[r, p // per]` at page `p % per` of it: its *physical page* is
`block * per + p % per`. Landmarks are kept per physical page, so a block shared by prefix caching shares them.
A layout is a pair of functions reading (keys, values) of physical pages from a layer's cache as
[..., kv_heads, page_size, head_dim]; the CPU layout is in cpu_attention.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparrow.attention.config import SparseConfig
from sparrow.attention.selection import select_pages
from sparrow.schedules import Schedule

PageReader = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def physical_pages(block_table: torch.Tensor, num_pages: int, block_size: int, page_size: int) -> torch.Tensor:
    """[requests, blocks] block table -> physical page of each request's first `num_pages` pages [requests, P]."""
    per = block_size // page_size
    page = torch.arange(num_pages, device=block_table.device)
    return block_table[:, page // per].long() * per + page % per


def decode_budget_pages(schedule: Schedule, seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(pages held, budget in pages) per decoding request with `seq_lens` cached tokens counting the new one: the
    schedule's budget at that length, as our engine's decode step (`RolloutEngine.budgets`)."""
    seq_lens = seq_lens.long()
    n_pages = (seq_lens + page_size - 1) // page_size
    if schedule.is_dense:
        return n_pages, n_pages
    return n_pages, schedule.budget_for(seq_lens) // page_size


@dataclass
class StepSplit:
    """A step's requests as the plugin sees them: query starts [R + 1] and lengths [R], cached lengths [R]
    (counting the tokens of this step), pages held, budget in pages, and which decode sparsely, all on the CPU."""

    starts: torch.Tensor
    query_lens: torch.Tensor
    seq_lens: torch.Tensor
    n_pages: torch.Tensor
    budget_pages: torch.Tensor
    is_sparse: torch.Tensor


def split_step(query_start_loc_cpu: torch.Tensor, seq_lens: torch.Tensor, is_prefilling: torch.Tensor | None,
               num_reqs: int, schedule: Schedule, page_size: int) -> StepSplit:
    """Which requests of a vLLM step decode sparsely: one query token, past the prompt (`is_prefilling` False, so
    a one-token prompt tail left by prefix caching is prefill) and a budget below the pages held."""
    starts = query_start_loc_cpu[: num_reqs + 1].long()
    query_lens = starts[1:] - starts[:-1]
    cached = seq_lens[:num_reqs].cpu().long()
    decoding = query_lens == 1
    if is_prefilling is not None:
        decoding &= ~is_prefilling[:num_reqs].cpu().bool()
    n_pages, budget = decode_budget_pages(schedule, cached, page_size)
    return StepSplit(starts, query_lens, cached, n_pages, budget, decoding & (budget < n_pages))


def filled_pages(slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """Physical pages whose last slot is written by this update (padding slots are negative)."""
    slots = slot_mapping.long()
    return torch.div(slots[(slots >= 0) & (slots % page_size == page_size - 1)], page_size, rounding_mode="floor")


class PageLandmarks:
    """One layer's landmark tensors per physical page, [pages, kv_heads, head_dim] each, kept as pages fill."""

    def __init__(self, sparse: SparseConfig, num_pages: int, kv_heads: int, head_dim: int, dtype, device):
        self.landmark = sparse.page_landmark
        self.tensors = [torch.zeros(num_pages, kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(self.landmark.tensors)]

    @property
    def num_pages(self) -> int:
        return self.tensors[0].shape[0]

    def update(self, pages: torch.Tensor, page_keys: torch.Tensor) -> None:
        """Landmarks of the physical `pages` [n] from their keys [n, kv_heads, page_size, head_dim]."""
        for store, mark in zip(self.tensors, self.landmark.build(page_keys)):
            store.index_copy_(0, pages, mark.to(store.dtype))

    def gather(self, phys: torch.Tensor) -> list[torch.Tensor]:
        """Landmarks of the pages `phys` [R, P] as the scorers take them, [R, kv_heads, P, head_dim] each."""
        return [m[phys].transpose(1, 2) for m in self.tensors]


def select_decode_pages(queries: torch.Tensor, marks: list[torch.Tensor], n_pages: torch.Tensor,
                        budget_pages: torch.Tensor, sparse: SparseConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages each decoding request attends: queries [R, Hkv, G, D], marks gathered [R, Hkv, P, D] ->
    (logical page indices [R, Hkv, K], valid [R, Hkv, K]) as `selection.select_pages`."""
    scores = sparse.page_landmark.score(queries.unsqueeze(2), *marks).squeeze(2)  # [R, Hkv, P]
    return select_pages(scores, n_pages[:, None], budget_pages[:, None], sparse.sink_pages, sparse.recent_pages)


def reference_decode(queries: torch.Tensor, read_pages: PageReader, phys: torch.Tensor, landmarks: PageLandmarks,
                     seq_lens: torch.Tensor, budget_pages: torch.Tensor, sparse: SparseConfig,
                     scale: float) -> torch.Tensor:
    """One sparse decode step of R requests: queries [R, Hkv, G, D] -> attention output [R, Hkv, G, D].

    phys [R, P]: physical pages of each request's pages (P: the most any request holds); seq_lens [R]: cached
    tokens including the new one; budget_pages [R]. Every page is read, then masked to the selected ones.
    """
    requests, kv_heads, _, dim = queries.shape
    ps = sparse.page_size
    n_pages = (seq_lens.long() + ps - 1) // ps
    marks = [m.to(queries.dtype) for m in landmarks.gather(phys)]
    pages, valid = select_decode_pages(queries, marks, n_pages, budget_pages, sparse)
    num = phys.shape[1]
    keep = torch.zeros(requests, kv_heads, num, dtype=torch.bool, device=queries.device)
    keep.scatter_(-1, pages, valid)
    mask = keep.repeat_interleave(ps, dim=-1) & (torch.arange(num * ps, device=queries.device)
                                                 < seq_lens.view(-1, 1, 1))
    keys, values = read_pages(phys)  # [R, P, Hkv, ps, D]
    keys = keys.permute(0, 2, 1, 3, 4).reshape(requests, kv_heads, num * ps, dim).to(queries.dtype)
    values = values.permute(0, 2, 1, 3, 4).reshape(requests, kv_heads, num * ps, dim).to(queries.dtype)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask.unsqueeze(2), scale=scale)
