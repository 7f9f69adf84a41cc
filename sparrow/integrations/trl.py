"""`SparrowGRPOTrainer`: TRL's GRPOTrainer with Sparrow's sparse vLLM rollouts, exact tail monitor and run-time
schedule (docs/trl.md). Two lines turn it on:

    from sparrow.integrations.trl import SparrowConfig, SparrowGRPOTrainer
    trainer = SparrowGRPOTrainer(model, reward_funcs, args=GRPOConfig(use_vllm=True, ...),
                                 sparrow_config=SparrowConfig(schedule="adaptive", tau=0.86), ...)

Before TRL builds vLLM, rank 0 writes the schedule file and, in colocate mode, every process points the plugin at
it (`SPARROW_VLLM_SCHEDULE=@file`; in server mode the server is started with that variable). After each generation
batch (`_generate_and_score_completions`, TRL's own rollouts, rewards, old log-probs and IS ratios untouched), a
`monitor_share` of each process's rollouts is teacher-forced through the training model, sparse under the schedule
the plugin reports in force against dense, both after TRL's temperature; the per-token values of all processes are
gathered, and one verdict per step is logged (`mismatch/...`, as `sparrow train` logs them) with its warnings. The
adaptive schedule's controller moves on the same gathered values, identically on every process; rank 0 writes the
next version and all processes wait for it before they generate again.

TRL's own forward (`_get_per_token_logps_and_entropies`) keeps only the sampled tokens' log-probs, so it cannot
serve for exact acceptance, which needs both full next-token distributions: the monitor runs its own dense and
sparse forwards on the monitored share only, one prompt forward per group for them all (`measure.batch.piece_logits`).

What the trainer sets or checks before TRL builds anything: the model (Sparrow's `smollm2-135m` becomes its
converted directory, `resolve_model`), TRL's importance sampling correction (`choose_correction`: token-level
truncation, Sparrow's TIS, unless the user chose a mode; logged), and the lengths the adaptive bins cover (vLLM's
`max_model_len`). A schedule that decodes nothing sparsely at the lengths the run reaches is warned about once
(`schedule_file.SparseCoverage`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from trl import GRPOConfig, GRPOTrainer

from sparrow.errors import SparrowError
from sparrow.rl.step import monitored_rows
from sparrow.vllm.env import FOLLOW, environment_for

from .config import SparrowConfig
from .monitor import gather_rows, measure, rollout_batch, verdict
from .schedule_file import RunTimeSchedule, SparseCoverage
from .trl_cpu import float32_eager, on_cpu, reload_sync
from .trl_exact import DraftCounters, exact_llm

__all__ = ["SparrowConfig", "SparrowGRPOTrainer"]

log = logging.getLogger("sparrow.integrations.trl")


TOKEN_TRUNCATE = "token_truncate"


def resolve_model(model):
    """TRL's `model` argument with Sparrow's model names resolved: `smollm2-135m` becomes the Hugging Face directory
    Sparrow converts it into (`sparrow.rollout.vllm_backend.model_directory`); a model object, a hub id or a
    directory goes to TRL unchanged. Sparrow's random test models (`tiny-*`) stop here with one message."""
    from sparrow.models import MODEL_NAMES

    if not isinstance(model, str) or model not in MODEL_NAMES or Path(model).is_dir():
        return model
    from sparrow.rollout.vllm_backend import model_directory

    if model != "smollm2-135m":
        raise SparrowError(f"model {model!r} is one of Sparrow's random test models, whose head size vLLM refuses: "
                           "SparrowGRPOTrainer takes a Hugging Face model id or directory, or 'smollm2-135m' "
                           "(its directory: sparrow.rollout.vllm_backend.model_directory('smollm2-135m'))")
    try:
        directory = str(model_directory(model))
    except SparrowError as err:
        raise SparrowError(f"model {model!r}: {err} (sparrow.rollout.vllm_backend.model_directory gives the "
                           "directory TRL and vLLM load)") from None
    log.info("model %r: Sparrow's converted Hugging Face directory %s", model, directory)
    return directory


