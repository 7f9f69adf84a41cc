"""Rollout generation: sampling settings, completions, and the engine."""

from .engine import RolloutEngine
from .prompts import Prompt, as_chat, content_keys, encode_prompt
from .sampling import SamplingParams
from .sequence import Completion

__all__ = ["Completion", "Prompt", "RolloutEngine", "SamplingParams", "as_chat", "content_keys", "encode_prompt"]
