"""The rollouts' schedule at run time, through the file Sparrow's vLLM plugin follows (`SPARROW_VLLM_SCHEDULE=@PATH`).

`RunTimeSchedule` holds the schedule a framework wants next: fixed, or adaptive (`sparrow train`'s controller,
sparrow/rl/controllers.py's `AdaptiveSchedule`, driven unchanged by the step's gathered measurements). Every
process keeps the same state (the same gathered values go in); only the writer (rank 0) writes the file, each
change under the next version number, and a new run starts the file over at version 1. After a generate call, `in_force` reads what the plugin reports beside the file (the version that
decoded, and the last refusal), so the monitor measures under the schedule that actually decoded the tokens.

`SparseCoverage` notices a schedule that decodes nothing sparsely at the lengths a run reaches (a budget that covers
them all), by the plugin's own rule (`sparrow.vllm.plan.sparse_rows`), and words one warning for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparrow.errors import SparrowError
from sparrow.rl.adaptive import AdaptiveState, start_state
from sparrow.rl.controllers import AdaptiveSchedule
from sparrow.schedules import Schedule, check_schedule_file, write_schedule_json
from sparrow.vllm.env import ENV_SCHEDULE, FOLLOW
from sparrow.vllm.plan import sparse_rows
from sparrow.vllm.status import read_status, status_path

from .config import SparrowConfig


class RunTimeSchedule:
    """The schedule file of one run: what is written (`schedule`, `version`) and what the plugin put in force."""

    def __init__(self, config: SparrowConfig, path: str | Path, max_length: int, writer: bool):
        self.config, self.path, self.writer = config, Path(path), writer
        self.max_length = int(max_length)
        sparse = config.sparse
        start = config.start_schedule()
        self.adaptive = (AdaptiveSchedule(start_state(start, config.bin_size, self.max_length, sparse.page_size,
                                                      sparse.always_kept_pages), config.tau, config.adaptive)
                         if config.is_adaptive else None)
        self.schedule = start if self.adaptive is None else self.adaptive.schedule()
        self.version = 1

    @property
    def state(self) -> AdaptiveState | None:
        """The adaptive controller's state (None: a fixed schedule)."""
        return None if self.adaptive is None else self.adaptive.current

    def resize(self, max_length: int) -> bool:
        """Before the first generation: the adaptive bins and budget ladder again, for the longest sequence the
        engine really holds (vLLM's own `max_model_len`), written as the next version. Returns whether it changed."""
        max_length = int(max_length)
        if self.adaptive is None or max_length == self.max_length:
            return False
        resized = RunTimeSchedule(self.config, self.path, max_length, self.writer)
        self.adaptive, self.schedule, self.max_length = resized.adaptive, resized.schedule, max_length
        self.version += 1
        self.write()
        return True

    def start(self) -> None:
        """Start the file over at version 1, whatever version an earlier run left in it, and drop that run's status
        file, so a stale report is never read as this run's."""
        if self.writer:
            status_path(self.path).unlink(missing_ok=True)
            self.write(restart=True)

    def write(self, restart: bool = False) -> None:
        """The schedule under its version (refused if the file holds a later one, unless `restart`)."""
        if self.writer:
            sparse = self.config.sparse
            write_schedule_json(self.schedule, self.path, sparse.page_size, version=self.version,
                                always_kept_pages=sparse.always_kept_pages, restart=restart)

    def measured(self) -> dict[str, Schedule]:
        """The schedules teacher-forced beside the one in force: the adaptive controller's one-rung-cheaper one."""
        return {} if self.adaptive is None else self.adaptive.measure()

    def in_force(self) -> tuple[Schedule, int, list[str]]:
        """The schedule the plugin reports in force (its version), and a warning when it is not the one written
        (a refused file, or an engine that has not read it)."""
        status = read_status(self.path)
        if status is None:
            raise SparrowError(f"Sparrow's vLLM plugin reported no schedule beside {str(self.path)!r} after a "
                               f"generate call: expected the vLLM engine started with {ENV_SCHEDULE}="
                               f"{FOLLOW}{self.path} (in TRL's server mode, set it for `trl vllm-serve`)")
        sparse = self.config.sparse
        schedule, _ = check_schedule_file({key: status[key] for key in ("name", "bins")},
                                          f"status file {str(status_path(self.path))!r}", sparse.page_size,
                                          sparse.always_kept_pages)
        warnings = []
        if status["version"] != self.version:
            why = f": the plugin refused it ({status['refused']})" if status.get("refused") else ""
            warnings.append(f"the rollouts decoded under schedule version {status['version']} ({schedule.name}), "
                            f"not version {self.version} ({self.schedule.name}) written to {self.path}{why}")
        return schedule, status["version"], warnings

    def update(self, current: np.ndarray, cheaper: np.ndarray, positions: np.ndarray) -> list[str]:
        """The adaptive controller's step on the exact acceptance under the schedule in force and one rung
        cheaper; a move is written as the next version. Returns what moved."""
        if self.adaptive is None:
            return []
        moved = self.adaptive.observe(current, cheaper, positions)
        if moved:
            self.schedule, self.version = self.adaptive.schedule(), self.version + 1
            self.write()
        return moved

    def metrics(self, version_in_force: int) -> dict[str, float]:
        """The version that decoded the step, and with the adaptive schedule each bin's budget written next and the
        cheaper rung's tails it was decided on."""
        values = {} if self.adaptive is None else {**self.adaptive.budget_metrics(), **self.adaptive.evidence}
        return {"sparrow/schedule_version": float(version_in_force),
                **{name: float(value) for name, value in values.items()}}


