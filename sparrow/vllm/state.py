"""The plugin's configuration in force in this process: set once from the environment when the plugin loads
(`activate`), read by the attention backend once per engine step (`active`), changed between generate calls by
the process that runs the model (`set_schedule`: VLLMBackend runs vLLM in-process; the engine's own state, the
landmarks, does not depend on it).

A followed file (`SPARROW_VLLM_SCHEDULE=@PATH`) is the run-time schedule for any framework whose engine runs
elsewhere (TRL's colocated or server vLLM, verl, OpenRLHF): `active()` takes one look at it
(`sparrow.schedules.runtime.FollowedFile`: one `stat`, a read only when it changed). A valid file is in force from
that engine step on; an invalid or missing one is refused with one logged message and the previous schedule stays
in force. Each switch (and each refusal) is reported in the status file beside it (`<stem>.in-force.json`).
Writers replace the file atomically (`sparrow.schedules.write_schedule_json`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from sparrow.errors import SparrowError
from sparrow.schedules import Schedule
from sparrow.schedules.runtime import FollowedFile, status_path

from .env import ENV_SCHEDULE, FOLLOW, PluginConfig

log = logging.getLogger("sparrow.vllm")


class PluginState:
    """The configuration in force (None: stock vLLM) and, with a followed schedule file, its follower."""

    def __init__(self):
        self.config: PluginConfig | None = None
        self.followed: FollowedFile | None = None

    def activate(self, config: PluginConfig | None) -> None:
        """Put `config` in force in this process (the plugin's entry point does this from the environment); a
        followed file is read again at the first engine step."""
        self.config = config
        self.followed = (None if config is None or config.source is None else
                         FollowedFile(config.source, config.sparse.page_size, config.sparse.always_kept_pages))

    def active(self) -> PluginConfig | None:
        """The configuration in force in this process (None: stock vLLM). With a followed schedule file, first one
        `stat` of it, and a re-read when it changed: the attention backend calls this once per engine step."""
        if self.followed is not None:
            self._follow(self.followed)
        return self.config

    def set_schedule(self, schedule: Schedule) -> None:
        """Change the schedule in force for the following forward passes of this process's engine (a followed file
        takes over again when it next changes)."""
        if self.config is None:
            raise SparrowError("Sparrow's vLLM plugin is not active in this process: set "
                               f"{ENV_SCHEDULE} before the engine starts")
        schedule.validate(self.config.sparse.page_size, self.config.sparse.always_kept_pages)
        self.config = replace(self.config, schedule=schedule)

    def _follow(self, followed: FollowedFile) -> None:
        """Put the followed file's schedule in force if it changed and is valid; otherwise log one message for it
        and keep the schedule in force. Either is reported beside the file."""
        config = self.config
        seen = followed.poll(config.schedule, config.version)
        if seen is None:
            return
        if followed.refused is not None:
            log.warning("Sparrow's vLLM plugin refused %s=%s%s: %s; schedule version %d (%s) stays in force",
                        ENV_SCHEDULE, FOLLOW, followed.path, followed.refused, config.version, config.schedule.name)
        else:
            self.config = replace(config, schedule=seen[0], version=seen[1])
        try:
            followed.report(self.config.schedule, self.config.version)
        except OSError as err:
            log.warning("Sparrow's vLLM plugin could not write %s: %s", status_path(followed.path), err)


_PROCESS = PluginState()  # vLLM loads the plugin once per process: one state per process
activate = _PROCESS.activate
active = _PROCESS.active
set_schedule = _PROCESS.set_schedule
