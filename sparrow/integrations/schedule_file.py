"""The rollouts' schedule at run time, through the file Sparrow's vLLM plugin follows (`SPARROW_VLLM_SCHEDULE=@PATH`).

`RunTimeSchedule` holds the schedule a framework wants next: fixed, or adaptive (sparrow/rl/adaptive.py's
`start_state` and `update`, driven unchanged by the step's gathered measurements). Every process keeps the same
state (the same gathered values go in); only the writer (rank 0) writes the file, each change under the next
version number. After a generate call, `in_force` reads what the plugin reports beside the file (the version that
decoded, and the last refusal), so the monitor measures under the schedule that actually decoded the tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparrow.errors import SparrowError
from sparrow.rl.adaptive import by_bin, start_state, update
from sparrow.schedules import Schedule
from sparrow.vllm.config import ENV_SCHEDULE, FOLLOW, read_status, status_path, write_schedule

from .config import SparrowConfig


class RunTimeSchedule:
    """The schedule file of one run: what is written (`schedule`, `version`) and what the plugin put in force."""

    def __init__(self, config: SparrowConfig, path: str | Path, max_length: int, writer: bool):
        self.config, self.path, self.writer = config, Path(path), writer
        sparse = config.sparse
        start = config.start_schedule()
        self.state = (start_state(start, config.bin_size, max_length, sparse.page_size, sparse.always_kept_pages)
                      if config.is_adaptive else None)
        self.schedule = start if self.state is None else self.state.schedule()
        self.version = 1

    def start(self) -> None:
        """Write version 1 and drop an earlier run's status file, so a stale report is never read as this run's."""
        if self.writer:
            status_path(self.path).unlink(missing_ok=True)
            self.write()

    def write(self) -> None:
        if self.writer:
            write_schedule(self.path, self.schedule, self.version, self.config.page_size)

    def measured(self) -> dict[str, Schedule]:
        """The schedules teacher-forced beside the one in force: the adaptive controller's one-rung-cheaper one."""
        return {} if self.state is None else {"cheaper": self.state.schedule(-1)}

    def in_force(self) -> tuple[Schedule, int, list[str]]:
        """The schedule the plugin reports in force (its version), and a warning when it is not the one written
        (a refused file, or an engine that has not read it)."""
        status = read_status(self.path)
        if status is None:
            raise SparrowError(f"Sparrow's vLLM plugin reported no schedule beside {str(self.path)!r} after a "
                               f"generate call: expected the vLLM engine started with {ENV_SCHEDULE}="
                               f"{FOLLOW}{self.path} (in TRL's server mode, set it for `trl vllm-serve`)")
        bins = status["bins"]
        schedule = Schedule(status["name"], tuple(b["start"] for b in bins), tuple(b["kv_budget"] for b in bins))
        warnings = []
        if status["version"] != self.version:
            why = f": the plugin refused it ({status['refused']})" if status.get("refused") else ""
            warnings.append(f"the rollouts decoded under schedule version {status['version']} ({schedule.name}), "
                            f"not version {self.version} ({self.schedule.name}) written to {self.path}{why}")
        return schedule, status["version"], warnings

    def update(self, current: np.ndarray, cheaper: np.ndarray, positions: np.ndarray) -> list[str]:
        """The adaptive controller's step on the exact acceptance under the schedule in force and one rung
        cheaper; a move is written as the next version. Returns what moved."""
        if self.state is None:
            return []
        cfg, positions = self.config, np.asarray(positions).astype(np.int64)
        size = cfg.bin_size
        self.state, moved = update(self.state, by_bin(current, positions, size), by_bin(cheaper, positions, size),
                                   cfg.tau, cfg.adaptive_margin, cfg.adaptive_patience, cfg.adaptive_min_tokens)
        if moved:
            self.schedule, self.version = self.state.schedule(), self.version + 1
            self.write()
        return moved

    def metrics(self, version_in_force: int) -> dict[str, float]:
        """The version that decoded the step, and with the adaptive schedule each bin's budget written next."""
        out = {"sparrow/schedule_version": float(version_in_force)}
        if self.state is not None:
            for i, budget in enumerate(self.state.budgets):
                out[f"adaptive/bin_{i * self.state.bin_size}/budget"] = float(budget)
        return out
