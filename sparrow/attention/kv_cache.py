"""Preallocated per-sequence KV cache with page landmarks kept up to date as pages fill.

Every sequence (row) is stored left-aligned: token i of row b sits in slot i, so pages start at slot 0 for every
row whatever its prompt length. Keys and values are held as [rows, kv_heads, pages, page_size, head_dim] so that a
selected page is one contiguous block. A page's landmark tensors (landmarks.py: the centroid, or Quest's min and
max) are computed once, when its last slot is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparrow.cpu.huge_pages import zeros

from .config import SparseConfig


@dataclass
class DecodeStep:
    """Layer-independent facts of one decode step, computed once per step rather than once per layer.

    total: cached tokens per row including the new one; n_pages: pages holding them; budget_pages: per-row
    budget (None = dense); sparse: whether any row attends to fewer pages than it has; write_index: the flat
    slot of the new token per (row, kv head); filled / filled_pages: rows whose page the new token completes;
    used_pages / selected: the most pages any row holds / attends (read from the device once per step, not per
    layer: on a GPU each read waits for the device).
    """

    total: torch.Tensor
    n_pages: torch.Tensor
    budget_pages: torch.Tensor | None
    sparse: bool
    write_index: torch.Tensor
    filled: torch.Tensor
    filled_pages: torch.Tensor
    dense_mask: torch.Tensor
    used_pages: int
    selected: int


@dataclass
class SpanStep:
    """A dense forward of `span` tokens appended to every row at its own length (the verification of drafted
    tokens): token s of row b goes to slot lengths[b] + s and attends to slots 0..lengths[b] + s.

    total: cached tokens per row after the span; write_index: the flat slot of each new token per (row, kv head,
    token); mask [B, 1, span, width]: which slots each new token attends; filled_rows / filled_pages: the pages
    whose last slot the span writes (their landmarks are rebuilt from the new keys)."""

    total: torch.Tensor
    write_index: torch.Tensor
    mask: torch.Tensor
    filled_rows: torch.Tensor
    filled_pages: torch.Tensor


class KVCache:
    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int,
                 sparse: SparseConfig, dtype: torch.dtype, device: torch.device):
        self.sparse = sparse
        ps = sparse.page_size
        self.num_pages = -(-capacity // ps)
        self.capacity = self.num_pages * ps
        shape = (rows, kv_heads, self.num_pages, ps, head_dim)
        lm_shape = (rows, kv_heads, self.num_pages, head_dim)
        self.keys = [zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [zeros(shape, dtype, device) for _ in range(num_layers)]
        tensors = sparse.page_landmark.tensors
        self.landmarks = [[torch.zeros(lm_shape, dtype=dtype, device=device) for _ in range(tensors)]
                          for _ in range(num_layers)]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def write_prompt(self, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write one prompt's keys/values [Hkv, T, D] into slots 0..T-1 of every row in `rows`."""
        length = key.shape[1]
        ps = self.sparse.page_size
        flat_k = self.keys[layer].view(self.rows, key.shape[0], self.capacity, -1)
        flat_v = self.values[layer].view(self.rows, key.shape[0], self.capacity, -1)
        flat_k[rows, :, :length] = key
        flat_v[rows, :, :length] = value
        full = length // ps
        if full:
            page_keys = key[:, : full * ps].reshape(key.shape[0], full, ps, -1)
            for store, mark in zip(self.landmarks[layer], self.sparse.page_landmark.build(page_keys)):
                store[rows, :, :full] = mark

    def begin_step(self, budget_pages: torch.Tensor | None, known: np.ndarray | None = None,
                   known_pages: np.ndarray | None = None) -> DecodeStep:
        """Prepare a decode step that appends one token to every row (lengths grow after the forward). `known`: the
        rows' lengths as the host already knows them (and `known_pages` their budget pages, None when dense), so
        that the step's sizes are found without reading the device; otherwise they are read from it once."""
        ps = self.sparse.page_size
        total = self.lengths + 1
        n_pages = (total + ps - 1) // ps
        kv_heads = self.keys[0].shape[1]
        row_head = torch.arange(self.rows * kv_heads, device=total.device).view(self.rows, kv_heads)
        write_index = (row_head * self.capacity + self.lengths[:, None]).flatten()
        chosen = n_pages if budget_pages is None else torch.minimum(budget_pages, n_pages)
        if known is None:
            filled = torch.nonzero(total % ps == 0).flatten()
            span, used, selected, sparse = torch.stack(  # one device read
                [total.max(), n_pages.max(), chosen.max(), (chosen < n_pages).any().long()]).tolist()
        else:
            span, used, selected, sparse, filled = _step_sizes(np.asarray(known, dtype=np.int64) + 1, known_pages,
                                                               ps)
            filled = torch.as_tensor(filled, device=total.device)
        dense_mask = (torch.arange(span, device=total.device) < total[:, None]).view(self.rows, 1, 1, span)
        return DecodeStep(total, n_pages, budget_pages, bool(sparse), write_index, filled, n_pages[filled] - 1,
                          dense_mask, used, selected)

    def write_token(self, layer: int, key: torch.Tensor, value: torch.Tensor, step: DecodeStep) -> None:
        """Write each row's new key/value [rows, Hkv, D] at slot `lengths[row]`; finish landmarks of filled pages."""
        dim = key.shape[-1]
        self.keys[layer].view(-1, dim).index_copy_(0, step.write_index, key.reshape(-1, dim))
        self.values[layer].view(-1, dim).index_copy_(0, step.write_index, value.reshape(-1, dim))
        self._build_landmarks(layer, step.filled, step.filled_pages)

    def _build_landmarks(self, layer: int, rows: torch.Tensor, pages: torch.Tensor) -> None:
        """(Re)build the landmarks of page pages[i] of row rows[i] from the keys now cached there."""
        if rows.numel():
            page_keys = self.keys[layer][rows, :, pages]  # [n, Hkv, ps, D]
            for store, mark in zip(self.landmarks[layer], self.sparse.page_landmark.build(page_keys)):
                store[rows, :, pages] = mark

    def begin_span(self, span: int) -> SpanStep:
        """Prepare a dense forward of `span` new tokens per row (lengths grow by the caller afterwards)."""
        ps = self.sparse.page_size
        device = self.lengths.device
        slots = self.lengths[:, None] + torch.arange(span, device=device)  # [B, S]
        kv_heads = self.keys[0].shape[1]
        row_head = torch.arange(self.rows * kv_heads, device=device).view(self.rows, kv_heads, 1)
        write_index = (row_head * self.capacity + slots[:, None, :]).flatten()  # [B, Hkv, S] order
        total = self.lengths + span
        width = int(total.max())
        mask = (torch.arange(width, device=device) <= slots[:, :, None]).unsqueeze(1)
        first, last = self.lengths // ps, total // ps - 1  # pages whose last slot lies in the span
        pages = first[:, None] + torch.arange(span // ps + 1, device=device)
        rows, column = torch.nonzero(pages <= last[:, None], as_tuple=True)
        return SpanStep(total, write_index, mask, rows, pages[rows, column])

    def write_span(self, layer: int, key: torch.Tensor, value: torch.Tensor, step: SpanStep) -> None:
        """Write each row's new keys/values [rows, Hkv, S, D] from slot `lengths[row]` on; rebuild the landmarks of
        the pages they complete (a draft may have built them from its own keys)."""
        dim = key.shape[-1]
        self.keys[layer].view(-1, dim).index_copy_(0, step.write_index, key.reshape(-1, dim))
        self.values[layer].view(-1, dim).index_copy_(0, step.write_index, value.reshape(-1, dim))
        self._build_landmarks(layer, step.filled_rows, step.filled_pages)

    def keep(self, kept: list[int]) -> list[int]:
        """Keep only the rows `kept` (ascending; finished sequences dropped), compacted in place with one row copied
        per dropped row below len(kept). Returns the new order: new row i is old row order[i]."""
        order = compaction_order(kept)
        moves = [(i, r) for i, r in enumerate(order) if r != i]
        for tensor in [*self.keys, *self.values, *(m for lm in self.landmarks for m in lm), self.lengths]:
            for i, r in moves:
                tensor[i].copy_(tensor[r])
        count = len(order)
        self.keys = [k[:count] for k in self.keys]
        self.values = [v[:count] for v in self.values]
        self.landmarks = [[m[:count] for m in lm] for lm in self.landmarks]
        self.lengths = self.lengths[:count]
        return order

    def clone(self) -> KVCache:
        """An independent copy (used to run several decodes from one shared prefill)."""
        copy = object.__new__(KVCache)
        copy.__dict__.update(self.__dict__)
        copy.keys = [_copy(k) for k in self.keys]
        copy.values = [_copy(v) for v in self.values]
        copy.landmarks = [[m.clone() for m in lm] for lm in self.landmarks]
        copy.lengths = self.lengths.clone()
        return copy


def _step_sizes(total: np.ndarray, budget_pages: np.ndarray | None,
                ps: int) -> tuple[int, int, int, bool, np.ndarray]:
    """`begin_step`'s sizes from the rows' lengths `total` (the new token counted) on the host: the longest row, the
    most pages a row holds, the most it attends, whether any attends fewer than it holds, the rows [n] whose page
    the new token completes."""
    n_pages = (total + ps - 1) // ps
    chosen = n_pages if budget_pages is None else np.minimum(budget_pages, n_pages)
    return (int(total.max()), int(n_pages.max()), int(chosen.max()), bool((chosen < n_pages).any()),
            np.flatnonzero(total % ps == 0))


def compaction_order(kept: list[int]) -> list[int]:
    """The rows `kept` (ascending) in the order `KVCache.keep` leaves them: a kept row below len(kept) stays where
    it is, and each dropped row below it is filled by a kept row from above, so no source is overwritten first."""
    count = len(kept)
    holes = sorted(set(range(count)) - set(kept))
    movers = [r for r in kept if r >= count]
    order = list(range(count))
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    return order


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A cache tensor in new memory allocated like the original (huge pages where available)."""
    return zeros(tuple(tensor.shape), tensor.dtype, tensor.device).copy_(tensor)
