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
sparse forwards, one prompt forward per group (`rollout.batch.piece_logits`), on the monitored share only.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from trl import GRPOConfig, GRPOTrainer

from sparrow.errors import SparrowError
from sparrow.vllm.config import FOLLOW, environment_for

from .config import SparrowConfig
from .monitor import gather_rows, measure, monitored_rows, rollout_batch, verdict
from .schedule_file import RunTimeSchedule

__all__ = ["SparrowConfig", "SparrowGRPOTrainer"]

log = logging.getLogger("sparrow.integrations.trl")


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
    plugins before the variable was set), on CPU with TRL patched for vLLM's CPU build (trl_cpu.py)."""
    if mode != "colocate":
        return
    os.environ.update(environment_for(config.sparse, f"{FOLLOW}{path}"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.plugins

    from sparrow.vllm import plugin

    from .trl_cpu import adapt_trl_to_vllm_cpu

    if vllm.plugins.plugins_loaded:
        plugin.register()
    adapt_trl_to_vllm_cpu()


class SparrowGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose vLLM rollouts decode sparsely under a schedule that may change during the run, with
    Sparrow's exact tail statistics in its logs. `sparrow_warnings` keeps (step, message) of every warning."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *rest,
                 sparrow_config: SparrowConfig | None = None, **kwargs):
        if args is None or not args.use_vllm:
            raise SparrowError(f"SparrowGRPOTrainer needs GRPOConfig(use_vllm=True, ...), got args={args!r:.80}: "
                               "Sparrow's sparse rollouts run inside vLLM")
        self.sparrow = sparrow_config or SparrowConfig()
        path = Path(self.sparrow.schedule_file or Path(args.output_dir) / "sparrow" / "schedule.json")
        state = PartialState()
        self.sparrow_schedule = RunTimeSchedule(self.sparrow, path.resolve(), max_model_length(model, args),
                                                writer=state.is_main_process)
        self.sparrow_schedule.start()
        state.wait_for_everyone()
        configure_plugin(self.sparrow, path.resolve(), args.vllm_mode)
        self.sparrow_warnings: list[tuple[int, str]] = []
        self._sparrow_batches = 0
        super().__init__(model, reward_funcs, args, *rest, **kwargs)

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
        metrics = self.sparrow_schedule.metrics(version)
        measured = self.sparrow_schedule.measured()
        self._sparrow_batches += 1
        due = (self._sparrow_batches - 1) % self.sparrow.monitor_every == 0
        if due and not (schedule.is_dense and not measured):
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
            self.sparrow_warnings.append((self.state.global_step + 1, message))
            if self.accelerator.is_main_process:
                log.warning("step %d: %s", self.state.global_step + 1, message)

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
