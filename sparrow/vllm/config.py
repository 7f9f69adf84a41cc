"""What the vLLM plugin does, read from the environment (no vLLM import, so it is testable anywhere).

vLLM builds its engine from its own arguments, and TRL builds `LLM(...)` itself, so the plugin takes no engine
arguments: it is configured by environment variables, read once per process when the plugin loads.

- SPARROW_VLLM_SCHEDULE: a schedule spec (`parse_schedule`: a preset name, `const:N`, `0:512,3584:1024`, a JSON
  file, or `dense`). Unset: the plugin does nothing and vLLM runs stock.
- SPARROW_VLLM_LANDMARK (centroid|quest), SPARROW_VLLM_DENSE_LAYERS ("0,1"), SPARROW_VLLM_PAGE_SIZE (16):
  the SparseConfig, as our engine's options.

In the process that runs the model (VLLMBackend runs vLLM in-process), `set_schedule` changes the schedule between
generate calls; the engine's own state (landmarks) does not depend on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from sparrow.attention.config import SparseConfig
from sparrow.errors import SparrowError
from sparrow.schedules import DENSE, Schedule, parse_schedule

ENV_SCHEDULE = "SPARROW_VLLM_SCHEDULE"
ENV_LANDMARK = "SPARROW_VLLM_LANDMARK"
ENV_DENSE_LAYERS = "SPARROW_VLLM_DENSE_LAYERS"
ENV_PAGE_SIZE = "SPARROW_VLLM_PAGE_SIZE"
ENV_NAMES = (ENV_SCHEDULE, ENV_LANDMARK, ENV_DENSE_LAYERS, ENV_PAGE_SIZE)


@dataclass(frozen=True)
class PluginConfig:
    """The sparse rule the plugin applies: our SparseConfig and the schedule in force."""

    sparse: SparseConfig
    schedule: Schedule


def from_environment(environ=None) -> PluginConfig | None:
    """The configuration the environment asks for, None when SPARROW_VLLM_SCHEDULE is unset; a SparrowError
    naming the variable for any bad value."""
    env = os.environ if environ is None else environ
    spec = env.get(ENV_SCHEDULE, "").strip()
    if not spec:
        return None
    page_text = env.get(ENV_PAGE_SIZE, "16").strip()
    try:
        page_size = int(page_text)
    except ValueError:
        raise SparrowError(f"{ENV_PAGE_SIZE}={page_text!r}: expected a positive integer") from None
    try:
        sparse = SparseConfig.from_options(page_size, env.get(ENV_LANDMARK, "centroid").strip(),
                                           env.get(ENV_DENSE_LAYERS, "0,1"))
    except SparrowError as err:
        raise SparrowError(f"Sparrow's vLLM plugin ({', '.join(ENV_NAMES[1:])}): {err}") from None
    try:
        schedule = parse_schedule(spec, sparse.page_size, sparse.always_kept_pages)
    except SparrowError as err:
        raise SparrowError(f"{ENV_SCHEDULE}={spec!r}: {err}") from None
    return PluginConfig(sparse, schedule)


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
    config = from_environment({**environment_for(sparse), **given})
    for name, field in _OPTIONS:
        if name in given and getattr(config.sparse, field) != getattr(sparse, field):
            option = "--" + field.replace("_", "-")
            raise SparrowError(f"{name}={given[name]!r} disagrees with the command's {option} "
                               f"{getattr(sparse, field)!r}: with --backend vllm the command's options configure "
                               f"Sparrow's vLLM plugin; unset {name} or pass {option} {given[name].strip()}")
    return replace(config.schedule, name=given[ENV_SCHEDULE].strip()) if ENV_SCHEDULE in given else None


def check_schedule(wanted: Schedule | None, schedule: Schedule) -> None:
    """Refuse to run `schedule` when the user's SPARROW_VLLM_SCHEDULE (`wanted`, from `check_environment`) is
    another one."""
    if wanted is not None and (wanted.starts, wanted.budgets) != (schedule.starts, schedule.budgets):
        raise SparrowError(f"{ENV_SCHEDULE}={wanted.name!r} disagrees with the "
                           f"command's schedule {schedule.name!r}: with --backend vllm the command's --schedule sets "
                           f"the plugin's schedule; unset {ENV_SCHEDULE} or pass that schedule as --schedule")


_active: PluginConfig | None = None


def active() -> PluginConfig | None:
    """The configuration in force in this process (None: stock vLLM)."""
    return _active


def activate(config: PluginConfig | None) -> None:
    """Put `config` in force in this process (the plugin's entry point does this from the environment)."""
    global _active
    _active = config


def set_schedule(schedule: Schedule) -> None:
    """Change the schedule in force for the following forward passes of this process's engine."""
    if _active is None:
        raise SparrowError("Sparrow's vLLM plugin is not active in this process: set "
                           f"{ENV_SCHEDULE} before the engine starts")
    schedule.validate(_active.sparse.page_size, _active.sparse.always_kept_pages)
    activate(PluginConfig(_active.sparse, schedule))
