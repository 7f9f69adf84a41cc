"""Atomic, resumable training checkpoints: the policy (transformers format), optimizer, and trainer state.

A checkpoint is written into a temporary directory beside its final place and renamed into place at the end,
so a run killed while saving never leaves a half-written `checkpoint-N`; only the last `keep` are kept.
With a DistillSparse adapter (a peft-wrapped model) the policy is still saved as the plain transformers model
(LoRA weights left out, `from_pretrained` loads it), and the adapter goes to `checkpoint-N/adapter/` in peft's
format (`PeftModel.from_pretrained` / `--adapter` load it) with its optimizer state in `adapter/optimizer.pt`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from sparrow.attention.interface import base_model
from sparrow.errors import SparrowError

from .distill import ADAPTER_MARK

_NAME = re.compile(r"^checkpoint-(\d+)$")
ADAPTER_DIR = "adapter"


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def _has_adapter(model) -> bool:
    return hasattr(model, "peft_config")


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
        if _has_adapter(model):
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
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for _, old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model, optimizer, adapter_optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore the policy weights, the adapter if any, and their optimizer states in place; returns the trainer
    state."""
    from safetensors.torch import load_file

    adapter = path / ADAPTER_DIR
    if adapter.is_dir() != _has_adapter(model):
        held = "holds a DistillSparse adapter" if adapter.is_dir() else "holds no DistillSparse adapter"
        raise SparrowError(f"checkpoint {path} {held} but this run has distill "
                           f"{'on' if _has_adapter(model) else 'off'}; resume with the run's own distill setting")
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
        raise RuntimeError(f"checkpoint {path} does not match the model (missing {missing}, unexpected {unexpected})")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if adapter.is_dir():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapter / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise RuntimeError(f"adapter {adapter} does not match the model (unexpected {result.unexpected_keys})")
        if adapter_optimizer is not None:
            adapter_optimizer.load_state_dict(torch.load(adapter / "optimizer.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())
