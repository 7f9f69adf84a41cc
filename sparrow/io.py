"""Small file helpers shared by the commands: atomic writes and JSONL reading with line numbers."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from sparrow.errors import SparrowError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` so that a reader never sees a partial file (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the result should look like any file the user writes
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, data) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """(line number, object) for every non-empty line; a line that is not a JSON object is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise SparrowError(f"file {str(path)!r} does not exist")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SparrowError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise SparrowError(f"{path}:{number}: expected a JSON object")
        rows.append((number, row))
    if not rows:
        raise SparrowError(f"file {str(path)!r} holds no rows")
    return rows
