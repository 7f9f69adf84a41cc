"""The rollout seam: what a trainer, `eval`, `profile` and the DistillSparse probes need from a rollout engine.

A backend turns prompts into completions under a sampling setting and a KV-budget schedule, keeps its weights
equal to the policy's when told, and releases what it holds. Everything else (rewards, recompute, measurement)
happens on the trainer's side from the returned `Completion`s, so a backend may be our engine in this process
(`native`), a pool of Ray actors or a vLLM engine.

Randomness is per sequence: the samples of (sampling.seed, prompt key, sample index) are the same whatever the
batch size, the other prompts in the call or the process that runs them. A prompt's key defaults to its index in
the call; a caller that splits one call into several passes the original indices as `prompt_keys`.

A backend may also have a `timing` attribute: seconds of its last `generate` call per phase (the native engine's
prefill, decode and sample); the trainer logs it as `time/rollout_<phase>_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from sparrow.engine import Completion, Prompt, SamplingParams
from sparrow.schedules import Schedule


@runtime_checkable
class RolloutBackend(Protocol):
    """Generates rollouts; see the module docstring for the contract."""

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams, schedule: Schedule,
                 num_samples: int = 1, *, prompt_keys: Sequence[int] | None = None, adapter: bool = True,
                 progress: bool = False, draft_tokens: int | None = None) -> list[Completion]:
        """`num_samples` completions per prompt, grouped by prompt then sample index (`prompt_index` is the
        position in `prompts`). `adapter=False` samples from the policy without its DistillSparse adapter.
        `draft_tokens` K: exact mode (the schedule drafts K tokens per dense verification; the native engine and
        its Ray workers only)."""
        ...

    def sync_weights(self, model) -> None:
        """Make the backend's weights (adapter included, where it has one) equal to `model`'s."""
        ...

    def close(self) -> None:
        """Release workers, caches and processes; the backend is unusable afterwards."""
        ...
