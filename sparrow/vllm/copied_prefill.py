"""A KV connector for decode benchmarks: the engine prefills its first request, and every later request gets that
prompt's whole blocks copied into its own cache blocks instead of computing them.

`sparrow bench --backend vllm` times decode at 8K cached tokens on 8 distinct prompts in two engines (stock and
plugin); prefilling all 16 took two thirds of the command on a CPU (22-88 s a prompt on 2 cores). With this
connector each engine prefills one prompt and copies it, as our engine's benchmark does: the requests keep their own
blocks (dense decode reads 8 caches, not one 8 times), filled with a real prefill's values (vLLM's
`DecodeBenchConnector` fills random ones, which made its CPU kernel 1.2-1.5x slower per step than real ones).

Loaded through vLLM's public connector interface (`kv_transfer_config` with `kv_connector_module_path`), so the
engine stays stock. Only whole blocks are copied; a prompt's partial last block is computed as usual. Copied
blocks bypass the attention backend's cache update, so a copy into a step that decodes sparsely would leave the
plugin's landmarks stale: prefill with the dense schedule (the plugin rebuilds landmarks at the first sparse step).
vLLM keeps one connector per process and any engine's shutdown clears it: run such an engine alone in its process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

CONNECTOR = "CopiedPrefillConnector"


def kv_transfer_config() -> dict:
    """The `kv_transfer_config` engine argument that loads this connector."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": __name__, "kv_role": "kv_both"}


@dataclass
class CopiedPrefillMetadata(KVConnectorMetadata):
    """One step's work: the blocks to snapshot (the source request's, just finished) and, per request, the
    destination blocks that take the snapshot's blocks from `first` on."""

    snapshot: list[int] = field(default_factory=list)
    copies: list[tuple[list[int], int]] = field(default_factory=list)


class CopiedPrefillConnector(KVConnectorBase_V1):
    """Scheduler side: the first request computes its prompt; when it finishes, its full blocks are snapshot; later
    requests report their full blocks within the snapshot as external. Worker side: snapshot and copy, per layer."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"{CONNECTOR} copies one KV cache group, this engine has {len(groups)}")
        self.block_size = groups[0].kv_cache_spec.block_size
        self.source: str | None = None  # the request whose prefill is copied
        self.source_blocks = 0  # full blocks in the snapshot, once taken
        self.pending = CopiedPrefillMetadata()
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.snapshots: dict[str, torch.Tensor] = {}

    # scheduler side

    def _copyable_tokens(self, request) -> int:
        """The request's tokens in whole blocks the snapshot holds (its last token is always computed)."""
        return min((request.num_tokens - 1) // self.block_size, self.source_blocks) * self.block_size

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.source is None:
            self.source = request.request_id
        return max(0, self._copyable_tokens(request) - num_computed_tokens), False  # prefix-cached blocks stay

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens:
            end = self._copyable_tokens(request) // self.block_size
            first = end - num_external_tokens // self.block_size
            self.pending.copies.append((blocks.get_block_ids()[0][first:end], first))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self.pending = self.pending, CopiedPrefillMetadata()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id == self.source and not self.source_blocks:
            full = request.num_prompt_tokens // self.block_size
            self.pending.snapshot = list(block_ids[:full])
            self.source_blocks = full
        return False, None

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if meta.snapshot:
            index = torch.tensor(meta.snapshot)
            self.snapshots = {name: cache.index_select(0, index) for name, cache in self.kv_caches.items()}
        for ids, first in meta.copies:
            index = torch.tensor(ids)
            for name, cache in self.kv_caches.items():
                cache.index_copy_(0, index, self.snapshots[name][first:first + len(ids)])

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
