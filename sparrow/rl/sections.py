"""The sections of the `sparrow train` config that are train's own (GRPO, the monitor, the adaptive schedule,
evaluation, the run) and train's versions of the shared ones (sparse, sampling, rollout): each with its options,
defaults, help and validation. config.py composes them into `TrainConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.io import check_output, require_file
from sparrow.options import SCHEDULE_HELP, RolloutSection, SamplingSection, ScheduledSparseSection, SparseSection
from sparrow.schedules.adaptive import ADAPTIVE, FALLBACKS
from sparrow.typed_config import check_finite, check_int, option

from .losses import ADVANTAGE_ESTIMATORS, GROUP_STDS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, TIS_MODES

MONITORS = ("exact", "bounds")
NON_FINITE_ACTIONS = ("skip", "stop")


def _check_choice(name: str, value, known) -> None:
    if value not in known:
        raise SparrowError(f"unknown {name} {value!r}: expected one of {', '.join(known)}")


@dataclass
class TrainSparseSection(ScheduledSparseSection):
    schedule: str = option("dense", "rollout KV budget schedule (dense for the dense-rollout baseline; adaptive: "
                           "moved per length bin during training to hold tau); otherwise " + SCHEDULE_HELP)

    def validate(self) -> None:
        SparseSection.validate(self)  # the schedule may be `adaptive`: TrainConfig parses it
        self.check_mode()
        if self.schedule != ADAPTIVE:  # adaptive with --rollout-mode dense: TrainConfig says why
            self.check_dense_mode()

    def drafts(self, given: dict) -> bool:
        """Rollouts draft in exact mode, or in an adaptive schedule's exact fallback."""
        return self.exact or given.get("adaptive_fallback") == "exact"


@dataclass
class TrainSamplingSection(SamplingSection):
    num_logprobs: int = option(20, "top-K log-probs kept per rollout token; they bound the acceptance rate (more: "
                               "tighter bounds)")

    def validate(self) -> None:
        check_finite("temperature", self.temperature, 0, low_open=True)  # training needs a sampled policy
        super().validate()
        if self.num_logprobs == 0:
            raise SparrowError("num_logprobs must be >= 1 in training: the acceptance monitor bounds each rollout "
                               "token with its top-K log-probs; got 0")

    def params(self, seed: int, **extra) -> SamplingParams:
        return super().params(seed, num_logprobs=self.num_logprobs, **extra)


@dataclass
class TrainRolloutSection(RolloutSection):
    wire_dtype: str | None = option(None, "dtype of the weights sent to Ray workers (bfloat16 halves the bytes; "
                                    "workers compute in --dtype)")

    def validate(self, device: str, exact: bool = False, draft_tokens: int | None = None) -> None:
        super().validate(device, exact, draft_tokens)
        if self.wire_dtype is not None:
            _check_choice("wire_dtype", self.wire_dtype, ("float32", "bfloat16"))
            if not self.workers:
                raise SparrowError(f"wire_dtype {self.wire_dtype!r} is how weights travel to Ray rollout workers, "
                                   "and there are none: give --rollout-workers N as well, or drop --wire-dtype")


