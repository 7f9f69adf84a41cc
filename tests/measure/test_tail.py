"""Tail statistics per length bin (`sparrow.metrics.tail`): the order-statistic interval of the 5th percentile,
the verdicts against tau and the tokens that would decide them, and `tail_stats`, against hand and numpy values."""

import json
import math

import numpy as np
import pytest
import torch

from sparrow.errors import SparrowError
from sparrow.metrics.tail import bin_tails, quantile_interval, tail_stats, tokens_to_decide


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(SparrowError, match=match):
        fn(*args, **kwargs)


def _binom_ppf(p, n, q):
    """The smallest k with P(Binomial(n, q) <= k) >= p, summed by hand."""
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * q**k * (1 - q) ** (n - k)
        if total >= p:
            return k
    return n


def test_quantile_interval_is_the_order_statistics_at_binomial_quantiles():
    shuffled = np.random.default_rng(0).permutation(np.arange(1, 101) / 100)  # x_(k) = k / 100
    # 100 tokens, q = 0.05: P(X <= 0) = 0.0059 < 0.025 <= P(X <= 1) = 0.037 and P(X <= 9) = 0.972 < 0.975
    # <= P(X <= 10) = 0.989, so the interval runs from x_(1) to x_(10 + 1)
    assert (_binom_ppf(0.025, 100, 0.05), _binom_ppf(0.975, 100, 0.05)) == (1, 10)
    low, estimate, high = quantile_interval(shuffled, 0.05)
    assert (low, high) == (0.01, 0.11)
    assert estimate == np.quantile(shuffled, 0.05) == pytest.approx(0.05 + 0.95 * 0.01, abs=1e-15)  # index 4.95
    assert low <= estimate <= high


def test_quantile_interval_of_a_median_and_without_a_lower_order_statistic():
    values = np.random.default_rng(1).permutation(np.arange(1, 21) * 0.05)  # x_(k) = k / 20
    # 20 tokens, q = 0.5: the 2.5% and 97.5% quantiles of Binomial(20, 0.5) are 6 and 14: x_(6) to x_(15)
    assert (_binom_ppf(0.025, 20, 0.5), _binom_ppf(0.975, 20, 0.5)) == (6, 14)
    low, estimate, high = quantile_interval(values, 0.5)
    assert (low, high) == (values[values.argsort()[5]], values[values.argsort()[14]])
    assert (low, high) == pytest.approx((0.30, 0.75), abs=1e-15)
    assert estimate == np.quantile(values, 0.5) == pytest.approx(0.525, abs=1e-15)
    # 10 tokens, q = 0.05: P(X <= 0) = 0.60 >= 0.025, so no order statistic bounds it below: the interval starts at 0
    assert _binom_ppf(0.025, 10, 0.05) == 0 and _binom_ppf(0.975, 10, 0.05) == 2
    low, estimate, high = quantile_interval(np.arange(1, 11) / 10, 0.05)
    assert (low, high) == (0.0, 0.3) and low <= estimate == np.quantile(np.arange(1, 11) / 10, 0.05) <= high


def _verdict_data():
    """Bin [0, 100): 400 tokens at 0.95 or 1 (above 0.8); [100, 200): 400 at 0.5 (below); none in [200, 300);
    [300, 400): 100 tokens, 4 of them at 0.7 and 96 at 0.9 (its interval x_(1) = 0.7 to x_(11) = 0.9 holds 0.8)."""
    alpha = np.concatenate([np.r_[np.full(300, 0.95), np.ones(100)], np.full(400, 0.5), np.r_[np.full(4, 0.7),
                                                                                                np.full(96, 0.9)]])
    positions = np.concatenate([np.arange(400) % 100, 100 + np.arange(400) % 100, 300 + np.arange(100)])
    order = np.random.default_rng(2).permutation(alpha.size)  # the order of tokens does not matter
    return alpha[order], positions[order]


