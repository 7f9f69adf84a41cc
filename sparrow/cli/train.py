"""`sparrow train`: GRPO with truncated importance sampling on sparse rollouts (see sparrow/rl/trainer.py)."""

from __future__ import annotations

from sparrow.rl.config import TrainConfig
from sparrow.rl.trainer import train

from .config import add_config_options, load_config


def run(args) -> int:
    train(load_config(TrainConfig, args))
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("train", help="GRPO + TIS training on sparse rollouts (optionally DistillSparse)")
    add_config_options(parser, TrainConfig)
    parser.set_defaults(run=run)
