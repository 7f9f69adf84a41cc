"""The schedule controllers the training loop asks each step (schedules/controllers.py): what they return, what they log,
and that their saved state restores them."""

from types import SimpleNamespace

import pytest
import torch

from sparrow.metrics.tail import quantile_interval
from sparrow.rl.config import AdaptiveSection
from sparrow.schedules import const
from sparrow.schedules.adaptive import start_state
from sparrow.schedules.controllers import AdaptiveSchedule, FixedSchedule

RULE = AdaptiveSection(margin=0.0, patience=1, min_tokens=10)


def test_a_fixed_schedule_measures_nothing_more_and_saves_nothing():
    fixed = FixedSchedule(const(64))
    metrics = {}
    assert fixed.schedule() == const(64) and fixed.measure() is None
    assert fixed.after_step(1, SimpleNamespace(exact=None), metrics) == [] and metrics == {} and fixed.state() == {}


def test_the_adaptive_controller_raises_a_bin_below_tau_logs_it_and_restores_from_its_state():
    adaptive = AdaptiveSchedule(start_state(const(64), 128, 256, 16, 3), 0.9, RULE)
    assert adaptive.schedule().budgets == (64, 64) and adaptive.measure()["cheaper"].budgets == (48, 48)
    low = torch.full((20,), 0.5)  # bin 0's tokens all below tau 0.9: its budget moves up one rung
    done = SimpleNamespace(exact=low, exact_at=torch.arange(20), measured={"cheaper": low})
    metrics = {}
    events = adaptive.after_step(3, done, metrics)
    # the budgets in force, and bin 0's tail one rung cheaper (48 tokens: every token 0.5; 20 tokens cannot bound a
    # 5th percentile from below, so the interval's lower end is 0), the evidence a move down waits on; bin 128
    # measured nothing
    assert metrics == {"adaptive/bin_0/budget": 64, "adaptive/bin_128/budget": 64,
                       "adaptive/bin_0/cheaper_p5": 0.5, "adaptive/bin_0/cheaper_p5_low": 0.0,
                       # what moved and on what evidence: the p5 under the budget in force, its interval and tokens
                       "adaptive/bin_0/p5": 0.5, "adaptive/bin_0/p5_low": 0.0, "adaptive/bin_0/p5_high": 0.5,
                       "adaptive/bin_0/tokens": 20, "adaptive/bin_0/move": 1, "adaptive/bin_0/next_budget": 128,
                       "adaptive/bin_0/down_streak": 0}
    assert len(events) == 1 and events[0].startswith("step 3: adaptive schedule: bin [0, 128)")
    assert adaptive.schedule().budgets == (128, 64)  # the next rung of the ladder (48, 64, 128, 256)
    again = AdaptiveSchedule(start_state(const(64), 128, 256, 16, 3), 0.9, RULE)
    again.restore(adaptive.state())
    assert again.schedule() == adaptive.schedule()


def test_the_adaptive_controller_logs_the_cheaper_rungs_tail_it_moves_down_on():
    adaptive = AdaptiveSchedule(start_state(const(64), 128, 256, 16, 3), 0.9, RULE)
    positions = torch.cat([torch.arange(100), 128 + torch.arange(5)])  # 100 tokens in bin 0, 5 in bin 128
    current = torch.full((105,), 0.97)  # tau holds under the schedule in force
    cheaper = torch.cat([torch.linspace(0.92, 1.0, 100), torch.linspace(0.5, 1.0, 5)])
    done = SimpleNamespace(exact=current, exact_at=positions, measured={"cheaper": cheaper})
    metrics = {}
    events = adaptive.after_step(1, done, metrics)
    low, p5, _ = quantile_interval(cheaper[:100].numpy())
    assert metrics["adaptive/bin_0/cheaper_p5"] == pytest.approx(p5)
    assert metrics["adaptive/bin_0/cheaper_p5_low"] == pytest.approx(low)
    assert "adaptive/bin_128/cheaper_p5" not in metrics  # too few tokens to decide on
    # with margin 0 and patience 1 the cheaper rung's lower end above tau moves bin 0 down to 48 at once
    assert low >= 0.9 and len(events) == 1 and "budget down to 48" in events[0]
    metrics = {}
    bottom = SimpleNamespace(exact=current[:100], exact_at=torch.arange(100), measured={"cheaper": current[:100]})
    adaptive.after_step(2, bottom, metrics)
    assert "adaptive/bin_0/cheaper_p5" not in metrics  # at the ladder's first rung there is no cheaper one


