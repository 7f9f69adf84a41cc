"""Sparrow's sparse decode as vLLM's CPU attention backend (registered over CPU_ATTN by plugin.py).

Everything but sparse decode is vLLM's own CPU kernel: prefill and chunked prefill, dense layers, requests whose
budget covers their cache, and every request while the schedule is dense. The cache keeps vLLM's layout, written
by vLLM's own op; this backend adds, per layer, the landmarks of each physical page, computed from the cache when
the page's last slot is written (so prefix-cached blocks keep theirs), and attends the selected pages of sparse
decoding requests in place (`cpu_kernel.paged_sparse_decode`; `paged.reference_decode` for non-float32 dtypes).
While the schedule is dense a step does nothing beyond stock vLLM: landmarks are not kept, and the first sparse
step rebuilds them from the cache (one pass over it per layer). The cache's memory is moved to transparent huge
pages on first use (`use_huge_pages`), which speeds up vLLM's dense kernel as well as ours.

Which requests decode sparsely is the step's plan (plan.py, shared with the CUDA backend); the rest of the step
is a sub-batch with its own scheduler metadata for vLLM's kernel.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields

import torch
from vllm import envs
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata, MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from sparrow.attention.config import SparseConfig
from sparrow.cpu import huge_pages
from sparrow.cpu import kernel as cpu_kernel
from sparrow.errors import SparrowError

from .checks import check_engine, check_layers, check_sparse_config
from .env import PluginConfig
from .state import active
from .paged import PageLandmarks, filled_pages, reference_decode
from .plan import SparsePlan, StockRows, plan_step

try:
    from vllm import _cpu_ops as ops  # vLLM 0.34 moved the CPU attention ops here from _custom_ops
except ImportError:
    from vllm import _custom_ops as ops

# ISAs whose key layout is channel-major per (block, head); the plugin asks vLLM for one of them.
_READABLE_ISAS = ("vec", "vec16")
_HUGE_CACHES: set[int] = set()  # the cache allocations already given huge pages (all layers share one)


def use_huge_pages(kv_cache: torch.Tensor) -> None:
    """Back the memory of vLLM's cache (the one allocation behind every layer's view) by transparent huge pages,
    once per allocation: vLLM allocates it in 4 KiB pages, and both its dense kernel and ours read the cache
    faster from 2 MiB ones (BENCHMARKS). Best effort; SPARROW_HUGE_PAGES=0 keeps vLLM's memory as it is. The copy
    took 9 s per GiB on a 2-core VM whose free memory had first to be made into huge pages, 1 s per GiB once it
    had some."""
    storage = kv_cache.untyped_storage()
    if storage.data_ptr() in _HUGE_CACHES or kv_cache.device.type != "cpu":
        return
    _HUGE_CACHES.add(storage.data_ptr())
    if not huge_pages.enabled():
        return
    gib = storage.nbytes() / 2**30
    loud = gib >= 0.25  # the copy takes seconds per GiB where the kernel must first free up huge pages
    if loud:
        print(f"sparrow: moving vLLM's KV cache ({gib:.1f} GiB) into huge pages, once (SPARROW_HUGE_PAGES=0 skips "
              "it)", file=sys.stderr, flush=True)
    started = time.perf_counter()
    moved = huge_pages.collapse(storage.data_ptr(), storage.nbytes())
    if loud:
        print(f"sparrow: {'moved' if moved else 'not all moved: ' + huge_pages.last_refusal()} "
              f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)


def _layer_metadata(layer):
    """This step's attention metadata of `layer` (None outside a forward, or in vLLM's dummy runs)."""
    metadata = get_forward_context().attn_metadata
    return metadata.get(layer.layer_name) if isinstance(metadata, dict) else metadata


def cpu_page_reader(kv_cache: torch.Tensor, page_size: int):
    """Reader of physical pages of a CPU cache [blocks, Hkv, block, 2 D]: per (block, head) the keys as [D, block]
    then the values as [block, D]. Returns read(phys [...]) -> (keys, values) [..., Hkv, page_size, D]."""
    blocks, kv_heads, block, two_d = kv_cache.shape
    dim, per = two_d // 2, block // page_size
    flat = kv_cache.view(blocks, kv_heads, 2, block * dim)
    keys = flat[:, :, 0].view(blocks, kv_heads, dim, per, page_size)
    values = flat[:, :, 1].view(blocks, kv_heads, per, page_size, dim)

    def read(phys: torch.Tensor):
        block_of, sub = torch.div(phys, per, rounding_mode="floor"), phys % per
        return keys[block_of, :, :, sub].transpose(-1, -2), values[block_of, :, sub]

    return read


@dataclass
class StockMetadata:
    """vLLM's CPU kernel inputs for the stock rows of a step (`plan.StockRows`)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class SparrowCPUMetadata(CPUAttentionMetadata):
    """vLLM's metadata of a step under a sparse schedule: the plan (None: no request decodes sparsely this step),
    the pages whose last slot the step writes (for every layer's landmarks) and the stock rows' kernel inputs."""

    sparse_plan: SparsePlan | None = None
    filled_pages: torch.Tensor | None = None
    stock_metadata: StockMetadata | None = None
    plugin_config: PluginConfig | None = None


class SparrowCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    exact = False  # exact mode: `build` serves the dense target, `build_for_drafting` the drafter

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = active()
        if config is not None and not self.is_cross_attention and not self.is_encoder_only_attention:
            check_sparse_config(config.sparse, self.block_size, self.kv_cache_dtype)
            self.exact = check_engine(vllm_config)
            check_layers(config.sparse, vllm_config.model_config.get_total_num_hidden_layers())
            if self.isa not in _READABLE_ISAS:
                self.isa = "vec"  # AMX repacks keys; the vec kernels read the layout our kernel reads
                self._set_isa_to_layers(layer_names)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return meta if self.exact else self._sparrow(meta, common_attn_metadata, drafting=False)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int):
        meta = super().build(0, common_attn_metadata, fast_build=True)
        return self._sparrow(meta, common_attn_metadata, drafting=True)

    def _sparrow(self, meta: CPUAttentionMetadata, common_attn_metadata: CommonAttentionMetadata,
                 drafting: bool) -> CPUAttentionMetadata:
        """`meta` with the step's plan under the schedule in force (unchanged under a dense one)."""
        config = active()
        if (config is None or config.schedule.is_dense or self.is_cross_attention
                or self.is_encoder_only_attention):
            return meta
        plan = plan_step(common_attn_metadata, config.schedule, config.sparse.page_size, self.block_size,
                         drafting=drafting)
        stock = None
        if plan is not None and plan.stock is not None:
            stock = self._stock_metadata(plan.stock, common_attn_metadata, meta)
        filled = filled_pages(common_attn_metadata.slot_mapping, config.sparse.page_size)
        return SparrowCPUMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, sparse_plan=plan,
                                  filled_pages=filled, stock_metadata=stock, plugin_config=config)

    def _stock_metadata(self, rows: StockRows, cm: CommonAttentionMetadata, meta) -> StockMetadata:
        seq_lens = rows.seq_lens
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows.rows.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=rows.query_start_loc,
            causal=meta.causal, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        return StockMetadata(rows.query_start_loc, seq_lens, cm.block_table_tensor[rows.rows], scheduler_metadata)


class SparrowCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.landmarks: PageLandmarks | None = None
        self.landmarks_current = False  # whether the landmarks match the cache (not after a dense step)
        self.layout_checked = False
        config = active()
        self.sparse = None if config is None else config.sparse  # fixed for the engine; the schedule is not
        if config is not None and attn_type == AttentionType.DECODER:
            unsupported = [name for name, present in (
                ("ALiBi", alibi_slopes is not None), ("a sliding window", self.sliding_window > 0),
                ("attention sinks", sinks is not None), ("a logit soft cap", bool(self.logits_soft_cap)),
                ("KV sharing between layers", kv_sharing_target_layer_name is not None)) if present]
            if unsupported:
                raise SparrowError(f"Sparrow's vLLM plugin does not support attention with {', '.join(unsupported)}"
                                   "; unset SPARROW_VLLM_SCHEDULE to run this model with stock vLLM")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        sparse = self.sparse
        if sparse is None or self.attn_type != AttentionType.DECODER or not kv_cache.numel():
            return
        use_huge_pages(kv_cache)
        meta = _layer_metadata(layer)
        if not isinstance(meta, SparrowCPUMetadata):  # a dense schedule's step (or vLLM's dummy run)
            self.landmarks_current = False
            return
        read = cpu_page_reader(kv_cache, sparse.page_size)
        if not self.layout_checked:
            self._check_layout(read, key, slot_mapping, sparse.page_size, getattr(layer, "isa", "?"))
        landmarks = self._landmarks(kv_cache, sparse)
        if not self.landmarks_current:
            landmarks.rebuild(read)
            self.landmarks_current = True
        elif meta.filled_pages.numel():
            landmarks.update(meta.filled_pages, read(meta.filled_pages)[0])

    def _check_layout(self, read, key, slot_mapping, page_size: int, isa: str) -> None:
        """The keys just written read back through our view (once per layer): a layout we do not know fails here."""
        valid = torch.nonzero(slot_mapping >= 0).flatten()[:4]
        if not valid.numel():
            return
        slots = slot_mapping[valid].long()
        keys = read(torch.div(slots, page_size, rounding_mode="floor"))[0]  # [n, Hkv, ps, D]
        stored = keys[torch.arange(slots.numel()), :, slots % page_size]
        if not torch.equal(stored, key[valid].to(stored.dtype)):
            raise SparrowError(f"vLLM's CPU KV cache (isa {isa!r}) is not laid out as Sparrow's plugin reads it "
                               f"(keys channel-major per block, ISAs {', '.join(_READABLE_ISAS)})")
        self.layout_checked = True

    def _landmarks(self, kv_cache: torch.Tensor, sparse: SparseConfig) -> PageLandmarks:
        blocks, kv_heads, block, two_d = kv_cache.shape
        num_pages = blocks * (block // sparse.page_size)
        if self.landmarks is None or self.landmarks.num_pages != num_pages:
            self.landmarks = PageLandmarks(sparse, num_pages, kv_heads, two_d // 2, kv_cache.dtype,
                                           kv_cache.device)
            self.landmarks_current = False  # a new cache may already hold keys
        return self.landmarks

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = getattr(attn_metadata, "sparse_plan", None)
        config = getattr(attn_metadata, "plugin_config", None)
        if (plan is None or config is None or self.landmarks is None
                or extract_layer_index(layer.layer_name) in config.sparse.dense_layers):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if plan.stock is not None:
            self._stock_forward(layer, query, kv_cache, attn_metadata, plan.stock, output)
        count, group = plan.tokens.numel(), self.num_heads // self.num_kv_heads
        queries = query.index_select(0, plan.tokens).view(count, self.num_kv_heads, group, self.head_size)
        out = self._sparse_decode(queries, kv_cache, plan, config.sparse)
        output.index_copy_(0, plan.tokens, out.reshape(count, self.num_heads, -1).to(output.dtype))
        return output

    def _stock_forward(self, layer, query, kv_cache, meta: SparrowCPUMetadata, rows: StockRows, output) -> None:
        part = meta.stock_metadata
        blocks, kv_heads, block, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(blocks, kv_heads, block * 2, -1).chunk(2, dim=2)
        queries = query.index_select(0, rows.tokens)
        out = torch.empty(queries.shape[0], *output.shape[1:], dtype=output.dtype, device=output.device)
        ops.cpu_attention_with_kv_cache(
            query=queries, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=part.query_start_loc, seq_lens=part.seq_lens, scale=self.scale, causal=meta.causal,
            alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window, block_table=part.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=part.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        output.index_copy_(0, rows.tokens, out)

    def _sparse_decode(self, queries, kv_cache, plan: SparsePlan, sparse: SparseConfig) -> torch.Tensor:
        if kv_cache.dtype == torch.float32 and sparse.page_landmark.compiled and cpu_kernel.usable(queries):
            return cpu_kernel.paged_sparse_decode(queries, kv_cache, plan.page_table, self.landmarks.tensors,
                                                  plan.n_pages, plan.budget_pages, plan.seq_lens, sparse,
                                                  self.scale)
        return reference_decode(queries.float(), cpu_page_reader(kv_cache, sparse.page_size), plan.page_table,
                                self.landmarks, plan.seq_lens, plan.budget_pages, sparse, self.scale)


class SparrowCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with Sparrow's sparse decode (same name, cache shape and kernels otherwise)."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        """Multiples of 16, not vLLM's 32: its CPU kernels run blocks of 16 too (ISA "vec16"), the block the plugin
        asks for (`config.cpu_block_size`)."""
        return [MultipleOf(16)]

    @staticmethod
    def get_impl_cls():
        return SparrowCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return SparrowCPUMetadataBuilder
