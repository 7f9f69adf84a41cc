"""Rollout backends: the `RolloutBackend` protocol (backend.py) and its implementations (native, Ray, vLLM), chosen
by factory.py from a `ModelSpec` (model_spec.py)."""

from .backend import RolloutBackend
from .native import NativeBackend

__all__ = ["NativeBackend", "RolloutBackend"]
