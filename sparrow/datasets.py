"""Prompt datasets for RL training: loading JSONL / Parquet rows, deterministic batch sampling, held-out splits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparrow.errors import SparrowError
from sparrow.io import read_jsonl, require_file
from sparrow.typed_config import check_int

_EXTENSIONS = (".jsonl", ".json", ".parquet")
_MAX_REPORTED = 10
_MISSING = object()
_VERL_ANSWER = "reward_model.ground_truth"


@dataclass(frozen=True)
class Example:
    """One training prompt: `index` is its row position in the file (from 0), `answer` the ground truth
    (any JSON value, None when the file has none) and `columns` every other top-level field of the row, which
    the trainer passes to reward functions as keyword arguments (TRL-style)."""

    index: int
    prompt: str | list[dict]
    answer: object
    columns: dict


@dataclass(frozen=True)
class DataSpec:
    """Where the prompts are and which fields hold the prompt and the answer (dotted paths reach into nested
    fields, e.g. "reward_model.ground_truth")."""

    path: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"


def _check_spec(spec: DataSpec) -> Path:
    """The data file's path, after refusing bad field names and a file that is missing, empty or of an unknown
    kind."""
    for name in ("prompt_field", "answer_field"):
        value = getattr(spec, name)
        if not isinstance(value, str) or not value:
            raise SparrowError(f"{name} must be a non-empty field name, got {value!r}")
    if spec.prompt_field == spec.answer_field:
        raise SparrowError(
            f"prompt_field and answer_field are both {spec.prompt_field!r}; expected two different fields"
        )
    path = Path(spec.path)
    suffix = path.suffix.lower()
    if suffix not in _EXTENSIONS:
        raise SparrowError(
            f"data file {str(path)!r} has extension {suffix or '(none)'!r}; expected one of {', '.join(_EXTENSIONS)}"
        )
    require_file(path, "data file")
    if path.stat().st_size == 0:
        raise SparrowError(f"data file {str(path)!r} is empty; expected at least one row")
    return path


def load_examples(spec: DataSpec) -> list[Example]:
    """Read a `.jsonl` / `.json` (one JSON object per line) or `.parquet` file into examples.

    A field name is looked up as a top-level key first, then as a dotted path into nested objects. verl's
    Parquet layout works with the defaults: when `answer_field` is "answer", no row has an "answer" field and
    some row has `reward_model.ground_truth`, that path is used as the answer. The answer may be missing only if
    it is missing in every row (a prompt-only file, answers are then None); a row without it in a file whose
    other rows have it is an error. Bad rows (missing or malformed prompt, missing answer) are reported together,
    up to 10 in one SparrowError, by line number for JSONL and by row number (from 0) for Parquet.
    """
    path = _check_spec(spec)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows, unit = list(enumerate(_read_parquet(path))), "row"
    else:
        rows, unit = read_jsonl(path), "line"

    if not _any_has(rows, spec.prompt_field):
        raise SparrowError(
            f"{path}: no row has the prompt field {spec.prompt_field!r}; the first row's fields are "
            f"{sorted(rows[0][1])}; expected prompt_field (--prompt-field) to name one of them"
        )
    answer_field = spec.answer_field
    if answer_field == "answer" and not _any_has(rows, "answer") and _any_has(rows, _VERL_ANSWER):
        answer_field = _VERL_ANSWER
    answers_present = _any_has(rows, answer_field)
    examples, problems = [], []
    for index, (number, row) in enumerate(rows):
        prompt = _lookup(row, spec.prompt_field)
        answer = _lookup(row, answer_field)
        problem = _prompt_problem(prompt, spec.prompt_field)
        if problem is None and answers_present and answer is _MISSING:
            problem = f"missing answer field {answer_field!r} (other rows have it)"
        if problem is not None:
            problems.append((number, problem))
            continue
        columns = {key: value for key, value in row.items() if key not in (spec.prompt_field, answer_field)}
        examples.append(Example(index, prompt, None if answer is _MISSING else answer, columns))
    if len(problems) == 1:  # one line, as the other files' errors: FILE:LINE: problem
        number, problem = problems[0]
        raise SparrowError(f"{path}:{number}: {problem}" if unit == "line"
                           else f"{path}: row {number} (counted from 0): {problem}")
    if problems:
        shown = "\n  ".join(f"{unit} {number}: {problem}" for number, problem in problems[:_MAX_REPORTED])
        more = f"\n  ... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        counted = " (rows counted from 0)" if unit == "row" else ""
        raise SparrowError(f"{path}: {len(problems)} bad {unit}(s){counted}:\n  {shown}{more}")
    return examples


def _read_parquet(path: Path) -> list[dict]:
    """Rows of a Parquet file as Python dicts (nested structs and lists become dicts and lists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise SparrowError(f"data file {str(path)!r} is not a readable Parquet file ({err})") from None
    if not rows:
        raise SparrowError(f"data file {str(path)!r} holds no rows")
    return rows


def _lookup(row: dict, field: str):
    """The value at `field`: a top-level key, else a dotted path through nested dicts; _MISSING if absent."""
    if field in row:
        return row[field]
    value = row
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _any_has(rows: list[tuple[int, dict]], field: str) -> bool:
    return any(_lookup(row, field) is not _MISSING for _, row in rows)


def _prompt_problem(prompt, field: str) -> str | None:
    """Why `prompt` is unusable (None if it is a non-empty string or non-empty list of {role, content} messages)."""
    if prompt is _MISSING:
        return f"missing prompt field {field!r}"
    if isinstance(prompt, str):
        if not prompt.strip():
            return f"prompt {prompt!r} is empty; expected text or chat messages"
        return None if (bad := text_problem(prompt)) is None else f"prompt {bad}"
    if isinstance(prompt, list):
        if not prompt:
            return "prompt is an empty list; expected at least one chat message"
        for position, message in enumerate(prompt):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                expected = "expected a dict with a string 'role' and 'content'"
                return f"prompt message {position} is {_short(message)}; {expected}"
            if not isinstance(message.get("content"), str):
                return f"prompt message {position} has content {_short(message.get('content'))}; expected a string"
            for key in ("role", "content"):
                if (bad := text_problem(message[key])) is not None:
                    return f"prompt message {position}'s {key} {bad}"
        return None
    return f"prompt is {_short(prompt)}; expected a non-empty string or a list of {{role, content}} messages"


def text_problem(text: str) -> str | None:
    """Why `text` is not Unicode text a tokenizer can take (a lone surrogate: JSON's "\\ud800" unpaired, or bytes
    in a command-line argument that are not UTF-8), as words to follow a name; None if it is fine."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"holds a lone surrogate {text[err.start]!r} at character {err.start}; expected Unicode text "
                "(surrogates \\ud800-\\udfff only in pairs; command-line text in UTF-8)")
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class PromptSampler:
    """Which examples each training step uses, as a pure function of (seed, step).

    The examples are walked epoch after epoch, each epoch in its own order, a permutation drawn from
    `numpy.random.default_rng([seed, epoch])`. Step `s` takes positions `s * batch_size` up to
    `(s + 1) * batch_size` of that endless walk, so a batch may finish one epoch and start the next, and a
    resumed run at step k gets the same batches as an uninterrupted one without saving any state.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        self.num_examples = check_int("num_examples", num_examples, 1)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self._orders: dict[int, np.ndarray] = {}

    def batch(self, step: int) -> list[int]:
        """Example indices (positions in the list the sampler was built for) for training step `step` (from 0)."""
        step = check_int("step", step, 0)
        start = step * self.batch_size
        indices = []
        for position in range(start, start + self.batch_size):
            epoch, offset = divmod(position, self.num_examples)
            indices.append(int(self._order(epoch)[offset]))
        return indices

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's example order; the last few are cached since consecutive steps reuse them."""
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            if len(self._orders) >= 4:
                del self._orders[next(iter(self._orders))]
            self._orders[epoch] = order
        return order


def read_prompts(path: str) -> list:
    """Prompts from a JSONL file: each line an object with a 'prompt' that is text or a list of chat messages,
    checked as training data is (`_prompt_problem`)."""
    prompts = []
    for number, row in read_jsonl(path):
        prompt = row.get("prompt", _MISSING)
        problem = _prompt_problem(prompt, "prompt")
        if problem is not None:
            raise SparrowError(f"{path}:{number}: {problem}")
        prompts.append(prompt)
    return prompts
