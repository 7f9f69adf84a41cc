"""Schedule files: `{"name", "page_size", "version"?, "bins"}` (or a bare list of bins), checked alike for every
reader (`check_schedule_file`), written atomically by the one writer (`write_schedule_json`); versions only go up
where a file is followed at run time."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparrow.errors import SparrowError
from sparrow.io import atomic_write_json, require_file

from .schedule import DEFAULT_KEPT_PAGES, MAX_TOKENS, Schedule

FILE_KEYS = ("name", "page_size", "version", "bins")

BIN_KEYS = ("start", "kv_budget")


def read_schedule_file(path: str | os.PathLike, page_size: int = 16,
                       always_kept_pages: int = DEFAULT_KEPT_PAGES,
                       previous: tuple[Schedule, int] | None = None) -> tuple[Schedule, int | None]:
    """A JSON schedule file (the forms `parse_schedule` reads from a file), checked by `check_schedule_file` as
    every reader's is, whatever its name looks like, and its top-level "version" (None when it has none; the
    run-time file a vLLM plugin follows carries one). `previous`: the (schedule, version) in force for a followed
    file, which a new version must not go back from."""
    return read_file(Path(path), page_size, always_kept_pages, previous)



def read_file(path: Path, page_size: int, always_kept_pages: int,
               previous: tuple[Schedule, int] | None = None) -> tuple[Schedule, int | None]:
    """A JSON schedule file, read and passed through `check_schedule_file`."""
    where = f"schedule file {str(path)!r}"
    require_file(path, "schedule file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SparrowError(f"{where} is not valid JSON: {err}") from None
    return check_schedule_file(data, where, page_size, always_kept_pages, path.stem, previous)



def check_schedule_file(data, where: str, page_size: int, always_kept_pages: int, name: str = "schedule",
                        previous: tuple[Schedule, int] | None = None) -> tuple[Schedule, int | None]:
    """The one check of a schedule file's content (`data`: its parsed JSON; `where`: how to name the file), for
    every reader: a list of {"start", "kv_budget"} bins, or {"bins": [...], "name"?, "page_size"?, "version"?}
    with no other key; at least one bin (an empty list only under the name "dense", as `write_schedule_json` writes
    the dense schedule); the bins as `Schedule.validate` wants them (starts ascending from 0, whole-page budgets
    holding the always-kept pages, everything below MAX_TOKENS). `previous`: the (schedule, version) in force
    where the file is followed at run time; a version below it, or other bins under the same version, is refused.
    Returns the schedule and the file's version (None without one); `name` when the file gives none."""
    version = None
    if isinstance(data, dict):
        unknown = [key for key in data if key not in FILE_KEYS]
        if unknown:
            raise SparrowError(f"{where}: unknown key {unknown[0]!r}; expected only {', '.join(FILE_KEYS)}")
        if "bins" not in data:
            raise SparrowError(f"{where} has no 'bins' key; expected a list of "
                               '{"start", "kv_budget"} objects or an object with "bins"')
        if "page_size" in data and data["page_size"] != page_size:
            raise SparrowError(f"{where} is for page size {data['page_size']!r}, "
                               f"but page size {page_size} was requested")
        name, version = data.get("name", name), data.get("version")
        if not isinstance(name, str):
            raise SparrowError(f"{where}: name {name!r} is not a string")
        if version is not None and (type(version) is not int or not 0 <= version <= MAX_TOKENS):
            raise SparrowError(f"{where}: version {version!r} is not an integer >= 0")
        data = data["bins"]
    if isinstance(data, list):
        for i, item in enumerate(data):
            extra = [key for key in item if key not in BIN_KEYS] if isinstance(item, dict) else []
            if extra:
                raise SparrowError(f"{where}: bin {i} has unknown key {extra[0]!r}; expected only start and "
                                   "kv_budget")
        if not data and name != "dense":
            raise SparrowError(f"{where}: bins is empty; expected at least one {{\"start\", \"kv_budget\"}} bin "
                               "(a dense schedule is 'dense', or a file named \"dense\" with no bins)")
    schedule = Schedule.from_json(name, data, where)
    try:
        schedule.validate(page_size, always_kept_pages)
    except SparrowError as err:
        raise SparrowError(f"{where}: {err}") from None
    if previous is not None and version is not None:
        held, held_version = previous
        if version < held_version:
            raise SparrowError(f"{where}: version {version} is below version {held_version} in force; versions only "
                               "go up: write the next one")
        if version == held_version and (schedule.starts, schedule.budgets) != (held.starts, held.budgets):
            raise SparrowError(f"{where}: bins differ from those of version {held_version} in force under the same "
                               f"version; a change of bins takes a version above {held_version}")
    return schedule, version



def write_schedule_json(schedule: Schedule, path: str | os.PathLike, page_size: int = 16, *,
                        version: int | None = None, always_kept_pages: int = DEFAULT_KEPT_PAGES) -> Path:
    """The one writer of schedule files: `{"name", "page_size", "version"?, "bins"}`, replaced atomically so a
    reader (the vLLM plugin following the file) never sees half of it. Refused, as its reader would refuse it, when
    a budget is not whole pages or holds fewer than `always_kept_pages` pages. With a `version` (the run-time file
    a plugin follows), a version below the one the file holds is refused: a follower would refuse it too."""
    if version is not None:
        if type(version) is not int or version < 0:
            raise SparrowError(f"schedule version {version!r} is not an integer >= 0")
        held = version_held(Path(path))
        if held is not None and version < held:
            raise SparrowError(f"schedule file {str(path)!r} holds version {held}; refusing to write version "
                               f"{version} over it: versions only go up (the plugin reports the version in force), "
                               "so write the next one")
    schedule.validate(page_size, always_kept_pages)
    data = {"name": schedule.name, "page_size": page_size}
    if version is not None:
        data["version"] = version
    return atomic_write_json(path, {**data, "bins": schedule.to_json()})



def version_held(path: Path) -> int | None:
    """The version a schedule file holds now; None when it has none or cannot be read (nothing to go back from)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if type(version) is int else None
