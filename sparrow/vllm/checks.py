"""What the plugin needs of vLLM's engine, checked when a metadata builder is made and refused with one message.

- Pages: our page size divides vLLM's KV block size, and the cache is unquantized (landmarks are its keys).
- Dense layers: the model has every layer SPARROW_VLLM_DENSE_LAYERS names (its layer count is known only here).
- Tensor parallelism: selection is per KV head from the scores of that head's query heads (the group), so a rank
  applies the rule exactly when it holds whole groups: the KV heads split evenly over the ranks. When the ranks
  outnumber the KV heads, vLLM replicates each KV head and gives each rank part of its group, whose scores differ
  from the whole group's: refused. Context parallelism splits a request's tokens over ranks, so no rank sees all
  its pages: refused.
- Speculative decoding only as exact mode (exact_mode.py): the policy itself drafts sparsely and verifies densely.
"""

from __future__ import annotations

import os

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError

from .env import DEFAULT_DENSE_LAYERS, ENV_DENSE_LAYERS
from .exact_mode import is_exact

UNSET = "; unset SPARROW_VLLM_SCHEDULE to run stock vLLM"


def check_sparse_config(sparse: SparseConfig, block_size: int, kv_cache_dtype: str) -> None:
    """Our pages tile vLLM's blocks, and the cache holds the keys unquantized."""
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache  # 0.32 has it here too; 0.33 only here

    if block_size % sparse.page_size:
        raise SparrowError(f"Sparrow's vLLM plugin: page size {sparse.page_size} does not divide vLLM's KV block "
                           f"size {block_size}; use a page size that divides it (16 divides every block size)")
    if is_quantized_kv_cache(kv_cache_dtype):
        raise SparrowError(f"Sparrow's vLLM plugin needs an unquantized KV cache, got kv_cache_dtype="
                           f"{kv_cache_dtype!r}")


def check_layers(sparse: SparseConfig, layers: int, environ=None) -> None:
    """At engine start, where the model's layer count is known: refuse dense layers the model does not have, naming
    SPARROW_VLLM_DENSE_LAYERS and its value (--backend vllm sets it from --dense-layers)."""
    past = [i for i in sparse.dense_layers if i >= layers]
    if past:
        value = (os.environ if environ is None else environ).get(ENV_DENSE_LAYERS, DEFAULT_DENSE_LAYERS)
        raise SparrowError(f"{ENV_DENSE_LAYERS}={value!r} names layer {past[0]}, but the model's layer count is "
                           f"{layers}; expected dense layer indices from 0 to {layers - 1}")


def check_parallel(total_kv_heads: int, tensor_parallel: int, context_parallel: int = 1) -> None:
    """Each tensor-parallel rank holds whole query groups (KV heads divisible by the ranks); no context parallel."""
    if total_kv_heads % tensor_parallel:
        raise SparrowError(f"Sparrow's vLLM plugin is exact under tensor parallelism only when the {total_kv_heads} "
                           f"KV heads split evenly over the {tensor_parallel} ranks (each rank then selects pages "
                           "for whole query groups); use a tensor-parallel size dividing the KV heads" + UNSET)
    if context_parallel > 1:
        raise SparrowError(f"Sparrow's vLLM plugin does not support context parallelism (size {context_parallel}): "
                           "each rank would select among part of a request's pages" + UNSET)


def check_engine(vllm_config) -> bool:
    """The parallel layout and decoding mode of a vLLM engine (`check_parallel`; speculative decoding only as exact
    mode). Returns whether the engine runs exact mode."""
    parallel = vllm_config.parallel_config
    check_parallel(vllm_config.model_config.get_total_num_kv_heads(), parallel.tensor_parallel_size,
                   parallel.decode_context_parallel_size * parallel.prefill_context_parallel_size)
    return is_exact(vllm_config)