def test_bin_tails_verdicts_above_below_and_undecided():
    alpha, positions = _verdict_data()
    above, below, undecided = bin_tails(alpha, positions, 100, tau=0.8)
    assert [(t.start, t.end, t.count) for t in (above, below, undecided)] == [(0, 100, 400), (100, 200, 400),
                                                                             (300, 400, 100)]
    assert (above.verdict, below.verdict, undecided.verdict) == ("above", "below", "undecided")
    assert (above.p5_low, above.p5, above.p5_high) == (0.95, 0.95, 0.95) and above.tokens_to_decide is None
    assert above.frac_above_0999 == 0.25 and above.mean == pytest.approx(0.9625, abs=1e-12)
    assert (below.p5_low, below.p5_high) == (0.5, 0.5) and below.tokens_to_decide is None
    assert (undecided.p5_low, undecided.p5_high) == (0.7, 0.9) and undecided.frac_above_0999 == 0.0
    # 4% of its tokens are below tau: 1.96^2 * 0.05 * 0.95 / 0.01^2 = 1824.76 tokens decide, 1725 more than it has
    assert undecided.tokens_to_decide == 1725
    assert json.loads(json.dumps([t.to_json() for t in (above, below, undecided)]))[2]["verdict"] == "undecided"


def test_bin_tails_p1_is_numpys_quantile():
    rng = np.random.default_rng(4)
    alpha, positions = rng.beta(8, 1, 900), rng.integers(0, 3000, 900)
    for t in bin_tails(alpha, positions, 1000, tau=0.8):
        values = alpha[(positions >= t.start) & (positions < t.end)]
        assert t.p1 == np.quantile(values, 0.01) and t.p5 == np.quantile(values, 0.05)
        assert t.p5_low <= t.p5 <= t.p5_high


@pytest.mark.parametrize(("n", "below"), [(100, 4), (200, 5), (50, 0), (400, 12), (60, 6), (100, 10), (1000, 100)])
def test_tokens_to_decide_is_the_closed_form(n, below):
    values = np.r_[np.full(below, 0.5), np.full(n - below, 0.9)]
    share, q = below / n, 0.05
    expected = max(1, math.ceil(1.96**2 * q * (1 - q) / (share - q) ** 2 - n))
    assert tokens_to_decide(values, 0.8) == expected
    assert tokens_to_decide(values[::-1], 0.8) == expected


def test_tokens_to_decide_is_none_when_the_share_is_q():
    assert tokens_to_decide(np.r_[np.full(5, 0.5), np.full(95, 0.9)], 0.8) is None


def test_tail_stats_on_known_values():
    alpha = np.array([0.6, 1.0, 0.2, 0.8, 0.4])
    positions = np.array([2, 11, 0, 10, 1])  # bin size 10: [0.2, 0.4, 0.6] in bin 0, [0.8, 1.0] in bin 1
    out = tail_stats(alpha, positions, 10)
    first, second = out["bins"]
    assert (first["start"], first["end"], first["count"], second["start"], second["end"], second["count"]) == \
        (0, 10, 3, 10, 20, 2)
    assert first["p5"] == np.quantile([0.2, 0.4, 0.6], 0.05) == pytest.approx(0.22, abs=1e-15)  # index 0.1
    assert first["p1"] == np.quantile([0.2, 0.4, 0.6], 0.01) and first["p50"] == 0.4
    assert first["mean"] == pytest.approx(0.4, abs=1e-15) and first["frac_above_tail"] == 0.0
    assert second["p5"] == np.quantile([0.8, 1.0], 0.05) == pytest.approx(0.81, abs=1e-15)
    assert second["mean"] == pytest.approx(0.9, abs=1e-15) and second["frac_above_tail"] == 0.5
    assert out["overall"]["p5"] == np.quantile(alpha, 0.05) == pytest.approx(0.24, abs=1e-15)  # index 0.2
    assert out["overall"]["mean"] == pytest.approx(0.6, abs=1e-15) and out["overall"]["count"] == 5
    assert out["pearson_p5_bin"] is None and out["bin_size"] == 10


