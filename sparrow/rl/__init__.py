"""GRPO training on sparse rollouts: the config (config.py), one step in phases (step.py) and its metrics
(step_metrics.py), the losses and estimators (losses.py, pure), the adaptive schedule (adaptive.py),
DistillSparse (distill.py), the loop (trainer.py), checkpoints and run directories, and the report."""
