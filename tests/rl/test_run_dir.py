"""A run's output directory: one run at a time (also against other processes), stale locks of killed runs taken
over, debris of killed writes removed, resumes with changed options refused, logs cut back to the checkpoint."""

import errno
import fcntl
import json
import multiprocessing
import os
import signal
import socket
import time

import pytest

from sparrow.errors import SparrowError
from sparrow.rl import run_dir
from sparrow.rl.run_dir import (
    RESUMABLE_OPTIONS,
    RunLock,
    check_resume_config,
    clean_stray_files,
    config_differences,
    repair_metrics,
)

_fork = multiprocessing.get_context("fork")  # the children start at once: no second import of torch


def _hold(path, ready, spawn_child):
    """Take the run lock, optionally fork a long-lived child (a reward worker), report, then wait to be killed."""
    RunLock(path, log=lambda _: None).acquire()
    if not spawn_child:
        ready.send(None)
    elif os.fork() == 0:
        ready.send(os.getpid())  # sent once the child runs, after the fork hooks
        time.sleep(60)
        os._exit(0)
    time.sleep(60)


def _start_holder(path, spawn_child=False):
    receive, send = _fork.Pipe(duplex=False)
    proc = _fork.Process(target=_hold, args=(path, send, spawn_child), daemon=True)
    proc.start()
    assert receive.poll(10), "the holder did not take the lock"
    return proc, receive.recv()


def _dead_pid() -> int:
    proc = _fork.Process(target=os._exit, args=(0,))
    proc.start()
    proc.join()
    return proc.pid


def _record(pid, boot_id=None):
    return json.dumps({"pid": pid, "host": socket.gethostname(), "boot_id": boot_id or run_dir._boot_id(),
                       "started": "2026-12-01T10:00:00"})


