"""The one way completions of data rows are scored, in training, held-out evaluation and `sparrow eval`."""

from __future__ import annotations

from sparrow.rewards.runner import ScoreResult, score


def example_columns(examples, completions) -> dict[str, list]:
    """The keyword columns of each completion's row: `answer` and every other field of the row (TRL-style)."""
    rows = [examples[c.prompt_index] for c in completions]
    columns = {"answer": [ex.answer for ex in rows]}
    for key in sorted({k for ex in rows for k in ex.columns}):
        columns.setdefault(key, [ex.columns.get(key) for ex in rows])
    return columns


def score_examples(reward_fns, examples, completions) -> ScoreResult:
    """Score `completions` (whose `prompt_index` points into `examples`) with `[(name, fn, weight), ...]`."""
    prompts = [examples[c.prompt_index].prompt for c in completions]
    return score(reward_fns, prompts, [c.text for c in completions], example_columns(examples, completions))
