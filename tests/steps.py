"""One GRPO step and its metrics, as the trainer runs them (`run_step`, then `step_metrics`)."""

from sparrow.rl.config import StepConfig
from sparrow.rl.step import Policy, run_step
from sparrow.rl.step_metrics import step_metrics
from sparrow.schedules import Schedule


def grpo_step(policy: Policy, backend, examples: list, reward_fns: list, schedule: Schedule, cfg: StepConfig,
              seed: int, number: int = 0) -> dict:
    return step_metrics(run_step(policy, backend, examples, reward_fns, schedule, cfg, seed, number), cfg)
