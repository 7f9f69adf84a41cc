"""Sparrow over the attention backend vLLM picks on CUDA (FlashAttention, FlashInfer, Triton), wrapped, not replaced.

`wrap(base)` subclasses the backend vLLM would have used, its metadata builder and its impl: name, cache shape,
configuration checks and kernels stay the wrapped one's, so vLLM's choice is unchanged (plugin.py registers a
wrapper over each member, and vLLM's priority order then finds the same backend valid). Per step:

- The builder makes the step's plan (plan.py) from vLLM's host copies, then calls the wrapped builder ONCE, on the
  whole batch, with the sparse decoding requests' cached lengths set to 1 (the plan's `stock_seq_lens_cpu`, on the
  device and host copies; no cascade prefix). Every other request's metadata is what the wrapped builder makes of
  it, and a sparse request costs the wrapped kernel one token instead of its whole context. (A sub-batch would
  need the wrapped builder's metadata for part of the batch; FlashInfer plans into state shared by the builder, so
  one build per step is the safe way.)
- The impl runs the wrapped forward on the whole batch, then overwrites the sparse requests' rows: in sparse layers
  with our sparse decode, in dense layers with our kernel on all of the request's pages (exact attention, as the
  wrapped kernel never saw their context). So every layer is exact; the sparse rows cost one token of the wrapped
  kernel plus ours.
- CUDA graphs: with vLLM capturing full decode graphs, a uniform decode step takes the fixed-shape path
  (graph_decode.py): per-request budgets and the lengths the wrapped kernel is given (1 where ours attends) in
  buffers of fixed address, written on the device; ours runs on the whole batch and each row keeps its owner's
  output. The builder declares the lower of the wrapped builder's support and UNIFORM_SINGLE_TOKEN_DECODE.
- Every impl also refuses what the rule cannot be exact under (ALiBi, sliding windows, sinks, soft caps, KV sharing,
  a quantized cache) and keeps, per layer, the landmarks of each physical page, computed from the cache when the
  page's last slot is written (so prefix-cached blocks keep theirs); every cache write therefore goes through
  `do_kv_cache_update`: the wrapper declares no fused RoPE + cache write and no cache write by the model ahead of
  attention (vLLM 0.33's `supports_kv_cache_update_bypass`, which FlashAttention and FlashInfer set). Landmark
  updates of up to FIXED_UPDATE_TOKENS slots, and any under capture, take the fixed-shape update, so capture and
  replay run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from vllm.config import CUDAGraphMode
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from sparrow.errors import SparrowError

from .checks import check_engine, check_layers, check_sparse_config
from .env import PluginConfig
from .state import active
from .graph_decode import DecodeGraphBuffers, DecodeGraphPlan, graph_sparse_decode, largest_budget_pages
from .paged import PageLandmarks, filled_pages, physical_pages
from .plan import SparsePlan, plan_step
from .triton_decode import page_reader, paged_sparse_attention, sparse_decode

WRAPPED = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")  # what vLLM 0.32-0.34 pick on CUDA for decoder attention
OURS = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
PREFIX = "Sparrow_"
FIXED_UPDATE_TOKENS = 1024  # landmark updates of at most this many slots use the fixed-shape (capturable) update
_FULL_GRAPH_MODES = (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL)


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


def eager_step(config: PluginConfig, cm: CommonAttentionMetadata, block_size: int, drafting: bool = False
               ) -> tuple[SparrowStep, CommonAttentionMetadata] | None:
    """The plan of a step (`drafting`: an exact-mode drafter's) and the metadata the wrapped builder gets (None: no
    sparse request, or a batch the rule leaves alone: multimodal prefix ranges, non-causal attention)."""
    if config.schedule.is_dense or cm.mm_req_doc_ranges is not None or cm.causal is not True:
        return None
    plan = plan_step(cm, config.schedule, config.sparse.page_size, block_size, sub_batch=False, drafting=drafting)
    if plan is None:
        return None
    step = SparrowStep(config, cm.seq_lens, cm.block_table_tensor, plan=plan)
    return step, reduced(cm, plan.stock_seq_lens_cpu)


def graph_buffers(vllm_config, config: PluginConfig, device) -> DecodeGraphBuffers | None:
    """The buffers of the fixed-shape decode path when vLLM captures full decode graphs and the schedule the engine
    starts with is sparse (its largest budget sets the slots kept)."""
    compilation = vllm_config.compilation_config
    slots = largest_budget_pages(config.schedule, config.sparse.page_size)
    if compilation.cudagraph_mode not in _FULL_GRAPH_MODES or not slots:
        return None
    requests = max([vllm_config.scheduler_config.max_num_seqs, *(compilation.cudagraph_capture_sizes or [])])
    return DecodeGraphBuffers(requests, slots, device)


class SparrowBuilderMixin:
    """The wrapped builder, called once per step on the whole batch with the sparse requests reduced to one token."""
    exact = False  # exact mode: `build` serves the dense target, `build_for_drafting` the drafter


    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = active()
        self.graph_buffers = None
        self.sparrow_block_size = kv_cache_spec.block_size
        if config is not None:
            check_sparse_config(config.sparse, kv_cache_spec.block_size, "auto")
            self.exact = check_engine(vllm_config)
            check_layers(config.sparse, vllm_config.model_config.get_total_num_hidden_layers())
            self.graph_buffers = None if self.exact else graph_buffers(vllm_config, config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        theirs = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        return min(theirs, OURS, key=lambda support: support.value)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int):
        """An exact-mode drafter's step: the eager plan (vLLM captures the drafter's steps piecewise at most)."""
        config, cm, step = active(), common_attn_metadata, None
        if config is not None:
            planned = eager_step(config, cm, self.sparrow_block_size, drafting=True)
            if planned is not None:
                step, cm = planned
        meta = super().build(0, cm, fast_build=True)
        meta.sparrow_step = step
        return meta

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        config, cm, step = active(), common_attn_metadata, None
        if self.exact:
            config = None  # the target of exact mode: dense
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


class SparrowImplMixin:
    """What Sparrow adds to the wrapped impl (FlashAttention, FlashInfer, Triton: the same cache layout and write):
    the refusals, the landmarks kept from the cache as it is written, and the sparse requests' rows from our kernel
    after the wrapped forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "attn_type"):
            self.attn_type = AttentionType.DECODER  # FlashInferImpl keeps none: it takes decoder attention only
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

    def fused_rope_kvcache_supported(self) -> bool:
        return False  # a fused RoPE + cache write would bypass do_kv_cache_update, where the landmarks are kept

    def fused_qk_norm_rope_kvcache_supported(self) -> bool:
        return False  # as above

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
    impl = type(PREFIX + base.get_impl_cls().__name__, (SparrowImplMixin, base.get_impl_cls()),
                {"__module__": __name__})
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": f"Sparrow over {base.__name__}.",
                 "wrapped": base, "get_impl_cls": staticmethod(lambda: impl),
                 "get_builder_cls": staticmethod(lambda: builder),
                 "supports_kv_cache_update_bypass": False}  # vLLM 0.33+: no model writes the cache around us
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

