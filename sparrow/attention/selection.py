"""The page-selection rule shared by the decode and teacher-forced paths (pure tensor math); the page scores it
ranks come from the landmark (landmarks.py).

Shapes use `...` for leading dims: (batch, kv_head) when decoding, (batch, kv_head, position) when teacher-forcing.
"""

from __future__ import annotations

import torch


def select_pages(scores: torch.Tensor, n_pages: torch.Tensor, budget_pages: torch.Tensor,
                 sink_pages: int, recent_pages: int, slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the pages each row attends to.

    scores: [..., P] page scores (entries for pages >= n_pages are ignored); n_pages, budget_pages: integer
    tensors broadcastable to scores[..., 0]. Each row keeps its first `sink_pages` and last `recent_pages` pages,
    then the top-scoring others, `min(budget_pages, n_pages)` pages in all (so a row with no more pages than its
    budget attends densely). Returns (page indices [..., K], valid [..., K]) with K the largest count over rows
    (`slots`, when the caller knows it: reading it from the device waits for the GPU); entries past a row's own
    count are marked invalid.
    """
    num = scores.shape[-1]
    page = torch.arange(num, device=scores.device)
    n_pages = n_pages.unsqueeze(-1)
    exists = page < n_pages
    forced = exists & ((page < sink_pages) | (page >= n_pages - recent_pages))
    ranked = scores.masked_fill(~exists, float("-inf")).masked_fill(forced, float("inf"))
    count = torch.minimum(budget_pages.unsqueeze(-1), n_pages).expand(ranked.shape[:-1] + (1,))
    k = int(count.max()) if slots is None else slots
    pages = ranked.topk(k, dim=-1, sorted=True).indices
    valid = torch.arange(k, device=scores.device) < count
    return pages, valid
