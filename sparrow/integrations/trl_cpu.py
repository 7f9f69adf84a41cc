"""What TRL's colocated vLLM engine needs on vLLM's CPU build (TRL 1.16, vLLM 0.32); applied only on CPU, and only to
the Sparrow trainer's own engine (trl.py's `colocated_engine`): TRL's `LLM` and `VLLMGeneration` are left as TRL
has them for every other engine and trainer in the process.

1. `float32_eager`: TRL builds `LLM(model=...)` with the checkpoint's dtype and vLLM's default compilation.
   On CPU vLLM runs a float32 checkpoint in bfloat16 and compiles the model with torch.compile (minutes, and
   Sparrow's compiled paged CPU kernel is float32 only), so the engine is built in float32, eager.
2. `reload_sync`: TRL's colocated weight sync calls the model's `load_weights` with each parameter.
   vLLM's CPU build repacks linear weights after loading (for its GEMM kernels), and `load_weights` into the
   repacked layers fails, so the weights go through vLLM's `reload_weights`, which loads and repacks again, with
   the weights given (TRL's PEFT merge and name fixes kept: `_iter_named_params`). The prefix cache is reset as
   TRL does. TRL names a tied weight once (`named_parameters()`); it is sent under all its names
   (sparrow/vllm/weights.py), else vLLM's LM head, tied to the embedding, keeps its old packed weights on CPU.
"""

from __future__ import annotations

import functools
import types


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def float32_eager(build):
    """TRL's `LLM` (`build`) building its engine in float32, eager."""
    return functools.partial(build, dtype="float32", enforce_eager=True)


def trl_vllm_name(generation, name: str) -> str:
    """The name TRL 1.16's `_iter_named_params` sends for the parameter `name` of its model (PEFT's prefixes off,
    then `_fix_param_name_to_vllm`); the PEFT fixes leave a plain model's names unchanged."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    return generation._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."])


def _sync_weights(self) -> None:
    from sparrow.vllm.weights import reload, tied_aliases, with_tied_aliases

    aliases = tied_aliases(self.model.named_parameters(remove_duplicate=False), functools.partial(trl_vllm_name, self))
    weights = ((name, param.float()) for name, param in self._iter_named_params())
    reload(self.llm, with_tied_aliases(weights, aliases))
    self.llm.reset_prefix_cache()


def reload_sync(generation) -> None:
    """The weight sync of this one TRL `VLLMGeneration` through vLLM's `reload_weights` (an attribute of the
    instance: TRL's class keeps its own `sync_weights`)."""
    generation.sync_weights = types.MethodType(_sync_weights, generation)
