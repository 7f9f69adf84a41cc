"""The `sparrow train` config: one nested, typed config, validated once before any model is loaded.

Sections: model, sparse, sampling, data (and rewards), grpo (loss and optimizer), monitor, distill, eval, rollout,
run. The command-line flags are the flat option names (see sparrow/typed_config.py); YAML files may use either
nested sections or the flat names. `TrainConfig.validate()` checks every value and parses every schedule once;
what a section parses stays on it (`sparse.config()`, `data.parsed`: the reward functions), and what the run
derives from several sections (its schedules) is in `config.parsed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrow.attention import SparseConfig
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.io import check_output, require_file
from sparrow.options import (
    SCHEDULE_HELP,
    DataSection,
    ModelSection,
    RolloutSection,
    SamplingSection,
    ScheduledSparseSection,
    SparseSection,
)
from sparrow.schedules import DENSE, Schedule
from sparrow.typed_config import check_finite, check_int, option, section

from .adaptive import ADAPTIVE, FALLBACKS
from .distill import DistillConfig
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
    """`schedule: adaptive`: budgets per length bin (`bin_size`) move during training (sparrow/rl/adaptive.py),
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


@dataclass(frozen=True)
class StepConfig:
    """The sections of the train config a step reads (shared with the run's `TrainConfig`, not copied)."""

    grpo: GRPOSection = field(default_factory=GRPOSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    draft_tokens: int | None = None  # exact mode: tokens the schedule drafts per dense verification


@dataclass(frozen=True)
class Parsed:
    """The schedules validation derived once from several sections (the sparse settings and the reward functions
    stay on their sections: `TrainConfig.sparse.config()`, `TrainConfig.data.parsed`)."""

    schedule: Schedule  # the rollout schedule; with `schedule: adaptive`, where the adaptive one starts
    adaptive: bool
    switch_schedule: Schedule | None
    eval_schedule: Schedule


@dataclass
class TrainConfig:
    """One GRPO run. Option names follow TRL where they mean the same thing (num_generations, learning_rate, ...)."""

    model: ModelSection = section(ModelSection, name="tiny-qwen3")
    sparse: TrainSparseSection = section(TrainSparseSection)
    sampling: TrainSamplingSection = section(TrainSamplingSection)
    data: DataSection = section(DataSection)
    grpo: GRPOSection = section(GRPOSection)
    monitor: MonitorSection = section(MonitorSection)
    adaptive: AdaptiveSection = section(AdaptiveSection)
    distill: DistillConfig = section(DistillConfig)
    eval: EvalSection = section(EvalSection)
    rollout: TrainRolloutSection = section(TrainRolloutSection)
    run: RunSection = section(RunSection)
    parsed: Parsed | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        for part in (self.model, self.sparse, self.sampling, self.data, self.grpo, self.monitor, self.adaptive,
                     self.eval, self.run):
            part.validate()
        self.rollout.validate(self.model.device, self.sparse.exact, self.sparse.draft)
        self.sampling.check_exact_rule(self.sparse.exact)
        distill = self.distill
        adaptive = self.sparse.schedule == ADAPTIVE
        schedule = self.sparse.parse(self.adaptive.start if adaptive else self.sparse.schedule)
        if self.sparse.rollout_mode == "dense":
            if adaptive:
                raise SparrowError("--rollout-mode dense decodes every rollout densely: schedule adaptive has nothing "
                                   "to move; give one or the other")
            schedule = DENSE
        if self.sparse.exact and schedule.is_dense:
            raise SparrowError("--rollout-mode exact drafts with a sparse schedule: give --schedule other than "
                               "'dense' (a preset, const:N, adaptive, ...)")
        if adaptive and self.monitor.monitor != "exact":
            raise SparrowError("schedule adaptive moves budgets on the exact acceptance: it needs monitor exact, "
                               f"not {self.monitor.monitor!r}")
        if adaptive and distill.switch_schedule is not None:
            raise SparrowError("schedule adaptive and switch_schedule both choose the rollout schedule; give one")
        if adaptive and self.adaptive.fallback == "exact":
            if self.sparse.exact:
                raise SparrowError("adaptive_fallback exact falls back to exact rollouts, and --rollout-mode exact "
                                   "rolls out every step in exact mode already; give one or the other")
            if self.rollout.backend == "vllm":
                raise SparrowError("adaptive_fallback exact switches single steps to exact mode, which only "
                                   "Sparrow's engine does per step (--backend native); use adaptive_fallback budget "
                                   "or dense")
        switch = None
        if distill.switch_schedule is not None:
            switch = self.sparse.parse(distill.switch_schedule)
            if distill.switch_schedule == self.sparse.schedule:
                raise SparrowError(f"switch_schedule {distill.switch_schedule!r} is the rollout schedule itself; "
                                   "expected a more aggressive candidate")
        if distill.probe_data is not None and distill.switch_schedule is None:
            raise SparrowError("probe_data is only used by the switch probes; give switch_schedule as well")
        if distill.probe_data is not None:
            require_file(distill.probe_data, "probe_data file")
        try:
            eval_schedule = self.sparse.parse(self.eval.schedule)
        except SparrowError as err:
            raise SparrowError(f"eval_schedule: {err}") from None
        self.parsed = Parsed(schedule, adaptive, switch, eval_schedule)
        self.data.check_answers(("data", self.data.path), ("eval_data", self.eval.data))
        monitor = self.monitor
        checked = (monitor.reward_check_every and not self.sparse.exact
                   and (adaptive or switch is not None or not schedule.is_dense))
        if checked and monitor.reward_check_samples == 1 and min(monitor.reward_check_prompts,
                                                                  self.grpo.prompts_per_step) == 1:
            raise SparrowError("the reward check with reward_check_samples 1 of reward_check_prompts 1 compares one "
                               "pair of samples, which gives no interval; expected at least 2 pairs (raise either), "
                               "or reward_check_every 0 to turn the check off")

    def check_given(self, given: dict) -> None:
        """Refuse options given explicitly (`given`: their names and values from the YAML file or command line,
        before defaults) that would do nothing or be cut down without a word."""
        if given.get("eval_at_start") and self.eval.data is None:
            raise SparrowError("eval_at_start scores the held-out set before the first step, and there is none: give "
                               "--eval-data FILE as well, or drop --eval-at-start")
        for names, used, needs in self._dependent_options():
            for name in names:
                if name in given and not used:
                    raise SparrowError(f"{name} {given[name]!r} does nothing without {needs}: give it as well, or "
                                       f"drop {name}")
        monitor, grpo = self.monitor, self.grpo
        if "min_retention" in given and monitor.min_retention > 1:
            raise SparrowError(f"min_retention must be in (0, 1] as calibrate's, got {monitor.min_retention}: it is "
                               "the share of the dense policy's reward the sparse rollouts must keep")
        if "reward_check_samples" in given and monitor.reward_check_samples > grpo.num_generations:
            raise SparrowError(f"reward_check_samples {monitor.reward_check_samples} exceeds num_generations "
                               f"{grpo.num_generations}: the reward check pairs dense samples with the samples of a "
                               f"rollout group; expected at most {grpo.num_generations}")
        if "reward_check_prompts" in given and monitor.reward_check_prompts > grpo.prompts_per_step:
            raise SparrowError(f"reward_check_prompts {monitor.reward_check_prompts} exceeds prompts_per_step "
                               f"{grpo.prompts_per_step}: the reward check draws from the prompts of a step; expected "
                               f"at most {grpo.prompts_per_step}")

    def _dependent_options(self) -> list[tuple[tuple[str, ...], bool, str]]:
        """Options that only act under another one: (their names, whether that one is in force, what it is)."""
        return [
            (("adaptive_start", "adaptive_margin", "adaptive_patience", "adaptive_min_tokens", "adaptive_fallback"),
             self.parsed.adaptive, "schedule adaptive"),
            (("eval_every", "eval_generations", "eval_schedule"), self.eval.data is not None, "eval_data"),
            (("distill_lr", "distill_rank", "distill_alpha", "distill_targets", "distill_dropout", "distill_lambda",
              "distill_kl"), self.distill.enabled, "distill (the adapter)"),
            (("probe_every", "probe_prompts", "probe_patience"), self.distill.switch_schedule is not None,
             "switch_schedule (what the probes test)"),
            (("kl_estimator",), self.grpo.kl_coef > 0, "kl_coef above 0"),
        ]

    def step_config(self, exact: bool = False) -> StepConfig:
        """The sections one GRPO step reads; `exact`: the step rolls out in exact mode (an adaptive bin fell back
        to it), drafting `draft_tokens` per verification."""
        draft = self.sparse.draft_tokens if exact else self.sparse.draft
        return StepConfig(self.grpo, self.sampling, self.monitor, self.sparse.config(), draft)
