"""Page landmarks, each known in one place: what a page keeps, how pages are scored with it, what it costs.

A landmark summarises the keys of one full page ([..., page_size, D], post-RoPE) by `tensors` vectors of head_dim
per KV head ([..., D] each), computed once when the page fills. A decode step scores the full pages against its
queries [B, Hkv, T, G, D] (G query heads per KV head) and keeps the best ones (`selection.select_pages`).

- centroid: the mean key, scored by its dot product with the group-mean query (one score per KV head).
- quest: per-channel min and max keys (Quest), scored per query head by the upper bound
  sum_c max(q_c kmax_c, q_c kmin_c) of that head's dot product with any key of the page, then maxed over the group.

A new landmark is one `Landmark` in REGISTRY: the KV cache, the PyTorch kernels, `SparseConfig` validation, the
cost model and the benchmark's bytes per step all read it from here. Leave `compiled` False unless
csrc/sparse_decode.cpp learns to score it (the kernel tells its landmarks apart by their tensor count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparrow.errors import SparrowError


def centroid_landmarks(page_keys: torch.Tensor) -> list[torch.Tensor]:
    """page_keys [..., page_size, D] -> [mean key [..., D]]."""
    return [page_keys.mean(dim=-2)]


def quest_landmarks(page_keys: torch.Tensor) -> list[torch.Tensor]:
    """page_keys [..., page_size, D] -> [per-channel min [..., D], per-channel max [..., D]]."""
    return [page_keys.amin(dim=-2), page_keys.amax(dim=-2)]


def centroid_scores(queries: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Score pages by the dot product of the group-mean query with each page's mean key.

    queries: [B, Hkv, T, G, D] (post-RoPE), centroids: [B, Hkv, P, D] -> scores [B, Hkv, T, P].
    """
    return queries.mean(dim=3) @ centroids.transpose(-1, -2)


def quest_scores(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound sum_c max(q_c kmax_c, q_c kmin_c) per query head, maximized over the group's heads.

    Since kmax >= kmin, the max picks kmax where q_c >= 0 and kmin where q_c < 0: two matmuls.
    queries: [B, Hkv, T, G, D], kmin/kmax: [B, Hkv, P, D] -> scores [B, Hkv, T, P].
    """
    kmax_t = kmax.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, D, P]
    kmin_t = kmin.unsqueeze(2).transpose(-1, -2)
    bound = queries.clamp(min=0) @ kmax_t + queries.clamp(max=0) @ kmin_t  # [B, Hkv, T, G, P]
    return bound.amax(dim=3)


@dataclass(frozen=True)
class Landmark:
    """One kind of page landmark.

    tensors: vectors kept per page and KV head, in the order `build` returns them and `score` takes them.
    per_query_head: scored with every query head of a group (then maxed) rather than with the group-mean query.
    compiled: the compiled CPU decode kernel scores it too.
    build(page_keys [..., page_size, D]) -> `tensors` tensors [..., D];
    score(queries [B, Hkv, T, G, D], *tensors [B, Hkv, P, D]) -> page scores [B, Hkv, T, P].
    """

    name: str
    tensors: int
    per_query_head: bool
    compiled: bool
    build: Callable[[torch.Tensor], list[torch.Tensor]]
    score: Callable[..., torch.Tensor]

    def bytes_per_page(self, kv_heads: int, head_dim: int, element_bytes):
        """Bytes one page's landmarks take in one layer (all KV heads), read once per scoring step."""
        return self.tensors * kv_heads * head_dim * element_bytes

    def score_flops_per_page(self, heads: int, kv_heads: int, head_dim: int) -> int:
        """FLOPs of scoring one page in one layer: a multiply and an add per channel, tensor and scoring head."""
        return 2 * self.tensors * head_dim * (heads if self.per_query_head else kv_heads)


REGISTRY: dict[str, Landmark] = {
    "centroid": Landmark("centroid", tensors=1, per_query_head=False, compiled=True, build=centroid_landmarks,
                         score=centroid_scores),
    "quest": Landmark("quest", tensors=2, per_query_head=True, compiled=True, build=quest_landmarks,
                      score=quest_scores),
}
LANDMARKS = tuple(REGISTRY)


def get_landmark(name: str) -> Landmark:
    """The registered landmark called `name`; a SparrowError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise SparrowError(f"unknown landmark {name!r}: expected one of {', '.join(LANDMARKS)}")
    return REGISTRY[name]
