"""DistillSparse's switch probes: the exact acceptance of the sparse actor under a candidate schedule on held-out
prompts (`probe`), and the switch's state (`SwitchState`, advanced by `observe_probe`, pure): rollouts move to the
candidate once every length bin's 5th percentile reaches tau on enough consecutive probes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.attention import SparseConfig
from sparrow.measure.acceptance import teacher_forced_acceptance
from sparrow.measure.tail import tail_stats
from sparrow.schedules import Schedule


@dataclass(frozen=True)
class SwitchState:
    """Where schedule switching stands: consecutive passing probes, and the step after which rollouts switched."""

    streak: int = 0
    switched_at: int | None = None

    @property
    def switched(self) -> bool:
        return self.switched_at is not None

    def to_json(self) -> dict:
        return {"streak": self.streak, "switched_at": self.switched_at}

    @classmethod
    def from_json(cls, data: dict | None) -> SwitchState:
        return cls(**(data or {}))


def observe_probe(state: SwitchState, bin_p5: list[float], tau: float, patience: int, step: int) -> SwitchState:
    """The state after a probe at `step` whose per-bin 5th percentiles are `bin_p5` (pure).

    A probe passes when it has bins and every bin's p5 >= tau; a failing probe resets the streak. Rollouts switch
    once `patience` consecutive probes pass; after that the state no longer changes.
    """
    if state.switched:
        return state
    streak = state.streak + 1 if bin_p5 and min(bin_p5) >= tau else 0
    return SwitchState(streak, step if streak >= patience else None)


def probe(backend, model, prompts: list, schedule: Schedule, sampling, num_samples: int, sparse: SparseConfig,
          bin_size: int, pad_id: int = 0) -> tuple[list[float], dict]:
    """Exact acceptance of the current sparse actor under `schedule` against the dense policy on `prompts`: the
    backend samples with the adapter on, then `teacher_forced_acceptance` measures every token (adapter on for
    the sparse actor, off for the dense policy). Returns the per-bin 5th percentiles (bins by total cached
    length) and `probe/...` metrics."""
    completions = backend.generate(prompts, sampling, schedule, num_samples)
    alphas = teacher_forced_acceptance(model, completions, schedule, sparse, sampling.logprob_temperature,
                                       pad_id=pad_id)
    alpha = torch.tensor([a for values in alphas for a in values], dtype=torch.float64)
    positions = torch.tensor([len(c.prompt_token_ids) + i for c in completions for i in range(len(c.token_ids))])
    stats = tail_stats(alpha, positions, bin_size)
    metrics = {"probe/acceptance/p5": stats["overall"]["p5"], "probe/acceptance/mean": stats["overall"]["mean"]}
    for b in stats["bins"]:
        metrics[f"probe/bin_{b['start']}/acceptance_p5"] = b["p5"]
        metrics[f"probe/bin_{b['start']}/acceptance_mean"] = b["mean"]
    return [b["p5"] for b in stats["bins"]], metrics
