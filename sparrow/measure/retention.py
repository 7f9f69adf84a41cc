"""How much of the dense reward the sparse actor keeps, with an interval from paired samples; and the interval of a
mean reward over prompts (pure).

Each pair is one sampled completion drawn twice with the same prompt and random stream: once by the sparse actor,
once by the dense policy. Retention is the ratio of their mean rewards, R = mean(sparse) / mean(dense). Its
interval comes from the delta method for a ratio of means: the linearised residuals e_i = (x_i - R y_i) / mean(y)
have mean zero and var(R) ~ var(sum e) / n^2. Samples of one prompt are correlated, so the residuals are summed
per prompt (cluster-robust variance, G clusters) and the interval uses Student's t with G - 1 degrees of freedom.
When no reward is negative the ratio cannot be, so the lower bound is cut at 0 (a few pairs otherwise give
intervals like [-1.1, 3.0]). A retention level is "held" when the whole interval is at or above it, "lost" when
the whole interval is below it, and "undecided" otherwise (also when there are fewer than two prompts, or the dense
mean is 0). A mean over prompts gets no interval from fewer than three prompts, and one cut to the reward's range
where that is known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from sparrow.errors import SparrowError


@dataclass(frozen=True)
class Retention:
    """Sparse mean reward over dense mean reward on paired samples, with its interval (None where undefined)."""

    value: float | None
    low: float | None
    high: float | None
    sparse_mean: float
    dense_mean: float
    pairs: int
    prompts: int

    def verdict(self, level: float) -> str:
        """"held", "lost" or "undecided" for the retention level `level`."""
        if self.low is not None and self.low >= level:
            return "held"
        if self.high is not None and self.high < level:
            return "lost"
        return "undecided"

    def to_json(self) -> dict:
        return asdict(self)


def reward_retention(sparse: Sequence[float], dense: Sequence[float], groups: Sequence | None = None,
                     confidence: float = 0.95) -> Retention:
    """Retention of `sparse` rewards against the `dense` rewards of the same samples, pair by pair.

    groups: the prompt of each pair (pairs of one prompt form one cluster); None treats every pair as its own.
    """
    x = np.asarray(sparse, dtype=np.float64)
    y = np.asarray(dense, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise SparrowError(f"retention needs two equally long, non-empty lists of rewards, got {x.size} sparse and "
                           f"{y.size} dense")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise SparrowError("retention needs finite rewards")
    if not 0.0 < confidence < 1.0:
        raise SparrowError(f"confidence must be in (0, 1), got {confidence}")
    labels = np.arange(x.size) if groups is None else np.asarray(list(groups))
    if labels.shape != x.shape:
        raise SparrowError(f"groups must name one prompt per pair: {labels.size} for {x.size} pairs")
    clusters = np.unique(labels, return_inverse=True)[1]
    count = int(clusters.max()) + 1
    sparse_mean, dense_mean = float(x.mean()), float(y.mean())
    if dense_mean == 0.0:
        return Retention(None, None, None, sparse_mean, dense_mean, int(x.size), count)
    ratio = sparse_mean / dense_mean
    if count < 2:
        return Retention(ratio, None, None, sparse_mean, dense_mean, int(x.size), count)
    residual_sums = np.bincount(clusters, weights=(x - ratio * y) / dense_mean, minlength=count)
    variance = count / (count - 1) * float(np.sum(residual_sums ** 2)) / x.size ** 2
    half = float(stats.t.ppf(0.5 + confidence / 2, count - 1)) * math.sqrt(variance)
    low = max(0.0, ratio - half) if (x >= 0).all() and (y >= 0).all() else ratio - half
    return Retention(ratio, low, ratio + half, sparse_mean, dense_mean, int(x.size), count)


MIN_INTERVAL_PROMPTS = 3  # two give Student's t one degree of freedom: +-12.7 standard errors, no usable interval


def mean_interval(values: list[float], confidence: float = 0.95,
                  bounds: tuple[float, float] | None = None) -> tuple[float, float]:
    """Student's t interval of the mean of `values` (one per prompt: samples of one prompt are correlated, prompts
    are the independent units), cut to `bounds` (low, high) when every value is known to lie in that range (the mean
    cannot leave it); (nan, nan) for fewer than MIN_INTERVAL_PROMPTS values."""
    n = len(values)
    if n < MIN_INTERVAL_PROMPTS:
        return float("nan"), float("nan")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    if bounds is None:
        return mean - half, mean + half
    return max(bounds[0], mean - half), min(bounds[1], mean + half)


def too_few_prompts(count: int) -> str:
    """What stands where an interval over `count` prompts would, when they are too few for one."""
    return f"{count} prompt{'' if count == 1 else 's'}: too few for an interval (needs {MIN_INTERVAL_PROMPTS})"


def paired_difference(a: list[float], b: list[float], confidence: float = 0.95,
                      bounds: tuple[float, float] | None = None) -> tuple[float, float, float]:
    """(mean, low, high) of a - b over paired units (e.g. two policies' mean rewards on the same prompts); `bounds`:
    the range of each value of a and b, so a difference lies within +-(high - low)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    spread = None if bounds is None else (bounds[0] - bounds[1], bounds[1] - bounds[0])
    return (sum(diffs) / len(diffs), *mean_interval(diffs, confidence, spread))
