"""The plugin's configuration in force in this process: set once from the environment when the plugin loads
(`activate`), read by the attention backend once per engine step (`active`), changed between generate calls by
the process that runs the model (`set_schedule`: VLLMBackend runs vLLM in-process; the engine's own state, the
landmarks, does not depend on it).

A followed file (`SPARROW_VLLM_SCHEDULE=@PATH`) is the run-time schedule for any framework whose engine runs
elsewhere (TRL's colocated or server vLLM, verl, OpenRLHF): `active()` compares the file's inode, size and
modification time with the last ones seen (one `stat`), and only when they changed reads and parses it. A valid
file is in force from that engine step on; an invalid or missing one is refused with one logged message and the
previous schedule stays in force. Each switch (and each refusal) is reported in the status file beside it
(status.py). Writers replace the file atomically (`sparrow.schedules.write_schedule_json`); an in-place write is
at worst read half-written, refused, and read again when it is complete.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from sparrow.errors import SparrowError
from sparrow.schedules import Schedule, read_schedule_file

from .env import ENV_SCHEDULE, FOLLOW, PluginConfig
from .status import status_path, write_status

log = logging.getLogger("sparrow.vllm")
_UNREAD = ("unread",)


def _stat_key(path: Path) -> tuple | None:
    """What tells a replaced or rewritten file from the one last seen (None: missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class PluginState:
    """The configuration in force (None: stock vLLM) and, with a followed file, its stat when last read (None: it
    was missing) and why its current content was refused (None: it was not)."""

    def __init__(self):
        self.config: PluginConfig | None = None
        self.seen: tuple | None = _UNREAD
        self.refused: str | None = None

    def activate(self, config: PluginConfig | None) -> None:
        """Put `config` in force in this process (the plugin's entry point does this from the environment); a
        followed file is read again at the first engine step."""
        self.config, self.seen, self.refused = config, _UNREAD, None

    def active(self) -> PluginConfig | None:
        """The configuration in force in this process (None: stock vLLM). With a followed schedule file, first one
        `stat` of it, and a re-read when it changed: the attention backend calls this once per engine step."""
        if self.config is not None and self.config.source is not None:
            self._follow(self.config.source)
        return self.config

    def set_schedule(self, schedule: Schedule) -> None:
        """Change the schedule in force for the following forward passes of this process's engine (a followed file
        takes over again when it next changes)."""
        if self.config is None:
            raise SparrowError("Sparrow's vLLM plugin is not active in this process: set "
                               f"{ENV_SCHEDULE} before the engine starts")
        schedule.validate(self.config.sparse.page_size, self.config.sparse.always_kept_pages)
        self.config = replace(self.config, schedule=schedule)

    def _follow(self, source: Path) -> None:
        """Put the followed file's schedule in force if it changed and is valid; otherwise log one message for it
        and keep the schedule in force."""
        key, config = _stat_key(source), self.config
        if key == self.seen:
            return
        try:
            if key is None:
                raise SparrowError(f"schedule file {str(source)!r} does not exist")
            schedule, version = read_schedule_file(source, config.sparse.page_size, config.sparse.always_kept_pages,
                                                   previous=(config.schedule, config.version))
        except (SparrowError, OSError) as err:
            if _stat_key(source) == key:  # not a file caught mid-write: refuse it once
                self.seen, self.refused = key, str(err)
                log.warning("Sparrow's vLLM plugin refused %s=%s%s: %s; schedule version %d (%s) stays in force",
                            ENV_SCHEDULE, FOLLOW, source, err, config.version, config.schedule.name)
                self._report(source)
            return
        if _stat_key(source) != key:
            return  # replaced while read: read it again at the next step
        self.seen, self.refused = key, None
        changed = (schedule.starts, schedule.budgets) != (config.schedule.starts, config.schedule.budgets)
        if version is None:
            version = config.version + changed
        self.config = replace(config, schedule=schedule, version=version)
        self._report(source)

    def _report(self, source: Path) -> None:
        """Write the status file beside the followed one (a failure is logged, never raised)."""
        try:
            write_status(source, self.config.schedule, self.config.version, self.refused)
        except OSError as err:
            log.warning("Sparrow's vLLM plugin could not write %s: %s", status_path(source), err)


_PROCESS = PluginState()  # vLLM loads the plugin once per process: one state per process
activate = _PROCESS.activate
active = _PROCESS.active
set_schedule = _PROCESS.set_schedule
