"""Atomic, resumable training checkpoints: the policy (transformers format), optimizer, and trainer state.

A checkpoint is written into a temporary directory beside its final place and renamed into place at the end,
so a run killed while saving never leaves a half-written `checkpoint-N`; only the last `keep` are kept.
With a DistillSparse adapter (a peft-wrapped model) the policy is still saved as the plain transformers model
(LoRA weights left out, `from_pretrained` loads it), and the adapter goes to `checkpoint-N/adapter/` in peft's
format (`PeftModel.from_pretrained` / `--adapter` load it) with its optimizer state in `adapter/optimizer.pt`.
Every file and the directory are synced to disk before the rename, and the run directory after it, so a crash
cannot leave a renamed checkpoint with empty files. On resume, `latest_valid_checkpoint` checks the newest
checkpoints cheaply (files present, safetensors headers covering their files, optimizer states loadable, trainer
state complete) and falls back past damaged ones.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from sparrow.attention.interface import base_model
from sparrow.errors import SparrowError
from sparrow.io import fsync_dir, umask
from sparrow.lora import ADAPTER_MARK, has_adapter
from sparrow.schedules.controllers import SwitchState

_NAME = re.compile(r"^checkpoint-(\d+)$")
ADAPTER_DIR = "adapter"
_FULL_BELOW = 64 * 2**20  # free bytes under which a failed checkpoint write is put down to a full disk


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def _plain_names(inner) -> dict[str, str]:
    """Plain transformers key -> key in `inner`'s state dict, for every non-LoRA tensor of a LoRA-injected model."""
    return {key.replace(".base_layer", ""): key for key in inner.state_dict() if ADAPTER_MARK not in key}


