"""Block-sparse attention (SPEC section 3): configuration, page landmarks, page selection, KV cache, kernels and
the model hook."""

from .config import SparseConfig
from .interface import AttentionContext, enable_sparse_attention
from .kv_cache import KVCache
from .landmarks import centroid_scores, quest_scores
from .selection import select_pages

__all__ = [
    "AttentionContext",
    "KVCache",
    "SparseConfig",
    "centroid_scores",
    "enable_sparse_attention",
    "quest_scores",
    "select_pages",
]
