"""Measurement: how far sparse rollouts drift from the dense policy, and what they cost.

batch (finished rollouts as padded tensors, split into pieces that share a prompt, and their forwards),
divergence (exact acceptance rate from full logits; pure), bounds (acceptance bounds from top-K log-probs;
pure), checks (their shared input checks), acceptance (exact acceptance of finished rollouts), tail (tail
statistics per length bin: p1 / p5 / p50, p5 intervals and verdicts; pure), retention (reward retention of
paired samples; pure), profiling (per-schedule profiles), calibration (cheapest schedule holding tau; pure)
and cost_model (predicted cost of dense vs sparse rollouts; pure).
"""

from .acceptance import lockstep_acceptance, piece_acceptance, teacher_forced_acceptance

__all__ = ["lockstep_acceptance", "piece_acceptance", "teacher_forced_acceptance"]
