"""Reward retention of paired sparse/dense samples: the ratio of means and its delta-method interval."""

import numpy as np
import pytest
from scipy import stats

from sparrow.errors import SparrowError
from sparrow.measure.retention import mean_interval, paired_difference, reward_retention, too_few_prompts


def test_retention_and_its_interval_on_hand_computed_pairs():
    # R = 0.75; residuals (x - R y) / mean(y) = [.25, -.75, .25, .25]; var = 4/3 * 0.75 / 16 = 1/16
    r = reward_retention([1, 0, 1, 1], [1, 1, 1, 1])
    half = stats.t.ppf(0.975, 3) * 0.25
    assert r.value == 0.75 and (r.pairs, r.prompts) == (4, 4)
    assert 0.75 - half < 0 and r.low == 0.0 and r.high == pytest.approx(0.75 + half)  # no reward below 0
    wider = reward_retention([1, 0, 1, 1] * 4, [1, 1, 1, 1] * 4)  # 16 pairs: var 16/15 * 3 / 256
    assert wider.low == pytest.approx(0.75 - stats.t.ppf(0.975, 15) * np.sqrt(16 / 15 * 3) / 16)


def test_identical_rewards_retain_everything_with_no_width():
    r = reward_retention([0.2, 0.9, 0.4, 0.0], [0.2, 0.9, 0.4, 0.0])
    assert (r.value, r.low, r.high) == (1.0, 1.0, 1.0)
    assert r.verdict(1.0) == "held"


def test_pairs_of_one_prompt_are_one_cluster():
    sparse, dense = [1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]
    alone = reward_retention(sparse, dense)
    grouped = reward_retention(sparse, dense, groups=[0, 0, 1, 1, 2, 2])
    assert alone.value == grouped.value == 0.5 and grouped.prompts == 3
    # residual sums per prompt [1, -1, 0] / 6 pairs: var = 3/2 * 2 / 36; t with 2 degrees of freedom
    assert grouped.high - grouped.value == pytest.approx(stats.t.ppf(0.975, 2) * np.sqrt(1.5 * 2 / 36))


def test_the_lower_bound_stops_at_zero_only_when_no_reward_is_negative():
    sparse, dense = [1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]
    half = stats.t.ppf(0.975, 2) * np.sqrt(1.5 * 2 / 36)  # 1.24: the delta interval reaches 0.5 - 1.24 < 0
    grouped = reward_retention(sparse, dense, groups=[0, 0, 1, 1, 2, 2])
    assert grouped.low == 0.0 and grouped.high == pytest.approx(0.5 + half)
    signed = reward_retention([1, 1, -1, -1, 1, -1], [1, 1, 1, 1, 1, 1], groups=[0, 0, 1, 1, 2, 2])
    assert signed.value == 0.0 and signed.low == pytest.approx(-2 * half)


def test_verdicts_and_undefined_cases():
    low = reward_retention([0.0] * 8 + [0.1] * 8, [1.0] * 16)
    assert low.verdict(0.9) == "lost" and low.verdict(0.0) == "held"
    assert reward_retention([1, 0], [0, 0]).value is None
    single = reward_retention([1, 0, 1], [1, 1, 1], groups=[7, 7, 7])
    assert single.value == pytest.approx(2 / 3) and single.low is None and single.verdict(0.5) == "undecided"


@pytest.mark.parametrize("sparse, dense, message", [
    ([1, 2], [1], "equally long"), ([], [], "non-empty"), ([float("nan")], [1], "finite")])
def test_bad_pairs_are_refused(sparse, dense, message):
    with pytest.raises(SparrowError, match=message):
        reward_retention(sparse, dense)


def test_the_mean_interval_over_prompts_is_students_t():
    values = [0.1, 0.5, 0.3, 0.9, 0.0]
    low, high = mean_interval(values)
    expected = stats.t.interval(0.95, 4, loc=np.mean(values), scale=stats.sem(values))
    assert (low, high) == pytest.approx(expected)
    assert all(np.isnan(mean_interval([0.4])))


def test_two_prompts_give_no_interval_and_a_known_reward_range_bounds_one():
    """The long demo's held-out rewards of 2 prompts gave '0.361 (95% interval -1.303..2.025)' for a reward in
    [0, 1]: two prompts now give none; four near the top of [0, 1] give one cut at 1."""
    assert all(np.isnan(mean_interval([0.230, 0.492])))
    assert all(np.isnan(mean_interval([0.230, 0.492], bounds=(0.0, 1.0))))
    assert too_few_prompts(2) == "2 prompts: too few for an interval (needs 3)"
    values = [0.95, 1.0, 1.0, 0.9]
    t_low, t_high = stats.t.interval(0.95, 3, loc=np.mean(values), scale=stats.sem(values))
    assert t_high > 1.03  # Student's t alone leaves the reward's range
    low, high = mean_interval(values, bounds=(0.0, 1.0))
    assert (low, high) == (pytest.approx(t_low), 1.0) and 0.88 < low < 0.89
    mean, low, high = paired_difference([1.0, 1.0, 0.0], [0.0, 0.0, 1.0], bounds=(0.0, 1.0))
    assert mean == pytest.approx(1 / 3) and (low, high) == (-1.0, 1.0)  # differences lie in [-1, 1]