def choose_correction(args: GRPOConfig, choice: str) -> tuple[str, bool]:
    """TRL's importance sampling correction of the rollouts for sparse decoding, set on `args` in place, and
    (the line saying which is in force, whether it deserves a warning).

    Sparse rollouts differ from the training model a little on many tokens. TRL 1.16's default,
    `sequence_mask`, zeroes a whole sequence when the product of its tokens' ratios leaves [clip_min, clip_max]:
    at sparse budgets that is most of a batch (BENCHMARKS.md, "TRL": a sparse batch's tokens weighted by 0.077 on
    average). Token-level truncation (`token_truncate`, Sparrow's TIS: each token's ratio clipped) keeps every
    token's signal, bounded. With `choice` 'auto' TRL's default is replaced; a mode the user set (any other value,
    or bounds that a truncation cannot use) and `choice` 'trl' are kept."""
    mode = args.vllm_importance_sampling_mode
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if not args.vllm_importance_sampling_correction:
        return ("importance sampling correction: none (GRPOConfig(vllm_importance_sampling_correction=False)): "
                "the sparse rollouts' tokens are trained on as if the training model had sampled them; "
                f"Sparrow's correction is vllm_importance_sampling_mode={TOKEN_TRUNCATE!r}"), True
    default = GRPOConfig.__dataclass_fields__["vllm_importance_sampling_mode"].default
    bounds = f"clip_min {low}, clip_max {high}"
    if choice == "auto" and mode == default and mode != TOKEN_TRUNCATE and (low is not None or high is not None):
        args.vllm_importance_sampling_mode = TOKEN_TRUNCATE
        return (f"importance sampling correction: vllm_importance_sampling_mode={TOKEN_TRUNCATE!r} ({bounds}), set by "
                f"Sparrow in place of TRL's default {default!r}: each token's ratio pi_train / pi_vllm is clipped "
                "(Sparrow's TIS), where a sequence-level mask drops every rollout whose product of ratios leaves the "
                "bounds, most of a batch at sparse budgets. To keep TRL's, SparrowConfig(correction='trl')"), False
    whose = "GRPOConfig's, kept"
    if mode == default:
        whose = ("TRL's default, kept by SparrowConfig(correction='trl')" if choice == "trl" else
                 "TRL's default, kept: no clip bound to truncate at")
    line = f"importance sampling correction: vllm_importance_sampling_mode={mode!r} ({bounds}; {whose})"
    if mode.startswith("sequence"):
        return line + (f"; a sequence-level mode weighs whole rollouts, and sparse rollouts differ on many tokens: "
                       f"{TOKEN_TRUNCATE!r} is Sparrow's correction"), True
    return line, False


def vllm_args_check(args) -> None:
    """One message naming the option when the arguments cannot run sparse rollouts."""
    if args is None:
        raise SparrowError("SparrowGRPOTrainer needs args=GRPOConfig(use_vllm=True, ...), got none (TRL's default "
                           "has use_vllm=False): Sparrow's sparse rollouts run inside vLLM")
    if not getattr(args, "use_vllm", False):
        raise SparrowError(f"SparrowGRPOTrainer needs GRPOConfig(use_vllm=True, ...), got use_vllm="
                           f"{getattr(args, 'use_vllm', None)!r} in its {type(args).__name__}: Sparrow's sparse "
                           "rollouts run inside vLLM (vllm_mode='colocate' or 'server')")


