"""The plugin's report beside a followed schedule file: which version is in force in the engine, its bins, since
when, and the last refusal, so that the writer learns under which schedule the following tokens decode.

For `schedule.json` the report is `schedule.in-force.json`, replaced atomically by the engine at each switch and
each refusal (state.py) and read by the writer (sparrow/integrations/schedule_file.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sparrow.io import atomic_write_json
from sparrow.schedules import Schedule


def status_path(path: str | os.PathLike) -> Path:
    """Where the plugin reports the schedule in force for the followed file `path` (schedule.json ->
    schedule.in-force.json)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.in-force.json")


def read_status(path: str | os.PathLike) -> dict | None:
    """The plugin's report for the followed file `path`: {"version", "name", "bins", "since", "pid", "refused"}
    (refused: the last refusal's message, or None), or None before an engine has run a step under it."""
    try:
        return json.loads(status_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def write_status(path: str | os.PathLike, schedule: Schedule, version: int, refused: str | None) -> Path:
    """Report `schedule` (version `version`) in force for the followed file `path`, and the last refusal."""
    return atomic_write_json(status_path(path), {"version": version, "name": schedule.name, "bins": schedule.to_json(),
                                                 "since": time.time(), "pid": os.getpid(), "refused": refused})
