"""Small helpers shared by the commands: atomic writes, durable JSONL appends, JSONL reading with line numbers, and
strict reading of environment variables (`env_flag`, `env_int`: a value not understood is refused by name).

Files that a run appends to (metrics.jsonl, eval.jsonl) can end in a torn line when the run is killed during a
write; `parse_jsonl` recognises one (the last line, without its newline, not a JSON object or not UTF-8: a write
cut inside a character) so that readers of such logs can skip it and the trainer can cut it off on resume.
Read such files with `read_jsonl_text`, which keeps bytes that are not UTF-8 for `parse_jsonl` to judge by line.

`require_file` (with `file_problem`) and `check_output` check a command's input files and output paths before any
work, saying what a path is instead of a readable file (missing, a symlink loop, a directory, unreadable).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import tempfile
import threading
import warnings
from pathlib import Path

from sparrow.errors import SparrowError


FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_flag(name: str, default: bool, meaning: str = "", environ=None) -> bool:
    """A yes/no environment variable: 1/true/yes/on or 0/false/no/off (any case, surrounding spaces ignored);
    unset or empty, `default`. Any other value is a SparrowError naming the variable, its value and the accepted
    ones (`meaning`: what 1 does, for the message)."""
    value = (os.environ if environ is None else environ).get(name, "")
    word = value.strip().lower()
    if not word:
        return default
    if word not in FLAG_WORDS:
        raise SparrowError(f"{name}={value!r}: expected 1{f' ({meaning})' if meaning else ''} or 0 "
                           "(or true/false, yes/no, on/off)")
    return FLAG_WORDS[word]


def env_int(name: str, default: int, minimum: int | None = None, environ=None) -> int:
    """An integer environment variable, at least `minimum`; unset or empty, `default`. Any other value is a
    SparrowError naming the variable, its value and what was expected."""
    value = (os.environ if environ is None else environ).get(name, "")
    if not value.strip():
        return default
    expected = {None: "an integer", 0: "an integer >= 0", 1: "a positive integer"}.get(minimum,
                                                                                    f"an integer >= {minimum}")
    try:
        number = int(value.strip())
    except ValueError:
        raise SparrowError(f"{name}={value!r}: expected {expected}") from None
    if minimum is not None and number < minimum:
        raise SparrowError(f"{name}={value!r}: expected {expected}")
    return number


def require_file(path: str | os.PathLike | None, what: str) -> Path:
    """`path` as a Path if it is a readable regular file; otherwise a SparrowError saying what it is instead: missing,
    a symlink loop, a symlink to nothing, a directory, not a regular file, or not readable."""
    if path is None:
        raise SparrowError(f"give the {what}")
    problem = file_problem(path)
    if problem is not None:
        raise SparrowError(f"{what} {str(path)!r} {problem}")
    return Path(path)


def file_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be read as a file, as the end of a sentence about it ("does not exist", "is a symlink
    loop", ...), or None when it can."""
    found = Path(path)
    try:
        info = found.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symlink loop (a link that leads back to itself); expected a file"
        if err.errno in (errno.EACCES, errno.EPERM):
            return "cannot be reached: permission denied on a directory above it"
        if err.errno == errno.ENOTDIR:
            return "lies under a file, not a directory"
        if found.is_symlink():
            return f"is a symlink to {os.readlink(found)!r}, which does not exist"
        return "does not exist"
    if stat.S_ISDIR(info.st_mode):
        return "is a directory; expected a file"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if not os.access(found, os.R_OK):
        return "cannot be read: permission denied"
    return None


def check_output(path: str, what: str, directory: bool) -> None:
    """Refuse, before any work, an output that cannot be made: an existing file where a directory goes (or an
    existing directory where a file goes), a path under an existing file, or one whose nearest existing directory
    this process cannot write in."""
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise SparrowError(f"{what} {path!r} is an existing file; expected a directory (existing or new)")
    if not directory and target.is_dir():
        raise SparrowError(f"{what} {path!r} is a directory; expected a file name")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SparrowError(f"{what} {path!r} lies under {str(parent)!r}, which is a file, not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise SparrowError(f"{what} {path!r} cannot be written: directory {str(parent)!r} is not writable "
                                   "(read-only or no permission); expected a path in a writable directory")
            return


