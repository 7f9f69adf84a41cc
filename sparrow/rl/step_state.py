"""What one GRPO step works on: the `Policy` (the trained side) and the `StepBatch` (the step's rollouts and all
the phases derive from them, filled phase by phase), and the clock that times each phase."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from sparrow.datasets import Example
from sparrow.lora import without_adapter
from sparrow.measure.batch import RolloutBatch
from sparrow.rewards.runner import ScoreResult
from sparrow.schedules import Schedule


@dataclass
class Policy:
    """The trained side: the model, its optimizer, the frozen KL reference and the DistillSparse distiller."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pad_id: int = 0
    reference: torch.nn.Module | None = None
    distiller: object | None = None

    def dense(self) -> contextlib.AbstractContextManager:
        """The dense policy: the model with its adapter (if any) off."""
        return without_adapter(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass
class StepBatch:
    """Everything one step knows about its rollouts, filled phase by phase."""

    examples: list[Example]
    schedule: Schedule
    completions: list = field(default_factory=list)
    scored: ScoreResult | None = None
    rewards: torch.Tensor | None = None  # [prompts, n]
    advantages: torch.Tensor | None = None  # [prompts * n]
    batch: RolloutBatch | None = None
    logp_old: torch.Tensor | None = None
    bounds: torch.Tensor | None = None  # [tokens, 2] lower / upper acceptance bounds
    exact: torch.Tensor | None = None  # [tokens] exact acceptance of the monitored rows (positions in exact_at)
    exact_at: torch.Tensor | None = None
    measure: dict = field(default_factory=dict)  # name -> schedule, also teacher-forced on the monitored rows
    measured: dict = field(default_factory=dict)  # name -> [tokens] their exact acceptance (positions in exact_at)
    logp_ref: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    timing: dict = field(default_factory=dict)
    update: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    dense_rewards: list[float] | None = None  # the reward check's dense samples, on check steps only
    # the monitored rows and what they measured (a monitor.Monitor), until recorded in exact/measured
    monitor: object | None = None


class Clock:
    """`with Clock(step, name):` puts the seconds the block took under `time/<name>_s` in the step's timing."""

    def __init__(self, step: StepBatch, name: str):
        self.step, self.name = step, name

    def __enter__(self):
        self.began = time.perf_counter()

    def __exit__(self, *exc):
        self.step.timing[f"time/{self.name}_s"] = time.perf_counter() - self.began
