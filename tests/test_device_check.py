"""scripts/device_check.py, the one GPU check, without a GPU: which steps it plans in which order (checks before
timings), and how a step's result, failure, failed check or skip past the deadline lands in its one JSON file."""

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scripts(monkeypatch, tmp_path):
    """scripts/ importable, and device_record writing a fresh summary under tmp_path."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import device_record

    monkeypatch.setattr(device_record, "SUMMARY", {"machine": {}, "steps": {}, "checks": []})
    monkeypatch.setattr(device_record, "PATH", tmp_path / "device_check.json")
    monkeypatch.setattr(device_record, "DEADLINE", 0.0)
    return device_record


def test_every_sections_checks_run_before_the_timings(scripts, tmp_path):
    import device_check

    args = device_check.parse_args(["--out", str(tmp_path)])
    names = [name for name, _ in device_check.plan(args, torch.device("cpu"), tmp_path)]
    assert names == ["engine/attention_checks", "engine/exact_checks", "engine/training_checks",
                     "vllm/kernel_vs_reference", "vllm/graph_capture_vs_eager", "vllm/plan_time",
                     "vllm/vllm_vs_teacher_forced", "exact/identity", *device_check.TIMINGS]
    dry = device_check.parse_args(["--dry-run", "--sections", "vllm,exact"])
    assert [name for name, _ in device_check.plan(dry, torch.device("cpu"), tmp_path)] == [
        "vllm/kernel_vs_reference", "vllm/graph_capture_vs_eager", "vllm/plan_time"]
    with pytest.raises(SystemExit):
        device_check.parse_args(["--sections", "engine,trl"])


def test_steps_record_results_failures_and_skips_past_the_deadline(scripts):
    def failing_check():
        scripts.check("a number", 2.0, 1.0)

    def raising():
        raise RuntimeError("no CUDA here")

    scripts.run_step("a/fine", lambda: {"tokens_per_s": 3.0})
    scripts.run_step("a/partial", lambda: {"runs": [], "ok": False})
    scripts.run_step("a/check", failing_check)
    scripts.run_step("a/raises", raising)
    scripts.DEADLINE = 1e-9
    scripts.run_step("a/late", lambda: pytest.fail("a step ran past the deadline"))
    saved = json.loads(scripts.PATH.read_text())
    steps = saved["steps"]
    assert steps["a/fine"]["ok"] and steps["a/fine"]["tokens_per_s"] == 3.0
    assert not steps["a/partial"]["ok"] and not steps["a/check"]["ok"]
    assert not steps["a/raises"]["ok"] and "RuntimeError: no CUDA here" in steps["a/raises"]["error"]
    assert "past the deadline" in steps["a/late"]["skipped"]
    assert saved["checks"] == [{"check": "a number", "value": 2.0, "limit": 1.0, "ok": False}]
    assert scripts.seconds_left(600) == 1.0  # a child process started now gets what is left, at least a second