def _constructed():
    """Three bins of 2000 with known contents plus a partial fourth; bin 1 is skipped entirely."""
    rng = np.random.default_rng(1)
    positions = np.concatenate([rng.integers(0, 1000, 400), rng.integers(2000, 3000, 300),
                                rng.integers(3000, 4000, 500), rng.integers(5000, 5100, 50)])
    alpha = np.concatenate([1 - 0.01 * rng.random(400), 1 - 0.05 * rng.random(300),
                            1 - 0.2 * rng.random(500), 1 - 0.5 * rng.random(50)])
    alpha[::7] = 1.0
    return alpha, positions


def test_tail_stats_constructed():
    alpha, positions = _constructed()
    out = tail_stats(torch.from_numpy(alpha), torch.from_numpy(positions), bin_size=1000)
    assert set(out) == {"bins", "overall", "pearson_alpha_position", "pearson_p5_bin", "bin_size"}
    bins = out["bins"]
    assert all(set(b) == {"bin", "start", "end", "count", "mean", "p1", "p5", "p50", "frac_above_tail"} for b in bins)
    assert [b["bin"] for b in bins] == [0, 2, 3, 5]
    assert [(b["start"], b["end"]) for b in bins] == [(0, 1000), (2000, 3000), (3000, 4000), (5000, 6000)]
    assert [b["count"] for b in bins] == [400, 300, 500, 50]
    edges = [(0, 400), (400, 700), (700, 1200), (1200, 1250)]
    for b, (s, e) in zip(bins, edges):
        chunk = alpha[s:e]
        assert b["p5"] == pytest.approx(np.percentile(chunk, 5), rel=1e-12)
        assert b["p1"] == pytest.approx(np.percentile(chunk, 1), rel=1e-12)
        assert b["p50"] == pytest.approx(np.percentile(chunk, 50), rel=1e-12)
        assert b["mean"] == pytest.approx(chunk.mean(), rel=1e-12)
        assert b["frac_above_tail"] == pytest.approx((chunk >= 0.999).mean(), rel=1e-12)
    overall = out["overall"]
    assert overall["count"] == alpha.size
    assert overall["mean"] == pytest.approx(alpha.mean(), rel=1e-12)
    assert overall["p5"] == pytest.approx(np.percentile(alpha, 5), rel=1e-12)
    assert overall["frac_above_tail"] == pytest.approx((alpha >= 0.999).mean(), rel=1e-12)
    assert out["pearson_alpha_position"] == pytest.approx(np.corrcoef(alpha, positions)[0, 1], abs=1e-10)
    p5 = [b["p5"] for b in bins]
    assert out["pearson_p5_bin"] == pytest.approx(np.corrcoef([0, 2, 3, 5], p5)[0, 1], abs=1e-10)
    assert out["pearson_p5_bin"] < -0.9
    assert "beta_fit" not in out
    assert json.loads(json.dumps(out)) == out


def test_tail_stats_has_no_options_its_consumers_ignore():
    """The 5th percentile and the 0.999 tail are what profile, calibrate, training and the probes read."""
    for option in ({"percentile": 10}, {"tail_threshold": 0.99}):
        with pytest.raises(TypeError, match="unexpected keyword"):
            tail_stats([0.5, 0.9], [0, 1], 10, **option)


def test_tail_stats_accepts_numpy_and_undefined_pearson():
    out = tail_stats(np.full(10, 0.5), np.arange(10), bin_size=5)
    assert out["pearson_alpha_position"] is None and out["pearson_p5_bin"] is None
    assert [b["count"] for b in out["bins"]] == [5, 5]
    three = tail_stats(np.full(30, 0.5), np.arange(30), bin_size=10)
    assert len(three["bins"]) == 3 and three["pearson_p5_bin"] is None
    assert tail_stats([0.2] * 5, [0] * 5, bin_size=1, fit_beta=True)["beta_fit"] is None