def save_checkpoint(output_dir: Path, step: int, model, tokenizer, optimizer, state: dict, keep: int,
                    adapter_optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write checkpoint-`step` (after `step` completed steps) atomically and prune to the newest `keep`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    staging = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}.", dir=output_dir))
    try:
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp makes 0700; a checkpoint should look like any directory
        if has_adapter(model):
            inner = base_model(model)
            tensors = inner.state_dict()
            inner.save_pretrained(staging, state_dict={plain: tensors[key]
                                                       for plain, key in _plain_names(inner).items()})
            model.save_pretrained(staging / ADAPTER_DIR)
            if adapter_optimizer is not None:
                torch.save(adapter_optimizer.state_dict(), staging / ADAPTER_DIR / "optimizer.pt")
        else:
            model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        (staging / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=1))
        _fsync_tree(staging)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException as err:
        full = _disk_full(err, staging)
        shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise SparrowError(f"no space left on device while writing {final}; nothing of it was kept: free some "
                               "space, then --resume continues from the last complete checkpoint") from None
        raise
    fsync_dir(output_dir)
    # Prune among steps up to this one: a later checkpoint here is a damaged one a resume skipped, and must not
    # count toward `keep` (it would push out the intact checkpoints).
    for _, old in [c for c in list_checkpoints(output_dir) if c[0] <= step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _disk_full(err: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC, or an error of torch or safetensors (which do not keep the
    errno) on a disk now all but full."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return isinstance(err, Exception) and shutil.disk_usage(where).free < _FULL_BELOW
    except OSError:
        return False


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):  # files before the directories holding them
        if path.is_dir():
            fsync_dir(path)
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(root)


def _safetensors_problem(root: Path, name: str) -> str | None:
    from safetensors import safe_open

    if not (root / name).is_file():
        return f"{name} is missing"
    try:
        with safe_open(root / name, "pt"):  # parses the header and checks that its tensors cover the file exactly
            return None
    except Exception as err:  # noqa: BLE001 - any failure to open means the file is damaged
        return f"{name}: {err}"


def _optimizer_problem(root: Path, name: str) -> str | None:
    if not (root / name).is_file():
        return f"{name} is missing"
    try:
        state = torch.load(root / name, map_location="cpu", weights_only=True, mmap=True)  # mmap: no tensor read
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file raises anything from zip to unpickling
        return f"{name} does not load ({(str(err).splitlines() or [type(err).__name__])[0]})"
    if not isinstance(state, dict) or not {"state", "param_groups"} <= state.keys():
        return f"{name} is not an optimizer state"
    return None


def _read_json(root: Path, name: str) -> tuple[dict | None, str | None]:
    """(object, None) or (None, what is wrong) for JSON file `name` under `root`."""
    if not (root / name).is_file():
        return None, f"{name} is missing"
    try:
        data = json.loads((root / name).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{name} is not valid JSON ({err})"
    return (data, None) if isinstance(data, dict) else (None, f"{name} is not a JSON object")


def _state_problem(path: Path) -> str | None:
    state, problem = _read_json(path, "trainer_state.json")
    if problem is not None:
        return problem
    match = _NAME.match(path.name)
    if not isinstance(state.get("step"), int) or (match and state["step"] != int(match.group(1))):
        return f"trainer_state.json has step {state.get('step')!r}; expected {match.group(1) if match else 'an int'}"
    if not isinstance(state.get("config"), dict):
        return "trainer_state.json holds no config"
    try:
        SwitchState.from_json(state.get("switch"))
    except TypeError:
        return f"trainer_state.json has an invalid switch state {state.get('switch')!r}"
    return None


def read_trainer_state(path: Path) -> dict:
    """The trainer state of checkpoint `path` ({"step", "config", "switch"}); SparrowError naming what is wrong."""
    problem = _state_problem(path)
    if problem is not None:
        raise SparrowError(f"checkpoint {path} is damaged: {problem}")
    return json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint directory `path` cannot be resumed from, or None if it looks intact. Cheap: it reads
    headers and JSON, not the weights; the first problem found is named."""
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    if not weights:
        return "no model weights (*.safetensors)" if any(path.iterdir()) else "the directory is empty"
    index, problem = (_read_json(path, "model.safetensors.index.json")
                      if (path / "model.safetensors.index.json").exists() else ({}, None))
    shards = sorted(set((index or {}).get("weight_map", {}).values()) - set(weights))
    problems = [problem, f"shard {shards[0]} is missing" if shards else None,
                *(_safetensors_problem(path, w) for w in weights), _read_json(path, "config.json")[1],
                _optimizer_problem(path, "optimizer.pt")]
    if (path / ADAPTER_DIR).is_dir():
        problems += [_safetensors_problem(path, f"{ADAPTER_DIR}/adapter_model.safetensors"),
                     _read_json(path, f"{ADAPTER_DIR}/adapter_config.json")[1],
                     _optimizer_problem(path, f"{ADAPTER_DIR}/optimizer.pt")]
    problems.append(_state_problem(path))
    return next((p for p in problems if p is not None), None)


def latest_valid_checkpoint(output_dir: Path, log) -> tuple[int, Path] | None:
    """(step, path) of the newest intact checkpoint in `output_dir`, each newer damaged one skipped with a
    warning naming it; None if there is no checkpoint. A SparrowError if every checkpoint is damaged: starting
    over would silently throw the run away."""
    found = list_checkpoints(Path(output_dir))
    damaged = []
    for step, path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            return step, path
        log(f"warning: skipping damaged checkpoint {path}: {problem}")
        damaged.append(f"{path.name} ({problem})")
    if damaged:
        raise SparrowError(f"no intact checkpoint to resume from in {output_dir}: {'; '.join(damaged)}; delete them "
                           "to start the run over, or choose another --output-dir")
    return None


def load_checkpoint(path: Path, model, optimizer, adapter_optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore the policy weights, the adapter if any, and their optimizer states in place; returns the trainer
    state."""
    from safetensors.torch import load_file

    problem = checkpoint_problem(path)
    if problem is not None:
        raise SparrowError(f"checkpoint {path} is damaged: {problem}")
    adapter = path / ADAPTER_DIR
    if adapter.is_dir() != has_adapter(model):
        held = "holds a DistillSparse adapter" if adapter.is_dir() else "holds no DistillSparse adapter"
        raise SparrowError(f"checkpoint {path} {held} but this run has distill "
                           f"{'on' if has_adapter(model) else 'off'}; resume with the run's own distill setting")
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    inner = base_model(model)
    names = _plain_names(inner)
    missing, unexpected = inner.load_state_dict({names.get(k, k): v for k, v in weights.items()}, strict=False)
    plain = {key: name for name, key in names.items()}
    missing = {plain[key] for key in missing if ADAPTER_MARK not in key}
    tied = set(getattr(inner, "_tied_weights_keys", None) or {})
    if unexpected or missing - tied:
        raise SparrowError(f"checkpoint {path} does not match the model (missing {_some(missing - tied)}, "
                           f"unexpected {_some(unexpected)}); resume with the run's own --model")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if adapter.is_dir():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapter / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise SparrowError(f"adapter {adapter} does not match the model (unexpected "
                               f"{_some(result.unexpected_keys)}); resume with the run's own distill options")
        if adapter_optimizer is not None:
            adapter_optimizer.load_state_dict(torch.load(adapter / "optimizer.pt", weights_only=True))
    return read_trainer_state(path)


def _some(names) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "") if names else "none"
