"""Sparrow over the attention backend vLLM picks on CUDA (FlashAttention, FlashInfer, Triton), wrapped, not replaced.

`wrap(base)` subclasses the backend vLLM would have used, its metadata builder and its impl: name, cache shape,
configuration checks and kernels stay the wrapped one's, so vLLM's choice is unchanged (plugin.py registers a
wrapper over each member, and vLLM's priority order then finds the same backend valid). Per step:

- The builder makes the step's plan (plan.py) from vLLM's host copies, then calls the wrapped builder ONCE, on the
  whole batch, with the sparse decoding requests' cached lengths set to 1 (device and host copies; no cascade
  prefix). Every other request's metadata is what the wrapped builder makes of it, and a sparse request costs the
  wrapped kernel one token instead of its whole context. (A sub-batch would need the wrapped builder's metadata
  for part of the batch; FlashInfer plans into state shared by the builder, so one build per step is the safe way.)
- The impl runs the wrapped forward on the whole batch, then overwrites the sparse requests' rows: in sparse layers
  with our sparse decode, in dense layers with our kernel on all of the request's pages (exact attention, as the
  wrapped kernel never saw their context). So every layer is exact; the sparse rows cost one token of the wrapped
  kernel plus ours.
- CUDA graphs: with vLLM capturing full decode graphs, a uniform decode step takes the fixed-shape path
  (graph_decode.py): per-request budgets and the lengths the wrapped kernel is given (1 where ours attends) in
  buffers of fixed address, written on the device; ours runs on the whole batch and each row keeps its owner's
  output. The builder declares the lower of the wrapped builder's support and UNIFORM_SINGLE_TOKEN_DECODE.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from .checks import check_engine, check_sparse_config
from .config import PluginConfig, active
from .cuda_attention import SparrowImplMixin, graph_buffers
from .graph_decode import DecodeGraphPlan, graph_sparse_decode
from .paged import physical_pages
from .plan import SparsePlan, host_seq_lens, plan_step, sparse_rows
from .triton_decode import paged_sparse_attention, sparse_decode

WRAPPED = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")  # the members vLLM 0.32 picks on CUDA for decoder attention
OURS = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
PREFIX = "Sparrow_"


@dataclass
class SparrowStep:
    """What the impl needs of a step besides the wrapped metadata: the true cached lengths and block table of every
    request, and either the eager plan or the fixed-shape one."""

    config: PluginConfig
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: SparsePlan | None = None
    graph: DecodeGraphPlan | None = None


def reduced(cm: CommonAttentionMetadata, stock_lens_cpu: torch.Tensor) -> CommonAttentionMetadata:
    """`cm` with the cached lengths `stock_lens_cpu` (host; 1 for the sparse requests) on both sides."""
    num_reqs = cm.num_reqs
    seq_lens = cm.seq_lens.clone()
    seq_lens[:num_reqs] = stock_lens_cpu.to(seq_lens.device, seq_lens.dtype, non_blocking=True)
    host = None if cm.seq_lens_cpu_upper_bound is None else cm.seq_lens_cpu_upper_bound.clone()
    if host is not None:
        host[:num_reqs] = stock_lens_cpu.to(host.dtype)
    return cm.replace(seq_lens=seq_lens, seq_lens_cpu_upper_bound=host, max_seq_len=int(stock_lens_cpu.max()),
                      _num_computed_tokens_cache=None)


def eager_step(config: PluginConfig, cm: CommonAttentionMetadata, block_size: int
               ) -> tuple[SparrowStep, CommonAttentionMetadata] | None:
    """The plan of a step and the metadata the wrapped builder gets (None: no sparse request, or a batch the rule
    leaves alone: multimodal prefix ranges, non-causal attention)."""
    if config.schedule.is_dense or cm.mm_req_doc_ranges is not None or cm.causal is not True:
        return None
    page_size = config.sparse.page_size
    starts = cm.query_start_loc_cpu[: cm.num_reqs + 1].long()
    seq_lens = host_seq_lens(cm).long()
    prefilling = None if cm.is_prefilling is None else cm.is_prefilling[: cm.num_reqs].cpu().bool()
    sparse = sparse_rows(starts[1:] - starts[:-1], seq_lens, prefilling, config.schedule, page_size)[0]
    if not bool(sparse.any()):
        return None
    plan = plan_step(cm, config.schedule, page_size, block_size)
    step = SparrowStep(config, cm.seq_lens, cm.block_table_tensor, plan=plan)
    return step, reduced(cm, torch.where(sparse, 1, seq_lens))


class SparrowBuilderMixin:
    """The wrapped builder, called once per step on the whole batch with the sparse requests reduced to one token."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = active()
        self.graph_buffers = None
        self.sparrow_block_size = kv_cache_spec.block_size
        if config is not None:
            check_sparse_config(config.sparse, kv_cache_spec.block_size, "auto")
            check_engine(vllm_config)
            self.graph_buffers = graph_buffers(vllm_config, config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        theirs = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        return min(theirs, OURS, key=lambda support: support.value)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        config, cm, step = active(), common_attn_metadata, None
        if config is not None and self.graph_buffers is not None and cm.max_query_len == 1:
            graph = self.graph_buffers.fill(cm, config.schedule, config.sparse.page_size)
            step = SparrowStep(config, cm.seq_lens, cm.block_table_tensor, graph=graph)
            cm = cm.replace(seq_lens=graph.stock_seq_lens, _num_computed_tokens_cache=None)
        elif config is not None:
            planned = eager_step(config, cm, self.sparrow_block_size)
            if planned is not None:
                step, cm = planned
        meta = super().build(0 if step is not None else common_prefix_len, cm, fast_build)
        meta.sparrow_step = step
        return meta


def all_pages(n_pages: torch.Tensor, kv_heads: int, num_pages: int) -> torch.Tensor:
    """Every page of each request for every KV head, [R, Hkv, num_pages], -1 past its `n_pages`."""
    page = torch.arange(num_pages, device=n_pages.device)
    pages = torch.where(page < n_pages.view(-1, 1), page, -1)
    return pages.unsqueeze(1).expand(-1, kv_heads, -1)


class SparrowWrappedImplMixin(SparrowImplMixin):
    """The wrapped forward on the whole batch, then the sparse requests' rows from our kernel."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        step = getattr(attn_metadata, "sparrow_step", None)
        if step is None:
            return output
        dense = self.landmarks is None or extract_layer_index(layer.layer_name) in step.config.sparse.dense_layers
        key_cache, value_cache = self.caches(kv_cache)
        group, sparse = self.num_heads // self.num_kv_heads, step.config.sparse
        if step.graph is not None:
            graph = step.graph
            count = graph.budget_pages.shape[0]
            queries = query[:count].view(count, self.num_kv_heads, group, self.head_size)
            if dense:
                out = self._all_pages(queries, key_cache, value_cache, step.block_table[:count],
                                      step.seq_lens[:count], sparse.page_size)
            else:
                out = graph_sparse_decode(queries, key_cache, value_cache, step.block_table[:count], self.landmarks,
                                          step.seq_lens[:count], graph.budget_pages, sparse, self.scale, graph.slots)
            rows = output[:count]
            ours = (graph.budget_pages > 0).view((count,) + (1,) * (rows.dim() - 1))
            rows.copy_(torch.where(ours, out.reshape(rows.shape).to(rows.dtype), rows))
            return output
        plan = step.plan
        count = plan.tokens.numel()
        queries = query.index_select(0, plan.tokens).view(count, self.num_kv_heads, group, self.head_size)
        if dense:
            pages = all_pages((plan.seq_lens.long() + sparse.page_size - 1) // sparse.page_size, self.num_kv_heads,
                              plan.page_table.shape[1])
            out = paged_sparse_attention(queries, key_cache, value_cache, plan.page_table, pages, plan.seq_lens,
                                         sparse.page_size, self.scale)
        else:
            out = sparse_decode(queries, key_cache, value_cache, plan.page_table, self.landmarks, plan.seq_lens,
                                plan.budget_pages, sparse, self.scale)
        output.index_copy_(0, plan.tokens, out.reshape((count,) + output.shape[1:]).to(output.dtype))
        return output

    def _all_pages(self, queries, key_cache, value_cache, block_table, seq_lens, page_size: int) -> torch.Tensor:
        """Exact attention over every page of each request (a dense layer's rows on the fixed-shape path)."""
        block = key_cache.shape[1]
        page_table = physical_pages(block_table, block_table.shape[1] * (block // page_size), block, page_size)
        pages = all_pages((seq_lens.long() + page_size - 1) // page_size, self.num_kv_heads, page_table.shape[1])
        return paged_sparse_attention(queries, key_cache, value_cache, page_table, pages, seq_lens, page_size,
                                      self.scale)


def wrap(base: type, name: str | None = None) -> type:
    """Sparrow over the attention backend class `base` (named `name` in this module, for vLLM to import)."""
    name = name or PREFIX + base.__name__
    builder = type(PREFIX + base.get_builder_cls().__name__, (SparrowBuilderMixin, base.get_builder_cls()),
                   {"__module__": __name__})
    impl = type(PREFIX + base.get_impl_cls().__name__, (SparrowWrappedImplMixin, base.get_impl_cls()),
                {"__module__": __name__})
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": f"Sparrow over {base.__name__}.",
                 "wrapped": base, "get_impl_cls": staticmethod(lambda: impl),
                 "get_builder_cls": staticmethod(lambda: builder)}
    return type(name, (base,), namespace)


def wrapper_path(member: str) -> str:
    """Where vLLM finds the wrapper of its backend `member` (FLASH_ATTN, ...): this module, resolved lazily."""
    return f"{__name__}.{PREFIX}{member}"


@cache
def _wrapper(member: str) -> type:
    return wrap(resolve_obj_by_qualname(AttentionBackendEnum[member].value), PREFIX + member)


def __getattr__(name: str):
    """`Sparrow_<MEMBER>`: the wrapper of vLLM's own class for that member, made (and its module imported) only when
    vLLM asks for it, so that importing this module imports no CUDA-only kernel."""
    if name.startswith(PREFIX) and name[len(PREFIX):] in WRAPPED:
        return _wrapper(name[len(PREFIX):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

