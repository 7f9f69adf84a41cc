"""The adaptive schedule: each length bin's KV budget moves, during training, to the cheapest budget whose exact
acceptance tail holds tau (pure; the trainer feeds it the measurements it already makes).

Budgets live on a ladder of whole pages: the always-kept pages, then doubling page counts, up to a budget that
covers the bin (dense there). Every step the rollouts are sampled under the schedule in force, and the monitored
rows are teacher-forced twice through the sparse actor: under that schedule (the exact acceptance the monitor
reports) and under the schedule one rung cheaper in every bin. The second measurement is slightly off-policy
(the prefixes were sampled one rung up), which is what makes the cheaper budget measurable without paying for
rollouts it might spoil. Per bin with at least `min_tokens` measured tokens:

* up: if the current p5 is below tau, the next step's rollouts in that bin are safer at once, as the fallback
  says (`FALLBACKS`): `budget`, one rung up; `dense`, the first rung covering the bin; `exact`, one rung up, and
  the bin is "fallen": while any bin is, every step rolls out in exact mode (the schedule drafts, the dense policy
  verifies), until the fallen bin's p5 interval clears tau + margin on `patience` monitored steps in a row;
* down: if the lower end of the cheaper budget's p5 interval reaches tau + margin on `patience` steps in a row,
  the bin moves one rung down.

Raising on one step's estimate and lowering only on certain evidence with a margin is the hysteresis: a bin does
not oscillate between two rungs around tau. The state (budgets, streaks, fallen bins) is small and saved in
checkpoints, so a resumed run continues exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from sparrow.errors import SparrowError
from sparrow.metrics.tail import quantile_interval

from .schedule import Schedule

ADAPTIVE = "adaptive"  # the schedule option's value that selects the adaptive schedule (`sparrow train`, TRL)


def ladder(page_size: int, always_kept_pages: int, max_length: int) -> list[int]:
    """Budgets in tokens: the always-kept pages, then 2^k pages, up to the first that covers `max_length`."""
    pages = [always_kept_pages]
    k = 1
    while pages[-1] * page_size < max_length:
        k *= 2
        if k > pages[-1]:
            pages.append(k)
    return [p * page_size for p in pages]


FALLBACKS = ("budget", "dense", "exact")
"""What a bin whose p5 fell below tau gets at the next step: the next budget up, a budget covering the bin, or the
next budget up with the step rolled out in exact mode."""


class AdaptiveRule(Protocol):
    """The adaptive rule's settings, as `sparrow train`'s adaptive section and TRL's SparrowConfig give them
    (checked by `check_rule`)."""

    margin: float
    patience: int
    min_tokens: int
    fallback: str


@dataclass(frozen=True)
class AdaptiveState:
    """Per length bin [i * bin_size, (i + 1) * bin_size): the budget's rung on the ladder, the steps in a row its
    cheaper rung held tau + margin (`down_streaks`), whether it fell back to exact mode (`fallen`, 0 or 1) and the
    steps in a row a fallen bin has held tau + margin since (`holds`)."""

    bin_size: int
    ladder: tuple[int, ...]
    rungs: tuple[int, ...]
    down_streaks: tuple[int, ...]
    fallen: tuple[int, ...] = ()
    holds: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("fallen", "holds"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0,) * len(self.rungs))

    @property
    def budgets(self) -> list[int]:
        return [self.ladder[r] for r in self.rungs]

    @property
    def exact(self) -> bool:
        """Whether the next step rolls out in exact mode (a bin fell back to it)."""
        return any(self.fallen)

    def covering_rung(self, b: int) -> int:
        """The first rung whose budget covers bin `b`'s every cached length (dense attention there)."""
        end = (b + 1) * self.bin_size
        return next((r for r, budget in enumerate(self.ladder) if budget >= end), len(self.ladder) - 1)

    def schedule(self, offset: int = 0) -> Schedule:
        """The schedule in force (`offset` -1: every bin one rung cheaper, never below the ladder's first)."""
        starts = [i * self.bin_size for i in range(len(self.rungs))]
        budgets = [self.ladder[max(0, min(len(self.ladder) - 1, r + offset))] for r in self.rungs]
        return Schedule(",".join(f"{s}:{b}" for s, b in zip(starts, budgets)), tuple(starts), tuple(budgets))

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> AdaptiveState:
        """The state `to_json` wrote (a state saved before fallen bins existed has none)."""
        return cls(data["bin_size"], *(tuple(data.get(k, ())) for k in ("ladder", "rungs", "down_streaks", "fallen",
                                                                          "holds")))


