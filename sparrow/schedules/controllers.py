"""Who picks each training step's schedule: one controller per run, so the training loop has no special cases.

Each is a `ScheduleController`. `FixedSchedule` keeps the configured schedule. `AdaptiveSchedule` moves each length bin's budget on the step's
exact acceptance (rl/adaptive.py), and with `adaptive_fallback: exact` asks for exact rollouts (`exact()`). `SwitchSchedule` (DistillSparse) probes a more aggressive schedule every few
steps on held-out prompts and switches to it once its tail holds tau. The loop asks `schedule()` and `measure()`
(schedules to teacher-force beside it) before a step, passes the finished step to `after_step` (which may add
metrics and returns messages to log), and saves `state()` with each checkpoint (`restore` on resume).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np

from sparrow.measure.tail import by_bin
from sparrow.schedules import Schedule

from .adaptive import AdaptiveState, cheaper_tails, current_tails, update
from .config import AdaptiveSection, TrainConfig
from .probes import SwitchState, observe_probe, probe
from .step import Policy, StepBatch

PROBE_SEED = 2**40  # probe sampling seeds stay apart from the rollout seeds (seed * 1_000_003 + step)


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

    def after_step(self, step: int, done: StepBatch, metrics: dict) -> list[str]:
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

    def __init__(self, start: AdaptiveState, tau: float, rule: AdaptiveSection):
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

    def after_step(self, step: int, done: StepBatch, metrics: dict) -> list[str]:
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


class SwitchSchedule(ScheduleController):
    """DistillSparse's switch: the configured schedule until `probe_patience` consecutive probes (every
    `probe_every` steps, the candidate schedule's exact acceptance on the probe prompts) hold every length bin's
    p5 at tau; the candidate from then on. Logs `probe/...` metrics and `distill/switched`."""

    def __init__(self, config: TrainConfig, policy: Policy, backend, probes: list):
        self.fixed, self.config, self.policy, self.backend, self.probes = (config.parsed.schedule, config, policy,
                                                                           backend, probes)
        self.candidate, self.switch = config.parsed.switch_schedule, SwitchState()

    def schedule(self) -> Schedule:
        return self.candidate if self.switch.switched else self.fixed

    def after_step(self, step: int, done: StepBatch, metrics: dict) -> list[str]:
        config, distill, events = self.config, self.config.distill, []
        if not self.switch.switched and step % distill.probe_every == 0:
            clock = time.perf_counter()
            sampling = config.sampling.params(seed=PROBE_SEED + config.run.seed * 1_000_003 + step)
            bins, probed = probe(self.backend, self.policy.model, [ex.prompt for ex in self.probes], self.candidate,
                                 sampling, config.grpo.num_generations, config.sparse.config(), config.monitor.bin_size,
                                 self.policy.pad_id)
            self.switch = observe_probe(self.switch, bins, config.monitor.tau, distill.probe_patience, step)
            metrics.update({**probed, "probe/streak": self.switch.streak, "time/probe_s": time.perf_counter() - clock})
            if self.switch.switched:
                events.append(f"step {step}: every length bin's 5th percentile of acceptance under "
                              f"{distill.switch_schedule} reached tau {config.monitor.tau} on {distill.probe_patience} "
                              "consecutive probes; rollouts switch to it")
        metrics["distill/switched"] = float(self.switch.switched)
        return events

    def state(self) -> dict:
        return {"switch": self.switch.to_json()}

    def restore(self, saved: dict) -> None:
        self.switch = SwitchState.from_json(saved.get("switch"))
