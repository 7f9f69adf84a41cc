"""`sparrow train`: GRPO with truncated importance sampling on sparse rollouts (see sparrow/rl/trainer.py)."""

from __future__ import annotations

from sparrow.rl.trainer import TrainConfig, train

from .config import add_config_options, load_config

HELP = {
    "model": "smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, a .gguf file or a local Hugging Face directory",
    "data": "prompt set: .jsonl or .parquet (verl layout detected)",
    "reward": "reward function: math, first_number, code, or module:function / file.py:function",
    "reward_weights": "weight of each --reward, in order",
    "schedule": "rollout KV budget schedule (dense for the dense-rollout baseline)",
    "num_generations": "rollouts per prompt (the GRPO group)",
    "tis_mode": "truncated importance sampling: truncate, mask or off",
    "tis_cap": "C in min(pi_old / pi_rollout, C)",
    "output_dir": "where metrics.jsonl and checkpoints go",
    "resume": "continue from the newest checkpoint in --output-dir",
    "num_logprobs": "top-K log-probs kept per rollout token; they bound the acceptance rate (more: tighter bounds)",
    "tau": "tail-acceptance threshold: a length bin whose 5th percentile falls below it is warned about",
    "bin_size": "length bin, in cached tokens, of the acceptance statistics",
    "distill": "DistillSparse: a LoRA adapter active only in the sparse actor, trained toward the dense policy",
    "distill_kl": "k3 (sampled-token estimate of KL(sparse||dense)), forward (exact KL(dense||sparse)) or reverse",
    "distill_targets": "all-linear or comma-separated module names for the adapter",
    "switch_schedule": "a more aggressive schedule rollouts switch to once probes show its tail acceptance >= tau",
    "probe_data": "prompts for the switch probes (default: the last probe_prompts rows of --data, held out)",
}


def run(args) -> int:
    train(load_config(TrainConfig, args))
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("train", help="GRPO + TIS training on sparse rollouts (optionally DistillSparse)")
    add_config_options(parser, TrainConfig, HELP)
    parser.set_defaults(run=run)
