"""The one way completions of data rows are scored, in training, held-out evaluation and `sparrow eval`."""

from __future__ import annotations

from sparrow.errors import SparrowError
from sparrow.rewards.runner import ScoreResult, score

STAND_INS = ("1", "The answer is 2.")  # the completions `check_reward_functions` scores before any rollout


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


def check_reward_functions(reward_fns, examples) -> None:
    """Score two stand-in completions of the first example once, so that a reward function that raises, returns
    the wrong number of values or a non-finite one is refused before the model loads, not after the rollouts."""
    from sparrow.engine import Completion

    try:
        score_examples(reward_fns, examples, [Completion(0, i, [], text=text) for i, text in enumerate(STAND_INS)])
    except SparrowError as err:
        raise SparrowError(f"{err} (checked before the first rollout on the stand-in completions {STAND_INS!r} "
                           "of the first example)") from None
