"""The tail of per-token acceptance per length bin (pure): the one module that computes tail statistics.

The statistic that predicts stability is the 5th percentile of alpha per length bin, not the mean (SPEC 2).
`tail_stats` describes each bin (count, mean, p1 / p5 / p50, share at 1, per-sequence minima) and the whole run
(correlations with length, a Beta fit of the tail) for profiles and probes; `bin_tails` answers the training
monitor's question, is a bin's 5th percentile above tau? Both group tokens with `length_bins` and take quantiles
with numpy's linear interpolation (`np.quantile`); `by_bin` groups values by the same bins (the adaptive schedule's
and TRL's monitor's).

The q-quantile of n i.i.d. tokens lies between the order statistics x_(l) and x_(u), where l and u are the
a/2 and 1 - a/2 quantiles of Binomial(n, q) (the count of tokens below the true quantile): a confidence
interval that needs no assumption on the distribution of alpha. A bin is "below" tau when the whole interval
is, "above" when none of it is, and otherwise "undecided", with the number of tokens that would decide it at
the observed share of tokens below tau (normal approximation of the binomial test of that share against q).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy import stats

from sparrow.errors import SparrowError
from sparrow.metrics.checks import as_float_tensor, as_positions, first_index
from sparrow.typed_config import check_int

TAIL_THRESHOLD = 0.999  # tail_stats: alpha at or above it counts as "at 1"; the Beta fit covers what lies below
_MIN_BETA_TAIL = 20
_ALPHA_TOL = 1e-5


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
    out = []
    for b, members in length_bins(np.asarray(positions) // bin_size):
        values = alpha[members]
        low, p5, high = quantile_interval(values, q, confidence)
        verdict = "below" if high < tau else "above" if low >= tau else "undecided"
        out.append(BinTail(int(b) * bin_size, (int(b) + 1) * bin_size, int(values.size), float(values.mean()),
                           float(np.quantile(values, 0.01)), p5, low, high, float(np.mean(values > 0.999)), verdict,
                           tokens_to_decide(values, tau, q, confidence) if verdict == "undecided" else None))
    return out


def tail_stats(alpha, positions, bin_size: int, fit_beta: bool = False, sequences=None) -> dict:
    """Distribution of per-token alpha per position bin [k*bin_size, (k+1)*bin_size), as a JSON-ready dict.

    Keys: bins (non-empty, increasing; bin, start, end, count, mean, p1, p5, p50, frac_above_tail = share of
    alpha >= 0.999), overall (same stats over all tokens), pearson_alpha_position (over tokens), pearson_p5_bin
    (per-bin 5th percentile vs bin index), bin_size, and with `fit_beta` the scaled-Beta fit of the tail
    (alpha < 0.999) on [0, 0.999] as beta_fit = {a, b, scale, n, ks} (None when fewer than 20 tail values or the
    fit fails). With `sequences` (the sequence id of each token) every bin and overall also hold the minimum
    alpha of each sequence (over its tokens there): sequences, seq_min_mean and seq_min_p5 over sequences.
    Positions use whatever length origin the caller chooses.
    """
    a, pos, seq = _tail_input(alpha, positions, bin_size, sequences)
    bin_size = int(bin_size)
    rows = []
    for k, members in length_bins(torch.div(pos, bin_size, rounding_mode="floor").numpy()):
        index = torch.from_numpy(members)
        stats_k = _sorted_stats(torch.sort(a[index], stable=True).values)
        if seq is not None:
            stats_k.update(_sequence_minima(a[index], seq[index]))
        rows.append({"bin": k, "start": k * bin_size, "end": (k + 1) * bin_size, **stats_k})
    overall_sorted = torch.sort(a).values
    overall = _sorted_stats(overall_sorted)
    if seq is not None:
        overall.update(_sequence_minima(a, seq))
    out = {
        "bins": rows,
        "overall": overall,
        "pearson_alpha_position": _pearson(a, pos.to(torch.float64)),
        "pearson_p5_bin": (_pearson(torch.tensor([float(r["bin"]) for r in rows], dtype=torch.float64),
                                    torch.tensor([r["p5"] for r in rows], dtype=torch.float64))
                           if len(rows) >= 3 else None),
        "bin_size": bin_size,
    }
    if fit_beta:
        out["beta_fit"] = _fit_beta(overall_sorted, TAIL_THRESHOLD)
    return out


def length_bins(bins: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Each non-empty bin index of the tokens, ascending, with the indices of its tokens in their original order."""
    order = np.argsort(bins, kind="stable")
    ids, starts = np.unique(bins[order], return_index=True)
    return list(zip(ids.tolist(), np.split(order, starts[1:])))


