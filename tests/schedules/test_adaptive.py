"""The adaptive schedule controller on synthetic acceptance data: budgets move the right way, with hysteresis,
never below the always-kept pages nor above the covering rung, and its state round-trips for resumes."""

import numpy as np
import pytest

from sparrow.metrics.tail import by_bin
from sparrow.schedules import DENSE, const, parse_schedule
from sparrow.schedules.adaptive import AdaptiveState, ladder, start_state, update

TAU, MARGIN = 0.8, 0.02


def _state(budget=256, bins=3):
    return start_state(const(budget), 512, 512 * bins, page_size=16, always_kept_pages=3)


def _alpha(level, n=400, spread=0.01, seed=0):
    """n acceptance values whose 5th percentile is close to `level`."""
    rng = np.random.default_rng(seed)
    return np.clip(level + spread * 1.645 + spread * rng.standard_normal(n), 0, 1)


def test_the_ladder_starts_at_the_always_kept_pages_and_ends_covering_the_length():
    assert ladder(16, 3, 1000) == [48, 64, 128, 256, 512, 1024]
    assert _state().ladder[0] == 48 and _state().ladder[-1] >= 1536
    assert _state(256).budgets == [256, 256, 256]
    assert start_state(DENSE, 512, 1024, 16, 3).budgets == [1024, 1024]
    uneven = start_state(parse_schedule("0:64,512:128,1024:512"), 512, 1536, 16, 3)
    assert uneven.budgets == [64, 128, 512]


def test_a_bin_below_tau_moves_up_after_one_monitored_step_certain_or_not():
    state, events = update(_state(), {0: _alpha(0.6)}, {}, TAU, MARGIN, patience=2, min_tokens=100)
    assert state.budgets == [512, 256, 256] and "budget up to 512" in events[0]
    barely = np.concatenate([np.full(22, 0.79), np.full(378, 0.95)])  # p5 just below tau, interval across it
    once, events = update(_state(), {1: barely}, {}, TAU, MARGIN, patience=2, min_tokens=100)
    assert once.budgets == [256, 512, 256] and "p5 0.790" in events[0] and "400 tokens" in events[0]
    few, events = update(_state(), {1: barely[:99]}, {}, TAU, MARGIN, patience=2, min_tokens=100)
    assert few == _state() and events == []  # below tau, but too few tokens to say so


@pytest.mark.parametrize("fallback, budgets, fallen", [("budget", [512, 256, 256], (0, 0, 0)),
                                                       ("dense", [512, 256, 256], (0, 0, 0)),
                                                       ("exact", [512, 256, 256], (1, 0, 0))])
def test_each_fallback_acts_at_the_next_step(fallback, budgets, fallen):
    """Bin 0 ([0, 512)) is covered by 512 tokens, so dense and the next rung agree there; bin 2 ([1024, 1536))
    needs 2048 to be dense."""
    state, events = update(_state(), {0: _alpha(0.6)}, {}, TAU, MARGIN, 2, 100, fallback)
    assert state.budgets == budgets and state.fallen == fallen and state.exact == (fallback == "exact")
    assert events[0].endswith("next step rolls out in exact mode") == (fallback == "exact")
    far, _ = update(_state(), {2: _alpha(0.6)}, {}, TAU, MARGIN, 2, 100, fallback)
    assert far.budgets[2] == {"budget": 512, "dense": 2048, "exact": 512}[fallback]
    assert far.covering_rung(2) == far.ladder.index(2048)


