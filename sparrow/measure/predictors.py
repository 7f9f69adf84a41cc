"""Tail or mean? Which statistic of the per-token acceptance predicts that sparse rollouts fall behind dense (pure).

Each run is summarised by its acceptance statistics (mean, p5, p1, pooled over the run's monitored tokens or
taken as a median over steps, as the caller decides) and by its outcome against the dense run on the same prompts
and seeds: reward retention (sparse over dense mean reward) and whether it fell behind. A statistic predicts well
when it ranks the runs as their retention ranks them (Spearman's rho), and when, of two runs that another statistic
cannot tell apart, it orders them as their outcomes are ordered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats

from sparrow.errors import SparrowError

STATISTICS = ("mean", "p5", "p1")


@dataclass(frozen=True)
class RunOutcome:
    """One sparse run: its acceptance statistics and how its reward compares with the matching dense run."""

    name: str
    mean: float
    p5: float
    p1: float
    retention: float  # sparse mean reward / dense mean reward
    behind: bool  # the run fell behind dense (the caller's rule, e.g. retention or held-out interval below)


def rank_correlations(runs: list[RunOutcome]) -> dict[str, tuple[float, float, int]]:
    """Per statistic, Spearman's rho against retention, its two-sided p-value and the number of runs it was
    taken over: the runs where the statistic is known (not nan); (nan, nan, n) below 3 runs or for constant
    values."""
    out = {}
    for name in STATISTICS:
        known = [r for r in runs if not math.isnan(getattr(r, name))]
        values, retention = [getattr(r, name) for r in known], [r.retention for r in known]
        if len(known) < 3 or len(set(values)) < 2 or len(set(retention)) < 2:
            out[name] = (float("nan"), float("nan"), len(known))
            continue
        rho, p = stats.spearmanr(values, retention)
        out[name] = (float(rho), float(p), len(known))
    return out


def contrast_pairs(runs: list[RunOutcome], mean_within: float = 0.01, p5_apart: float = 0.05) -> list[dict]:
    """Pairs of runs whose mean acceptance is within `mean_within` while their p5 differ by at least `p5_apart`,
    with which statistic orders their retention correctly (the one whose higher value went with the higher
    retention)."""
    if mean_within < 0 or p5_apart < 0:
        raise SparrowError(f"mean_within and p5_apart must be >= 0, got {mean_within} and {p5_apart}")
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if abs(a.mean - b.mean) <= mean_within and abs(a.p5 - b.p5) >= p5_apart:
                better = a if a.retention > b.retention else b if b.retention > a.retention else None
                other = b if better is a else a
                right = [s for s in STATISTICS if better is not None and getattr(better, s) > getattr(other, s)]
                pairs.append({"runs": (a.name, b.name), "mean": (a.mean, b.mean), "p5": (a.p5, b.p5),
                              "retention": (a.retention, b.retention), "predicted_by": right})
    return pairs