def by_bin(alpha, positions, bin_size: int) -> dict[int, np.ndarray]:
    """{bin index: the values of `alpha` whose position (cached length) falls in it}, bins ascending, each bin's
    values in their original order."""
    alpha = np.asarray(alpha)
    return {b: alpha[members] for b, members in length_bins(np.asarray(positions) // bin_size)}


def _tail_input(alpha, positions, bin_size, sequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """tail_stats' inputs checked and flattened: alpha as CPU float64 clamped to [0, 1], positions (>= 0) and
    sequence ids (or None) as CPU int64, one of each per token."""
    check_int("bin_size", bin_size, 1)
    a = as_float_tensor(alpha, "alpha").detach().to("cpu", torch.float64)
    pos = as_positions(positions)
    if a.shape != pos.shape:
        raise SparrowError(f"alpha has shape {tuple(a.shape)} but positions has shape {tuple(pos.shape)}: "
                           f"expected one position per alpha value")
    a, pos = a.reshape(-1), pos.reshape(-1)
    if a.numel() == 0:
        raise SparrowError("tail_stats got no tokens: expected at least one alpha value")
    if torch.isnan(a).any():
        raise SparrowError(f"alpha contains NaN (first at index {first_index(torch.isnan(a))}): expected values "
                           f"in [0, 1]")
    outside = (a < -_ALPHA_TOL) | (a > 1 + _ALPHA_TOL)
    if outside.any():
        i = first_index(outside)
        raise SparrowError(f"alpha[{i}] = {float(a[i])} is outside [0, 1]: expected acceptance rates in [0, 1]")
    if (pos < 0).any():
        i = first_index(pos < 0)
        raise SparrowError(f"positions[{i}] = {int(pos[i])} is negative: expected positions >= 0")
    seq = None if sequences is None else as_positions(sequences).reshape(-1)
    if seq is not None and seq.shape != a.shape:
        raise SparrowError(f"sequences has {seq.numel()} ids for {a.numel()} alpha values: expected one per value")
    return a.clamp(0, 1), pos, seq


def _sorted_stats(values: torch.Tensor) -> dict:
    """count, mean, p1, p5, p50 and the share >= TAIL_THRESHOLD of an ascending float64 tensor."""
    n = values.numel()
    threshold = torch.tensor([TAIL_THRESHOLD], dtype=values.dtype)
    above = n - int(torch.searchsorted(values, threshold, right=False)[0])
    p1, p5, p50 = np.quantile(values.numpy(), (0.01, 0.05, 0.5)).tolist()
    return {"count": n, "mean": float(values.mean()), "p1": p1, "p5": p5, "p50": p50, "frac_above_tail": above / n}


def _sequence_minima(values: torch.Tensor, sequences: torch.Tensor) -> dict:
    """Over sequences, the mean and 5th percentile (numpy's linear) of each sequence's smallest value."""
    order = np.argsort(sequences.numpy(), kind="stable")
    ids = sequences.numpy()[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    minima = np.minimum.reduceat(values.numpy()[order], starts)
    return {"sequences": int(minima.size), "seq_min_mean": float(minima.mean()),
            "seq_min_p5": float(np.quantile(minima, 0.05))}


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Pearson r of two float64 vectors; None when fewer than 2 points or either is constant."""
    if x.numel() < 2 or bool(x.min() == x.max()) or bool(y.min() == y.max()):
        return None
    xc, yc = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    if denom == 0 or not math.isfinite(denom):
        return None
    return max(-1.0, min(1.0, float((xc * yc).sum()) / denom))


def _fit_beta(sorted_alpha: torch.Tensor, thr: float) -> dict | None:
    """MLE Beta(a, b) with loc 0 and scale thr on the tail alpha < thr, with its KS statistic.

    Exact zeros are moved to 1e-12 * thr since the Beta log-likelihood is -inf there.
    """
    tail = sorted_alpha[sorted_alpha < thr].numpy()
    if tail.size < _MIN_BETA_TAIL:
        return None
    tail = np.clip(tail, 1e-12 * thr, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, b, _, _ = stats.beta.fit(tail, floc=0.0, fscale=thr)
            ks = stats.kstest(tail, "beta", args=(a, b, 0.0, thr)).statistic
    except (RuntimeError, ValueError, FloatingPointError):
        return None
    if not all(math.isfinite(v) and v > 0 for v in (a, b)) or not math.isfinite(ks):
        return None
    return {"a": float(a), "b": float(b), "scale": float(thr), "n": int(tail.size), "ks": float(ks)}
