"""Preallocated per-sequence KV cache with page landmarks kept up to date as pages fill.

Every sequence (row) is stored left-aligned: token i of row b sits in slot i, so pages start at slot 0 for every
row whatever its prompt length. Keys and values are held as [rows, kv_heads, pages, page_size, head_dim] so that a
selected page is one contiguous block. A page's landmark (centroid, or Quest's min/max) is computed once, when its
last slot is written.
"""

from __future__ import annotations

import torch

from .config import SparseConfig


class KVCache:
    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int,
                 sparse: SparseConfig, dtype: torch.dtype, device: torch.device):
        self.sparse = sparse
        ps = sparse.page_size
        self.num_pages = -(-capacity // ps)
        self.capacity = self.num_pages * ps
        shape = (rows, kv_heads, self.num_pages, ps, head_dim)
        lm_shape = (rows, kv_heads, self.num_pages, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        n_lm = 2 if sparse.landmark == "quest" else 1
        self.landmarks = [[torch.zeros(lm_shape, dtype=dtype, device=device) for _ in range(n_lm)]
                          for _ in range(num_layers)]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def _page_landmarks(self, page_keys: torch.Tensor) -> list[torch.Tensor]:
        """page_keys [..., page_size, D] -> the landmark tensors [..., D] for full pages."""
        if self.sparse.landmark == "quest":
            return [page_keys.amin(dim=-2), page_keys.amax(dim=-2)]
        return [page_keys.mean(dim=-2)]

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
            for store, mark in zip(self.landmarks[layer], self._page_landmarks(page_keys)):
                store[rows, :, :full] = mark

    def write_token(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write each row's new key/value [rows, Hkv, D] at slot `lengths[row]`; finish landmarks of filled pages."""
        ps = self.sparse.page_size
        row = torch.arange(self.rows, device=key.device)
        page = self.lengths // ps
        offset = self.lengths % ps
        self.keys[layer][row, :, page, offset] = key
        self.values[layer][row, :, page, offset] = value
        filled = torch.nonzero(offset == ps - 1).flatten()
        if filled.numel():
            page_keys = self.keys[layer][filled, :, page[filled]]  # [n, Hkv, ps, D]
            for store, mark in zip(self.landmarks[layer], self._page_landmarks(page_keys)):
                store[filled, :, page[filled]] = mark

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (finished sequences), compacting the batch."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.landmarks = [[m.index_select(0, rows) for m in lm] for lm in self.landmarks]
        self.lengths = self.lengths.index_select(0, rows)

    def clone(self) -> "KVCache":
        """An independent copy (used to run several decodes from one shared prefill)."""
        copy = object.__new__(KVCache)
        copy.__dict__.update(self.__dict__)
        copy.keys = [k.clone() for k in self.keys]
        copy.values = [v.clone() for v in self.values]
        copy.landmarks = [[m.clone() for m in lm] for lm in self.landmarks]
        copy.lengths = self.lengths.clone()
        return copy
