"""Checkpoints on disk: the user's permissions, synced before and after the rename, damaged ones recognised cheaply
and skipped for the newest intact one, and pruning that never removes an intact checkpoint for a damaged one."""

import json
import os
import shutil
import stat

import pytest
import torch

from sparrow.errors import SparrowError
from sparrow.lora import LoraSpec, adapter_parameters, attach_adapter, base_parameters
from sparrow.models import load_model
from sparrow.rl.checkpoint import (
    checkpoint_problem,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _trained(distill=False):
    """A fresh tiny model after one optimizer step (so the optimizer state holds tensors), its tokenizer and
    optimizers."""
    model, tokenizer = load_model("tiny-llama")
    if distill:
        model = attach_adapter(model, LoraSpec(rank=2, alpha=16.0))
    optimizer = torch.optim.AdamW(base_parameters(model), lr=1e-3)
    adapter_optimizer = torch.optim.AdamW(adapter_parameters(model), lr=1e-3) if distill else None
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    if adapter_optimizer is not None:
        adapter_optimizer.step()
    return model, tokenizer, optimizer, adapter_optimizer


def _save(out, steps, distill=False, keep=5):
    model, tokenizer, optimizer, adapter_optimizer = _trained(distill)
    for step in steps:
        save_checkpoint(out, step, model, tokenizer, optimizer, {"config": {"seed": 0}, "switch": None}, keep,
                        adapter_optimizer)
    return model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A run directory with intact checkpoint-1 and checkpoint-2 (plain policy) and one with an adapter."""
    root = tmp_path_factory.mktemp("runs")
    _save(root / "plain", [1, 2])
    _save(root / "distill", [1, 2], distill=True)
    return root


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGES = {
    "truncated weights": (lambda c: _truncate(c / "model.safetensors"), "model.safetensors: .*not fully covered"),
    "weights cut in the header": (lambda c: _truncate(c / "model.safetensors", 0.0001), "model.safetensors: "),
    "garbage optimizer": (lambda c: (c / "optimizer.pt").write_bytes(os.urandom(4096)), "optimizer.pt does not load"),
    "truncated optimizer": (lambda c: _truncate(c / "optimizer.pt"), "optimizer.pt does not load"),
    "missing trainer state": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "invalid trainer state": (lambda c: (c / "trainer_state.json").write_text('{"step": 2, "con'),
                              "trainer_state.json is not valid JSON"),
    "trainer state without config": (lambda c: (c / "trainer_state.json").write_text('{"step": 2}'),
                                     "trainer_state.json holds no config"),
    "trainer state of another step": (lambda c: (c / "trainer_state.json").write_text('{"step": 7, "config": {}}'),
                                      "trainer_state.json has step 7; expected 2"),
    "missing weights": (lambda c: (c / "model.safetensors").unlink(), r"no model weights \(\*.safetensors\)"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one(pristine, tmp_path, damage):
    out = tmp_path / "run"
    shutil.copytree(pristine / "plain", out)
    spoil, problem = DAMAGES[damage]
    spoil(out / "checkpoint-2")
    warnings = []
    assert latest_valid_checkpoint(out, warnings.append) == (1, out / "checkpoint-1")
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping damaged checkpoint {out}/checkpoint-2: ")
    assert checkpoint_problem(out / "checkpoint-2") is not None
    with pytest.raises(SparrowError, match=f"checkpoint {out}/checkpoint-2 is damaged: {problem}"):
        load_checkpoint(out / "checkpoint-2", *_trained()[::2])
    model, _, optimizer, _ = _trained()
    assert load_checkpoint(out / "checkpoint-1", model, optimizer)["step"] == 1
    assert len(optimizer.state) == len(list(model.parameters()))


def test_an_empty_stray_checkpoint_is_skipped(pristine, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(pristine / "plain", out)
    (out / "checkpoint-3").mkdir()
    warnings = []
    assert latest_valid_checkpoint(out, warnings.append) == (2, out / "checkpoint-2")
    assert warnings == [f"warning: skipping damaged checkpoint {out}/checkpoint-3: the directory is empty"]


def test_a_damaged_adapter_is_recognised(pristine, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(pristine / "distill", out)
    assert checkpoint_problem(out / "checkpoint-2") is None
    _truncate(out / "checkpoint-2" / "adapter" / "adapter_model.safetensors")
    (out / "checkpoint-1" / "adapter" / "optimizer.pt").unlink()
    assert checkpoint_problem(out / "checkpoint-2").startswith("adapter/adapter_model.safetensors: ")
    assert checkpoint_problem(out / "checkpoint-1") == "adapter/optimizer.pt is missing"


def test_no_intact_checkpoint_is_one_message_and_no_checkpoint_is_none(pristine, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(pristine / "plain", out)
    (out / "checkpoint-1" / "optimizer.pt").unlink()
    (out / "checkpoint-2" / "trainer_state.json").unlink()
    with pytest.raises(SparrowError, match=r"no intact checkpoint to resume from in .*: checkpoint-2 "
                                           r"\(trainer_state.json is missing\); checkpoint-1 \(optimizer.pt is "
                                           r"missing\); delete them"):
        latest_valid_checkpoint(out, lambda _: None)
    assert latest_valid_checkpoint(tmp_path / "fresh", lambda _: None) is None


def test_checkpoints_get_the_users_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        _save(tmp_path, [1])
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "checkpoint-1").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "checkpoint-1" / "trainer_state.json").stat().st_mode) == 0o640


def test_a_checkpoint_is_synced_before_its_rename_and_the_run_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    model, tokenizer, optimizer, _ = _trained()
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(tmp_path, 1, model, tokenizer, optimizer, {"config": {}}, 2)
    rename = events.index("rename")
    synced = {os.path.relpath(p, tmp_path).split("/", 1)[-1] for p in events[:rename]}
    files = {str(p.relative_to(tmp_path / "checkpoint-1")) for p in (tmp_path / "checkpoint-1").rglob("*")}
    assert files <= synced and {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= files
    assert events[rename + 1:] == [str(tmp_path)]


def test_pruning_keeps_intact_checkpoints_over_a_later_damaged_one(tmp_path):
    model, tokenizer, optimizer, _ = _trained()
    save_checkpoint(tmp_path, 1, model, tokenizer, optimizer, {"config": {}}, 1)
    (tmp_path / "checkpoint-5").mkdir()  # left by a killed run; the resume skipped it
    save_checkpoint(tmp_path, 2, model, tokenizer, optimizer, {"config": {}}, 1)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 5]
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["step"] == 2
