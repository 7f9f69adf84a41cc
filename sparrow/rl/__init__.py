"""GRPO training on sparse rollouts: the config (config.py), one step in phases (step.py) and its metrics
(step_metrics.py), the losses and estimators (losses.py, pure), DistillSparse (distill.py) and its switch probes
(probes.py), the loop (trainer.py), checkpoints and run directories, and the report. The schedule controllers the
loop asks each step (fixed, adaptive, the switch) are sparrow.schedules'."""