def test_beta_fit_recovers_parameters():
    from scipy import stats

    a, b, thr = 3.0, 0.6, 0.999
    tail = stats.beta.rvs(a, b, scale=thr, size=20000, random_state=np.random.default_rng(2))
    tail = tail[tail < thr]
    alpha = np.concatenate([tail, np.ones(5000)])
    out = tail_stats(alpha, np.arange(alpha.size), bin_size=4096, fit_beta=True)
    fit = out["beta_fit"]
    assert fit["n"] == tail.size and fit["scale"] == thr
    assert fit["a"] == pytest.approx(a, rel=0.05) and fit["b"] == pytest.approx(b, rel=0.05)
    assert fit["ks"] < 0.02


def test_tail_stats_errors():
    a, pos = np.array([0.5, 0.9, 1.0]), np.array([0, 1, 2])
    _raises("no tokens", tail_stats, np.array([]), np.array([], dtype=np.int64), 10)
    _raises("shape", tail_stats, a, pos[:2], 10)
    _raises("NaN", tail_stats, np.array([0.5, np.nan, 1.0]), pos, 10)
    _raises(r"alpha\[1\] = 1.01 is outside \[0, 1\]", tail_stats, np.array([0.5, 1.01, 1.0]), pos, 10)
    _raises("outside", tail_stats, np.array([-0.1, 0.5, 1.0]), pos, 10)
    assert tail_stats(np.array([0.5, 1 + 1e-7, -1e-7]), pos, 10)["overall"]["count"] == 3
    _raises("bin_size", tail_stats, a, pos, 0)
    _raises(r"positions\[1\] = -1 is negative", tail_stats, a, np.array([0, -1, 2]), 10)
    _raises("not an integer", tail_stats, a, np.array([0, 1.5, 2]), 10)


def test_p1_of_the_training_monitor_and_of_profiles_equals_numpys():
    alpha = np.random.default_rng(3).beta(8, 1, 700)
    positions = np.repeat([0, 1, 2], [123, 400, 177])
    tails = bin_tails(alpha, positions, 1, tau=0.8)
    stats = tail_stats(alpha, positions, 1)["bins"]
    for t, b, values in zip(tails, stats, np.split(alpha, [123, 523])):
        assert (t.start, t.end, t.count) == (b["start"], b["end"], b["count"]) and t.mean == pytest.approx(b["mean"])
        assert t.p1 == pytest.approx(np.percentile(values, 1), rel=1e-12) == b["p1"]
        assert t.p5 == pytest.approx(np.percentile(values, 5), rel=1e-12)
        assert t.to_json()["p1"] == t.p1 < t.p5


def test_each_sequences_minimum_per_bin_and_overall():
    alpha = np.array([0.9, 0.5, 1.0, 0.7, 0.99, 0.8, 0.6, 1.0])
    positions = np.array([0, 1, 0, 1, 2, 0, 1, 2])  # bin size 2: positions 0-1 in bin 0, 2 in bin 1
    sequences = np.array([0, 0, 1, 1, 1, 2, 2, 2])
    out = tail_stats(alpha, positions, 2, sequences=sequences)
    assert out["overall"]["sequences"] == 3
    assert out["overall"]["seq_min_mean"] == pytest.approx(np.mean([0.5, 0.7, 0.6]))
    assert out["overall"]["seq_min_p5"] == pytest.approx(np.percentile([0.5, 0.7, 0.6], 5))
    first, second = out["bins"]
    assert first["sequences"] == 3 and first["seq_min_mean"] == pytest.approx(np.mean([0.5, 0.7, 0.6]))
    assert second["sequences"] == 2 and second["seq_min_mean"] == pytest.approx(np.mean([0.99, 1.0]))
    assert "seq_min_mean" not in tail_stats(alpha, positions, 2)["overall"]
    _raises("sequences has 2 ids for 8", tail_stats, alpha, positions, 2, sequences=[0, 1])