def _exact_step(alpha: torch.Tensor, positions: torch.Tensor):
    """A step rolled out in exact mode: the drafts' acceptance, and nothing teacher-forced one rung cheaper."""
    return SimpleNamespace(exact=alpha, exact_at=positions, measured={"cheaper": torch.full_like(alpha, float("nan"))})


def test_the_exact_fallback_rolls_out_the_next_steps_in_exact_mode_until_the_bin_holds_tau():
    rule = AdaptiveSection(margin=0.0, patience=2, min_tokens=10, fallback="exact")
    adaptive = AdaptiveSchedule(start_state(const(64), 128, 256, 16, 3), 0.9, rule)
    low = torch.full((20,), 0.5)
    metrics = {}
    events = adaptive.after_step(1, SimpleNamespace(exact=low, exact_at=torch.arange(20),
                                                    measured={"cheaper": low}), metrics)
    assert adaptive.exact() and adaptive.schedule().budgets == (128, 64) and "exact mode" in events[0]
    assert metrics["adaptive/exact"] == 0 and metrics["adaptive/exact_next"] == 1
    assert metrics["adaptive/bin_0/fallen"] == 1 and metrics["adaptive/bin_0/move"] == 1
    high = torch.full((200,), 0.99)  # enough tokens for the interval's lower end to clear tau
    for step, still in ((2, True), (3, False)):  # patience 2: two exact steps holding tau, then sparse again
        metrics = {}
        events = adaptive.after_step(step, _exact_step(high, torch.arange(200) % 128), metrics)
        assert metrics["adaptive/exact"] == 1 and adaptive.exact() == still
        assert "adaptive/bin_0/cheaper_p5" not in metrics  # an exact step measures no cheaper rung: no move down
        assert metrics["adaptive/bin_0/move"] == 0 and metrics["adaptive/bin_0/hold_streak"] == (1 if still else 0)
    assert "leave exact mode" in events[0] and adaptive.schedule().budgets == (128, 64)


@pytest.mark.parametrize("fallback, budget", [("budget", 128), ("dense", 256)])
def test_budget_and_dense_fallbacks_never_ask_for_exact_rollouts(fallback, budget):
    rule = AdaptiveSection(margin=0.0, patience=1, min_tokens=10, fallback=fallback)
    adaptive = AdaptiveSchedule(start_state(const(64), 128, 512, 16, 3), 0.9, rule)
    low = torch.full((20,), 0.5)
    metrics = {}
    adaptive.after_step(1, SimpleNamespace(exact=low, exact_at=128 + torch.arange(20), measured={"cheaper": low}),
                        metrics)
    assert not adaptive.exact() and "adaptive/exact" not in metrics and "adaptive/bin_128/fallen" not in metrics
    assert adaptive.schedule().budgets[1] == budget == metrics["adaptive/bin_128/next_budget"]


def test_no_move_down_without_evidence_one_rung_cheaper():
    """The budget in force holds tau, but the cheaper rung was measured on too few tokens, or not at all."""
    adaptive = AdaptiveSchedule(start_state(const(64), 128, 256, 16, 3), 0.9, RULE)
    good = torch.full((40,), 0.99)
    for measured in ({"cheaper": torch.cat([good[:5], torch.full((35,), float("nan"))])}, {}):
        metrics = {}
        assert adaptive.after_step(1, SimpleNamespace(exact=good, exact_at=torch.arange(40), measured=measured),
                                   metrics) == []
        assert adaptive.schedule().budgets == (64, 64) and metrics["adaptive/bin_0/move"] == 0
