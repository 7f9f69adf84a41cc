"""Loading a training model's weights into a running vLLM engine exactly (`reload_weights`), for `VLLMBackend` and
the TRL integration.

vLLM's `reload_weights` loads layer by layer: each layer is put back on the meta device, gets the tensors sent for
it, is processed again (on CPU, `process_weights_after_loading` repacks linear weights for its GEMM kernels, the
LM head's too) and is copied into its old storage. A layer that receives nothing keeps its old tensors and its old
processed state, with the warning "<Layer>: Failed to load weights". With tied embeddings the LM head shares its
weight with the token embedding, and a model's `named_parameters()` (what TRL sends) names that weight once, as
`model.embed_tokens.weight`: the storage is updated through the embedding, but the LM head is not processed again,
so on CPU its packed copy (oneDNN / sgl GEMM handle) keeps the old weights and vLLM's logits come from a stale
head. `with_tied_aliases` sends such a weight under every name the model gives it, as a state dict would.

`RotaryEmbedding: Failed to load weights` is logged at every reload of a model with rotary embeddings, whatever
is sent: its only tensor is `cos_sin_cache`, a buffer computed from the config that no checkpoint holds, and vLLM
keeps it. `reload` filters that one message out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED_LOAD = "%s: Failed to load weights"


def tied_aliases(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 rename: Callable[[str], str] = lambda name: name) -> dict[str, list[str]]:
    """{first name of a parameter reachable under several names: its other names}, from
    `model.named_parameters(remove_duplicate=False)`, every name through `rename` (the sender's name fixes)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in named_parameters:
        name = rename(name)
        canonical = first.setdefault(id(param), name)
        if name != canonical and name not in aliases.setdefault(canonical, []):
            aliases[canonical].append(name)
    return {name: others for name, others in aliases.items() if others}


def with_tied_aliases(weights: Iterable[tuple[str, torch.Tensor]],
                      aliases: dict[str, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, each tied one followed by the same tensor under its other names (each name sent once)."""
    sent: set[str] = set()
    for name, tensor in weights:
        yield name, tensor
        sent.add(name)
        for alias in aliases.get(name, ()):
            if alias not in sent:
                yield alias, tensor
                sent.add(alias)


class _RotaryCacheFilter(logging.Filter):
    """Drops vLLM's "Failed to load weights" for rotary embeddings only (a buffer derived from the config)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == FAILED_LOAD and isinstance(record.args, tuple) and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))


def quiet_rotary_reload_warning() -> None:
    reload_log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryCacheFilter) for f in reload_log.filters):
        reload_log.addFilter(_RotaryCacheFilter())


def reload(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `weights` (checkpoint names and format, tied weights under all their names) into the running engine
    `llm` (a `vllm.LLM`) in place; every layer is processed again, the exact-mode drafter's copy of the policy too
    (vLLM's `reload_weights` reloads the target only). The caller resets the prefix cache. Streamed as they come,
    except with a drafter: then each tensor is copied first, since a sender may change its tensors in place once
    its iterator ends (TRL unmerges a LoRA adapter) and the drafter loads them after the target."""
    quiet_rotary_reload_warning()
    drafter = any(llm.collective_rpc(has_drafter))
    if drafter:
        weights = [(name, tensor.detach().clone()) for name, tensor in weights]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
    if drafter:
        llm.collective_rpc(reload_drafter, args=(weights,))


def has_drafter(worker) -> bool:
    """On a vLLM worker: whether the engine drafts with a model of its own (exact mode's copy of the policy)."""
    return getattr(getattr(worker.model_runner, "drafter", None), "model", None) is not None


def reload_drafter(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """On a vLLM worker: load `weights` into the draft model of exact mode."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    drafter = worker.model_runner.drafter
    reload_weights(drafter.vllm_config, drafter.model, weights_iterator=iter(weights), weights_path=None,
                   is_checkpoint_format=True)
