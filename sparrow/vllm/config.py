"""What the vLLM plugin does, read from the environment (no vLLM import, so it is testable anywhere).

vLLM builds its engine from its own arguments, and TRL builds `LLM(...)` itself, so the plugin takes no engine
arguments: it is configured by environment variables, read when the plugin loads in each process.

- SPARROW_VLLM_SCHEDULE: a schedule spec (`parse_schedule`: a preset name, `const:N`, `0:512,3584:1024`, a JSON
  file, or `dense`), fixed for the engine's life; or `@PATH`, a JSON schedule file the plugin follows while vLLM
  runs (below). Unset: the plugin does nothing and vLLM runs stock.
- SPARROW_VLLM_LANDMARK (centroid|quest), SPARROW_VLLM_DENSE_LAYERS ("0,1"), SPARROW_VLLM_PAGE_SIZE (16):
  the SparseConfig, as our engine's options.

A followed file (`@PATH`) is the run-time schedule for any framework whose engine runs elsewhere (TRL's colocated
or server vLLM, verl, OpenRLHF): `active()`, which the attention backend's metadata builder calls once per engine
step, compares the file's inode, size and modification time with the last ones seen (one `stat`), and only when
they changed reads and parses it. A valid file is in force from that engine step on; an invalid or missing one is
refused with one logged message and the previous schedule stays in force. Each switch (and each refusal) is
reported in the status file beside it (`status_path`): the version in force, its bins, since when, and the last
refusal, so a writer learns under which schedule the following tokens decode. Writers replace the file atomically
(`write_schedule`); an in-place write is at worst read half-written, refused, and read again when it is complete.

In the process that runs the model (VLLMBackend runs vLLM in-process), `set_schedule` changes the schedule between
generate calls; the engine's own state (landmarks) does not depend on it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError
from sparrow.io import atomic_write_json, env_int
from sparrow.schedules import DEFAULT_KEPT_PAGES, DENSE, Schedule, parse_schedule, read_schedule_file

ENV_SCHEDULE = "SPARROW_VLLM_SCHEDULE"
ENV_LANDMARK = "SPARROW_VLLM_LANDMARK"
ENV_DENSE_LAYERS = "SPARROW_VLLM_DENSE_LAYERS"
ENV_PAGE_SIZE = "SPARROW_VLLM_PAGE_SIZE"
ENV_NAMES = (ENV_SCHEDULE, ENV_LANDMARK, ENV_DENSE_LAYERS, ENV_PAGE_SIZE)
FOLLOW = "@"  # SPARROW_VLLM_SCHEDULE=@PATH: the schedule file followed at run time

log = logging.getLogger("sparrow.vllm")


@dataclass(frozen=True)
class PluginConfig:
    """The sparse rule the plugin applies: our SparseConfig and the schedule in force; with a followed schedule
    file, its path (`source`) and the version in force (the file's "version", else a count of its changes)."""

    sparse: SparseConfig
    schedule: Schedule
    version: int = 0
    source: Path | None = field(default=None, compare=False)


def from_environment(environ=None) -> PluginConfig | None:
    """The configuration the environment asks for, None when SPARROW_VLLM_SCHEDULE is unset; a SparrowError
    naming the variable for any bad value."""
    env = os.environ if environ is None else environ
    spec = env.get(ENV_SCHEDULE, "").strip()
    if not spec:
        return None
    page_size = env_int(ENV_PAGE_SIZE, 16, minimum=1, environ=env)
    layers_text = env.get(ENV_DENSE_LAYERS, "0,1")
    try:
        layers = tuple(int(x) for x in layers_text.split(",") if x.strip())
    except ValueError:
        layers = (-1,)
    if any(i < 0 for i in layers):
        raise SparrowError(f"{ENV_DENSE_LAYERS}={layers_text!r}: expected comma-separated layer indices >= 0, "
                           "e.g. '0,1' (empty: no dense layer)")
    try:
        sparse = SparseConfig.from_options(page_size, env.get(ENV_LANDMARK, "centroid").strip(), layers_text)
    except SparrowError as err:
        raise SparrowError(f"Sparrow's vLLM plugin ({', '.join(ENV_NAMES[1:])}): {err}") from None
    if spec.startswith(FOLLOW):
        path = spec[len(FOLLOW):].strip()
        if not path:
            raise SparrowError(f"{ENV_SCHEDULE}={spec!r}: expected {FOLLOW}PATH, the path of a JSON schedule file "
                               f"to follow, after the {FOLLOW}")
        source = Path(path)
        try:
            schedule, version = read_schedule(source, sparse)
        except SparrowError as err:
            raise SparrowError(f"{ENV_SCHEDULE}={spec!r}: {err}") from None
        return PluginConfig(sparse, schedule, 0 if version is None else version, source)
    try:
        schedule = parse_schedule(spec, sparse.page_size, sparse.always_kept_pages)
    except SparrowError as err:
        raise SparrowError(f"{ENV_SCHEDULE}={spec!r}: {err}") from None
    return PluginConfig(sparse, schedule)


def cpu_block_size(page_size: int) -> int:
    """The KV block size the plugin asks of vLLM on CPU: one page per block where vLLM's CPU kernels allow it (a
    multiple of 16). vLLM's CPU cache stores each (block, head)'s keys channel-major, so in its default block of
    128 a page's 16 keys of one channel are one cache line 512 bytes from the next channel's: reading the pages the
    rule selects then also pulls their neighbours' lines. With one page per block they are contiguous, and the
    sparse layer reads only what it uses (BENCHMARKS: 0.67 -> 0.53 of the dense layer's time at 1.1K cached tokens
    and 32 of 69 pages). vLLM's own dense kernel is as fast on blocks of 16 at 1K tokens, 7-13% slower at 8K."""
    return math.lcm(16, page_size)


def environment_for(sparse: SparseConfig, schedule: Schedule | str = DENSE) -> dict[str, str]:
    """The variables that make a vLLM process load the plugin with `sparse` and `schedule` (a spec string, or a
    Schedule written as explicit bins)."""
    if isinstance(schedule, Schedule):
        spec = "dense" if schedule.is_dense else ",".join(f"{s}:{b}" for s, b in zip(schedule.starts,
                                                                                        schedule.budgets))
    else:
        spec = schedule
    return {ENV_SCHEDULE: spec, ENV_LANDMARK: sparse.landmark,
            ENV_DENSE_LAYERS: ",".join(str(i) for i in sparse.dense_layers), ENV_PAGE_SIZE: str(sparse.page_size)}


_OPTIONS = ((ENV_PAGE_SIZE, "page_size"), (ENV_LANDMARK, "landmark"), (ENV_DENSE_LAYERS, "dense_layers"))


def check_environment(sparse: SparseConfig, environ=None) -> Schedule | None:
    """For a command that sets these variables from its own options (--backend vllm), which would overwrite the
    user's unseen: refuse, naming the variable and its value, one the user set that is invalid or disagrees with
    `sparse`. Returns the schedule a set SPARROW_VLLM_SCHEDULE asks for, named by its value (None if unset), for
    `check_schedule`."""
    env = os.environ if environ is None else environ
    given = {name: env[name] for name in ENV_NAMES if env.get(name, "").strip()}
    if not given:
        return None
    spec = given.get(ENV_SCHEDULE, "").strip()
    if spec.startswith(FOLLOW):
        raise SparrowError(f"{ENV_SCHEDULE}={given[ENV_SCHEDULE]!r} asks the plugin to follow a schedule file, which "
                           "--backend vllm does not do: the command's --schedule sets the plugin's schedule; unset "
                           f"{ENV_SCHEDULE} (to run the file's schedule, pass --schedule "
                           f"{spec[len(FOLLOW):].strip() or 'PATH'})")
    config = from_environment({**environment_for(sparse), **given})
    for name, attr in _OPTIONS:
        if name in given and getattr(config.sparse, attr) != getattr(sparse, attr):
            option = "--" + attr.replace("_", "-")
            raise SparrowError(f"{name}={given[name]!r} disagrees with the command's {option} "
                               f"{getattr(sparse, attr)!r}: with --backend vllm the command's options configure "
                               f"Sparrow's vLLM plugin; unset {name} or pass {option} {given[name].strip()}")
    return replace(config.schedule, name=given[ENV_SCHEDULE].strip()) if ENV_SCHEDULE in given else None


def check_schedule(wanted: Schedule | None, schedule: Schedule) -> None:
    """Refuse to run `schedule` when the user's SPARROW_VLLM_SCHEDULE (`wanted`, from `check_environment`) is
    another one."""
    if wanted is not None and (wanted.starts, wanted.budgets) != (schedule.starts, schedule.budgets):
        raise SparrowError(f"{ENV_SCHEDULE}={wanted.name!r} disagrees with the "
                           f"command's schedule {schedule.name!r}: with --backend vllm the command's --schedule sets "
                           f"the plugin's schedule; unset {ENV_SCHEDULE} or pass that schedule as --schedule")


def read_schedule(path: str | os.PathLike, sparse: SparseConfig) -> tuple[Schedule, int | None]:
    """A schedule file (any JSON form `parse_schedule` reads) and its optional top-level "version" (an integer
    >= 0), checked against `sparse`; a SparrowError naming the file and the bad value otherwise."""
    path = Path(path)
    schedule = read_schedule_file(path, sparse.page_size, sparse.always_kept_pages)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SparrowError(f"schedule file {str(path)!r} changed while it was read ({err}); expected a file "
                           "replaced atomically (write_schedule)") from None
    version = data.get("version") if isinstance(data, dict) else None
    if version is not None and (type(version) is not int or version < 0):
        raise SparrowError(f"schedule file {str(path)!r}: version {version!r} is not an integer >= 0")
    return schedule, version


def write_schedule(path: str | os.PathLike, schedule: Schedule, version: int, page_size: int = 16,
                   always_kept_pages: int = DEFAULT_KEPT_PAGES) -> Path:
    """The writer's side of a followed schedule file: `schedule` as `{"name", "page_size", "version", "bins"}`,
    replaced atomically, so the plugin never reads half a file. Refused here, as the plugin would refuse it, when
    a budget is not whole pages or holds fewer than the `always_kept_pages` (sink and recent) pages."""
    if type(version) is not int or version < 0:
        raise SparrowError(f"schedule version {version!r} is not an integer >= 0")
    schedule.validate(page_size, always_kept_pages)
    return atomic_write_json(path, {"name": schedule.name, "page_size": page_size, "version": version,
                                    "bins": schedule.to_json()})


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


def _stat_key(path: Path) -> tuple | None:
    """What tells a replaced or rewritten file from the one last seen (None: missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_UNREAD = ("unread",)
_active: PluginConfig | None = None
_seen: tuple | None = _UNREAD  # the followed file's stat when last read (None: it was missing)
_refused: str | None = None  # why the followed file's current content was refused


def active() -> PluginConfig | None:
    """The configuration in force in this process (None: stock vLLM). With a followed schedule file, first one
    `stat` of it, and a re-read when it changed: the attention backend calls this once per engine step."""
    if _active is not None and _active.source is not None:
        _follow(_active.source)
    return _active


def _follow(source: Path) -> None:
    """Put the followed file's schedule in force if it changed and is valid; otherwise log one message for it and
    keep the schedule in force."""
    global _active, _seen, _refused
    key = _stat_key(source)
    if key == _seen:
        return
    try:
        if key is None:
            raise SparrowError(f"schedule file {str(source)!r} does not exist")
        schedule, version = read_schedule(source, _active.sparse)
    except SparrowError as err:
        if _stat_key(source) == key:  # not a file caught mid-write: refuse it once
            _seen, _refused = key, str(err)
            log.warning("Sparrow's vLLM plugin refused %s=%s%s: %s; schedule version %d (%s) stays in force",
                        ENV_SCHEDULE, FOLLOW, source, err, _active.version, _active.schedule.name)
            _report(source)
        return
    if _stat_key(source) != key:
        return  # replaced while read: read it again at the next step
    _seen, _refused = key, None
    changed = (schedule.starts, schedule.budgets) != (_active.schedule.starts, _active.schedule.budgets)
    if version is None:
        version = _active.version + changed
    _active = replace(_active, schedule=schedule, version=version)
    _report(source)


def _report(source: Path) -> None:
    """Write the status file beside the followed one (atomically; a failure is logged, never raised)."""
    config = _active
    status = {"version": config.version, "name": config.schedule.name, "bins": config.schedule.to_json(),
              "since": time.time(), "pid": os.getpid(), "refused": _refused}
    try:
        atomic_write_json(status_path(source), status)
    except OSError as err:
        log.warning("Sparrow's vLLM plugin could not write %s: %s", status_path(source), err)


def activate(config: PluginConfig | None) -> None:
    """Put `config` in force in this process (the plugin's entry point does this from the environment); a followed
    file is read again at the first engine step."""
    global _active, _seen, _refused
    _active, _seen, _refused = config, _UNREAD, None


def set_schedule(schedule: Schedule) -> None:
    """Change the schedule in force for the following forward passes of this process's engine (a followed file
    takes over again when it next changes)."""
    global _active
    if _active is None:
        raise SparrowError("Sparrow's vLLM plugin is not active in this process: set "
                           f"{ENV_SCHEDULE} before the engine starts")
    schedule.validate(_active.sparse.page_size, _active.sparse.always_kept_pages)
    _active = replace(_active, schedule=schedule)