@dataclass
class GRPOSection:
    """Defaults follow the release (SPEC section 7)."""

    steps: int = option(2, "GRPO steps")
    prompts_per_step: int = option(2, "prompt groups per step")
    num_generations: int = option(8, "rollouts per prompt (the GRPO group)")
    learning_rate: float = option(1e-6, "AdamW learning rate of the policy, in (0, 1]")
    weight_decay: float = option(0.0, "AdamW weight decay of the policy")
    max_grad_norm: float = option(1.0, "gradient clipping norm")
    advantage_estimator: str = option("grpo", "grpo ((r - mean) / std per group), dr_grpo (r - mean) or rloo "
                                      "(leave-one-out mean)")
    advantage_std: str = option("sample", "group std of grpo: sample (Bessel, as verl, TRL and the release) or "
                                "population")
    policy_loss: str = option("ppo_clip", "policy loss by name: " + ", ".join(POLICY_LOSSES))
    clip_low: float = option(0.2, "PPO clip below 1 (ratio >= 1 - clip_low)")
    clip_high: float = option(0.28, "PPO clip above 1 (ratio <= 1 + clip_high)")
    dual_clip: float | None = option(3.0, "dual-clip constant c > 1 for negative advantages (null: off)")
    tis_mode: str = option("truncate", "truncated importance sampling: truncate, mask or off")
    tis_cap: float = option(2.0, "C in min(pi_old / pi_rollout, C)")
    loss_aggregation: str = option("token-mean", "how token losses are averaged: " + ", ".join(LOSS_AGGREGATIONS))
    mini_batches: int = option(1, "optimizer steps per GRPO step")
    micro_batch_size: int = option(4, "rows per forward and backward of the update (gradients accumulated)")
    gradient_checkpointing: bool = option(False, "recompute each decoder layer in backward instead of keeping its "
                                          "activations (policy and adapter updates): ~1.5 GB less per 1K prompt "
                                          "tokens on SmolLM2-135M, for a second forward in backward")
    log_prob_micro_batch_size: int | None = option(None, "rows per forward without gradients (recompute, monitor, "
                                                   "KL reference; default --micro-batch-size): a whole group "
                                                   "computes its prompt once")
    kl_coef: float = option(0.0, "weight of the KL penalty to the initial policy (0: no reference model)")
    kl_estimator: str = option("k3", "KL estimator: " + ", ".join(KL_ESTIMATORS))
    non_finite: str = option("skip", "a mini-batch whose loss or gradient is not finite: skip its update (and say "
                             "so) or stop the run")

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "mini_batches", "micro_batch_size"):
            check_int(name, getattr(self, name), 1)
        if self.log_prob_micro_batch_size is not None:
            check_int("log_prob_micro_batch_size", self.log_prob_micro_batch_size, 1)
        check_int("num_generations", self.num_generations, 2)  # one sample per group has zero advantage
        check_finite("learning_rate", self.learning_rate, 0, 1, low_open=True)
        check_finite("weight_decay", self.weight_decay, 0)
        check_finite("max_grad_norm", self.max_grad_norm, 0, low_open=True)
        check_finite("clip_low", self.clip_low, 0, 1, high_open=True)
        check_finite("clip_high", self.clip_high, 0)
        if self.dual_clip is not None:
            check_finite("dual_clip", self.dual_clip, 1, low_open=True)
        check_finite("tis_cap", self.tis_cap, 0, low_open=True)
        check_finite("kl_coef", self.kl_coef, 0)
        _check_choice("advantage_estimator", self.advantage_estimator, tuple(ADVANTAGE_ESTIMATORS))
        _check_choice("advantage_std", self.advantage_std, tuple(GROUP_STDS))
        _check_choice("policy_loss", self.policy_loss, tuple(POLICY_LOSSES))
        _check_choice("tis_mode", self.tis_mode, tuple(TIS_MODES))
        _check_choice("loss_aggregation", self.loss_aggregation, tuple(LOSS_AGGREGATIONS))
        _check_choice("kl_estimator", self.kl_estimator, tuple(KL_ESTIMATORS))
        _check_choice("non_finite", self.non_finite, NON_FINITE_ACTIONS)
        batch = self.prompts_per_step * self.num_generations
        if self.mini_batches > batch:
            raise SparrowError(f"mini_batches {self.mini_batches} exceeds the {batch} rollouts of a step "
                               f"(prompts_per_step x num_generations); expected at most {batch}")


@dataclass
class MonitorSection:
    """How the acceptance tail of the rollouts is watched. `exact`: every `monitor_every`-th step, a
    `monitor_share` of the rollouts (the first rows) is teacher-forced through the sparse actor and compared with the
    dense recompute's full distributions; `bounds`: top-K log-prob bounds only (no extra forward). The reward check:
    every `reward_check_every`-th step (0: never) of sparse rollouts, the first `reward_check_samples` samples of
    the first `reward_check_prompts` prompts are also drawn densely with the same seeds and scored, and a
    retention whose interval lies below `min_retention` is warned about."""

    tau: float = option(0.86, "tail-acceptance threshold: a length bin whose 5th percentile falls below it is warned "
                        "about")
    bin_size: int = option(2000, "length bin, in cached tokens, of the acceptance statistics")
    monitor: str = option("exact", "acceptance monitor: exact (teacher-forced sparse vs dense, full distributions) "
                          "or bounds (top-K)")
    monitor_every: int = option(1, "exact monitoring every N-th step")
    monitor_share: float = option(1.0, "share of each step's rollouts measured exactly, the first rows "
                                   "(0 < share <= 1)")
    reward_check_every: int = option(4, "every N-th step of sparse rollouts, also roll out densely a few samples "
                                     "with the same seeds and compare rewards (0: never)")
    reward_check_prompts: int = option(1, "prompts of a step in the reward check")
    reward_check_samples: int = option(4, "samples per prompt in the reward check")
    min_retention: float = option(0.9, "sparse/dense reward retention below which (its whole interval) the reward "
                                  "check warns")

    def validate(self) -> None:
        check_finite("tau", self.tau, 0, 1)
        check_int("bin_size", self.bin_size, 1)
        check_int("monitor_every", self.monitor_every, 1)
        _check_choice("monitor", self.monitor, MONITORS)
        check_finite("monitor_share", self.monitor_share, 0, 1, low_open=True)
        check_int("reward_check_every", self.reward_check_every, 0)
        check_int("reward_check_prompts", self.reward_check_prompts, 1)
        check_int("reward_check_samples", self.reward_check_samples, 1)
        check_finite("min_retention", self.min_retention, 0, low_open=True)


