"""Rollout backends: the `RolloutBackend` protocol and its implementations (see backend.py)."""

from .backend import Prompt, RolloutBackend
from .native import NativeBackend

__all__ = ["NativeBackend", "Prompt", "RolloutBackend"]
