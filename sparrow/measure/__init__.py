"""Measurement: how far sparse rollouts drift from the dense policy, and what they cost.

batch (finished rollouts as padded tensors, split into pieces that share a prompt, and their forwards),
bounds (acceptance bounds from top-K log-probs; pure), acceptance (exact acceptance of finished rollouts),
retention (reward retention of paired samples; pure), profiling (per-schedule profiles), calibration (cheapest
schedule holding tau; pure) and cost_model (predicted cost of dense vs sparse rollouts; pure). The exact
acceptance rate, its input checks and the tail statistics per length bin are sparrow.metrics' (pure math below
the engine and the schedules).
"""

from .acceptance import lockstep_acceptance, piece_acceptance, teacher_forced_acceptance

__all__ = ["lockstep_acceptance", "piece_acceptance", "teacher_forced_acceptance"]
