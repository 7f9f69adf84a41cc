"""`SparrowConfig`: what Sparrow adds to a TRL run, in TRL's naming style (flat, snake_case, validated once)."""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.attention import SparseConfig
from sparrow.errors import SparrowError
from sparrow.options import SparseSection
from sparrow.rl.config import AdaptiveSection, MonitorSection
from sparrow.schedules import Schedule, parse_schedule
from sparrow.schedules.adaptive import ADAPTIVE
from sparrow.typed_config import check_finite, check_int
from sparrow.vllm.exact_mode import MAX_DRAFT_TOKENS

CORRECTIONS = ("auto", "trl")
ROLLOUT_MODES = ("sparse", "exact")


@dataclass
class SparrowConfig:
    """Sparse rollouts and their monitor for `SparrowGRPOTrainer`.

    schedule: the rollouts' KV budget schedule: a spec (`const:256`, `0:512,3584:1024`), a published preset, a
      calibrated schedule file (`sparrow calibrate`), `dense`, or `adaptive` (budgets per length bin move to the
      cheapest rung whose exact p5 holds tau, from `adaptive_start`; sparrow/schedules/adaptive.py).
    tau, bin_size: the stability threshold of each length bin's 5th percentile of acceptance, and the bins.
    monitor_share, monitor_every: the share of each process's rollouts (the first rows) teacher-forced
      for the exact tail, on every `monitor_every`-th generation batch.
    schedule_file: the file the vLLM plugin follows (`SPARROW_VLLM_SCHEDULE=@schedule_file`); default
      `<output_dir>/sparrow/schedule.json`. In TRL's server mode, start the server with that variable.
    landmark, dense_layers, page_size: the sparse attention, as `sparrow train`'s options.
    adaptive_fallback: `budget` (a bin below tau gets the next budget up) or `dense` (a budget covering it);
      `sparrow train`'s `exact` is refused here: vLLM cannot switch single steps to exact mode.
    The defaults are `sparrow train`'s: read from its sections (MonitorSection, SparseSection, AdaptiveSection).
    correction: `auto` (TRL's importance sampling correction becomes token-level truncation, Sparrow's TIS, unless
      the GRPOConfig names another `vllm_importance_sampling_mode` than TRL's default) or `trl` (GRPOConfig's as
      it is, TRL's default included); the trainer logs which is in force.
    rollout_mode: `sparse` (the rollouts decode under the schedule) or `exact` (colocate mode: vLLM's speculative
      decoding with the policy drafting `draft_tokens` a round under the fixed sparse `schedule` and verifying
      densely, sparrow/vllm/exact_mode.py; the rollouts are the dense policy's samples, so the importance weights
      are 1 and nothing is teacher-forced: the logs carry what the verifications kept).
    """

    schedule: str = ADAPTIVE
    tau: float = MonitorSection.tau
    bin_size: int = MonitorSection.bin_size
    monitor_share: float = MonitorSection.monitor_share
    monitor_every: int = MonitorSection.monitor_every
    schedule_file: str | None = None
    landmark: str = SparseSection.landmark
    dense_layers: str = SparseSection.dense_layers
    page_size: int = SparseSection.page_size
    adaptive_start: str = AdaptiveSection.start
    adaptive_margin: float = AdaptiveSection.margin
    adaptive_patience: int = AdaptiveSection.patience
    adaptive_min_tokens: int = AdaptiveSection.min_tokens
    adaptive_fallback: str = AdaptiveSection.fallback
    correction: str = "auto"
    rollout_mode: str = "sparse"
    draft_tokens: int = 4

    def __post_init__(self) -> None:
        self._check_rollout_mode()
        if self.correction not in CORRECTIONS:
            raise SparrowError(f"SparrowConfig.correction {self.correction!r}: expected 'auto' (token-level "
                               "truncated importance sampling unless GRPOConfig names a mode) or 'trl' (GRPOConfig's "
                               "vllm_importance_sampling_mode as it is)")
        self.monitor.validate()
        self.adaptive.validate()
        if self.adaptive_fallback == "exact":
            raise SparrowError("SparrowConfig.adaptive_fallback 'exact': switching single steps to exact rollouts "
                               "needs Sparrow's engine, not vLLM; expected 'budget' (the next budget up) or 'dense' "
                               "(a budget covering the bin)")
        if not isinstance(self.schedule, str) or not self.schedule.strip():
            raise SparrowError(f"schedule {self.schedule!r}: expected a schedule spec, preset, file or 'adaptive'")
        self.start_schedule()  # a bad spec stops here, before TRL builds anything

    def _check_rollout_mode(self) -> None:
        if self.rollout_mode not in ROLLOUT_MODES:
            raise SparrowError(f"SparrowConfig.rollout_mode {self.rollout_mode!r}: expected 'sparse' or 'exact'")
        if self.rollout_mode == "sparse":
            return
        if not isinstance(self.schedule, str) or self.schedule.strip() in (ADAPTIVE, "dense"):
            raise SparrowError(f"SparrowConfig(rollout_mode='exact') drafts under a fixed sparse schedule, got "
                               f"schedule {self.schedule!r}: give one such as 'const:1024' (in exact mode the budget "
                               "sets speed only; the rollouts are the dense policy's whatever it is)")
        if check_int("draft_tokens", self.draft_tokens, 1) > MAX_DRAFT_TOKENS:
            raise SparrowError(f"draft_tokens must be at most {MAX_DRAFT_TOKENS}, got {self.draft_tokens}")

    @property
    def exact(self) -> bool:
        return self.rollout_mode == "exact"

    @property
    def sparse(self) -> SparseConfig:
        check_int("page_size", self.page_size, 1)
        return SparseConfig.from_options(self.page_size, self.landmark, self.dense_layers)

    @property
    def monitor(self) -> MonitorSection:
        check_finite("monitor_share", self.monitor_share, 0, 1, low_open=True)
        return MonitorSection(tau=self.tau, bin_size=self.bin_size, monitor="exact",
                              monitor_every=self.monitor_every, monitor_share=self.monitor_share)

    @property
    def adaptive(self) -> AdaptiveSection:
        return AdaptiveSection(start=self.adaptive_start, margin=self.adaptive_margin,
                               patience=self.adaptive_patience, min_tokens=self.adaptive_min_tokens,
                               fallback=self.adaptive_fallback)

    @property
    def is_adaptive(self) -> bool:
        return self.schedule.strip() == ADAPTIVE

    def start_schedule(self) -> Schedule:
        """The fixed schedule, or the adaptive one's start, parsed for this sparse configuration."""
        sparse = self.sparse
        spec = self.adaptive_start if self.is_adaptive else self.schedule
        name = "adaptive_start" if self.is_adaptive else "schedule"
        try:
            return parse_schedule(spec, sparse.page_size, sparse.always_kept_pages)
        except SparrowError as err:
            also = ""
            if not self.is_adaptive and str(err).startswith("unknown schedule"):
                also = f", or {ADAPTIVE!r} (budgets per length bin that move during the run, from adaptive_start)"
            raise SparrowError(f"SparrowConfig.{name}: {err}{also}") from None
