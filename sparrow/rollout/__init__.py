"""Rollout backends: the `RolloutBackend` protocol and its implementations (see backend.py)."""

from .backend import Prompt, RolloutBackend
from .native import NativeBackend
from .prompts import as_chat, encode_prompt

__all__ = ["NativeBackend", "Prompt", "RolloutBackend", "as_chat", "encode_prompt"]
