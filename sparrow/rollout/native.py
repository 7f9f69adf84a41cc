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


class NativeBackend:
    """Rollouts from our engine. When the trainer's policy is the very model object (the usual case),
    `sync_weights` has nothing to copy; another model's parameters and buffers are copied in place."""

    name = "native"

    def __init__(self, model, tokenizer, sparse: SparseConfig | None = None, max_batch_size: int = 64):
        self.engine = RolloutEngine(model, tokenizer, sparse, max_batch_size=max_batch_size)

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams, schedule: Schedule,
                 num_samples: int = 1, *, prompt_keys: Sequence[int] | None = None, adapter: bool = True,
                 progress: bool = False) -> list[Completion]:
        scope = contextlib.nullcontext() if adapter else without_adapter(self.engine.model)
        keys = {} if prompt_keys is None else {"prompt_keys": list(prompt_keys)}
        with scope:
            return self.engine.generate(prompts, sampling, schedule, num_samples, progress=progress, **keys)

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        own = self.engine.model
        if model is own:
            return
        state = model.state_dict()
        missing = sorted(set(own.state_dict()) - set(state))
        if missing:
            raise SparrowError(f"sync_weights: the given model lacks {len(missing)} of the backend's tensors "
                               f"(first: {missing[0]}); expected the same architecture and adapter")
        own.load_state_dict(state, strict=True)

    def close(self) -> None:
        self.engine = None
