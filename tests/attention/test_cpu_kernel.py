"""The compiled kernel's build lock: a build killed midway (torch's `lock` file left behind) is detected and redone
instead of hanging every later run; waiting for a live build is bounded. No real compile: torch's build is faked."""

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from sparrow.attention import cpu_kernel

_fork = multiprocessing.get_context("fork")


def _killed_build(build_dir: Path) -> None:
    """What a kill during torch's first build leaves: its baton and partial outputs."""
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    (build_dir / "sparse_decode.o").write_bytes(b"\x7fELF partial")
    (build_dir / "build.ninja").write_text("rule cxx\n")


def test_a_killed_builds_lock_is_detected_and_its_partial_build_removed(tmp_path):
    build_dir = tmp_path / "sparrow_sparse_decode"
    _killed_build(build_dir)
    messages = []
    with cpu_kernel.build_guard(build_dir, wait_s=1.0, log=messages.append) as free:
        assert free and sorted(p.name for p in build_dir.iterdir()) == ["sparrow-build.lock"]
    assert len(messages) == 1 and messages[0].startswith(f"removing {build_dir / 'lock'} and the partial build")
    with cpu_kernel.build_guard(build_dir, wait_s=1.0, log=messages.append) as free:
        assert free
    assert len(messages) == 1  # an intact build directory is left alone


def _hold_build_lock(build_dir, ready):
    with cpu_kernel.build_guard(build_dir, wait_s=1.0, log=lambda _: None):
        (build_dir / "lock").touch()  # torch's baton of this live build
        ready.send(True)
        time.sleep(60)


def test_waiting_for_a_live_build_is_bounded_and_says_who_builds(tmp_path):
    receive, send = _fork.Pipe(duplex=False)
    holder = _fork.Process(target=_hold_build_lock, args=(tmp_path, send), daemon=True)
    holder.start()
    try:
        assert receive.poll(10)
        messages = []
        began = time.perf_counter()
        with cpu_kernel.build_guard(tmp_path, wait_s=0.3, log=messages.append) as free:
            assert not free
        assert 0.3 <= time.perf_counter() - began < 2
        assert messages == [f"waiting for pid {holder.pid} to finish building the CPU kernel in {tmp_path} "
                            "(at most 0.3 s)"]
        assert (tmp_path / "lock").exists()  # a live build's baton is not touched
    finally:
        holder.kill()
        holder.join()
    with cpu_kernel.build_guard(tmp_path, wait_s=0.3, log=messages.append) as free:
        assert free and not (tmp_path / "lock").exists()  # the holder died: now its baton is stale


def test_load_builds_past_a_stale_lock_instead_of_waiting_forever(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("SPARROW_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_module", None)
    _killed_build(tmp_path / "sparrow_sparse_decode")
    built = object()

    def torch_load(name, build_directory, **_):
        if os.path.exists(os.path.join(build_directory, "lock")):  # torch's FileBaton.wait() would spin forever
            raise AssertionError("torch would wait forever on the stale lock")
        return built

    monkeypatch.setattr(torch.utils.cpp_extension, "load", torch_load)
    assert cpu_kernel.load() is built


def test_a_build_lock_held_too_long_falls_back_to_pytorch_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("SPARROW_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "BUILD_WAIT_S", 0.2)
    receive, send = _fork.Pipe(duplex=False)
    holder = _fork.Process(target=_hold_build_lock, args=(tmp_path / "sparrow_sparse_decode", send), daemon=True)
    (tmp_path / "sparrow_sparse_decode").mkdir()
    holder.start()
    try:
        assert receive.poll(10)
        with pytest.warns(UserWarning, match=r"using the PyTorch path \(another process has held the build lock of "
                                             r".*sparrow_sparse_decode for over 0.2 s\)"):
            assert cpu_kernel.load() is None
    finally:
        holder.kill()
        holder.join()
