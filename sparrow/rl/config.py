"""The `sparrow train` config: one nested, typed config, validated once before any model is loaded.

Sections: model, sparse, sampling, data (and rewards), grpo (loss and optimizer), monitor, distill, eval, rollout,
run. The command-line flags are the flat option names (see sparrow/typed_config.py); YAML files may use either
nested sections or the flat names. `TrainConfig.validate()` checks every value and parses every schedule once;
the results are in `config.parsed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sparrow.attention import SparseConfig
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.models import resolve_device, resolve_dtype
from sparrow.rewards import load_reward
from sparrow.rewards.sandbox import require_sandbox
from sparrow.rollout.factory import check_backend, check_rollout_workers
from sparrow.schedules import Schedule, parse_schedule
from sparrow.typed_config import check_finite, check_int, flagged

from .distill import DistillConfig
from .losses import ADVANTAGE_ESTIMATORS, GROUP_STDS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, TIS_MODES

MONITORS = ("exact", "bounds")
NON_FINITE_ACTIONS = ("skip", "stop")
ANSWER_REWARDS = ("math", "first_number", "number_f1")


def _check_choice(name: str, value, known) -> None:
    if value not in known:
        raise SparrowError(f"unknown {name} {value!r}: expected one of {', '.join(known)}")


def _check_file(name: str, path: str | None) -> None:
    if path is None:
        return
    if not Path(path).exists():
        raise SparrowError(f"{name} file {path!r} does not exist")
    if not Path(path).is_file():
        raise SparrowError(f"{name} {path!r} is a directory; expected a .jsonl or .parquet file")


@dataclass
class ModelSection:
    name: str = flagged("model", "tiny-qwen3")
    dtype: str = "float32"
    device: str = "auto"

    def validate(self) -> None:
        resolve_dtype(self.dtype)
        resolve_device(self.device)


@dataclass
class SparseSection:
    schedule: str = "dense"
    page_size: int = 16
    landmark: str = "centroid"
    dense_layers: str = "0,1"

    def config(self) -> SparseConfig:
        return SparseConfig.from_options(self.page_size, self.landmark, self.dense_layers)

    def parse(self, spec: str) -> Schedule:
        sparse = self.config()
        return parse_schedule(spec, sparse.page_size, sparse.always_kept_pages)


@dataclass
class SamplingSection:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    num_logprobs: int = 20

    def validate(self) -> None:
        check_finite("temperature", self.temperature, 0, low_open=True)  # training needs a sampled policy
        self.params(seed=0)
        if self.num_logprobs == 0:
            raise SparrowError("num_logprobs must be >= 1 in training: the acceptance monitor bounds each rollout "
                               "token with its top-K log-probs; got 0")

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              num_logprobs=self.num_logprobs, seed=seed)


@dataclass
class DataSection:
    path: str | None = flagged("data", None)
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    reward: list[str] | None = None
    reward_weights: list[float] | None = None
    unsafe_code_reward: bool = False

    def validate(self) -> None:
        if self.path is None:
            raise SparrowError("give the prompt data: --data FILE.jsonl|.parquet")
        _check_file("data", self.path)
        names = self.reward or ["math"]
        weights = self.reward_weights or [1.0] * len(names)
        if len(weights) != len(names):
            raise SparrowError(f"{len(names)} reward(s) but {len(weights)} reward_weights; give one weight each")
        for w in weights:
            check_finite("reward weight", w)
        if "code" in names:
            require_sandbox(allow_unsafe=self.unsafe_code_reward)

    def rewards(self) -> list:
        names = self.reward or ["math"]
        weights = self.reward_weights or [1.0] * len(names)
        return [(name, load_reward(name), float(w)) for name, w in zip(names, weights)]


@dataclass
class GRPOSection:
    """Defaults follow the release (SPEC section 7)."""

    steps: int = 2
    prompts_per_step: int = 2
    num_generations: int = 8
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    advantage_estimator: str = "grpo"
    advantage_std: str = "sample"
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    tis_mode: str = "truncate"
    tis_cap: float = 2.0
    loss_aggregation: str = "token-mean"
    mini_batches: int = 1
    micro_batch_size: int = 4
    log_prob_micro_batch_size: int | None = None  # rows per no-grad forward (recompute, monitor); None: micro_batch_size
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    non_finite: str = "skip"

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
    """How the acceptance tail of the rollouts is watched. `exact`: every `monitor_every`-th step, the rollouts of
    a `monitor_share` of the groups are teacher-forced through the sparse actor and compared with the dense
    recompute's full distributions; `bounds`: top-K log-prob bounds only (no extra forward). The reward check:
    every `reward_check_every`-th step (0: never) of sparse rollouts, the first `reward_check_samples` samples of
    the first `reward_check_prompts` prompts are also drawn densely with the same seeds and scored, and a
    retention whose interval lies below `min_retention` is warned about."""

    tau: float = 0.86
    bin_size: int = 2000
    monitor: str = "exact"
    monitor_every: int = 1
    monitor_share: float = 1.0
    reward_check_every: int = 4
    reward_check_prompts: int = 1
    reward_check_samples: int = 4
    min_retention: float = 0.9

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

    start: str = flagged("adaptive_start", "dense")
    margin: float = flagged("adaptive_margin", 0.02)
    patience: int = flagged("adaptive_patience", 2)
    min_tokens: int = flagged("adaptive_min_tokens", 200)

    def validate(self) -> None:
        check_finite("adaptive_margin", self.margin, 0, 1, high_open=True)
        check_int("adaptive_patience", self.patience, 1)
        check_int("adaptive_min_tokens", self.min_tokens, 1)


@dataclass
class EvalSection:
    data: str | None = flagged("eval_data", None)
    every: int = flagged("eval_every", 10)
    generations: int = flagged("eval_generations", 4)
    schedule: str = flagged("eval_schedule", "dense")

    def validate(self) -> None:
        _check_file("eval_data", self.data)
        check_int("eval_every", self.every, 1)
        check_int("eval_generations", self.generations, 1)


@dataclass
class RolloutSection:
    backend: str = "native"
    workers: int = flagged("rollout_workers", 0)
    ray_address: str | None = None
    cpus_per_worker: int | None = None
    wire_dtype: str | None = None
    max_batch_size: int = 64

    def validate(self) -> None:
        check_backend(self.backend, self.workers, self.ray_address)
        if self.cpus_per_worker is not None:
            check_int("cpus_per_worker", self.cpus_per_worker, 1)
        if self.wire_dtype is not None:
            _check_choice("wire_dtype", self.wire_dtype, ("float32", "bfloat16"))
        check_int("max_batch_size", self.max_batch_size, 1)


@dataclass
class RunSection:
    seed: int = 0
    output_dir: str = "runs/train"
    save_every: int = 1
    keep_last: int = 2
    resume: bool = False
    allow_changes: bool = False

    def validate(self) -> None:
        check_int("seed", self.seed, 0)
        check_int("save_every", self.save_every, 1)
        check_int("keep_last", self.keep_last, 1)
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise SparrowError(f"output_dir {self.output_dir!r} is an existing file; expected a directory")
        if self.allow_changes and not self.resume:
            raise SparrowError("allow_changes only applies to --resume; pass both or neither")


@dataclass(frozen=True)
class StepConfig:
    """The sections of the train config a step reads (shared with the run's `TrainConfig`, not copied)."""

    grpo: GRPOSection = field(default_factory=GRPOSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    sparse: SparseConfig = field(default_factory=SparseConfig)


@dataclass(frozen=True)
class Parsed:
    """What validation derived once: the sparse settings, every schedule, the reward functions."""

    sparse: SparseConfig
    schedule: Schedule  # the rollout schedule; with `schedule: adaptive`, where the adaptive one starts
    adaptive: bool
    switch_schedule: Schedule | None
    eval_schedule: Schedule
    rewards: list


@dataclass
class TrainConfig:
    """One GRPO run. Option names follow TRL where they mean the same thing (num_generations, learning_rate, ...)."""

    model: ModelSection = field(default_factory=ModelSection)
    sparse: SparseSection = field(default_factory=SparseSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    data: DataSection = field(default_factory=DataSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    adaptive: AdaptiveSection = field(default_factory=AdaptiveSection)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalSection = field(default_factory=EvalSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    run: RunSection = field(default_factory=RunSection)
    parsed: Parsed | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        for section in (self.model, self.sampling, self.data, self.grpo, self.monitor, self.adaptive, self.eval,
                        self.rollout, self.run):
            section.validate()
        check_rollout_workers(self.rollout.workers, self.rollout.ray_address, self.model.device)
        distill = self.distill
        adaptive = self.sparse.schedule == "adaptive"
        schedule = self.sparse.parse(self.adaptive.start if adaptive else self.sparse.schedule)
        if adaptive and self.monitor.monitor != "exact":
            raise SparrowError("schedule adaptive moves budgets on the exact acceptance: it needs monitor exact, "
                               f"not {self.monitor.monitor!r}")
        if adaptive and distill.switch_schedule is not None:
            raise SparrowError("schedule adaptive and switch_schedule both choose the rollout schedule; give one")
        switch = None
        if distill.switch_schedule is not None:
            switch = self.sparse.parse(distill.switch_schedule)
            if distill.switch_schedule == self.sparse.schedule:
                raise SparrowError(f"switch_schedule {distill.switch_schedule!r} is the rollout schedule itself; "
                                   "expected a more aggressive candidate")
        if distill.probe_data is not None and distill.switch_schedule is None:
            raise SparrowError("probe_data is only used by the switch probes; give switch_schedule as well")
        _check_file("probe_data", distill.probe_data)
        rewards = self.data.rewards()
        self.parsed = Parsed(self.sparse.config(), schedule, adaptive, switch, self.sparse.parse(self.eval.schedule),
                             rewards)
        self._check_answers()

    def step_config(self) -> StepConfig:
        """The sections one GRPO step reads."""
        return StepConfig(self.grpo, self.sampling, self.monitor, self.parsed.sparse)

    def _check_answers(self) -> None:
        """Rewards that compare with a reference answer need one in every row (checked on the data now)."""
        needs = [name for name in (self.data.reward or ["math"]) if name in ANSWER_REWARDS]
        if not needs:
            return
        from sparrow.datasets import DataSpec, load_examples

        for name, path in (("data", self.data.path), ("eval_data", self.eval.data)):
            if path is None:
                continue
            examples = load_examples(DataSpec(path, self.data.prompt_field, self.data.answer_field))
            missing = [i for i, ex in enumerate(examples) if ex.answer in (None, "")]
            if missing:
                raise SparrowError(f"reward {needs[0]!r} compares with each row's {self.data.answer_field!r}, but "
                                   f"{len(missing)} row(s) of {name} {path!r} have none (first: row {missing[0]}); "
                                   "give --answer-field or another --reward")
