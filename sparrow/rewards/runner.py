"""Apply weighted reward functions to a batch and check what they return."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from sparrow.errors import SparrowError

_PREFIX_CHARS = 80


class RewardError(SparrowError):
    """A reward function raised: names the function, the failing sample's index, its completion and the cause."""

    def __init__(self, function: str, index: int | None, completion, cause: BaseException):
        self.function = function
        self.index = index
        self.cause = cause
        self.completion_prefix = str(completion)[:_PREFIX_CHARS] if index is not None else None
        cause_text = f"{type(cause).__name__}: {cause}"
        if index is None:
            where = "on the batch, though every sample succeeded alone"
        else:
            where = f"on sample {index} (completion starts {self.completion_prefix!r})"
        super().__init__(f"reward function {function!r} raised {where}: {cause_text}")


@dataclass(frozen=True)
class ScoreResult:
    """``totals[i]`` = sum over functions of weight * value; ``per_function[name]`` keeps the unweighted values;
    ``records[name]`` lists, per sample, what a function that returns detailed results (objects with
    ``reward`` and ``status``, like CodeResult) reported: ``{"status", "detail"}``."""

    totals: list[float]
    per_function: dict[str, list[float]]
    weights: dict[str, float]
    records: dict[str, list[dict]]


def _check_values(name: str, values, n: int) -> list[float]:
    if not isinstance(values, (list, tuple)):
        raise SparrowError(
            f"reward function {name!r} returned a {type(values).__name__}; expected a list of {n} floats"
        )
    if len(values) != n:
        raise SparrowError(f"reward function {name!r} returned {len(values)} values for {n} completions; expected {n}")
    out = []
    for i, value in enumerate(values):
        value = getattr(value, "reward", value)  # detailed results (e.g. CodeResult) carry their reward
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise SparrowError(f"reward function {name!r} returned {value!r} for sample {i}; expected a finite float")
        out.append(float(value))
    return out


def _locate_failure(name: str, fn, prompts, completions, columns, batch_error: Exception) -> RewardError:
    """Re-run ``fn`` one sample at a time to find the sample behind a failed batch call."""
    for i in range(len(completions)):
        try:
            fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in columns.items()})
        except Exception as exc:
            return RewardError(name, i, completions[i], exc)
    return RewardError(name, None, None, batch_error)


def score(reward_fns, prompts, completions, columns: dict | None = None) -> ScoreResult:
    """Score a batch with ``[(name, fn, weight), ...]``, each called as ``fn(prompts, completions, **columns)``."""
    columns = dict(columns or {})
    n = len(completions)
    if len(prompts) != n:
        raise SparrowError(f"got {len(prompts)} prompts and {n} completions; expected one prompt per completion")
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise SparrowError(f"column name {key!r} clashes with a reward function argument; expected another name")
        if not isinstance(values, (list, tuple)) or len(values) != n:
            size = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise SparrowError(f"column {key!r} has {size} values; expected a list of {n}, one per completion")
    seen = set()
    for entry in reward_fns:
        if not (isinstance(entry, tuple) and len(entry) == 3):
            raise SparrowError(f"reward entry {entry!r:.80}; expected a (name, function, weight) tuple")
        name, fn, weight = entry
        if not isinstance(name, str) or name in seen:
            raise SparrowError(f"reward name {name!r} is not a unique str; expected distinct names")
        seen.add(name)
        if not callable(fn):
            raise SparrowError(f"reward {name!r} is a {type(fn).__name__}; expected a callable")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(float(weight)):
            raise SparrowError(f"reward {name!r} has weight {weight!r}; expected a finite number")
    prompts, completions = list(prompts), list(completions)
    columns = {k: list(v) for k, v in columns.items()}
    totals = [0.0] * n
    per_function, weights, records = {}, {}, {}
    for name, fn, weight in reward_fns:
        try:
            raw = fn(prompts, completions, **columns)
        except Exception as exc:
            raise _locate_failure(name, fn, prompts, completions, columns, exc) from exc
        values = _check_values(name, raw, n)
        if all(hasattr(v, "status") for v in raw):
            records[name] = [{"status": v.status, "detail": str(getattr(v, "stderr_tail", ""))[-200:]} for v in raw]
        per_function[name] = values
        weights[name] = float(weight)
        totals = [t + float(weight) * v for t, v in zip(totals, values, strict=True)]
    return ScoreResult(totals, per_function, weights, records)
