"""Sparrow: sparse-attention rollouts for stable, efficient RL of language models."""

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import sparse_forward
from sparrow.engine import Completion, RolloutEngine, SamplingParams
from sparrow.errors import SparrowError
from sparrow.models import load_model
from sparrow.schedules import DENSE, Schedule, parse_schedule

__all__ = [
    "DENSE",
    "Completion",
    "RolloutEngine",
    "SamplingParams",
    "Schedule",
    "SparrowError",
    "SparseConfig",
    "load_model",
    "parse_schedule",
    "sparse_forward",
]
