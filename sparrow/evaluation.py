"""mean@k and unbiased pass@k of sampled completions, dense or sparse, scored by the training rewards."""

from __future__ import annotations

import math

from sparrow.datasets import Example
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.measure.retention import mean_interval, too_few_prompts
from sparrow.rewards.custom import REWARDS
from sparrow.rewards.scoring import score_examples
from sparrow.schedules import Schedule


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` passed: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise SparrowError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def reward_range(reward_fns: list) -> tuple[float, float] | None:
    """The range of the total reward of `[(name, fn, weight), ...]` when every reward is built in (each lies in
    [0, 1]: a share of tests, of numbers, or right / wrong); None when any is user-defined (its range is unknown)."""
    if not all(name in REWARDS for name, _, _ in reward_fns):
        return None
    return (sum(min(0.0, w) for _, _, w in reward_fns), sum(max(0.0, w) for _, _, w in reward_fns))


def interval_text(result: dict) -> str:
    """'95% interval 0.120..0.600' of an `evaluate` result's mean over prompts, or why it has none."""
    if not math.isfinite(result["mean_low"]):
        return too_few_prompts(result["examples"])
    return f"95% interval {result['mean_low']:.3f}..{result['mean_high']:.3f}"


def evaluate(backend, examples: list[Example], reward_fns: list, schedule: Schedule, sampling: SamplingParams, k: int,
             threshold: float = 1.0, progress: bool = False, adapter: bool = True,
             draft_tokens: int | None = None) -> dict:
    """Sample k completions per example from `backend` (a RolloutBackend; `adapter=False` samples the policy
    without its DistillSparse adapter) and score them as training does (every column of the row reaches the
    rewards); a completion passes when its total reward reaches `threshold`. Also each prompt's mean reward and
    length, and the 95% interval of mean@k over prompts (`mean_low`, `mean_high`; prompts are the independent
    units; NaN for too few prompts), cut to the total reward's range when known (`reward_range`). `draft_tokens`:
    exact mode (the schedule drafts, the dense policy decides)."""
    completions = backend.generate([ex.prompt for ex in examples], sampling, schedule, k, adapter=adapter,
                                   progress=progress, draft_tokens=draft_tokens)
    totals = score_examples(reward_fns, examples, completions).totals
    per_example = [totals[i * k:(i + 1) * k] for i in range(len(examples))]
    passed = [sum(r >= threshold for r in rewards) for rewards in per_example]
    means = [sum(rewards) / k for rewards in per_example]
    bounds = reward_range(reward_fns)
    low, high = mean_interval(means, bounds=bounds)
    ks = sorted({1, k} | {j for j in (2, 4, 8, 16, 32) if j < k})
    return {
        "examples": len(examples),
        "samples_per_example": k,
        f"mean@{k}": sum(totals) / len(totals),
        "mean_low": low,
        "mean_high": high,
        "reward_range": None if bounds is None else list(bounds),
        "per_example_mean": means,
        "prompt_length": [len(completions[i * k].prompt_token_ids) for i in range(len(examples))],
        **{f"pass@{j}": sum(pass_at_k(k, c, j) for c in passed) / len(passed) for j in ks},
        "mean_length": sum(len(c.token_ids) for c in completions) / len(completions),
    }
