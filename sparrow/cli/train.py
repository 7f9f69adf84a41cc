"""`sparrow train`: GRPO with truncated importance sampling on sparse rollouts (see sparrow/rl/trainer.py)."""

from __future__ import annotations

from sparrow.rl.trainer import TrainConfig, train

from .config import add_config_options, load_config

HELP = {
    "model": "smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, a .gguf file or a local Hugging Face directory",
    "data": "prompt set: .jsonl or .parquet (verl layout detected)",
    "reward": "reward function: math, code, or module:function / file.py:function",
    "reward_weights": "weight of each --reward, in order",
    "schedule": "rollout KV budget schedule (dense for the dense-rollout baseline)",
    "num_generations": "rollouts per prompt (the GRPO group)",
    "tis_mode": "truncated importance sampling: truncate, mask or off",
    "tis_cap": "C in min(pi_old / pi_rollout, C)",
    "output_dir": "where metrics.jsonl and checkpoints go",
    "resume": "continue from the newest checkpoint in --output-dir",
}


def run(args) -> int:
    train(load_config(TrainConfig, args))
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("train", help="GRPO + TIS training on sparse rollouts (work in progress)")
    add_config_options(parser, TrainConfig, HELP)
    parser.set_defaults(run=run)
