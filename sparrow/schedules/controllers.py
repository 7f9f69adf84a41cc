"""Who picks each training step's schedule: one controller per run, so the training loop has no special cases.

Each is a `ScheduleController`. `FixedSchedule` keeps the configured schedule. `AdaptiveSchedule` moves each length
bin's budget on the step's exact acceptance (adaptive.py), and with `adaptive_fallback: exact` asks for exact rollouts
(`exact()`). `SwitchSchedule` (DistillSparse) probes a more aggressive schedule every few steps on held-out prompts
and switches to it once its tail holds tau (`SwitchState`, advanced by `observe_probe`). The loop asks `schedule()`
and `measure()` (schedules to teacher-force beside it) before a step, passes the finished step to `after_step`
(which may add metrics and returns messages to log), and saves `state()` with each checkpoint (`restore` on resume).

The controllers decide on evidence others gather: the finished step's exact acceptance (sparrow.rl's StepBatch:
`exact`, `exact_at`, `measured`), or the switch's probe, a function sparrow.rl gives (rl/probes.py).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sparrow.metrics.tail import by_bin

from .adaptive import AdaptiveRule, AdaptiveState, cheaper_tails, current_tails, update
from .schedule import Schedule


class ScheduleController(ABC):
    """What the loop asks of a controller: the schedule of the next step (each controller's own); the defaults
    measure nothing more, log nothing and save nothing."""

    @abstractmethod
    def schedule(self) -> Schedule:
        """The schedule the next step's rollouts decode with."""

    def measure(self) -> dict[str, Schedule] | None:
        return None

    def exact(self) -> bool:
        """Whether the next step rolls out in exact mode instead of with the schedule alone."""
        return False

    def after_step(self, step: int, done, metrics: dict) -> list[str]:
        """After step `step` (`done`: its finished StepBatch), metrics added to `metrics` and messages to log."""
        return []

    def state(self) -> dict:
        return {}

    def restore(self, saved: dict) -> None:
        pass


class FixedSchedule(ScheduleController):
    """The configured schedule at every step."""

    def __init__(self, schedule: Schedule):
        self.fixed = schedule

    def schedule(self) -> Schedule:
        return self.fixed


class AdaptiveSchedule(ScheduleController):
    """The adaptive controller of `sparrow train` and of the TRL integration: the schedule in force and one rung
    cheaper are measured every step, and each bin's budget moves as `adaptive.update` decides (`observe`); the
    budgets in force go into the metrics as `adaptive/bin_<start>/budget` (`budget_metrics`), and per bin decided
    on, what moved and on what evidence (`evidence`): `p5`, `p5_low`, `p5_high` and `tokens` under the schedule in
    force, `move` (+1 up, -1 down, 0) and `next_budget`, `down_streak`, `cheaper_p5` and `cheaper_p5_low` (the p5
    one rung cheaper and the lower end of its interval, what a move down waits on) and, with the exact fallback,
    `fallen` and `hold_streak`; `adaptive/exact_next` says whether the next step rolls out in exact mode."""

    def __init__(self, start: AdaptiveState, tau: float, rule: AdaptiveRule):
        self.current, self.tau, self.rule = start, tau, rule
        self.evidence: dict[str, float] = {}  # the last observation's cheaper-rung tails, as metrics

    def schedule(self) -> Schedule:
        return self.current.schedule()

    def measure(self) -> dict[str, Schedule]:
        return {"cheaper": self.current.schedule(-1)}

    def exact(self) -> bool:
        return self.rule.fallback == "exact" and self.current.exact

    def budget_metrics(self) -> dict[str, int]:
        """Each bin's budget in force, by the bin's first cached length."""
        state = self.current
        return {f"adaptive/bin_{i * state.bin_size}/budget": budget for i, budget in enumerate(state.budgets)}

    def observe(self, current: np.ndarray, cheaper: np.ndarray, positions: np.ndarray) -> list[str]:
        """One step's exact acceptance of its measured tokens under the schedule in force and one rung cheaper, at
        their cached lengths `positions`: each bin's move. Returns what moved."""
        size, rule, before = self.current.bin_size, self.rule, self.current
        positions = np.asarray(positions).astype(np.int64)
        current, cheaper = np.asarray(current, dtype=np.float64), np.asarray(cheaper, dtype=np.float64)
        at = by_bin(current[~np.isnan(current)], positions[~np.isnan(current)], size)
        lower = by_bin(cheaper[~np.isnan(cheaper)], positions[~np.isnan(cheaper)], size)  # NaN: not measured
        self.current, moved = update(before, at, lower, self.tau, rule.margin, rule.patience, rule.min_tokens,
                                     rule.fallback)
        self.evidence = step_evidence(before, self.current, current_tails(before, at, rule.min_tokens),
                                      cheaper_tails(before, lower, rule.min_tokens), rule.fallback == "exact")
        return moved

    def after_step(self, step: int, done, metrics: dict) -> list[str]:
        metrics.update(self.budget_metrics())
        if self.rule.fallback == "exact":
            metrics["adaptive/exact"] = int(self.exact())  # this step's rollouts: exact mode or the schedule
        if done.exact is None:
            return []
        current = done.exact.cpu().numpy()
        cheaper = done.measured.get("cheaper")  # exact steps teacher-force nothing: no cheaper rung measured
        moved = self.observe(current, np.full_like(current, np.nan) if cheaper is None else cheaper.cpu().numpy(),
                             done.exact_at.cpu().numpy())
        metrics.update(self.evidence)
        return [f"step {step}: adaptive schedule: {event}" for event in moved]

    def state(self) -> dict:
        return {"adaptive": self.current.to_json()}

    def restore(self, saved: dict) -> None:
        self.current = AdaptiveState.from_json(saved["adaptive"])


def step_evidence(before: AdaptiveState, after: AdaptiveState, tails: dict, cheaper: dict, exact: bool) -> dict:
    """The metrics of one adaptive step, per bin decided on (`tails`: under the schedule in force) or with
    evidence one rung cheaper, keyed `adaptive/bin_<start>/...`: what it measured and what moved."""
    out: dict[str, float] = {}
    for b in sorted(set(tails) | set(cheaper)):
        key = f"adaptive/bin_{b * before.bin_size}"
        if b in tails:
            tail = tails[b]
            out.update({f"{key}/p5": tail.p5, f"{key}/p5_low": tail.low, f"{key}/p5_high": tail.high,
                        f"{key}/tokens": tail.tokens})
        if b in cheaper:
            out[f"{key}/cheaper_p5"], out[f"{key}/cheaper_p5_low"] = cheaper[b]
        out[f"{key}/move"] = (after.rungs[b] > before.rungs[b]) - (after.rungs[b] < before.rungs[b])
        out[f"{key}/next_budget"] = after.budgets[b]
        out[f"{key}/down_streak"] = after.down_streaks[b]
        if exact:
            out[f"{key}/fallen"], out[f"{key}/hold_streak"] = after.fallen[b], after.holds[b]
    if exact:
        out["adaptive/exact_next"] = int(after.exact)
    return out


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


class SwitchSchedule(ScheduleController):
    """DistillSparse's switch: the configured schedule (`fixed`) until `patience` consecutive probes (every `every`
    steps; `probe(step)`, the candidate schedule's per-bin p5 of exact acceptance on the probe prompts and its
    `probe/...` metrics) hold every length bin's p5 at tau; the `candidate` (named `named` in messages) from then
    on. Logs `probe/...` metrics and `distill/switched`."""

    def __init__(self, fixed: Schedule, candidate: Schedule, probe: Callable[[int], tuple[list[float], dict]], *,
                 every: int, patience: int, tau: float, named: str):
        self.fixed, self.candidate, self.probe = fixed, candidate, probe
        self.every, self.patience, self.tau, self.named = every, patience, tau, named
        self.switch = SwitchState()

    def schedule(self) -> Schedule:
        return self.candidate if self.switch.switched else self.fixed

    def after_step(self, step: int, done, metrics: dict) -> list[str]:
        events = []
        if not self.switch.switched and step % self.every == 0:
            clock = time.perf_counter()
            bins, probed = self.probe(step)
            self.switch = observe_probe(self.switch, bins, self.tau, self.patience, step)
            metrics.update({**probed, "probe/streak": self.switch.streak, "time/probe_s": time.perf_counter() - clock})
            if self.switch.switched:
                events.append(f"step {step}: every length bin's 5th percentile of acceptance under "
                              f"{self.named} reached tau {self.tau} on {self.patience} "
                              "consecutive probes; rollouts switch to it")
        metrics["distill/switched"] = float(self.switch.switched)
        return events

    def state(self) -> dict:
        return {"switch": self.switch.to_json()}

    def restore(self, saved: dict) -> None:
        self.switch = SwitchState.from_json(saved.get("switch"))
