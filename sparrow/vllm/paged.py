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

import torch
import torch.nn.functional as F

from sparrow.attention.config import SparseConfig
from sparrow.attention.selection import select_pages

PageReader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def physical_pages(block_table: torch.Tensor, num_pages: int, block_size: int, page_size: int) -> torch.Tensor:
    """[requests, blocks] block table -> physical page of each request's first `num_pages` pages [requests, P]
    (int64): each block's pages in order, one broadcast add."""
    per = block_size // page_size
    if per == 1:
        return block_table[:, :num_pages].long()
    first = block_table[:, : -(-num_pages // per)].long() * per
    return (first.unsqueeze(-1) + torch.arange(per, device=block_table.device)).flatten(1)[:, :num_pages]


def filled_pages(slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """Physical pages whose last slot is written by this update (padding slots are negative)."""
    slots = slot_mapping.long()
    return torch.div(slots[(slots >= 0) & (slots % page_size == page_size - 1)], page_size, rounding_mode="floor")


class PageLandmarks:
    """One layer's landmark tensors per physical page, [pages, kv_heads, head_dim] each, kept as pages fill."""

    def __init__(self, sparse: SparseConfig, num_pages: int, kv_heads: int, head_dim: int, dtype, device):
        self.landmark = sparse.page_landmark
        # one spare row past the pages, where `update_slots` sends the slots that complete no page
        self.stores = [torch.zeros(num_pages + 1, kv_heads, head_dim, dtype=dtype, device=device)
                       for _ in range(self.landmark.tensors)]
        self.tensors = [store[:num_pages] for store in self.stores]

    @property
    def num_pages(self) -> int:
        return self.tensors[0].shape[0]

    def update(self, pages: torch.Tensor, page_keys: torch.Tensor) -> None:
        """Landmarks of the physical `pages` [n] from their keys [n, kv_heads, page_size, head_dim]."""
        for store, mark in zip(self.tensors, self.landmark.build(page_keys)):
            store.index_copy_(0, pages, mark.to(store.dtype))

    def rebuild(self, read_pages: PageReader, chunk: int = 4096) -> None:
        """Landmarks of every physical page from the cache as it is now, `chunk` pages at a time: after steps that
        wrote keys without keeping landmarks (pages not yet full get landmarks too, which no selection reads)."""
        device = self.tensors[0].device
        for start in range(0, self.num_pages, chunk):
            pages = torch.arange(start, min(start + chunk, self.num_pages), device=device)
            self.update(pages, read_pages(pages)[0])

    def update_slots(self, slot_mapping: torch.Tensor, read_pages: PageReader, page_size: int) -> None:
        """`update(filled_pages(slot_mapping), ...)` with shapes fixed by the slot count and nothing read back to the
        host (CUDA graphs capture it): every written slot's page gets a landmark, sent to the spare row unless
        the slot is the page's last."""
        slots = slot_mapping.long()
        pages = torch.div(slots.clamp(min=0), page_size, rounding_mode="floor")
        fills = (slots >= 0) & (slots % page_size == page_size - 1)
        target = torch.where(fills, pages, self.num_pages)
        for store, mark in zip(self.stores, self.landmark.build(read_pages(pages)[0])):
            store.index_copy_(0, target, mark.to(store.dtype))

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