def umask() -> int:
    """The process's umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | os.PathLike) -> None:
    """Force a directory's entries (a rename into it) to disk; a no-op where the filesystem cannot sync directories."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` so that a reader never sees a partial file, also after a crash: temp file, fsync,
    rename, fsync of the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600; the result should look like any file the user writes
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):  # name the file asked for, not the hidden temporary one
            raise OSError(err.errno, err.strerror or str(err), str(path)) from None
        raise
    fsync_dir(path.parent)
    return path


def save_figure(fig, path: str | os.PathLike, **kwargs) -> Path:
    """`fig.savefig(path, **kwargs)`, an OSError naming the file: a full disk shows at a write, whose error names
    none ("[Errno 28] No space left on device")."""
    try:
        fig.savefig(path, **kwargs)
    except OSError as err:
        if err.filename is None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from None
        raise
    return Path(path)


def atomic_write_json(path: str | os.PathLike, data) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append `row` as one complete line in one write and force it to disk before returning, so that a kill
    leaves at most a torn last line (which `parse_jsonl` recognises) and a written row survives a crash."""
    data = memoryview((json.dumps(row) + "\n").encode("utf-8"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_text(path: str | os.PathLike) -> str:
    """A JSONL file's text, bytes that are not UTF-8 kept as surrogates for `parse_jsonl` to report by line."""
    return Path(path).read_text(encoding="utf-8", errors="surrogateescape")


def parse_jsonl(text: str, name: str, torn_tail_ok: bool = False) -> tuple[list[tuple[int, dict]], int | None]:
    """(line number, object) for every non-empty line of `text` (as `read_jsonl_text` reads it), and the number of
    a torn last line that was skipped (None if there was none). A line that is not UTF-8 or not a JSON object is an
    error naming `name` and the line; with `torn_tail_ok` the last line is skipped instead when it also lacks its
    newline (a write cut short)."""
    lines = text.splitlines()
    torn_tail = torn_tail_ok and not text.endswith("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            line.encode("utf-8")
            row = json.loads(line)
            problem = None if isinstance(row, dict) else "expected a JSON object"
        except UnicodeEncodeError:
            problem = "not UTF-8 text"
        except json.JSONDecodeError as err:
            problem = f"not valid JSON ({err.msg})"
        if problem is None:
            rows.append((number, row))
        elif torn_tail and number == len(lines):
            return rows, number
        else:
            raise SparrowError(f"{name}:{number}: {problem}")
    return rows, None


def read_jsonl(path: str | os.PathLike, torn_tail_ok: bool = False) -> list[tuple[int, dict]]:
    """(line number, object) for every non-empty line; a line that is not a JSON object is an error naming it.

    `torn_tail_ok` is for logs a run appends to: a torn last line is skipped with a warning instead.
    """
    path = require_file(path, "file")
    rows, torn = parse_jsonl(read_jsonl_text(path), str(path), torn_tail_ok)
    if torn is not None:
        warnings.warn(f"sparrow: {path}:{torn}: skipped a torn last line (a write cut short, e.g. by a kill)",
                      stacklevel=2)
    if not rows:
        raise SparrowError(f"file {str(path)!r} holds no rows")
    return rows


def write_whole(stream, text: str) -> None:
    """Write and flush `text` with Ctrl-C and SIGTERM held back until it is all written, so that an interrupt
    arriving mid-write (a pipe takes a long text in several writes) leaves no torn line; the held signal acts
    right after. Held by swapping the Python handlers, which always run in the main thread: a signal mask would
    hold only this thread's, and the process's other threads (PyTorch's, a progress bar's) would take the signal."""
    if threading.current_thread() is not threading.main_thread():  # handlers run in the main thread only
        stream.write(text)
        stream.flush()
        return
    arrived = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not None}  # None: a handler set outside Python, which we cannot restore
    try:
        stream.write(text)
        stream.flush()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for signum in dict.fromkeys(arrived):
        signal.raise_signal(signum)
