"""The schedule controllers the training loop asks each step (rl/controllers.py): what they return, what they log,
and that their saved state restores them."""

from types import SimpleNamespace

import torch

from sparrow.rl.adaptive import start_state
from sparrow.rl.config import AdaptiveSection
from sparrow.rl.controllers import AdaptiveSchedule, FixedSchedule
from sparrow.schedules import const

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
    assert metrics == {"adaptive/bin_0/budget": 64, "adaptive/bin_128/budget": 64}  # the budgets in force
    assert len(events) == 1 and events[0].startswith("step 3: adaptive schedule: bin [0, 128)")
    assert adaptive.schedule().budgets == (128, 64)  # the next rung of the ladder (48, 64, 128, 256)
    again = AdaptiveSchedule(start_state(const(64), 128, 256, 16, 3), 0.9, RULE)
    again.restore(adaptive.state())
    assert again.schedule() == adaptive.schedule()