def start_state(start: Schedule, bin_size: int, max_length: int, page_size: int,
                always_kept_pages: int) -> AdaptiveState:
    """The state whose budgets are `start`'s at each bin's first length, rounded up to the ladder (a dense start
    is the covering rung)."""
    steps = ladder(page_size, always_kept_pages, max_length)
    bins = -(-max_length // bin_size)
    rungs = []
    for i in range(bins):
        wanted = max_length if start.is_dense else start.budget_at(max(1, i * bin_size))
        rungs.append(next((r for r, b in enumerate(steps) if b >= wanted), len(steps) - 1))
    return AdaptiveState(bin_size, tuple(steps), tuple(rungs), (0,) * bins)


@dataclass(frozen=True)
class BinTail:
    """One bin's evidence of a step under the schedule in force: its p5 with the 95% interval, and its tokens."""

    p5: float
    low: float
    high: float
    tokens: int


def current_tails(state: AdaptiveState, current: dict[int, np.ndarray], min_tokens: int) -> dict[int, BinTail]:
    """{bin index: its tail} for the bins of the ladder with at least `min_tokens` tokens measured under the
    schedule in force: the bins a step decides on."""
    out = {}
    for b, values in current.items():
        if 0 <= b < len(state.rungs) and len(values) >= min_tokens:
            low, p5, high = quantile_interval(values)
            out[b] = BinTail(float(p5), float(low), float(high), len(values))
    return out


def check_rule(margin: float, patience: int, min_tokens: int, fallback: str) -> None:
    """A SparrowError naming the first bad setting of the adaptive rule."""
    if patience < 1 or min_tokens < 1 or not 0 <= margin < 1:
        raise SparrowError(f"adaptive schedule needs patience >= 1, min_tokens >= 1 and margin in [0, 1), got "
                           f"{patience}, {min_tokens}, {margin}")
    if fallback not in FALLBACKS:
        raise SparrowError(f"unknown adaptive_fallback {fallback!r}: expected one of {', '.join(FALLBACKS)}")


def update(state: AdaptiveState, current: dict[int, np.ndarray], cheaper: dict[int, np.ndarray], tau: float,
           margin: float, patience: int, min_tokens: int,
           fallback: str = "budget") -> tuple[AdaptiveState, list[str]]:
    """The state after one step's measurements ({bin index: exact acceptance of its tokens} under the schedule in
    force and under the one-rung-cheaper schedule) and what moved, as messages."""
    check_rule(margin, patience, min_tokens, fallback)
    rungs, downs = list(state.rungs), list(state.down_streaks)
    fallen, holds = list(state.fallen), list(state.holds)
    evidence = cheaper_tails(state, cheaper, min_tokens)
    events = []
    for b, tail in sorted(current_tails(state, current, min_tokens).items()):
        span = f"[{b * state.bin_size}, {(b + 1) * state.bin_size})"
        seen = f"p5 {tail.p5:.3f} (interval {tail.low:.3f}..{tail.high:.3f}, {tail.tokens} tokens)"
        if tail.p5 < tau:
            target = state.covering_rung(b) if fallback == "dense" else rungs[b] + 1
            target = max(rungs[b], min(target, len(state.ladder) - 1))
            falls = fallback == "exact" and not fallen[b]
            downs[b] = holds[b] = 0
            if target == rungs[b] and not falls:
                continue
            moved = f"up to {state.ladder[target]}" if target > rungs[b] else f"stays at {state.ladder[target]}"
            how = "; the next step rolls out in exact mode" if fallback == "exact" else ""
            rungs[b], fallen[b] = target, int(fallback == "exact")
            events.append(f"bin {span}: {seen} below tau {tau}; budget {moved}{how}")
            continue
        if fallen[b]:
            holds[b] = holds[b] + 1 if tail.low >= tau + margin else 0
            if holds[b] >= patience:
                fallen[b] = holds[b] = 0
                events.append(f"bin {span}: {seen} at {state.ladder[rungs[b]]} tokens, above tau {tau} + margin "
                              f"{margin} on {patience} step(s); its rollouts leave exact mode")
            continue
        if b not in evidence:
            downs[b] = 0
            continue
        p5_c, low_c = evidence[b]
        downs[b] = downs[b] + 1 if low_c >= tau + margin else 0
        if downs[b] >= patience:
            rungs[b] -= 1
            downs[b] = 0
            events.append(f"bin {span}: p5 at {state.ladder[rungs[b]]} tokens is {p5_c:.3f} (>= {low_c:.3f}, "
                          f"above tau {tau} + margin {margin}); budget down to {state.ladder[rungs[b]]}")
    return AdaptiveState(state.bin_size, state.ladder, tuple(rungs), tuple(downs), tuple(fallen),
                         tuple(holds)), events


def cheaper_tails(state: AdaptiveState, cheaper: dict[int, np.ndarray], min_tokens: int) -> dict[int, tuple[float,
                                                                                                           float]]:
    """{bin index: (p5, lower end of its 95% interval)} of the acceptance one rung cheaper, for the bins that have
    a cheaper rung and at least `min_tokens` tokens measured under it: the evidence a move down waits on."""
    out = {}
    for b, values in cheaper.items():
        if 0 <= b < len(state.rungs) and state.rungs[b] > 0 and len(values) >= min_tokens:
            low, p5, _ = quantile_interval(values)
            out[b] = (float(p5), float(low))
    return out
