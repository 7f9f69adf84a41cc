"""Math reward: the last ``\\boxed{...}`` of a completion checked against the ground truth with math-verify.

math-verify compares answers symbolically (``\\frac{1}{2}`` equals ``0.5``, ``\\{1,2\\}`` equals ``\\{2,1\\}``),
which is what the paper's math run scores with. Its timeouts use ``signal.alarm``, which only works in the main
thread, so off the main thread they are switched off (math-verify's own parameters) instead of failing.
"""

from __future__ import annotations

import functools
import re
import threading

from math_verify import parse, verify

from sparrow.errors import SparrowError

_BOXED = re.compile(r"\\boxed\s*\{")
_TIMEOUT_S = 5


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested, escaped braces handled); None if absent/unclosed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _timeout() -> int | None:
    """math-verify's signal-based timeout where it can work (main thread), else None (disabled)."""
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> tuple:
    """Parsed ground truth, cached because each prompt's answer is scored once per rollout in its group."""
    text = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    parsed = parse(text, parsing_timeout=timeout)
    if not parsed:
        raise SparrowError(
            f"ground-truth answer {gold!r} could not be parsed by math-verify; expected a number or a LaTeX expression"
        )
    return tuple(parsed)


def _gold_text(answer) -> str:
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
        raise SparrowError(f"ground-truth answer {answer!r} is not usable; expected a non-empty string or number")
    return str(answer).strip()


def math_score(completion: str, answer) -> float:
    """1.0 if the completion's last boxed answer equals ``answer`` per math-verify, else 0.0."""
    if not isinstance(completion, str):
        raise SparrowError(f"completion is a {type(completion).__name__}; expected a str")
    timeout = _timeout()
    gold = _parse_gold(_gold_text(answer), timeout)
    content = last_boxed(completion)
    if content is None or not content.strip():
        return 0.0
    predicted = parse("\\boxed{" + content + "}", parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(list(gold), predicted, timeout_seconds=timeout) else 0.0


def math_reward(prompts, completions, answer, **_) -> list[float]:
    """Reward function (TRL-style): ``math_score`` of each completion against the aligned ``answer`` column."""
    if len(answer) != len(completions):
        raise SparrowError(
            f"math_reward got {len(completions)} completions but {len(answer)} answers; expected equal lengths"
        )
    return [math_score(completion, gold) for completion, gold in zip(completions, answer, strict=True)]
