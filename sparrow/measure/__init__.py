"""Measurement: how far sparse rollouts drift from the dense policy (exact acceptance of finished rollouts)."""

from .acceptance import lockstep_acceptance, piece_acceptance, teacher_forced_acceptance

__all__ = ["lockstep_acceptance", "piece_acceptance", "teacher_forced_acceptance"]
