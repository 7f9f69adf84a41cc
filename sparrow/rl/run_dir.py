"""A training run's output directory: one run at a time, debris of killed runs removed, resumes that continue the
same run.

- `RunLock` holds an OS lock (flock) on `run.lock` for the run's lifetime, so a crash or kill releases it; the
  file names the holder (pid, host, start time) for the message a second run gets. A file still naming a holder
  when the lock is free is a run that was killed: taken over with a warning.
- `config_differences` / `check_resume_config` refuse a resume whose options differ from the saved ones, except
  `RESUMABLE_OPTIONS` under --allow-changes.
- `data_fingerprint` / `check_resume_data` refuse a resume whose data file changed, except under --allow-changes.
- `repair_metrics` cuts a JSONL log back to what the checkpoint being resumed from had seen.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from sparrow.errors import SparrowError
from sparrow.io import atomic_write_text, parse_jsonl, read_jsonl_text

LOCK_NAME = "run.lock"

# Options that never change what a run computes: where it is and how it was started.
IGNORED_OPTIONS = frozenset({"output_dir", "resume", "allow_changes"})
# Options a resumed run may change under --allow-changes: how long it runs and what it keeps; where and in what
# batches it computes (device, the rollout section, the batch of the forwards without gradients); the held-out
# evaluation, the acceptance monitoring and the reward check, which read the policy without changing it; what to
# do on a non-finite update; the code-reward sandbox opt-in. Everything else (model, data, seed, group shape,
# sampling, losses, optimizer, schedules, tau and bins, adapter) would make the continued run a different one. A
# name matches an option of that name in any section (`steps` matches `grpo.steps`), a dotted name exactly that
# option, and a section name the whole section (`eval` matches `eval.every`).
RESUMABLE_OPTIONS = frozenset({"steps", "save_every", "keep_last", "device", "rollout", "eval", "monitor.monitor",
                               "monitor_every", "monitor_share", "non_finite", "unsafe_code_reward",
                               "log_prob_micro_batch_size", "reward_check_every", "reward_check_prompts",
                               "reward_check_samples", "min_retention"})

_STAGING = re.compile(r"^\.checkpoint-\d+\..+")  # save_checkpoint's temporary directories
_ABSENT = object()
_HELD: set[int] = set()  # lock descriptors of this process


def _close_in_child() -> None:
    """A forked child (a reward worker pool) must not keep the run's lock alive after the run dies."""
    for fd in _HELD:
        os.close(fd)  # the parent's descriptor still holds the lock; LOCK_UN here would release it for both
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _stderr(message: str) -> None:
    print(f"sparrow: {message}", file=sys.stderr, flush=True)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process its parent has not reaped yet is a zombie: gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _describe(holder: dict) -> str:
    if not holder:
        return "a run that is starting up"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _why_stale(holder: dict) -> str | None:
    """Why the recorded holder cannot be running any more, or None when it may be (same host and boot, pid alive)."""
    if holder.get("host") != socket.gethostname():
        return None  # another host's pids cannot be checked from here
    if holder.get("boot_id") != _boot_id():
        return "it ran before this machine last booted"
    if not isinstance(holder.get("pid"), int) or not _alive(holder["pid"]):
        return f"pid {holder.get('pid')} is no longer running"
    return None


