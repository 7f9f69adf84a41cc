"""Reward functions for RL: math (math-verify in a worker pool with a hard timeout), first number and number F1
(answers of numbers), code (tests judged outside a bubblewrap sandbox), custom, and scoring."""

from sparrow.rewards.answer import first_number_reward
from sparrow.rewards.code import CodeResult, code_results, code_reward, extract_program, run_code
from sparrow.rewards.custom import REWARDS, load_reward
from sparrow.rewards.math import last_boxed, math_reward, math_score
from sparrow.rewards.runner import RewardError, ScoreResult, score

__all__ = [
    "REWARDS",
    "CodeResult",
    "RewardError",
    "ScoreResult",
    "code_results",
    "code_reward",
    "extract_program",
    "first_number_reward",
    "last_boxed",
    "load_reward",
    "math_reward",
    "math_score",
    "run_code",
    "score",
]