def test_a_second_run_fails_at_once_naming_the_holder_and_takes_over_after_a_kill(tmp_path):
    proc, _ = _start_holder(tmp_path / "run")
    try:
        began = time.perf_counter()
        with pytest.raises(SparrowError, match=rf"in use by another run \(pid {proc.pid} on host "
                                               rf"{socket.gethostname()}, started 20\d\d-"):
            RunLock(tmp_path / "run").acquire()
        assert time.perf_counter() - began < 1
    finally:
        proc.kill()
        proc.join()
    messages = []
    with RunLock(tmp_path / "run", log=messages.append):
        holder = json.loads((tmp_path / "run" / "run.lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert len(messages) == 1 and f"pid {proc.pid} is no longer running); taking it over" in messages[0]
    assert (tmp_path / "run" / "run.lock").read_text() == ""  # released cleanly: nothing to take over next time
    with RunLock(tmp_path / "run", log=messages.append):
        pass
    assert len(messages) == 1


def test_one_process_cannot_hold_one_directory_twice(tmp_path):
    with RunLock(tmp_path, log=lambda _: None), pytest.raises(SparrowError, match=f"pid {os.getpid()} "):
        RunLock(tmp_path).acquire()


def test_a_forked_worker_does_not_keep_a_killed_runs_lock(tmp_path):
    proc, child = _start_holder(tmp_path, spawn_child=True)
    try:
        proc.kill()
        proc.join()
        messages = []
        with RunLock(tmp_path, log=messages.append):
            assert "taking it over" in messages[0]
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_stale_record_of_a_dead_pid_or_an_earlier_boot_is_taken_over(tmp_path):
    pid = _dead_pid()
    (tmp_path / "run.lock").write_text(_record(pid))
    messages = []
    with RunLock(tmp_path, log=messages.append):
        pass
    (tmp_path / "run.lock").write_text(_record(os.getpid(), boot_id="an-earlier-boot"))
    with RunLock(tmp_path, log=messages.append):
        pass
    assert f"pid {pid} is no longer running" in messages[0]
    assert "it ran before this machine last booted" in messages[1]


def test_without_file_locks_the_record_decides(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    proc = _fork.Process(target=time.sleep, args=(30,), daemon=True)
    proc.start()
    try:
        (tmp_path / "run.lock").write_text(_record(proc.pid))
        with pytest.raises(SparrowError, match=rf"pid {proc.pid} .*delete .*run.lock if that run is gone"):
            RunLock(tmp_path).acquire()
    finally:
        proc.kill()
        proc.join()
    messages = []
    with RunLock(tmp_path, log=messages.append):
        pass
    assert f"pid {proc.pid} is no longer running" in messages[0]


def test_an_output_path_that_is_a_file_is_one_message(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(SparrowError, match="is an existing file; expected a directory"):
        RunLock(tmp_path / "out").acquire()


def test_a_run_that_fails_before_writing_leaves_no_directory_it_created(tmp_path):
    with pytest.raises(SparrowError), RunLock(tmp_path / "new"):
        raise SparrowError("bad reward")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with pytest.raises(SparrowError), RunLock(tmp_path / "old"):
        raise SparrowError("bad reward")
    assert (tmp_path / "old").is_dir()  # not ours to remove
    with pytest.raises(SparrowError), RunLock(tmp_path / "wrote"):
        (tmp_path / "wrote" / "metrics.jsonl").write_text("{}\n")
        raise SparrowError("step 1 failed")
    assert (tmp_path / "wrote" / "metrics.jsonl").is_file()
    with RunLock(tmp_path / "fine"):
        pass
    assert (tmp_path / "fine").is_dir()


def test_taking_the_lock_removes_unfinished_writes_only(tmp_path):
    (tmp_path / ".checkpoint-3.k2j4h1").mkdir()
    (tmp_path / ".checkpoint-3.k2j4h1" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "model.safetensors").write_bytes(b"whole")
    (tmp_path / "checkpoint-2" / ".trainer_state.json.x1.tmp").write_text("{")
    (tmp_path / ".report.md.a8f.tmp").write_text("half")
    (tmp_path / "notes.tmp").write_text("the user's")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    messages = []
    with RunLock(tmp_path, log=messages.append):
        pass
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["checkpoint-2", "checkpoint-2/model.safetensors", "metrics.jsonl", "notes.tmp", "run.lock"]
    assert messages == ["removed 3 unfinished write(s) of a killed run: .checkpoint-3.k2j4h1, "
                        ".report.md.a8f.tmp, .trainer_state.json.x1.tmp"]
    assert clean_stray_files(tmp_path / "missing") == []


SAVED = {"model": "tiny-qwen3", "seed": 0, "steps": 4, "output_dir": "runs/a", "resume": False,
         "grpo": {"learning_rate": 1e-6, "num_generations": 8, "clip": [0.2, 0.28]},
         "eval": {"every": 10, "data": None}}


def _current(**changes):
    config = json.loads(json.dumps(SAVED))
    for name, value in changes.items():
        *sections, leaf = name.split("__")
        target = config
        for section in sections:
            target = target[section]
        target[leaf] = value
    return config


def test_config_differences_compare_dotted_names_and_skip_ignored_and_allowed():
    current = _current(seed=1, grpo__learning_rate=1e-5, grpo__clip=(0.2, 0.28), output_dir="runs/b", resume=True,
                       eval__every=5, allow_changes=True)
    assert config_differences(SAVED, current, set()) == ["eval.every: 10 -> 5", "grpo.learning_rate: 1e-06 -> 1e-05",
                                                         "seed: 0 -> 1"]
    assert config_differences(SAVED, current, {"eval", "seed"}) == ["grpo.learning_rate: 1e-06 -> 1e-05"]
    added = _current(grpo__kl_coef=0.1)
    assert config_differences(SAVED, added, set()) == ["grpo.kl_coef: (not set) -> 0.1"]
    assert config_differences(SAVED, _current(steps=float("nan")), {"seed"}) == ["steps: 4 -> nan"]


def test_a_changed_resume_is_refused_listing_every_difference_unless_allowed():
    changed = _current(seed=3, grpo__num_generations=4, steps=8)
    with pytest.raises(SparrowError) as err:
        check_resume_config(SAVED, changed, allow_changes=False, where="runs/a/checkpoint-4")
    message = str(err.value)
    assert message.startswith("runs/a/checkpoint-4 was saved with different options: grpo.num_generations: 8 -> 4; "
                              "seed: 0 -> 3; steps: 4 -> 8; resume with the saved options, or pass --allow-changes")
    assert "\n" not in message
    with pytest.raises(SparrowError, match=r"even with --allow-changes: grpo.num_generations: 8 -> 4; seed: 0 -> 3;"
                                           r" restore them"):
        check_resume_config(SAVED, changed, allow_changes=True)
    extended = _current(steps=8, eval__every=2, output_dir="elsewhere")
    assert check_resume_config(SAVED, extended, allow_changes=True) == ["eval.every: 10 -> 2", "steps: 4 -> 8"]
    assert check_resume_config(SAVED, _current(resume=True), allow_changes=False) == []


def test_the_resumable_options_exclude_what_defines_the_run():
    defining = ["model", "data", "seed", "num_generations", "prompts_per_step", "learning_rate", "schedule", "dtype",
                "distill", "distill_rank", "max_new_tokens", "temperature", "page_size", "model.name", "run.seed",
                "grpo.learning_rate", "monitor.tau", "monitor.bin_size", "sparse.schedule", "distill.rank"]
    assert [name for name in defining if run_dir._matches(name, RESUMABLE_OPTIONS)] == []
    assert all(run_dir._matches(name, RESUMABLE_OPTIONS)
               for name in ["steps", "save_every", "keep_last", "eval.every", "eval.schedule", "grpo.steps",
                            "run.keep_last", "model.device", "rollout.workers", "monitor.monitor", "grpo.non_finite"])


def test_repair_metrics_cuts_the_log_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "try": 1}, {"step": 2, "try": 1}, {"step": 3, "try": 1}, {"step": 2, "try": 2},
            {"step": 3, "try": 2}, {"step": 4, "try": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    messages = []
    assert repair_metrics(path, 3, log=messages.append) == 4
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "try": 1}, {"step": 2, "try": 2}, {"step": 3, "try": 2}]
    assert messages == ["metrics.jsonl: dropped 3 row(s) past step 3 or logged twice and a torn last line "
                        "(written before the checkpoint a kill prevented)"]
    inode = path.stat().st_ino
    assert repair_metrics(path, 3) == 0 and path.stat().st_ino == inode  # nothing to do: not rewritten
    assert repair_metrics(tmp_path / "eval.jsonl", 3) == 0
    assert repair_metrics(path, -1) == 3 and path.read_text() == ""


def test_repair_metrics_refuses_a_row_without_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"loss": 2}\n')
    with pytest.raises(SparrowError, match=r"metrics.jsonl:2: expected an integer 'step', got None"):
        repair_metrics(path, 1)
