"""Atomic writes (whole files only, no temp files left behind, ordinary permissions, synced), durable JSONL appends
and torn last lines of logs."""

import os
import stat

import pytest

from sparrow.errors import SparrowError
from sparrow.io import append_jsonl, atomic_write_json, atomic_write_text, parse_jsonl, read_jsonl


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


def test_atomic_write_syncs_the_file_before_and_the_directory_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write_text(tmp_path / "out.txt", "data")
    assert events == ["fsync file", "rename", "fsync dir"]


def test_append_jsonl_writes_whole_synced_lines(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_size), real_fsync(fd)))
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1, "loss": 0.5})
    append_jsonl(path, {"step": 2, "loss": float("nan")})
    text = path.read_text()
    assert text.count("\n") == 2 and text.endswith("\n")
    assert synced == [len(text.splitlines()[0]) + 1, len(text)]
    assert [row["step"] for _, row in read_jsonl(path)] == [1, 2]


def test_a_torn_last_line_is_skipped_with_a_warning_only_where_asked(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: skipped a torn last line"):
        rows = read_jsonl(path, torn_tail_ok=True)
    assert rows == [(1, {"step": 1}), (2, {"step": 2})]
    with pytest.raises(SparrowError, match=r"metrics.jsonl:3: not valid JSON"):
        read_jsonl(path)  # a prompt file's bad last line stays an error


def test_only_the_last_line_without_newline_counts_as_torn():
    assert parse_jsonl('{"a": 1}\n{"a": 2}', "f", torn_tail_ok=True) == ([(1, {"a": 1}), (2, {"a": 2})], None)
    with pytest.raises(SparrowError, match="f:2: not valid JSON"):
        parse_jsonl('{"a": 1}\n{"a"\n{"a": 3}\n', "f", torn_tail_ok=True)
    with pytest.raises(SparrowError, match="f:2: not valid JSON"):
        parse_jsonl('{"a": 1}\n{"a": \n', "f", torn_tail_ok=True)  # a complete line: not a cut-short write
    assert parse_jsonl('{"a": 1}\n[1, 2', "f", torn_tail_ok=True) == ([(1, {"a": 1})], 2)


def test_non_utf8_jsonl_is_one_message(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(SparrowError, match=r"prompts.jsonl:1: not UTF-8 text"):
        read_jsonl(path)


def test_a_figure_that_cannot_be_written_names_its_file(tmp_path):
    from sparrow.io import save_figure

    class FullDisk:
        def savefig(self, path, **kwargs):
            raise OSError(28, "No space left on device")  # as a write fails: no file named

    with pytest.raises(OSError) as caught:
        save_figure(FullDisk(), tmp_path / "plot.png", dpi=100)
    assert (caught.value.errno, caught.value.filename) == (28, str(tmp_path / "plot.png"))
    from sparrow.cli.app import _one_line

    assert _one_line(caught.value) == f"{str(tmp_path / 'plot.png')!r}: No space left on device"


@pytest.mark.parametrize("other_thread", [False, True])
def test_write_whole_holds_a_termination_back_until_the_text_is_written(other_thread):
    """A SIGTERM arriving in the middle of the write (here: sent by the stream itself between two chunks) acts
    only after the whole text is written and flushed: no torn line. Also with another thread alive, which the
    kernel may hand the signal to (as PyTorch's threads are in a real run)."""
    import os
    import signal
    import threading
    import time

    from sparrow.io import write_whole

    class Terminated(Exception):
        pass

    class Chunked:
        def __init__(self):
            self.parts, self.flushed = [], False

        def write(self, text):
            half = len(text) // 2
            self.parts.append(text[:half])
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # a pipe blocking between two chunks: the main thread lets go of the interpreter
            self.parts.append(text[half:])

        def flush(self):
            self.flushed = True

    def terminate(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    stream, done = Chunked(), threading.Event()
    if other_thread:
        threading.Thread(target=done.wait).start()
    try:
        with pytest.raises(Terminated):
            write_whole(stream, '{"a": 1}\n{"b": 2}\n')
    finally:
        signal.signal(signal.SIGTERM, previous)
        done.set()
    assert "".join(stream.parts) == '{"a": 1}\n{"b": 2}\n' and stream.flushed
