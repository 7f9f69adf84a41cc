"""Acceptance rate, divergences, top-K bounds, percentile and tail statistics against hand and numpy values."""

import itertools
import json
import math

import numpy as np
import pytest
import torch

from sparrow.errors import SparrowError
from sparrow.measure.metrics import (
    acceptance_bounds,
    acceptance_rate,
    divergences,
    importance_ratio,
    kl_divergence,
    percentile,
    tail_stats,
    tv_distance,
)

NEG_INF = float("-inf")


def _logits(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _log(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_identical_distributions_give_one():
    x = _logits(4, 9, 500)
    for temperature in (1.0, 0.7, 1.6):
        alpha = acceptance_rate(x, x.clone(), temperature)
        assert alpha.shape == (4, 9) and alpha.dtype == torch.float32
        assert torch.allclose(alpha, torch.ones_like(alpha), atol=1e-6, rtol=0)


def test_disjoint_supports_give_zero():
    p = torch.tensor([[0.0, 1.0, NEG_INF, NEG_INF], [2.0, NEG_INF, NEG_INF, NEG_INF]])
    q = torch.tensor([[NEG_INF, NEG_INF, 0.5, 0.0], [NEG_INF, 1.0, 3.0, NEG_INF]])
    assert acceptance_rate(p, q).tolist() == [0.0, 0.0]
    assert torch.allclose(tv_distance(p, q), torch.ones(2))


def test_hand_example_and_symmetry():
    p, q = _log([0.5, 0.3, 0.2]), _log([0.2, 0.3, 0.5])
    assert acceptance_rate(p, q).item() == pytest.approx(0.7, abs=1e-6)
    x, y = _logits(6, 300, seed=1), _logits(6, 300, seed=2)
    assert torch.allclose(acceptance_rate(x, y, 0.8), acceptance_rate(y, x, 0.8), atol=1e-7, rtol=0)


def test_temperature_changes_alpha_as_expected():
    x, y = _logits(5, 200, seed=3), _logits(5, 200, seed=4)
    t = 0.6
    p = torch.softmax(x.double() / t, -1)
    q = torch.softmax(y.double() / t, -1)
    expected = torch.minimum(p, q).sum(-1).float()
    assert torch.allclose(acceptance_rate(x, y, t), expected, atol=1e-6, rtol=0)
    assert torch.allclose(acceptance_rate(x.bfloat16(), y.bfloat16(), t),
                          acceptance_rate(x.bfloat16().float(), y.bfloat16().float(), t), atol=1e-7, rtol=0)


def _kl64(x, y, t):
    logp, logq = torch.log_softmax(x.double() / t, -1), torch.log_softmax(y.double() / t, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def test_divergences_match_float64():
    x, y = _logits(3, 7, 400, seed=5), _logits(3, 7, 400, seed=6)
    t = 1.3
    d = divergences(x, y, t)
    assert set(d) == {"alpha", "tv", "kl_pq", "kl_qp"}
    assert torch.allclose(d["tv"], 1 - d["alpha"], atol=1e-6, rtol=0)
    assert torch.allclose(d["kl_pq"].double(), _kl64(x, y, t), atol=1e-5, rtol=1e-5)
    assert torch.allclose(d["kl_qp"].double(), _kl64(y, x, t), atol=1e-5, rtol=1e-5)
    assert torch.equal(kl_divergence(x, y, t), d["kl_pq"])
    assert torch.equal(kl_divergence(x, y, t, direction="qp"), d["kl_qp"])
    assert torch.equal(tv_distance(x, y, t), d["tv"])
    same = divergences(x, x.clone(), t)
    assert same["kl_pq"].abs().max() == 0 and same["kl_qp"].abs().max() == 0


def test_kl_with_masked_tokens():
    p = torch.tensor([[0.0, 0.0, NEG_INF], [0.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, NEG_INF]])
    d = divergences(p, q)
    assert d["kl_pq"][0].item() == pytest.approx(math.log(1.5), abs=1e-6)
    assert d["kl_qp"][0].item() == math.inf
    assert d["kl_pq"][1].item() == math.inf
    assert d["kl_qp"][1].item() == pytest.approx(math.log(1.5), abs=1e-6)
    assert d["alpha"][0].item() == pytest.approx(2 / 3, abs=1e-6)


def test_ratio_and_logp_diff_hand_example():
    p = torch.stack([_log([0.5, 0.3, 0.2]), _log([0.1, 0.6, 0.3])])
    q = torch.stack([_log([0.2, 0.3, 0.5]), _log([0.4, 0.4, 0.2])])
    tokens = torch.tensor([0, 2])
    d = divergences(p, q, tokens=tokens)
    assert d["ratio"].tolist() == pytest.approx([0.4, 2 / 3], abs=1e-6)
    assert d["logp_diff"].tolist() == pytest.approx([math.log(2.5), math.log(1.5)], abs=1e-6)
    assert torch.allclose(importance_ratio(p, q, tokens), d["ratio"], atol=1e-7)


def test_chunked_equals_unchunked():
    x, y = _logits(5, 7, 64, seed=7), _logits(5, 7, 64, seed=8)
    tokens = torch.randint(0, 64, (5, 7), generator=torch.Generator().manual_seed(9))
    full = divergences(x, y, 0.9, tokens=tokens, chunk_size=10**6)
    for chunk in (1, 7, None):
        part = divergences(x, y, 0.9, tokens=tokens, chunk_size=chunk)
        for key in full:
            assert torch.allclose(part[key], full[key], atol=1e-6, rtol=1e-6), (chunk, key)
        assert torch.allclose(acceptance_rate(x, y, 0.9, chunk_size=chunk), full["alpha"], atol=1e-6, rtol=0)


def test_default_chunk_is_bounded_for_large_vocab():
    from sparrow.measure.metrics import _FULL_TEMPS, _chunk_rows

    rows = _chunk_rows(None, 152_064, _FULL_TEMPS)
    assert 1 <= rows and rows * 152_064 * 4 * _FULL_TEMPS <= 512 * 2**20
    assert _chunk_rows(None, 10**9, _FULL_TEMPS) == 1


def _top(x, k, t):
    logp = torch.log_softmax(x / t, -1)
    values, ids = logp.topk(k, -1)
    return ids, values


def test_bounds_contain_exact_alpha_and_tighten():
    vocab, t = 50, 0.8
    for seed in range(20):
        x = _logits(4, 3, vocab, seed=100 + seed, scale=1.0 + seed % 4)
        y = x + _logits(4, 3, vocab, seed=200 + seed, scale=0.3 * (seed % 5))
        exact = acceptance_rate(x, y, t)
        widths = []
        for k in (1, 2, 5, 20, vocab):
            lower, upper = acceptance_bounds(*_top(x, k, t), y, t)
            assert lower.shape == upper.shape == exact.shape
            assert (lower <= exact + 1e-6).all() and (upper >= exact - 1e-6).all(), (seed, k)
            widths.append(upper - lower)
            if k == vocab:
                assert torch.allclose(lower, exact, atol=1e-6, rtol=0)
                assert (upper - lower).max() < 1e-5
        for wide, narrow in itertools.pairwise(widths):
            assert (narrow <= wide + 1e-6).all()


def test_bounds_chunked_and_random_sets():
    x, y = _logits(9, 40, seed=11), _logits(9, 40, seed=12)
    ids = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(i))[:6] for i in range(9)])
    logprobs = torch.log_softmax(x, -1).gather(-1, ids)
    exact = acceptance_rate(x, y)
    full = acceptance_bounds(ids, logprobs, y)
    assert (full[0] <= exact + 1e-6).all() and (full[1] >= exact - 1e-6).all()
    for chunk in (1, 4):
        part = acceptance_bounds(ids, logprobs, y, chunk_size=chunk)
        assert torch.allclose(part[0], full[0], atol=1e-7) and torch.allclose(part[1], full[1], atol=1e-7)


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    qs = [0, 0.5, 1, 5, 12.5, 33.3, 50, 66.7, 95, 99, 99.9, 100]
    for n in (1, 2, 3, 4, 10, 101, 1000):
        for dist in range(3):
            values = rng.random(n) if dist == 0 else rng.normal(size=n) if dist == 1 else rng.integers(0, 5, n) * 1.0
            for q in qs:
                expected = np.percentile(values, q, method="linear")
                assert percentile(torch.from_numpy(values), q) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert percentile(torch.tensor([[3.0, 1.0], [2.0, 4.0]]), 50) == 2.5
    assert percentile([7, 1, 3], 50) == 3.0


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


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(SparrowError, match=match):
        fn(*args, **kwargs)


