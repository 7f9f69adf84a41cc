"""The `native` backend: our `RolloutEngine` in this process, sharing the policy's model object."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from sparrow.attention import SparseConfig
from sparrow.engine import Completion, Prompt, RolloutEngine, SamplingParams
from sparrow.errors import SparrowError
from sparrow.lora import without_adapter
from sparrow.schedules import Schedule


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model` (cast to its dtype and device); the key sets must be equal."""
    own = set(model.state_dict())
    missing, extra = sorted(own - set(state)), sorted(set(state) - own)
    if missing or extra:
        first = f"first missing: {missing[0]}" if missing else f"first unexpected: {extra[0]}"
        raise SparrowError(f"sync_weights: the policy's state dict differs from the rollout model's in "
                           f"{len(missing)} missing and {len(extra)} unexpected tensors ({first}); expected the same "
                           "architecture and adapter (ModelSpec.lora / adapter)")
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


class NativeBackend:
    """Rollouts from our engine. When the trainer's policy is the very model object (the usual case),
    `sync_weights` has nothing to copy; another model's parameters and buffers are copied in place."""

    def __init__(self, model, tokenizer, sparse: SparseConfig | None = None, max_batch_size: int = 64):
        self.engine = RolloutEngine(model, tokenizer, sparse, max_batch_size=max_batch_size)

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams, schedule: Schedule,
                 num_samples: int = 1, *, prompt_keys: Sequence[int] | None = None, adapter: bool = True,
                 progress: bool = False, draft_tokens: int | None = None) -> list[Completion]:
        scope = contextlib.nullcontext() if adapter else without_adapter(self.engine.model)
        with scope:
            return self.engine.generate(prompts, sampling, schedule, num_samples, progress=progress,
                                        prompt_keys=prompt_keys, draft_tokens=draft_tokens)

    @property
    def timing(self) -> dict[str, float]:
        """Seconds of the last `generate` call per engine phase (prefill, decode, sample)."""
        return dict(self.engine.timing)

    def sync_weights(self, model) -> None:
        if model is not self.engine.model:
            load_state(self.engine.model, model.state_dict())

    def close(self) -> None:
        self.engine = None
