"""A schedule file at run time: one process writes the schedule it wants next, another (an inference engine, such as
Sparrow's vLLM plugin) follows the file and reports beside it which version is in force.

- The writer (`WrittenSchedule`): the schedule a run wants next, fixed or an adaptive controller's
  (controllers.py's `AdaptiveSchedule`, driven by the gathered measurements), each change written under the next
  version (`write_schedule_json`, atomically), a new run one version above the last one the file or its report
  holds. Every process of a run keeps the same state (the same gathered values go in); only the writer writes.
- The follower (`FollowedFile`): one `stat` of the file per look (its inode, size and modification time against the
  last ones seen), a read only when it changed; a valid file is in force from then on, its version never going back
  (`read_schedule_file`'s `previous`); an invalid or missing one is refused once and the schedule in force stays.
  A file replaced while read is read again at the next look; an in-place write is at worst read half-written,
  refused, and read again when it is complete.
- The report (`status_path`, `write_status`, `read_status`): for `schedule.json`, `schedule.in-force.json`, which
  the follower replaces at each switch and each refusal and the writer reads back (`WrittenSchedule.reported`), so
  a run measures under the schedule that actually decoded its tokens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sparrow.errors import SparrowError
from sparrow.io import atomic_write_json

from .files import check_schedule_file, read_schedule_file, version_held, write_schedule_json
from .schedule import Schedule

if TYPE_CHECKING:
    import numpy as np

    from .adaptive import AdaptiveState
    from .controllers import AdaptiveSchedule

_UNREAD = ("unread",)


def status_path(path: str | os.PathLike) -> Path:
    """Where the follower reports the schedule in force for the followed file `path` (schedule.json ->
    schedule.in-force.json)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.in-force.json")


def read_status(path: str | os.PathLike) -> dict | None:
    """The follower's report for the followed file `path`: {"version", "name", "bins", "since", "pid", "refused"}
    (refused: the last refusal's message, or None), or None before an engine has run a step under it."""
    try:
        return json.loads(status_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def write_status(path: str | os.PathLike, schedule: Schedule, version: int, refused: str | None) -> Path:
    """Report `schedule` (version `version`) in force for the followed file `path`, and the last refusal."""
    return atomic_write_json(status_path(path), {"version": version, "name": schedule.name, "bins": schedule.to_json(),
                                                 "since": time.time(), "pid": os.getpid(), "refused": refused})


def _stat_key(path: Path) -> tuple | None:
    """What tells a replaced or rewritten file from the one last seen (None: missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FollowedFile:
    """A schedule file followed at run time (`path`, for budgets of `page_size` pages holding `always_kept_pages`):
    its stat when last read (`seen`; None: it was missing) and why its current content was refused (`refused`;
    None: it was not)."""

    def __init__(self, path: str | os.PathLike, page_size: int, always_kept_pages: int):
        self.path, self.page_size, self.always_kept_pages = Path(path), page_size, always_kept_pages
        self.seen: tuple | None = _UNREAD
        self.refused: str | None = None

    def poll(self, schedule: Schedule, version: int) -> tuple[Schedule, int] | None:
        """One look at the file, given the schedule and version in force: None when there is nothing new (the file
        is as last seen, or was replaced while read: it is read again at the next look); otherwise the schedule and
        version in force from now on, the file's (a file without a version counts its changes), or, when the file
        is refused (`refused` says why), those given."""
        key = _stat_key(self.path)
        if key == self.seen:
            return None
        try:
            if key is None:
                raise SparrowError(f"schedule file {str(self.path)!r} does not exist")
            new, new_version = read_schedule_file(self.path, self.page_size, self.always_kept_pages,
                                                  previous=(schedule, version))
        except (SparrowError, OSError) as err:
            if _stat_key(self.path) != key:
                return None  # caught mid-write: read it again at the next look
            self.seen, self.refused = key, str(err)
            return schedule, version
        if _stat_key(self.path) != key:
            return None  # replaced while read: read it again at the next look
        self.seen, self.refused = key, None
        if new_version is None:
            new_version = version + ((new.starts, new.budgets) != (schedule.starts, schedule.budgets))
        return new, new_version

    def report(self, schedule: Schedule, version: int) -> Path:
        """Write the status file beside the followed one: `schedule` (version `version`) in force, and the last
        refusal."""
        return write_status(self.path, schedule, version, self.refused)


class WrittenSchedule:
    """The schedule file of one run as its writer keeps it: what is written (`schedule`, `version`), fixed (`start`)
    or moved by `adaptive`, and what the follower reports in force (`reported`). `writer`: whether this process
    writes the file (one process of a run does)."""

    def __init__(self, path: str | os.PathLike, page_size: int, always_kept_pages: int, writer: bool,
                 start: Schedule, adaptive: AdaptiveSchedule | None = None):
        self.path, self.writer = Path(path), writer
        self.page_size, self.always_kept_pages = page_size, always_kept_pages
        self.adaptive = adaptive
        self.schedule = start if adaptive is None else adaptive.schedule()
        self.version = 1

    @property
    def state(self) -> AdaptiveState | None:
        """The adaptive controller's state (None: a fixed schedule)."""
        return None if self.adaptive is None else self.adaptive.current

    def replace_adaptive(self, adaptive: AdaptiveSchedule) -> None:
        """Another adaptive controller (its bins remade before the first generation), its schedule written as the
        next version."""
        self.adaptive, self.schedule = adaptive, adaptive.schedule()
        self.version += 1
        self.write()

    def start(self) -> None:
        """The writer starts this run one version above any the file or its follower's report holds (a server that
        follows the file across runs never sees a version go back) and drops the earlier run's report, so a stale
        report is never read as this run's. Every process calls `join` once the writer is done."""
        if self.writer:
            try:
                status = read_status(self.path)
            except (OSError, ValueError):  # a damaged report of an earlier run holds no version
                status = None
            reported = status.get("version") if isinstance(status, dict) else None
            self.version = max(version_held(self.path) or 0, reported if type(reported) is int else 0) + 1
            status_path(self.path).unlink(missing_ok=True)
            self.write()

    def join(self) -> None:
        """Take the version the writer started this run at, so that every process of the run holds the same."""
        held = version_held(self.path)
        if held is None:
            raise SparrowError(f"the schedule file {str(self.path)!r} holds no version after the run's writer "
                               "started it: expected the writer process to call start() first")
        self.version = held

    def write(self) -> None:
        """The schedule under its version (refused if the file holds a later one)."""
        if self.writer:
            write_schedule_json(self.schedule, self.path, self.page_size, version=self.version,
                                always_kept_pages=self.always_kept_pages)

    def measured(self) -> dict[str, Schedule]:
        """The schedules teacher-forced beside the one in force: the adaptive controller's one-rung-cheaper one."""
        return {} if self.adaptive is None else self.adaptive.measure()

    def reported(self) -> tuple[Schedule, int, list[str]] | None:
        """The schedule the follower reports in force (its version), and a warning when it is not the one written
        (a refused file, or an engine that has not read it); None before the follower reported anything."""
        status = read_status(self.path)
        if status is None:
            return None
        schedule, _ = check_schedule_file({key: status[key] for key in ("name", "bins")},
                                          f"status file {str(status_path(self.path))!r}", self.page_size,
                                          self.always_kept_pages)
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
