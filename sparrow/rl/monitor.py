"""The exact monitor of a step: which rows it measures, their sparse teacher-forced forwards against the dense
policy's logits (given by whichever dense forward runs: the recompute's or the update's), and exact mode's monitor,
recorded while decoding."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparrow.measure.acceptance import monitored_rows, piece_acceptance

from .config import StepConfig
from .step_state import Policy, StepBatch


def monitored(policy: Policy, step: StepBatch, cfg: StepConfig, number: int) -> set[int]:
    """Rows whose exact acceptance is measured this step: the first `monitor_share` of them (prompts are drawn at
    random and a group's samples alike, so a random share; a share of a single group is a share of its rows),
    every `monitor_every`-th step. Dense rollouts of a model without an adapter are the dense policy itself:
    nothing to measure."""
    mon = cfg.monitor
    if mon.monitor != "exact" or number % mon.monitor_every or (step.schedule.is_dense and policy.distiller is None):
        return set()
    return set(range(monitored_rows(len(step.completions), mon.monitor_share)))


@dataclass
class Monitor:
    """The exact monitor of one step: its rows, and per row and position the acceptance their sparse teacher-forced
    forward had against the dense logits (`exact`, and `extra` per `measure` schedule; NaN where not measured)."""

    rows: set[int]
    exact: torch.Tensor
    extra: dict[str, torch.Tensor]
    seconds: float = 0.0

    def measure(self, policy: Policy, step: StepBatch, cfg: StepConfig, piece: torch.Tensor,
                dense_logits: torch.Tensor, prompt) -> None:
        """The acceptance of a piece's monitored rows against `dense_logits` (the piece's); `prompt`: a
        SharedPrompt of the same weights (the sparse actor's prefill is dense), or None for a prefill of its own
        (an adapter's)."""
        chosen = torch.tensor([int(row) in self.rows for row in piece])
        if not chosen.any():
            return
        piece, dense_logits = piece[chosen], dense_logits[chosen.to(dense_logits.device)]
        began, batch = time.perf_counter(), step.batch
        with torch.no_grad():
            for name, schedule in [(None, step.schedule), *step.measure.items()]:
                alpha = piece_acceptance(policy.model, batch, piece, schedule, cfg.sparse, batch.temperature,
                                         dense_logits=dense_logits, prompt=prompt)
                (self.exact if name is None else self.extra[name])[piece] = alpha
        self.seconds += time.perf_counter() - began

    def record(self, step: StepBatch, cfg: StepConfig) -> None:
        """Into the step: the measured tokens' acceptance and positions, and the monitor's time. Exact mode's rows
        all carry the acceptance their drafts had while decoding."""
        batch, exact, rows = step.batch, self.exact, self.rows
        if cfg.draft_tokens is not None:
            exact, rows = free_monitor(step.completions, batch.mask), set(range(len(step.completions)))
        if rows:
            measured = batch.mask.bool() & ~exact.isnan()
            step.exact, step.exact_at = exact[measured], batch.positions[measured]
            step.measured = {name: values[measured] for name, values in self.extra.items()}
            step.timing["time/monitor_s"] = self.seconds


def free_monitor(completions, mask: torch.Tensor) -> torch.Tensor:
    """Exact mode's monitor [N, T]: the acceptance each drafted token's distribution had against the dense one
    (recorded while decoding, `Completion.draft_acceptance`) at its place in the batch; NaN where none was drafted."""
    alpha = torch.full(mask.shape, float("nan"), device=mask.device)
    for row, completion in enumerate(completions):
        values = torch.tensor([float("nan") if a is None else a for a in completion.draft_acceptance])
        alpha[row, mask[row].bool()] = values.to(mask.device)
    return alpha
