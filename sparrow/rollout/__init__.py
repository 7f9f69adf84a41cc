"""Rollout backends: the `RolloutBackend` protocol and its implementations (see backend.py)."""

from .backend import RolloutBackend
from .native import NativeBackend

__all__ = ["NativeBackend", "RolloutBackend"]