def _read_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"pid": "unknown (unreadable lock file)"}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """Exclusive use of `output_dir` by this process until `release` (or the end of a `with` block, or its death).

    A second run on the same directory fails at once with a SparrowError naming the holder. Acquiring also
    removes the debris of killed writes (see `clean_stray_files`): only the lock holder may.
    """

    def __init__(self, output_dir: str | os.PathLike, log=_stderr):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self.log = log
        self._fd: int | None = None
        self._pid = os.getpid()
        self._created = False

    def acquire(self) -> RunLock:
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise SparrowError(f"output directory {str(self.output_dir)!r} is an existing file; expected a directory")
        self._created = not self.output_dir.exists()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            previous = self._lock(fd)
            if previous:
                why = _why_stale(previous) or "it did not release its lock"
                self.log(f"warning: {self.output_dir} was locked by a run that did not finish ({_describe(previous)}:"
                         f" {why}); taking it over")
            mine = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id(),
                    "started": datetime.datetime.now().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(mine).encode("utf-8"), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._pid = fd, os.getpid()
        _HELD.add(fd)
        clean_stray_files(self.output_dir, self.log)
        return self

    def _lock(self, fd: int) -> dict:
        """Take the lock on `fd`; returns the previous holder's record when it died holding it ({} if none)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SparrowError(f"{self.output_dir} is in use by another run ({_describe(_read_holder(fd))}); wait "
                               "for it to end or choose another --output-dir") from None
        except OSError:  # a filesystem without flock: judge the recorded holder instead
            holder = _read_holder(fd)
            if holder and _why_stale(holder) is None:
                raise SparrowError(f"{self.output_dir} is in use by another run ({_describe(holder)}); wait for it "
                                   f"to end or choose another --output-dir (this filesystem has no file locks: "
                                   f"delete {self.path} if that run is gone)") from None
            return holder
        return _read_holder(fd)

    def release(self) -> None:
        """Clear the holder record (an empty file means released cleanly) and unlock."""
        if self._fd is None or self._fd not in _HELD or os.getpid() != self._pid:
            return
        _HELD.discard(self._fd)
        try:
            os.ftruncate(self._fd, 0)
            with contextlib.suppress(OSError):  # a filesystem without flock: there is nothing to unlock
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type, *exc) -> None:
        """Release; a run that failed before writing anything into the directory it created leaves no directory."""
        self.release()
        if exc_type is not None and self._created and [p.name for p in self.output_dir.iterdir()] == [LOCK_NAME]:
            with contextlib.suppress(OSError):
                self.path.unlink()
                self.output_dir.rmdir()


def clean_stray_files(output_dir: str | os.PathLike, log=_stderr) -> list[Path]:
    """Remove what killed writes leave: `.checkpoint-N.*` staging directories of save_checkpoint and hidden
    `.NAME.*.tmp` files of atomic writes, anywhere in the run. Call only while holding the run's lock."""
    output_dir = Path(output_dir)
    stray = [p for p in output_dir.iterdir() if _STAGING.match(p.name)] if output_dir.is_dir() else []
    stray += [p for p in output_dir.rglob(".*.tmp") if p.is_file() and not any(s in p.parents for s in stray)]
    for path in stray:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stray:
        log(f"removed {len(stray)} unfinished write(s) of a killed run: {', '.join(sorted(p.name for p in stray))}")
    return stray


