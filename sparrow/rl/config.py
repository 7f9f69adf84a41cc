"""The `sparrow train` config: one nested, typed config, validated once before any model is loaded.

Sections: model, sparse, sampling, data (and rewards), grpo (loss and optimizer), monitor, distill, eval, rollout,
run. The command-line flags are the flat option names (see sparrow/typed_config.py); YAML files may use either
nested sections or the flat names. `TrainConfig.validate()` checks every value and parses every schedule once;
what a section parses stays on it (`sparse.config()`, `data.parsed`: the reward functions), and what the run
derives from several sections (its schedules) is in `config.parsed`. The sections themselves: sections.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrow.attention import SparseConfig
from sparrow.errors import SparrowError
from sparrow.io import require_file
from sparrow.options import DataSection, ModelSection, SamplingSection
from sparrow.schedules import DENSE, Schedule
from sparrow.schedules.adaptive import ADAPTIVE
from sparrow.typed_config import section

from .distill import DistillConfig
from .sections import (AdaptiveSection, EvalSection, GRPOSection, MonitorSection, RunSection, TrainRolloutSection,
                       TrainSamplingSection, TrainSparseSection)


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
