"""`sparrow train`: GRPO with truncated importance sampling on sparse rollouts (see sparrow/rl/trainer.py)."""

from __future__ import annotations

from sparrow.rl.config import TrainConfig
from sparrow.rl.trainer import train

from .common import ROLLOUT_HELP
from .config import add_config_options, load_config

HELP = {
    **ROLLOUT_HELP,
    "model": "smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, a .gguf file or a local Hugging Face directory",
    "data": "prompt set: .jsonl or .parquet (verl layout detected)",
    "reward": "reward function: math, first_number, number_f1, code, or module:function / file.py:function",
    "reward_weights": "weight of each --reward, in order",
    "schedule": "rollout KV budget schedule (dense for the dense-rollout baseline; adaptive: moved per length bin "
                "during training to hold tau)",
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
    "advantage_estimator": "grpo ((r - mean) / std per group), dr_grpo (r - mean) or rloo (leave-one-out mean)",
    "advantage_std": "group std of grpo: sample (Bessel, as verl, TRL and the release) or population",
    "policy_loss": "policy loss by name: ppo_clip (clipped PPO with dual clip, TIS-weighted)",
    "non_finite": "a mini-batch whose loss or gradient is not finite: skip its update (and say so) or stop the run",
    "monitor": "acceptance monitor: exact (teacher-forced sparse vs dense, full distributions) or bounds (top-K)",
    "monitor_every": "exact monitoring every N-th step",
    "micro_batch_size": "rows per forward and backward of the update (gradients accumulated)",
    "log_prob_micro_batch_size": "rows per forward without gradients (recompute, monitor, KL reference; default "
                                 "--micro-batch-size): a whole group computes its prompt once",
    "monitor_share": "share of each step's prompt groups measured exactly (0 < share <= 1)",
    "max_batch_size": "most sequences decoded together by a rollout engine",
    "allow_changes": "with --resume: accept a changed config for the options where continuing makes sense",
    "unsafe_code_reward": "let the code reward run without a sandbox where none is available (dangerous)",
    "learning_rate": "AdamW learning rate of the policy, in (0, 1]",
    "adaptive_start": "with --schedule adaptive: the schedule its budgets start from",
    "adaptive_margin": "with --schedule adaptive: a bin moves down only when the cheaper rung's p5 interval clears "
                       "tau + margin",
    "adaptive_patience": "with --schedule adaptive: consecutive steps of evidence before a bin moves (up at once when "
                         "certainly below tau)",
    "adaptive_min_tokens": "with --schedule adaptive: measured tokens a bin needs in a step to be decided on",
    "wire_dtype": "dtype of the weights sent to Ray workers (bfloat16 halves the bytes; workers compute in --dtype)",
}


def run(args) -> int:
    train(load_config(TrainConfig, args))
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("train", help="GRPO + TIS training on sparse rollouts (optionally DistillSparse)")
    add_config_options(parser, TrainConfig, HELP)
    parser.set_defaults(run=run)
