"""Sparrow's sparse decode as vLLM's CPU attention backend (registered over CPU_ATTN by plugin.py).

Everything but sparse decode is vLLM's own CPU kernel: prefill and chunked prefill, dense layers, requests whose
budget covers their cache, and every request while the schedule is dense. The cache keeps vLLM's layout, written
by vLLM's own op; this backend adds, per layer, the landmarks of each physical page, computed from the cache when
the page's last slot is written (so prefix-cached blocks keep theirs), and attends the selected pages of sparse
decoding requests in place (`cpu_kernel.paged_sparse_decode`; `paged.reference_decode` for non-float32 dtypes).

A request decodes sparsely when it computes one generated token (query length 1 and past its prompt, vLLM's
`is_prefilling`) and its schedule budget at its cached length is below the pages it holds: our engine's rule.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from sparrow.attention import cpu_kernel
from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError

from .config import active
from .paged import PageLandmarks, filled_pages, physical_pages, reference_decode, split_step

# ISAs whose key layout is channel-major per (block, head); the plugin asks vLLM for one of them.
_READABLE_ISAS = ("vec", "vec16")


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
class StockPart:
    """The requests of a step that vLLM's kernel attends (prefills, dense decodes): their tokens' indices in the
    batch and the metadata of that sub-batch."""

    tokens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class SparsePlan:
    """The sparse decoding requests of a step: their token index in the batch, physical pages [S, P], cached
    tokens (with the new one), pages held and budget in pages; `stock` the rest of the batch (None if empty)."""

    tokens: torch.Tensor
    phys: torch.Tensor
    seq_lens: torch.Tensor
    n_pages: torch.Tensor
    budget_pages: torch.Tensor
    stock: StockPart | None


@dataclass
class SparrowCPUMetadata(CPUAttentionMetadata):
    sparse_plan: SparsePlan | None = None


def check_sparse_config(sparse: SparseConfig, block_size: int, kv_cache_dtype: str) -> None:
    """What the plugin needs of vLLM's cache, refused before any generation with one message."""
    if block_size % sparse.page_size:
        raise SparrowError(f"Sparrow's vLLM plugin: page size {sparse.page_size} does not divide vLLM's KV block "
                           f"size {block_size}; use a page size that divides it (16 divides every CPU block size)")
    if is_quantized_kv_cache(kv_cache_dtype):
        raise SparrowError(f"Sparrow's vLLM plugin needs an unquantized KV cache, got kv_cache_dtype="
                           f"{kv_cache_dtype!r}")


class SparrowCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = active()
        if config is not None and not self.is_cross_attention and not self.is_encoder_only_attention:
            check_sparse_config(config.sparse, self.block_size, self.kv_cache_dtype)
            if self.isa not in _READABLE_ISAS:
                self.isa = "vec"  # AMX repacks keys; the vec kernels read the layout our kernel reads
                self._set_isa_to_layers(layer_names)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        config = active()
        if (config is None or config.schedule.is_dense or self.is_cross_attention
                or self.is_encoder_only_attention):
            return meta
        plan = self._plan(config, common_attn_metadata, meta)
        if plan is None:
            return meta
        return SparrowCPUMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, sparse_plan=plan)

    def _plan(self, config, cm: CommonAttentionMetadata, meta: CPUAttentionMetadata) -> SparsePlan | None:
        ps = config.sparse.page_size
        step = split_step(cm.query_start_loc_cpu, cm.seq_lens, cm.is_prefilling, cm.num_reqs, config.schedule, ps)
        rows = torch.nonzero(step.is_sparse).flatten()
        if not rows.numel():
            return None
        block_table = cm.block_table_tensor[: cm.num_reqs]
        phys = physical_pages(block_table[rows], int(step.n_pages[rows].max()), self.block_size, ps)
        others = torch.nonzero(~step.is_sparse).flatten()
        stock = self._stock_part(others, step.starts, step.query_lens, cm, meta) if others.numel() else None
        return SparsePlan(step.starts[rows], phys, step.seq_lens[rows], step.n_pages[rows], step.budget_pages[rows],
                          stock)

    def _stock_part(self, rows, starts, query_lens, cm, meta) -> StockPart:
        tokens = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in rows.tolist()])
        query_start_loc = torch.zeros(rows.numel() + 1, dtype=cm.query_start_loc.dtype)
        query_start_loc[1:] = torch.cumsum(query_lens[rows], 0)
        seq_lens = cm.seq_lens[rows]
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=query_start_loc,
            causal=meta.causal, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        return StockPart(tokens, query_start_loc, seq_lens, cm.block_table_tensor[rows], scheduler_metadata)


class SparrowCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.landmarks: PageLandmarks | None = None
        self.layout_checked = False
        if active() is not None and attn_type == AttentionType.DECODER:
            unsupported = [name for name, present in (
                ("ALiBi", alibi_slopes is not None), ("a sliding window", self.sliding_window > 0),
                ("attention sinks", sinks is not None), ("a logit soft cap", bool(self.logits_soft_cap)),
                ("KV sharing between layers", kv_sharing_target_layer_name is not None)) if present]
            if unsupported:
                raise SparrowError(f"Sparrow's vLLM plugin does not support attention with {', '.join(unsupported)}"
                                   "; unset SPARROW_VLLM_SCHEDULE to run this model with stock vLLM")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        config = active()
        if config is None or self.attn_type != AttentionType.DECODER or not kv_cache.numel():
            return
        sparse = config.sparse
        read = cpu_page_reader(kv_cache, sparse.page_size)
        if not self.layout_checked:
            self._check_layout(read, key, slot_mapping, sparse.page_size, getattr(layer, "isa", "?"))
        pages = filled_pages(slot_mapping, sparse.page_size)
        if pages.numel():
            self._landmarks(kv_cache, sparse).update(pages, read(pages)[0])

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
        return self.landmarks

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = getattr(attn_metadata, "sparse_plan", None)
        config = active()
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

    def _stock_forward(self, layer, query, kv_cache, meta, part: StockPart, output) -> None:
        blocks, kv_heads, block, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(blocks, kv_heads, block * 2, -1).chunk(2, dim=2)
        queries = query.index_select(0, part.tokens)
        out = torch.empty(queries.shape[0], *output.shape[1:], dtype=output.dtype, device=output.device)
        ops.cpu_attention_with_kv_cache(
            query=queries, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=part.query_start_loc, seq_lens=part.seq_lens, scale=self.scale, causal=meta.causal,
            alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window, block_table=part.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=part.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        output.index_copy_(0, part.tokens, out)

    def _sparse_decode(self, queries, kv_cache, plan: SparsePlan, sparse: SparseConfig) -> torch.Tensor:
        if kv_cache.dtype == torch.float32 and sparse.page_landmark.compiled and cpu_kernel.usable(queries):
            return cpu_kernel.paged_sparse_decode(queries, kv_cache, plan.phys, self.landmarks.tensors,
                                                  plan.n_pages, plan.budget_pages, plan.seq_lens, sparse,
                                                  self.scale)
        return reference_decode(queries.float(), cpu_page_reader(kv_cache, sparse.page_size), plan.phys,
                                self.landmarks, plan.seq_lens, plan.budget_pages, sparse, self.scale)


class SparrowCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with Sparrow's sparse decode (same name, cache shape and kernels otherwise)."""

    @staticmethod
    def get_impl_cls():
        return SparrowCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return SparrowCPUMetadataBuilder
