"""Measurement: how far sparse rollouts drift from the dense policy, and what they cost.

metrics (acceptance, bounds, divergences, tail statistics; pure), acceptance (exact acceptance of finished
rollouts), tail (p5 intervals per bin), profiling (per-schedule profiles), calibration (cheapest schedule
holding tau; pure), cost_model (predicted cost of dense vs sparse rollouts; pure) and model_shapes (the
shapes it prices, by model name or config.json).
"""

from .acceptance import lockstep_acceptance, piece_acceptance, teacher_forced_acceptance

__all__ = ["lockstep_acceptance", "piece_acceptance", "teacher_forced_acceptance"]
