"""Exact acceptance rate (`sparrow.metrics.divergence`) and its top-K bounds (`sparrow.measure.bounds`) against
hand values and float64. Tail statistics are tested in test_tail.py."""

import itertools

import pytest
import torch

from sparrow.errors import SparrowError
from sparrow.measure.bounds import acceptance_bounds
from sparrow.metrics.divergence import _ALPHA_TEMPS, acceptance_rate, chunk_rows

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


def test_alpha_with_masked_tokens():
    p = torch.tensor([[0.0, 0.0, NEG_INF], [0.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, NEG_INF]])
    assert acceptance_rate(p, q).tolist() == pytest.approx([2 / 3, 2 / 3], abs=1e-6)


def test_chunked_equals_unchunked():
    x, y = _logits(5, 7, 64, seed=7), _logits(5, 7, 64, seed=8)
    full = acceptance_rate(x, y, 0.9, chunk_size=10**6)
    for chunk in (1, 7, None):
        assert torch.allclose(acceptance_rate(x, y, 0.9, chunk_size=chunk), full, atol=1e-6, rtol=0)


def test_default_chunk_is_bounded_for_large_vocab():
    rows = chunk_rows(None, 152_064, _ALPHA_TEMPS)
    assert 1 <= rows and rows * 152_064 * 4 * _ALPHA_TEMPS <= 512 * 2**20
    assert chunk_rows(None, 10**9, _ALPHA_TEMPS) == 1


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
    _raises(r"logits_p has NaN at position \(1, 3\)", acceptance_rate, bad, x, chunk_size=1)
    masked = x.clone()
    masked[0, 2] = NEG_INF
    _raises(r"logits_p is -inf for every token at position \(0, 2\)", acceptance_rate, masked, x)
    plus = x.clone()
    plus[2, 0, 1] = float("inf")
    _raises(r"\+inf at position \(2, 0\)", acceptance_rate, x, plus)
    _raises("floating-point", acceptance_rate, x.long(), x.long())
    _raises("chunk_size", acceptance_rate, x, x, chunk_size=0)


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