def test_a_fallen_bin_leaves_exact_mode_only_after_patience_steps_above_tau_plus_margin():
    state, _ = update(_state(), {0: _alpha(0.6)}, {}, TAU, MARGIN, 2, 100, "exact")
    state, events = update(state, {0: _alpha(0.7)}, {}, TAU, MARGIN, 2, 100, "exact")  # still below: up again
    assert state.budgets[0] == 1024 and state.exact and "up to 1024" in events[0]
    state, _ = update(state, {0: _alpha(0.81)}, {}, TAU, MARGIN, 2, 100, "exact")  # within the margin: no hold
    assert state.exact and state.holds[0] == 0
    state, events = update(state, {0: _alpha(0.95)}, {}, TAU, MARGIN, 2, 100, "exact")
    assert state.exact and state.holds[0] == 1 and events == []
    state, events = update(state, {0: _alpha(0.95)}, {}, TAU, MARGIN, 2, 100, "exact")
    assert not state.exact and state.budgets[0] == 1024 and "leave exact mode" in events[0]
    top = start_state(DENSE, 512, 512, 16, 3)
    top, events = update(top, {0: _alpha(0.1)}, {}, TAU, MARGIN, 1, 100, "exact")
    assert top.exact and top.budgets == [top.ladder[-1]] and "stays at" in events[0]


def test_a_bin_moves_down_only_after_patience_steps_certainly_above_tau_plus_margin():
    state = _state()
    ok, cheap = _alpha(0.95), _alpha(0.9)
    for expected in ([256, 256, 256], [128, 256, 256]):
        state, _ = update(state, {0: ok}, {0: cheap}, TAU, MARGIN, patience=2, min_tokens=100)
        assert state.budgets == expected
    # the cheaper budget near tau (inside the margin) keeps the bin where it is: hysteresis
    near = _state()
    for _ in range(5):
        near, _ = update(near, {0: ok}, {0: _alpha(0.81)}, TAU, MARGIN, patience=2, min_tokens=100)
    assert near.budgets == [256, 256, 256]


def test_too_few_tokens_decide_nothing_and_budgets_stay_within_the_ladder():
    state, events = update(_state(), {0: _alpha(0.1, n=50)}, {0: _alpha(0.99, n=50)}, TAU, MARGIN, 1, 100)
    assert state == _state() and events == []
    bottom = start_state(const(48), 512, 512, 16, 3)
    for _ in range(4):
        bottom, _ = update(bottom, {0: _alpha(0.99)}, {0: _alpha(0.99)}, TAU, MARGIN, 1, 100)
    assert bottom.budgets == [48]  # never below the always-kept pages
    top = start_state(DENSE, 512, 512, 16, 3)
    top, _ = update(top, {0: _alpha(0.1)}, {}, TAU, MARGIN, 1, 100)
    assert top.budgets == [top.ladder[-1]]


def test_the_schedules_in_force_and_one_rung_cheaper_and_the_state_round_trip():
    state = start_state(parse_schedule("0:64,512:128,1024:512"), 512, 1536, 16, 3)
    assert state.schedule().budget_at(700) == 128 and state.schedule(-1).budgets == (48, 64, 256)
    assert parse_schedule(state.schedule().name) == state.schedule()
    assert AdaptiveState.from_json(state.to_json()) == state
    fallen, _ = update(state, {1: _alpha(0.5)}, {}, TAU, MARGIN, 2, 100, "exact")
    assert AdaptiveState.from_json(fallen.to_json()) == fallen and fallen.fallen == (0, 1, 0)
    saved = {"bin_size": 512, "ladder": list(state.ladder), "rungs": [1, 2, 4], "up_streaks": [0, 1, 0],
             "down_streaks": [0, 0, 1]}  # a checkpoint's state from before fallen bins
    old = AdaptiveState.from_json(saved)
    assert old.budgets == [64, 128, 512] and old.fallen == (0, 0, 0) and old.down_streaks == (0, 0, 1)
    grouped = by_bin(np.array([0.1, 0.2, 0.3]), np.array([10, 600, 620]), 512)
    assert set(grouped) == {0, 1} and list(grouped[1]) == [0.2, 0.3]


def test_bad_controller_settings_are_refused():
    with pytest.raises(Exception, match="patience"):
        update(_state(), {}, {}, TAU, MARGIN, patience=0, min_tokens=1)
    with pytest.raises(Exception, match="unknown adaptive_fallback 'never': expected one of budget, dense, exact"):
        update(_state(), {}, {}, TAU, MARGIN, 1, 1, "never")