def test_logit_errors():
    x = _logits(3, 4, 10)
    _raises("shape", acceptance_rate, x, x[:, :3])
    _raises("0-dim", acceptance_rate, torch.tensor(1.0), torch.tensor(1.0))
    _raises("temperature", acceptance_rate, x, x, 0.0)
    _raises("temperature", acceptance_rate, x, x, -1.0)
    _raises("temperature", acceptance_rate, x, x, float("nan"))
    bad = x.clone()
    bad[2, 1, 5] = float("nan")
    bad[1, 3, 0] = float("nan")
    _raises(r"logits_q has NaN at position \(1, 3\) \(vocab index 0\)", acceptance_rate, x, bad)
    _raises(r"logits_p has NaN at position \(1, 3\)", divergences, bad, x, chunk_size=1)
    masked = x.clone()
    masked[0, 2] = NEG_INF
    _raises(r"logits_p is -inf for every token at position \(0, 2\)", acceptance_rate, masked, x)
    plus = x.clone()
    plus[2, 0, 1] = float("inf")
    _raises(r"\+inf at position \(2, 0\)", acceptance_rate, x, plus)
    _raises("floating-point", acceptance_rate, x.long(), x.long())
    _raises("chunk_size", acceptance_rate, x, x, chunk_size=0)
    _raises("direction", kl_divergence, x, x, direction="pp")


