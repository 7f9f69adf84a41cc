"""Is the 5th percentile of acceptance above tau? A distribution-free interval and a verdict per length bin (pure).

The q-quantile of n i.i.d. tokens lies between the order statistics x_(l) and x_(u), where l and u are the
a/2 and 1 - a/2 quantiles of Binomial(n, q) (the count of tokens below the true quantile): a confidence
interval that needs no assumption on the distribution of alpha. A bin is "below" tau when the whole interval
is, "above" when none of it is, and otherwise "undecided", with the number of tokens that would decide it at
the observed share of tokens below tau (normal approximation of the binomial test of that share against q).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class BinTail:
    """The acceptance tail of one length bin [start, end)."""

    start: int
    end: int
    count: int
    mean: float
    p1: float  # the 1st percentile (numpy's linear interpolation, as p5): damage below the 5th
    p5: float
    p5_low: float
    p5_high: float
    frac_above_0999: float
    verdict: str  # "above", "below" or "undecided"
    tokens_to_decide: int | None  # more tokens that would decide an undecided bin (None: decided, or never)

    def to_json(self) -> dict:
        return asdict(self)


def quantile_interval(values: np.ndarray, q: float = 0.05, confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, estimate, high) of the q-quantile of `values` in [0, 1]; the interval from order statistics."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.size
    alpha = 1.0 - confidence
    lo = int(stats.binom.ppf(alpha / 2, n, q))  # 1-based index of the lower order statistic
    hi = int(stats.binom.ppf(1 - alpha / 2, n, q)) + 1
    low = float(x[lo - 1]) if lo >= 1 else 0.0
    high = float(x[hi - 1]) if hi <= n else 1.0
    return low, float(np.quantile(x, q)), high


def tokens_to_decide(values: np.ndarray, tau: float, q: float = 0.05, confidence: float = 0.95) -> int | None:
    """How many more tokens, at the share of tokens below tau seen so far, would make the binomial test of that
    share against q significant; None when the share equals q (no number of tokens would)."""
    n = len(values)
    share = float(np.mean(np.asarray(values) < tau))
    if share == q:
        return None
    z = stats.norm.ppf(1 - (1 - confidence) / 2)
    needed = z * z * q * (1 - q) / (share - q) ** 2
    return max(1, math.ceil(needed - n))


def bin_tails(alpha, positions, bin_size: int, tau: float, q: float = 0.05,
              confidence: float = 0.95) -> list[BinTail]:
    """Per non-empty bin of `positions` (cached length of each token), the tail of `alpha` against tau."""
    alpha = np.asarray(alpha, dtype=np.float64)
    bins = np.asarray(positions) // bin_size
    out = []
    for b in np.unique(bins):
        values = alpha[bins == b]
        low, p5, high = quantile_interval(values, q, confidence)
        verdict = "below" if high < tau else "above" if low >= tau else "undecided"
        out.append(BinTail(int(b) * bin_size, (int(b) + 1) * bin_size, int(values.size), float(values.mean()),
                           float(np.quantile(values, 0.01)), p5, low, high, float(np.mean(values > 0.999)), verdict,
                           tokens_to_decide(values, tau, q, confidence) if verdict == "undecided" else None))
    return out
