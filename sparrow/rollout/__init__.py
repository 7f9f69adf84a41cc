"""Rollout backends: the `RolloutBackend` protocol and its implementations (see backend.py)."""

from .backend import Prompt, RolloutBackend
from .native import NativeBackend
from .prompts import encode_prompt

__all__ = ["NativeBackend", "Prompt", "RolloutBackend", "encode_prompt"]
