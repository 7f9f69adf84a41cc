"""Atomic, resumable training checkpoints: the policy (transformers format), optimizer, and trainer state.

A checkpoint is written into a temporary directory beside its final place and renamed into place at the end,
so a run killed while saving never leaves a half-written `checkpoint-N`; only the last `keep` are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def save_checkpoint(output_dir: Path, step: int, model, tokenizer, optimizer, state: dict, keep: int) -> Path:
    """Write checkpoint-`step` (after `step` completed steps) atomically and prune to the newest `keep`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    staging = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}.", dir=output_dir))
    try:
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


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore the policy weights and optimizer state in place; returns the trainer state."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint {path} does not match the model (missing {missing}, unexpected {unexpected})")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())
