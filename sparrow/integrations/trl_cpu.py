"""What TRL's colocated vLLM engine needs on vLLM's CPU build (TRL 1.16, vLLM 0.32); applied only on CPU.

1. `float32_eager_engine`: TRL builds `LLM(model=...)` with the checkpoint's dtype and vLLM's default compilation.
   On CPU vLLM runs a float32 checkpoint in bfloat16 and compiles the model with torch.compile (minutes, and
   Sparrow's compiled paged CPU kernel is float32 only), so the engine is built in float32, eager.
2. `reload_weight_sync`: TRL's colocated weight sync calls the model's `load_weights` with each parameter.
   vLLM's CPU build repacks linear weights after loading (for its GEMM kernels), and `load_weights` into the
   repacked layers fails, so the weights go through vLLM's `reload_weights`, which loads and repacks again, with
   the weights given (TRL's PEFT merge and name fixes kept: `_iter_named_params`). The prefix cache is reset as
   TRL does.
"""

from __future__ import annotations

import functools


def float32_eager_engine() -> None:
    import vllm
    from trl.generation import vllm_generation

    if not isinstance(vllm_generation.LLM, functools.partial):
        vllm_generation.LLM = functools.partial(vllm.LLM, dtype="float32", enforce_eager=True)


def reload_weight_sync() -> None:
    from trl.generation import vllm_generation

    def sync_weights(self) -> None:
        weights = ((name, param.float()) for name, param in self._iter_named_params())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def adapt_trl_to_vllm_cpu() -> bool:
    """Both patches when vLLM runs on CPU; returns whether it does."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    float32_eager_engine()
    reload_weight_sync()
    return True
