"""Exact-answer reward for short factual answers: the first number in the completion must equal the answer.

Only the *first* number counts, so a completion cannot earn the reward by listing many candidates; prose
around the number ("The pass key is 73154.") is fine. This scores the built-in `passkey` task.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> str | None:
    """The first number in `text` (thousands separators removed), or None."""
    match = _NUMBER.search(text.replace(",", ""))
    return match.group(0) if match else None


def first_number_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the completion's first number equals the ground truth (compared as numbers), else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        found = first_number(completion)
        scores.append(float(found is not None and float(found) == float(str(gold).replace(",", ""))))
    return scores
