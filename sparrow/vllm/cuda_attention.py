"""Sparrow's sparse decode as a vLLM CUDA attention backend: vLLM's Triton backend with the rule, sub-batch style.

The plugin registers the wrappers of wrapped.py (over whichever backend vLLM picks); this backend is the first
design, kept as the reference the wrapped Triton backend is tested against, and `SparrowImplMixin` (refusals,
landmarks) is shared by both.

The step's plan is the CPU backend's (plan.py): sparse decoding requests go through our Triton kernel
(triton_decode.py), every other request of the step, dense layers, and every step while the schedule is dense
through vLLM's own Triton kernel on a sub-batch. The cache is vLLM's, written by vLLM's op; per layer we keep the
landmarks of each physical page, computed from the cache when the page's last slot is written (so prefix-cached
blocks keep theirs).

CUDA graphs: the backend declares UNIFORM_SINGLE_TOKEN_DECODE, so vLLM captures whole decode steps (every request
one token) and runs mixed prefill/decode steps piecewise with attention eager. With graphs on, a uniform decode
step takes the fixed-shape path (graph_decode.py) whether it is captured, replayed or run eagerly, and landmark
updates of up to FIXED_UPDATE_TOKENS slots take the fixed-shape update; so capture and replay run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch
from vllm.config import CUDAGraphMode
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from sparrow.errors import SparrowError

from .checks import check_engine, check_sparse_config
from .config import PluginConfig, active
from .graph_decode import DecodeGraphBuffers, DecodeGraphPlan, graph_sparse_decode, largest_budget_pages
from .paged import PageLandmarks, filled_pages
from .plan import SparsePlan, StockRows, plan_step
from .triton_decode import page_reader, sparse_decode

FIXED_UPDATE_TOKENS = 1024  # landmark updates of at most this many slots use the fixed-shape (capturable) update
_FULL_GRAPH_MODES = (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL)


@dataclass
class SparrowTritonMetadata(TritonAttentionMetadata):
    sparse_plan: SparsePlan | None = None
    stock_metadata: TritonAttentionMetadata | None = None
    decode_graph: DecodeGraphPlan | None = None
    plugin_config: PluginConfig | None = None


def eager_plan(config: PluginConfig, cm: CommonAttentionMetadata, meta: TritonAttentionMetadata,
               block_size: int) -> tuple[SparsePlan, TritonAttentionMetadata | None] | None:
    """The step's plan and vLLM's metadata for its stock rows (None: no sparse request, or a batch the plan does
    not split: multimodal prefix ranges, non-causal attention)."""
    if meta.mm_prefix_range_tensor is not None or meta.causal is not True:
        return None
    plan = plan_step(cm, config.schedule, config.sparse.page_size, block_size)
    if plan is None:
        return None
    return plan, None if plan.stock is None else stock_metadata(plan.stock, cm, meta)


def stock_metadata(rows: StockRows, cm: CommonAttentionMetadata, meta: TritonAttentionMetadata
                   ) -> TritonAttentionMetadata:
    """vLLM's metadata restricted to the stock rows (device gathers only)."""
    index = rows.rows
    return replace(meta, num_actual_tokens=rows.tokens.numel(), max_query_len=rows.max_query_len,
                   query_start_loc=rows.query_start_loc, max_seq_len=rows.max_seq_len, seq_lens=cm.seq_lens[index],
                   block_table=cm.block_table_tensor[index], slot_mapping=meta.slot_mapping[rows.tokens],
                   rswa_prefix_lens=None if meta.rswa_prefix_lens is None else meta.rswa_prefix_lens[index])


def graph_buffers(vllm_config, config: PluginConfig, device) -> DecodeGraphBuffers | None:
    """The buffers of the fixed-shape decode path when vLLM captures full decode graphs and the schedule the engine
    starts with is sparse (its largest budget sets the slots kept)."""
    compilation = vllm_config.compilation_config
    slots = largest_budget_pages(config.schedule, config.sparse.page_size)
    if compilation.cudagraph_mode not in _FULL_GRAPH_MODES or not slots:
        return None
    requests = max([vllm_config.scheduler_config.max_num_seqs, *(compilation.cudagraph_capture_sizes or [])])
    return DecodeGraphBuffers(requests, slots, device)


class SparrowTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = active()
        self.graph_buffers = None
        if config is not None:
            check_sparse_config(config.sparse, self.block_size, "auto")
            check_engine(vllm_config)
            self.graph_buffers = graph_buffers(vllm_config, config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        config = active()
        if config is None:
            return meta
        fields_of = {f.name: getattr(meta, f.name) for f in fields(meta)}
        cm = common_attn_metadata
        if self.graph_buffers is not None and cm.max_query_len == 1:
            graph = self.graph_buffers.fill(cm, config.schedule, config.sparse.page_size)
            return SparrowTritonMetadata(**fields_of, decode_graph=graph, plugin_config=config)
        if config.schedule.is_dense:
            return meta
        planned = eager_plan(config, cm, meta, self.block_size)
        if planned is None:
            return meta
        return SparrowTritonMetadata(**fields_of, sparse_plan=planned[0], stock_metadata=planned[1],
                                     plugin_config=config)


class SparrowImplMixin:
    """What every Sparrow attention impl on CUDA adds to vLLM's (Triton, FlashAttention, FlashInfer: the same cache
    layout and write): the refusals, the landmarks kept from the cache as it is written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.landmarks: PageLandmarks | None = None
        config = active()
        self.sparse = None if config is None else config.sparse  # fixed for the engine; the schedule is not
        if config is not None and self.attn_type == AttentionType.DECODER:
            unsupported = [name for name, present in (
                ("ALiBi", self.alibi_slopes is not None), ("a sliding window", self.sliding_window != (-1, -1)),
                ("attention sinks", getattr(self, "sinks", None) is not None),
                ("a logit soft cap", bool(self.logits_soft_cap)),
                ("KV sharing between layers", self.kv_sharing_target_layer_name is not None),
                ("chunked lookback", getattr(self, "chunk_lookback", -1) > -1),
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
        sparse = self.sparse
        if sparse is None or self.attn_type != AttentionType.DECODER or not kv_cache.numel():
            return
        blocks, kv_heads, block, _ = kv_cache.shape
        num_pages = blocks * (block // sparse.page_size)
        if self.landmarks is None or self.landmarks.num_pages != num_pages:
            self.landmarks = PageLandmarks(sparse, num_pages, kv_heads, self.head_size, kv_cache.dtype,
                                           kv_cache.device)
        read = page_reader(*self.caches(kv_cache), sparse.page_size)
        capturing = kv_cache.is_cuda and torch.cuda.is_current_stream_capturing()
        if slot_mapping.numel() <= FIXED_UPDATE_TOKENS or capturing:
            self.landmarks.update_slots(slot_mapping, read, sparse.page_size)
            return
        pages = filled_pages(slot_mapping, sparse.page_size)
        if pages.numel():
            self.landmarks.update(pages, read(pages)[0])


class SparrowTritonAttentionImpl(SparrowImplMixin, TritonAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        config = getattr(attn_metadata, "plugin_config", None)
        plan = getattr(attn_metadata, "sparse_plan", None)
        graph = getattr(attn_metadata, "decode_graph", None)
        if ((plan is None and graph is None) or config is None or self.landmarks is None
                or self.attn_type != AttentionType.DECODER
                or extract_layer_index(layer.layer_name) in config.sparse.dense_layers):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if graph is not None:
            return self._graph_forward(layer, query, key, value, kv_cache, attn_metadata, output, config)
        if plan.stock is not None:
            rows = plan.stock
            out = output.new_empty((rows.tokens.numel(),) + output.shape[1:])
            super().forward(layer, query.index_select(0, rows.tokens), key, value, kv_cache,
                            attn_metadata.stock_metadata, out)
            output.index_copy_(0, rows.tokens, out)
        count, group = plan.tokens.numel(), self.num_heads // self.num_kv_heads
        queries = query.index_select(0, plan.tokens).view(count, self.num_kv_heads, group, self.head_size)
        out = sparse_decode(queries, *self.caches(kv_cache), plan.page_table, self.landmarks, plan.seq_lens,
                            plan.budget_pages, config.sparse, self.scale)
        output.index_copy_(0, plan.tokens, out.reshape((count,) + output.shape[1:]).to(output.dtype))
        return output

    def _graph_forward(self, layer, query, key, value, kv_cache, meta: SparrowTritonMetadata, output,
                       config: PluginConfig):
        """A uniform decode step, fixed shapes (graph_decode.py): vLLM's kernel on every request (one token of
        work for ours), ours on every request (no page for vLLM's), each request's row from its owner."""
        graph = meta.decode_graph
        stock = replace(meta, seq_lens=graph.stock_seq_lens, decode_graph=None)
        super().forward(layer, query, key, value, kv_cache, stock, output)
        count, group = graph.budget_pages.shape[0], self.num_heads // self.num_kv_heads
        queries = query[:count].view(count, self.num_kv_heads, group, self.head_size)
        out = graph_sparse_decode(queries, *self.caches(kv_cache), meta.block_table[:count], self.landmarks,
                                  meta.seq_lens[:count], graph.budget_pages, config.sparse, self.scale, graph.slots)
        rows = output[:count]
        ours = (graph.budget_pages > 0).view((count,) + (1,) * (rows.dim() - 1))
        rows.copy_(torch.where(ours, out.reshape(rows.shape).to(rows.dtype), rows))
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
