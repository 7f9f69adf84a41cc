"""Rollout generation: sampling settings, completions, and the engine."""

from .engine import RolloutEngine
from .sampling import SamplingParams
from .sequence import Completion

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]