def flatten(config: dict, prefix: str = "") -> dict:
    """{dotted name: value} of a config with nested sections: {"grpo": {"learning_rate": 1e-6}} ->
    {"grpo.learning_rate": 1e-6}."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _matches(name: str, options) -> bool:
    return any(name == o or name.endswith("." + o) or name.startswith(o + ".") for o in options)


def _same(old, new) -> bool:
    if old is _ABSENT or new is _ABSENT:
        return old is new
    return old == new or json.dumps(old, sort_keys=True) == json.dumps(new, sort_keys=True)  # NaN == NaN


def _show(value) -> str:
    return "(not set)" if value is _ABSENT else repr(value)


def config_differences(saved: dict, current: dict, allowed: set[str] | frozenset[str]) -> list[str]:
    """'name: old -> new' for every option (dotted name, sections flattened) whose value differs between the
    saved and the current config, leaving out IGNORED_OPTIONS and the options `allowed` names. An option present
    on one side only is a difference."""
    old, new = flatten(json.loads(json.dumps(saved))), flatten(json.loads(json.dumps(current)))
    skip = IGNORED_OPTIONS | set(allowed)
    return [f"{name}: {_show(old.get(name, _ABSENT))} -> {_show(new.get(name, _ABSENT))}"
            for name in sorted(old.keys() | new.keys())
            if not _matches(name, skip) and not _same(old.get(name, _ABSENT), new.get(name, _ABSENT))]


def check_resume_config(saved: dict, current: dict, allow_changes: bool, where: str = "the checkpoint") -> list[str]:
    """Refuse (SparrowError listing every difference) to resume a run saved with `saved` under the `current`
    config, unless `allow_changes` and every changed option is in RESUMABLE_OPTIONS. Returns the accepted
    changes, for the log."""
    changes = config_differences(saved, current, set())
    if changes and not allow_changes:
        raise SparrowError(f"{where} was saved with different options: {'; '.join(changes)}; resume with the saved "
                           f"options, or pass --allow-changes to continue with changes to "
                           f"{', '.join(sorted(RESUMABLE_OPTIONS))}")
    forbidden = config_differences(saved, current, RESUMABLE_OPTIONS)
    if not forbidden:
        return changes
    raise SparrowError(f"{where} was saved with different options, and these cannot change in a resumed run even "
                       f"with --allow-changes: {'; '.join(forbidden)}; restore them or start a new run in another "
                       "--output-dir")


def data_fingerprint(path: str | os.PathLike, rows: list) -> dict:
    """What a resume checks of the data file: its path, its size in bytes, and the number and a hash of the rows
    read from it (`Example`s: prompt, answer and the other columns)."""
    content = json.dumps([[r.prompt, r.answer, r.columns] for r in rows], sort_keys=True, default=str)
    return {"path": str(path), "bytes": os.path.getsize(path), "rows": len(rows),
            "sha256": hashlib.sha256(content.encode("utf-8", "surrogatepass")).hexdigest()}


def check_resume_data(saved: dict | None, current: dict, allow_changes: bool,
                      where: str = "the checkpoint") -> list[str]:
    """Refuse (SparrowError naming the file and what changed) to resume on a data file that differs from the one
    `saved` describes (None: a checkpoint from before fingerprints, not checked), unless `allow_changes`. Returns
    the accepted changes, for the log."""
    if saved is None or saved.get("sha256") == current["sha256"]:
        return []
    changes = ", ".join(f"{key} {saved.get(key)} -> {current[key]}" for key in ("bytes", "rows")
                        if saved.get(key) != current[key]) or "same size and rows, but rows reordered or edited"
    if not allow_changes:
        raise SparrowError(f"data file {current['path']!r} changed since {where} was saved ({changes}); a resumed "
                           "run would draw other prompts than the run so far: restore the file, or pass "
                           "--allow-changes to continue on the changed data")
    return [f"data file {current['path']!r}: {changes}"]


def repair_metrics(path: str | os.PathLike, last_step: int, log=None) -> int:
    """Cut a run's JSONL log (metrics.jsonl, eval.jsonl) back to `last_step`, the step of the checkpoint being
    resumed from: drop rows with a larger step (written before a checkpoint the kill prevented; the resumed run
    writes them again), a torn last line, and earlier copies of a step logged again later. Rewrites the file
    atomically when anything changed; returns the number of lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    text = read_jsonl_text(path)
    rows, torn = parse_jsonl(text, str(path), torn_tail_ok=True)
    for number, row in rows:
        if not isinstance(row.get("step"), int):
            raise SparrowError(f"{path}:{number}: expected an integer 'step', got {row.get('step')!r}")
    last = {row["step"]: number for number, row in rows}
    kept = [number for number, row in rows if row["step"] <= last_step and last[row["step"]] == number]
    dropped = len(rows) - len(kept) + (torn is not None)
    if dropped:
        lines = text.splitlines()
        atomic_write_text(path, "".join(lines[n - 1] + "\n" for n in kept))
        if log is not None:
            torn_part = " and a torn last line" if torn is not None else ""
            log(f"{path.name}: dropped {len(rows) - len(kept)} row(s) past step {last_step} or logged twice"
                f"{torn_part} (written before the checkpoint a kill prevented)")
    return dropped