def first_sparse_length(schedule: Schedule, page_size: int, low: int, high: int) -> int | None:
    """The shortest cached length in [low, high] whose decode step the plugin takes sparsely under `schedule` (its
    budget holds fewer pages than the sequence), or None when every length there is decoded densely."""
    if schedule.is_dense or high < low:
        return None
    lengths = np.arange(max(low, 1), high + 1, dtype=np.int64)
    sparse, _, _ = sparse_rows(np.ones_like(lengths), lengths, None, schedule, page_size)
    hits = np.flatnonzero(sparse)
    return int(lengths[hits[0]]) if hits.size else None


class SparseCoverage:
    """Whether a run's rollouts decoded anything sparsely, from each generation batch's lengths; ONE warning if not,
    naming the longest length reached. A fixed schedule is judged at the first batch that decoded nothing sparsely
    (its budgets do not change, so the user hears it at once); an adaptive one, which starts dense by design, at the
    end of the run (`end`). A schedule chosen dense (`dense`) is never warned about."""

    def __init__(self, config: SparrowConfig, max_length: int):
        self.adaptive = config.is_adaptive
        self.chosen_dense = not self.adaptive and config.start_schedule().is_dense
        self.page_size, self.max_length = config.page_size, int(max_length)
        self.batches = self.sparse_batches = self.longest = 0
        self.warned = False

    def batch(self, schedule: Schedule, shortest_prompt: int, longest: int) -> list[str]:
        """One generation batch decoded under `schedule`: its prompts' shortest length and its longest sequence
        (prompt and completion, over all processes). Decode steps cache lengths shortest_prompt + 1 .. longest - 1."""
        self.batches += 1
        self.longest = max(self.longest, int(longest))
        if first_sparse_length(schedule, self.page_size, int(shortest_prompt) + 1, int(longest) - 1) is not None:
            self.sparse_batches += 1
            return []
        if self.adaptive or self.sparse_batches:
            return []
        return self._warn(schedule, "")

    def end(self, schedule: Schedule) -> list[str]:
        """At the end of the run: the warning, if no batch decoded sparsely and none was given."""
        if not self.batches or self.sparse_batches:
            return []
        how = (" The adaptive schedule starts from adaptive_start and moves each bin one rung per adaptive_patience "
               "steps, from a ladder that reaches vLLM's max model length: a shorter vllm_max_model_length or a "
               "sparser adaptive_start gets there sooner." if self.adaptive else "")
        return self._warn(schedule, how)

    def _warn(self, schedule: Schedule, how: str) -> list[str]:
        if self.warned or self.chosen_dense:
            return []
        self.warned = True
        first = first_sparse_length(schedule, self.page_size, 1, self.max_length)
        where = (f"it decodes sparsely only from {first} cached tokens on" if first is not None else
                 f"it keeps every token up to vLLM's max model length {self.max_length}")
        return [f"no rollout decoded sparsely in {self.batches} generation batch(es): schedule {schedule.name!r} keeps "
                f"every token of sequences up to the longest length reached ({self.longest} tokens); {where}. Choose "
                f"smaller budgets, or schedule='dense' to run dense on purpose.{how}"]