def max_model_length(model, args: GRPOConfig) -> int:
    """The longest sequence vLLM will hold: `vllm_max_model_length`, else the model's position limit."""
    if args.vllm_max_model_length:
        return int(args.vllm_max_model_length)
    if isinstance(model, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    else:
        config = model.config
    return int(config.max_position_embeddings)


def configure_plugin(config: SparrowConfig, path: Path, mode: str) -> None:
    """Colocate mode: this process's vLLM follows `path` (the plugin is registered again if vLLM had loaded its
    plugins before the variable was set)."""
    if mode != "colocate":
        if config.exact:
            raise SparrowError(f"SparrowConfig(rollout_mode='exact') runs in TRL's colocate mode (vllm_mode="
                               f"'colocate'), got vllm_mode={mode!r}: the trainer builds the engine's speculative "
                               "decoding there")
        return
    os.environ.update(environment_for(config.sparse, f"{FOLLOW}{path}"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.plugins

    from sparrow.vllm import plugin

    if vllm.plugins.plugins_loaded:
        plugin.register()


@contextlib.contextmanager
def colocated_engine(config: SparrowConfig, mode: str):
    """Colocate mode, while TRL builds the trainer's engine: TRL's `LLM` builds it in float32 and eager on vLLM's
    CPU build (trl_cpu.py) and drafting in exact mode (trl_exact.py). TRL's own `LLM` is back on exit, so other
    engines and trainers in the process (a plain TRL one, a sparse one after an exact one) get TRL's. Yields
    whether the engine's weight sync must go through vLLM's `reload_weights` (`trl_cpu.reload_sync`): on CPU,
    and in exact mode for the drafter's copy."""
    if mode != "colocate":
        yield False
        return
    from trl.generation import vllm_generation

    original = build = vllm_generation.LLM
    cpu = on_cpu()
    if cpu:
        build = float32_eager(build)
    if config.exact:
        build = exact_llm(build, config.draft_tokens)
    vllm_generation.LLM = build
    try:
        yield cpu or config.exact
    finally:
        vllm_generation.LLM = original


class SparrowGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose vLLM rollouts decode sparsely under a schedule that may change during the run, with
    Sparrow's exact tail statistics in its logs. `sparrow_warnings` keeps (step, message) of every warning."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *rest,
                 sparrow_config: SparrowConfig | None = None, **kwargs):
        vllm_args_check(args)
        self.sparrow = sparrow_config or SparrowConfig()
        model = resolve_model(model)
        state = PartialState()
        self.sparrow_correction, worth_warning = choose_correction(args, self.sparrow.correction)
        if state.is_main_process:
            (log.warning if worth_warning else log.info)("%s", self.sparrow_correction)
        path = Path(self.sparrow.schedule_file or Path(args.output_dir) / "sparrow" / "schedule.json")
        longest = max_model_length(model, args)
        if self.sparrow.is_adaptive and not args.vllm_max_model_length and state.is_main_process:
            log.warning("adaptive schedule: GRPOConfig.vllm_max_model_length is unset, so its length bins and budget "
                        "ladder reach the %d positions vLLM holds for this model; from a dense start each bin "
                        "descends one rung per adaptive_patience steps before anything decodes sparsely. Set "
                        "vllm_max_model_length to the longest prompt plus max_completion_length", longest)
        self.sparrow_schedule = RunTimeSchedule(self.sparrow, path.resolve(), longest, writer=state.is_main_process)
        self.sparrow_schedule.start()
        state.wait_for_everyone()
        self.sparrow_schedule.join()
        configure_plugin(self.sparrow, path.resolve(), args.vllm_mode)
        self.sparrow_warnings: list[tuple[int, str]] = []
        self._sparrow_batches = 0
        self._sparrow_last_schedule = None  # the schedule in force at the last generation batch
        self.sparrow_drafts = DraftCounters(self.sparrow.draft_tokens) if self.sparrow.exact else None
        if self.sparrow.exact and state.is_main_process:
            log.info("exact mode: %s drafts %d tokens per dense verification in vLLM; the rollouts are the dense "
                     "policy's samples, so the importance weights are 1 (TRL's correction leaves them so) and no "
                     "rollout is teacher-forced: the logs carry what the verifications kept", self.sparrow.schedule,
                     self.sparrow.draft_tokens)
        with colocated_engine(self.sparrow, args.vllm_mode) as reload:
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        if reload:
            reload_sync(self.vllm_generation)
        self._sparrow_engine_length()
        self.sparrow_coverage = SparseCoverage(self.sparrow, self.sparrow_schedule.max_length)

    def _sparrow_engine_length(self) -> None:
        """Colocate mode: the adaptive bins up to the length vLLM's engine really holds (its `max_model_len`, which
        vLLM derives from the model's config when vllm_max_model_length is unset)."""
        llm = getattr(getattr(self, "vllm_generation", None), "llm", None)
        engine = getattr(getattr(llm, "llm_engine", None), "model_config", None)
        held = getattr(engine, "max_model_len", None)
        if isinstance(held, int) and self.sparrow_schedule.resize(held):
            log.info("adaptive schedule: bins up to vLLM's max_model_len %d (version %d)", held,
                     self.sparrow_schedule.version)
        self.accelerator.wait_for_everyone()

    def train(self, *args, **kwargs):
        """TRL's training, then the warning of a run whose rollouts decoded nothing sparsely (adaptive schedules;
        a fixed one is warned about at its first such batch)."""
        result = super().train(*args, **kwargs)
        for message in self.sparrow_coverage.end(self._sparrow_last_schedule or self.sparrow_schedule.schedule):
            self._sparrow_warn(message)
        return result

    def _sparrow_warn(self, message: str) -> None:
        self.sparrow_warnings.append((self.state.global_step + 1, message))
        if self.accelerator.is_main_process:
            log.warning("step %d: %s", self.state.global_step + 1, message)

    def _sparrow_lengths(self, output: dict) -> tuple[int, int]:
        """(shortest prompt, longest prompt + completion) of the generation batch over all processes."""
        prompt = output["prompt_mask"].sum(1)
        total = prompt + output["completion_mask"].sum(1)
        local = torch.stack([-prompt.min(), total.max()]).to(self.accelerator.device, torch.int64)[None]
        both = self.accelerator.gather(local).reshape(-1, 2)
        return int(-both[:, 0].max()), int(both[:, 1].max())

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self._sparrow_step(output)
        return output

    def _sparrow_step(self, output: dict) -> None:
        """The schedule in force, the monitor's verdict on this generation batch and the adaptive move; logged
        through TRL's metrics."""
        clock = time.perf_counter()
        schedule, version, warnings = self.sparrow_schedule.in_force()
        self._sparrow_last_schedule = schedule
        warnings += self.sparrow_coverage.batch(schedule, *self._sparrow_lengths(output))
        metrics = self.sparrow_schedule.metrics(version)
        measured = self.sparrow_schedule.measured()
        self._sparrow_batches += 1
        due = (self._sparrow_batches - 1) % self.sparrow.monitor_every == 0
        if self.sparrow_drafts is not None:  # exact mode: what the verifications kept is the monitor
            metrics.update(self.sparrow_drafts.read(self.vllm_generation.llm))
        elif due and not (schedule.is_dense and not measured):
            table = self._sparrow_measure(output, {"current": schedule, **measured})
            alpha, positions = table[:, 0], table[:, -1]
            exact, tail = verdict(alpha, positions, self.sparrow.monitor)
            metrics.update(exact)
            warnings += tail
            if version == self.sparrow_schedule.version and measured:
                moved = self.sparrow_schedule.update(alpha, table[:, 1], positions)
                warnings += [f"adaptive schedule: {event}" for event in moved]
            self.accelerator.wait_for_everyone()  # a new schedule file is written before any process generates
        metrics["mismatch/warnings"] = float(len(warnings))
        metrics["time/sparrow_monitor_s"] = time.perf_counter() - clock
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)
        for message in warnings:
            self._sparrow_warn(message)

    def _sparrow_measure(self, output: dict, schedules: dict) -> np.ndarray:
        """[tokens of all processes, len(schedules) + 1]: each measured token's acceptance under each schedule,
        then its position."""
        batch = rollout_batch(output["prompt_ids"], output["prompt_mask"], output["completion_ids"],
                              output["completion_mask"], tool_mask=output.get("tool_mask"))
        rows = monitored_rows(batch.input_ids.shape[0], self.sparrow.monitor_share)
        model = self.accelerator.unwrap_model(self.model)
        local = measure(model, batch, rows, schedules, self.sparrow.sparse, self.temperature)
        table = torch.stack([local[name] for name in schedules] + [local["positions"]], dim=1)
        return gather_rows(table, self.accelerator.device).numpy()
