"""Sparrow's sparse decode as a vLLM CUDA attention backend: vLLM's Triton backend with the rule.

The same plan as the CPU backend (cpu_attention.py): a request decodes sparsely when it computes one generated
token (query length 1, not `is_prefilling`) and its schedule budget at its cached length is below the pages it
holds; those requests go through our Triton kernel (triton_decode.py), every other request of the step, dense
layers, and every step while the schedule is dense through vLLM's own Triton kernel on a sub-batch. The cache is
vLLM's, written by vLLM's op; per layer we keep the landmarks of each physical page, computed from the cache when
the page's last slot is written (so prefix-cached blocks keep theirs).

The plan is made on the host each step, so this backend declares no CUDA-graph support: vLLM then captures the
rest of the model piecewise and runs attention eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError

from .config import PluginConfig, active
from .paged import PageLandmarks, filled_pages, physical_pages, split_step
from .triton_decode import page_reader, sparse_decode


@dataclass
class StockPart:
    """The requests of a step that vLLM's kernel attends: their tokens' indices in the batch and the metadata of
    that sub-batch."""

    tokens: torch.Tensor
    metadata: TritonAttentionMetadata


@dataclass
class SparsePlan:
    """The sparse decoding requests of a step: their token index in the batch, physical pages [S, P], cached
    tokens (with the new one) and budget in pages; `stock` the rest of the batch (None if empty)."""

    tokens: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    budget_pages: torch.Tensor
    stock: StockPart | None


@dataclass
class SparrowTritonMetadata(TritonAttentionMetadata):
    sparse_plan: SparsePlan | None = None


def sparse_plan(config: PluginConfig, cm: CommonAttentionMetadata, meta: TritonAttentionMetadata,
                block_size: int) -> SparsePlan | None:
    """Which requests of the step decode sparsely (None: none, or a batch this plan does not split: multimodal
    prefix ranges, non-causal attention)."""
    if meta.mm_prefix_range_tensor is not None or meta.causal is not True:
        return None
    ps = config.sparse.page_size
    step = split_step(cm.query_start_loc_cpu, cm.seq_lens, cm.is_prefilling, cm.num_reqs, config.schedule, ps)
    starts, query_lens, seq_lens, n_pages, budget, is_sparse = (step.starts, step.query_lens, step.seq_lens,
                                                                step.n_pages, step.budget_pages, step.is_sparse)
    rows = torch.nonzero(is_sparse).flatten()
    if not rows.numel():
        return None
    device = cm.block_table_tensor.device
    on_device = rows.to(device)
    page_table = physical_pages(cm.block_table_tensor[on_device], int(n_pages[rows].max()), block_size, ps)
    others = torch.nonzero(~is_sparse).flatten()
    stock = _stock_part(others, starts, query_lens, seq_lens, cm, meta) if others.numel() else None
    return SparsePlan(starts[rows].to(device), page_table, cm.seq_lens[on_device], budget[rows].to(device), stock)


def _stock_part(rows, starts, query_lens, seq_lens, cm: CommonAttentionMetadata,
                meta: TritonAttentionMetadata) -> StockPart:
    device = cm.block_table_tensor.device
    tokens = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in rows.tolist()]).to(device)
    query_start_loc = torch.zeros(rows.numel() + 1, dtype=cm.query_start_loc.dtype)
    query_start_loc[1:] = torch.cumsum(query_lens[rows], 0)
    on_device = rows.to(device)
    sub = replace(meta, num_actual_tokens=tokens.numel(), max_query_len=int(query_lens[rows].max()),
                  query_start_loc=query_start_loc.to(device), max_seq_len=int(seq_lens[rows].max()),
                  seq_lens=cm.seq_lens[on_device], block_table=cm.block_table_tensor[on_device],
                  slot_mapping=meta.slot_mapping[tokens],
                  rswa_prefix_lens=None if meta.rswa_prefix_lens is None else meta.rswa_prefix_lens[on_device])
    return StockPart(tokens, sub)


def check_block_size(sparse: SparseConfig, block_size: int) -> None:
    if block_size % sparse.page_size:
        raise SparrowError(f"Sparrow's vLLM plugin: page size {sparse.page_size} does not divide vLLM's KV block "
                           f"size {block_size}; use a page size that divides it (16 divides every CUDA block size)")


class SparrowTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = active()
        if config is not None:
            check_block_size(config.sparse, self.block_size)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        config = active()
        if config is None or config.schedule.is_dense:
            return meta
        plan = sparse_plan(config, common_attn_metadata, meta, self.block_size)
        if plan is None:
            return meta
        return SparrowTritonMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, sparse_plan=plan)


class SparrowTritonAttentionImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.landmarks: PageLandmarks | None = None
        if active() is not None and self.attn_type == AttentionType.DECODER:
            unsupported = [name for name, present in (
                ("ALiBi", self.alibi_slopes is not None), ("a sliding window", self.sliding_window != (-1, -1)),
                ("attention sinks", self.sinks is not None), ("a logit soft cap", bool(self.logits_soft_cap)),
                ("KV sharing between layers", self.kv_sharing_target_layer_name is not None),
                ("chunked lookback", self.chunk_lookback > -1),
                (f"a quantized KV cache ({self.kv_cache_dtype})", is_quantized_kv_cache(self.kv_cache_dtype)))
                if present]
            if unsupported:
                raise SparrowError(f"Sparrow's vLLM plugin does not support attention with {', '.join(unsupported)}"
                                   "; unset SPARROW_VLLM_SCHEDULE to run this model with stock vLLM")

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False  # our kernel writes the attention output unquantized

    def caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value caches [blocks, block, Hkv, D] of a layer's cache [blocks, Hkv, block, 2 D], as vLLM's."""
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return key_cache, value_cache

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self.update_landmarks(kv_cache, slot_mapping)

    def update_landmarks(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Landmarks of the pages whose last slot `slot_mapping` just wrote, from the cache."""
        config = active()
        if config is None or self.attn_type != AttentionType.DECODER or not kv_cache.numel():
            return
        sparse = config.sparse
        blocks, kv_heads, block, _ = kv_cache.shape
        num_pages = blocks * (block // sparse.page_size)
        if self.landmarks is None or self.landmarks.num_pages != num_pages:
            self.landmarks = PageLandmarks(sparse, num_pages, kv_heads, self.head_size, kv_cache.dtype,
                                           kv_cache.device)
        pages = filled_pages(slot_mapping, sparse.page_size)
        if pages.numel():
            self.landmarks.update(pages, page_reader(*self.caches(kv_cache), sparse.page_size)(pages)[0])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = getattr(attn_metadata, "sparse_plan", None)
        config = active()
        if (plan is None or config is None or self.landmarks is None or self.attn_type != AttentionType.DECODER
                or extract_layer_index(layer.layer_name) in config.sparse.dense_layers):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if plan.stock is not None:
            part = plan.stock
            out = output.new_empty((part.tokens.numel(),) + output.shape[1:])
            super().forward(layer, query.index_select(0, part.tokens), key, value, kv_cache, part.metadata, out)
            output.index_copy_(0, part.tokens, out)
        count, group = plan.tokens.numel(), self.num_heads // self.num_kv_heads
        queries = query.index_select(0, plan.tokens).view(count, self.num_kv_heads, group, self.head_size)
        out = sparse_decode(queries, *self.caches(kv_cache), plan.page_table, self.landmarks, plan.seq_lens,
                            plan.budget_pages, config.sparse, self.scale)
        output.index_copy_(0, plan.tokens, out.reshape((count,) + output.shape[1:]).to(output.dtype))
        return output


class SparrowTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend with Sparrow's sparse decode (same name, cache shape and kernels otherwise)."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_impl_cls():
        return SparrowTritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return SparrowTritonMetadataBuilder