def test_token_errors():
    x = _logits(2, 5)
    _raises("out of range", divergences, x, x, tokens=torch.tensor([0, 5]))
    _raises("shape", divergences, x, x, tokens=torch.tensor([0]))
    _raises("integer", importance_ratio, x, x, torch.tensor([0.0, 1.0]))
    masked = x.clone()
    masked[1, 3] = NEG_INF
    _raises("probability 0 under p", importance_ratio, masked, x, torch.tensor([0, 3]))


def test_bounds_errors():
    y = _logits(2, 10)
    logprobs = torch.log(torch.full((2, 3), 0.1))
    _raises("twice", acceptance_bounds, torch.tensor([[0, 1, 2], [4, 5, 4]]), logprobs, y)
    _raises(r"id 10: expected ids in \[0, 10\)", acceptance_bounds, torch.tensor([[0, 1, 2], [4, 5, 10]]), logprobs, y)
    _raises("id -1", acceptance_bounds, torch.tensor([[0, -1, 2], [4, 5, 6]]), logprobs, y)
    _raises("shape", acceptance_bounds, torch.tensor([[0, 1], [4, 5]]), logprobs, y)
    _raises("exceeds the vocabulary", acceptance_bounds, torch.arange(11).expand(2, 11), torch.zeros(2, 11), y)
    _raises("not logits", acceptance_bounds, torch.tensor([[0, 1, 2], [4, 5, 6]]), torch.ones(2, 3), y)
    _raises("temperature", acceptance_bounds, torch.tensor([[0, 1, 2], [4, 5, 6]]), logprobs, y, 0)


def test_percentile_errors():
    _raises("empty", percentile, torch.tensor([]), 5)
    _raises(r"\[0, 100\]", percentile, torch.ones(3), 101)
    _raises(r"\[0, 100\]", percentile, torch.ones(3), -1)
    _raises("NaN", percentile, torch.tensor([1.0, float("nan")]), 5)


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
    from sparrow.measure.tail import bin_tails

    alpha = np.random.default_rng(3).beta(8, 1, 700)
    positions = np.repeat([0, 1, 2], [123, 400, 177])
    tails = bin_tails(alpha, positions, 1, tau=0.8)
    stats = tail_stats(alpha, positions, 1)["bins"]
    for t, b, values in zip(tails, stats, np.split(alpha, [123, 523])):
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
