"""What the vLLM plugin does, read from the environment (no vLLM import, so it is testable anywhere).

vLLM builds its engine from its own arguments, and TRL builds `LLM(...)` itself, so the plugin takes no engine
arguments: it is configured by environment variables, read when the plugin loads in each process.

- SPARROW_VLLM_SCHEDULE: a schedule spec (`parse_schedule`: a preset name, `const:N`, `0:512,3584:1024`, a JSON
  file, or `dense`), fixed for the engine's life; or `@PATH`, a JSON schedule file the plugin follows while vLLM
  runs (state.py). Unset: the plugin does nothing and vLLM runs stock.
- SPARROW_VLLM_LANDMARK (centroid|quest), SPARROW_VLLM_DENSE_LAYERS ("0,1"), SPARROW_VLLM_PAGE_SIZE (16):
  the SparseConfig, as our engine's options.

A command that starts vLLM itself with the plugin (--backend vllm) sets these variables from its options
(`environment_for`), after checking that the user's own do not disagree (`check_environment`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError
from sparrow.io import env_int
from sparrow.schedules import DENSE, Schedule, parse_schedule, read_schedule_file

ENV_SCHEDULE = "SPARROW_VLLM_SCHEDULE"
ENV_LANDMARK = "SPARROW_VLLM_LANDMARK"
ENV_DENSE_LAYERS = "SPARROW_VLLM_DENSE_LAYERS"
ENV_PAGE_SIZE = "SPARROW_VLLM_PAGE_SIZE"
ENV_NAMES = (ENV_SCHEDULE, ENV_LANDMARK, ENV_DENSE_LAYERS, ENV_PAGE_SIZE)
DEFAULT_DENSE_LAYERS = ",".join(map(str, SparseConfig.dense_layers))  # the release's, as the variable spells it
FOLLOW = "@"  # SPARROW_VLLM_SCHEDULE=@PATH: the schedule file followed at run time


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
    layers_text = env.get(ENV_DENSE_LAYERS, DEFAULT_DENSE_LAYERS)
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
            schedule, version = read_schedule_file(source, sparse.page_size, sparse.always_kept_pages)
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
    sparse layer reads only what it uses; vLLM's own dense kernel is somewhat slower on blocks of 16 at long context
    (figures: docs/vllm-plugin.md and BENCHMARKS.md, "Decode speed in vLLM with the plugin")."""
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

