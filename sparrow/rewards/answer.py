"""Rewards that compare numbers in a completion with the answer.

`first_number`: the first number in the completion must equal the answer. Only the *first* number counts, so a
completion cannot earn the reward by listing many candidates; prose around the number ("The pass key is
73154.") is fine. It scores the built-in `passkey` task.

`number_f1`: the F1 of the set of numbers in the completion against the answer's list of numbers: partial
credit for a partly right list, and listing extra numbers costs precision. Only numbers as long as the answer's
count (list indices such as "1." in "1. 60494" are not candidates). It scores the `manifest` task.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> str | None:
    """The first number in `text` (thousands separators removed), or None."""
    match = _NUMBER.search(text.replace(",", ""))
    return match.group(0) if match else None


def number_f1(text: str, gold: list) -> float:
    """F1 of the distinct numbers in `text` with as many digits as some number of `gold` against `gold`'s distinct
    numbers (0 when either is empty)."""
    truth = {str(g) for g in gold}
    found = {n for n in _NUMBER.findall(text.replace(",", "")) if len(n) in {len(t) for t in truth}}
    hits = len(found & truth)
    if not hits:
        return 0.0
    precision, recall = hits / len(found), hits / len(truth)
    return 2 * precision * recall / (precision + recall)


def number_f1_reward(prompts, completions, answer, **_) -> list[float]:
    """`number_f1` of each completion against its row's answer (a list of numbers)."""
    return [number_f1(c, gold if isinstance(gold, list) else [gold]) for c, gold in zip(completions, answer,
                                                                                        strict=True)]


def first_number_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the completion's first number equals the ground truth (compared as numbers), else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        found = first_number(completion)
        scores.append(float(found is not None and float(found) == float(str(gold).replace(",", ""))))
    return scores