@dataclass
class AdaptiveSection:
    """`schedule: adaptive`: budgets per length bin (`bin_size`) move during training (sparrow/schedules/adaptive.py),
    from the `adaptive_start` schedule, to the cheapest rung whose exact p5 holds tau."""

    start: str = option("dense", "with --schedule adaptive: the schedule its budgets start from",
                        flag="adaptive_start")
    margin: float = option(0.02, "with --schedule adaptive: a bin moves down only when the cheaper rung's p5 "
                           "interval clears tau + margin", flag="adaptive_margin")
    patience: int = option(2, "with --schedule adaptive: consecutive monitored steps of evidence before a bin moves "
                           "down or a fallen bin leaves exact mode (a bin below tau moves up after one)",
                           flag="adaptive_patience")
    min_tokens: int = option(200, "with --schedule adaptive: measured tokens a bin needs in a step to be decided on",
                             flag="adaptive_min_tokens")
    fallback: str = option("budget", "with --schedule adaptive: what a bin whose p5 fell below tau gets at the next "
                           "step: budget (the next rung up), dense (a budget covering the bin) or exact (the next "
                           "rung up, and steps roll out in exact mode until the bin holds tau + margin)",
                           flag="adaptive_fallback")

    def validate(self) -> None:
        check_finite("adaptive_margin", self.margin, 0, 1, high_open=True)
        check_int("adaptive_patience", self.patience, 1)
        check_int("adaptive_min_tokens", self.min_tokens, 1)
        _check_choice("adaptive_fallback", self.fallback, FALLBACKS)


@dataclass
class EvalSection:
    data: str | None = option(None, "held-out prompt set (.jsonl or .parquet) scored before training and every "
                              "eval_every steps", flag="eval_data")
    every: int = option(10, "held-out evaluation every N-th step", flag="eval_every")
    generations: int = option(4, "samples per held-out prompt (mean@k, pass@k)", flag="eval_generations")
    schedule: str = option("dense", "schedule of the held-out rollouts", flag="eval_schedule")
    at_start: bool = option(True, "also score the held-out set before the first step (the same for every run of "
                            "one model, seed and eval set: runs compared with one that has it may skip it)",
                            flag="eval_at_start")

    def validate(self) -> None:
        if self.data is not None:
            require_file(self.data, "eval_data file")
        check_int("eval_every", self.every, 1)
        check_int("eval_generations", self.generations, 1)


@dataclass
class RunSection:
    seed: int = option(0, "seed of the rollouts, the data order and the adapter's initialization")
    output_dir: str = option("runs/train", "where metrics.jsonl and checkpoints go")
    save_every: int = option(1, "checkpoint every N-th step")
    keep_last: int = option(2, "checkpoints kept")
    resume: bool = option(False, "continue from the newest checkpoint in --output-dir")
    allow_changes: bool = option(False, "with --resume: accept a changed config for the options where continuing "
                                 "makes sense")

    def validate(self) -> None:
        check_int("seed", self.seed, 0)
        check_int("save_every", self.save_every, 1)
        check_int("keep_last", self.keep_last, 1)
        check_output(self.output_dir, "output_dir", directory=True)
        if self.allow_changes and not self.resume:
            raise SparrowError("allow_changes only applies to --resume; pass both or neither")
