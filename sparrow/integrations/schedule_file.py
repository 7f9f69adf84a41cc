"""The rollouts' schedule at run time, through the file Sparrow's vLLM plugin follows (`SPARROW_VLLM_SCHEDULE=@PATH`).

`RunTimeSchedule` is `sparrow.schedules.runtime.WrittenSchedule` (the schedule written under versions, and the
version the plugin reports in force) made from a SparrowConfig: fixed, or adaptive (`sparrow train`'s controller,
`sparrow.schedules.controllers.AdaptiveSchedule`, driven unchanged by the step's gathered measurements). After a
generate call, `in_force` reads what the plugin reports beside the file, so the monitor measures under the schedule
that actually decoded the tokens.

`SparseCoverage` notices a schedule that decodes nothing sparsely at the lengths a run reaches (a budget that covers
them all), by the plugin's own rule (`sparrow.vllm.plan.sparse_rows`), and words one warning for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparrow.errors import SparrowError
from sparrow.schedules import Schedule
from sparrow.schedules.adaptive import start_state
from sparrow.schedules.controllers import AdaptiveSchedule
from sparrow.schedules.runtime import WrittenSchedule
from sparrow.vllm.env import ENV_SCHEDULE, FOLLOW
from sparrow.vllm.plan import sparse_rows

from .config import SparrowConfig


class RunTimeSchedule(WrittenSchedule):
    """The schedule file of one TRL run: what is written (`schedule`, `version`) and what the plugin put in force,
    for sequences up to `max_length` tokens."""

    def __init__(self, config: SparrowConfig, path: str | Path, max_length: int, writer: bool):
        self.config, self.max_length = config, int(max_length)
        sparse, start = config.sparse, config.start_schedule()
        super().__init__(path, sparse.page_size, sparse.always_kept_pages, writer, start,
                         _adaptive(config, start, self.max_length))

    def resize(self, max_length: int) -> bool:
        """Before the first generation: the adaptive bins and budget ladder again, for the longest sequence the
        engine really holds (vLLM's own `max_model_len`), written as the next version. Returns whether it changed."""
        max_length = int(max_length)
        if self.adaptive is None or max_length == self.max_length:
            return False
        self.max_length = max_length
        self.replace_adaptive(_adaptive(self.config, self.config.start_schedule(), max_length))
        return True

    def in_force(self) -> tuple[Schedule, int, list[str]]:
        """The schedule the plugin reports in force (its version), and a warning when it is not the one written
        (a refused file, or an engine that has not read it)."""
        reported = self.reported()
        if reported is None:
            raise SparrowError(f"Sparrow's vLLM plugin reported no schedule beside {str(self.path)!r} after a "
                               f"generate call: expected the vLLM engine started with {ENV_SCHEDULE}="
                               f"{FOLLOW}{self.path} (in TRL's server mode, set it for `trl vllm-serve`)")
        return reported


def _adaptive(config: SparrowConfig, start: Schedule, max_length: int) -> AdaptiveSchedule | None:
    """The adaptive controller of `config`, from `start`'s budgets, on bins up to `max_length` (None: a fixed
    schedule)."""
    if not config.is_adaptive:
        return None
    sparse = config.sparse
    return AdaptiveSchedule(start_state(start, config.bin_size, max_length, sparse.page_size,
                                        sparse.always_kept_pages), config.tau, config.adaptive)


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
