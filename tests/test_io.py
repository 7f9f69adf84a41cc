"""Atomic writes: whole files only, no temp files left behind, ordinary permissions."""

import os
import stat

import pytest

from sparrow.io import atomic_write_json, atomic_write_text


def test_atomic_write_replaces_whole_file_with_umask_permissions(tmp_path):
    path = tmp_path / "sub" / "out.txt"
    atomic_write_text(path, "old")
    old = os.umask(0o022)
    try:
        atomic_write_json(path, {"a": 1})
    finally:
        os.umask(old)
    assert path.read_text() == '{\n "a": 1\n}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["out.txt"]


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "out.json"
    atomic_write_text(path, "good")
    with pytest.raises(TypeError):
        atomic_write_json(path, {"bad": object()})
    assert path.read_text() == "good" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
