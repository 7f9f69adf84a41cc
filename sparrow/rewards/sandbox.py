"""Where the code reward's programs run: a bubblewrap sandbox, or bare processes only if the user opts in.

``run(job, base_dir)`` starts the harness (the directory harness/, which Python runs by its ``__main__.py``: the
judge, which runs the program and its tests) with a JSON job and returns what it reported. In the sandbox (bwrap
0.8 or newer) the judge is pid 1 of new pid, network, IPC, UTS and cgroup namespaces, with a new root that holds
read-only binds of the system directories (/usr and the /bin, /lib... links), /etc/ld.so.cache, the Python
installation and the harness's sources (/sparrow/harness: each of its ``*.py`` files, and nothing else of the
folder), fresh /proc and /dev, and one writable tmpfs of ``SCRATCH_BYTES``, /sandbox (the scratch directory); the
rest of the new root is read-only: no home, no project, no /tmp, no /etc. The environment is cleared. As an
ordinary user the sandbox has its own user namespace (uid 65534, no capabilities, no nested user namespaces) and
the program's ``RLIMIT_NPROC`` counts only that sandbox's processes. Root ignores ``RLIMIT_NPROC``, so as root the
judge keeps only CAP_SETUID, CAP_SETGID and CAP_KILL and runs the program as a user id of its own
(``_ROOT_UID_BASE`` + a counter), whose process count the limit caps.
``--die-with-parent`` ends the sandbox, and everything in it, when the process that started it dies.

Without bwrap (or where it cannot run) ``require_sandbox`` refuses, naming the problem, unless the user accepted
the risk (``require_sandbox(allow_unsafe=True)`` or ``SPARROW_UNSAFE_CODE_REWARD=1``): then the same harness runs
as plain processes in a temporary directory, with the rlimits but without any isolation, after a warning.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from sparrow.errors import SparrowError
from sparrow.io import env_flag
from sparrow.rewards.harness.processes import wait_exit

UNSAFE_ENV = "SPARROW_UNSAFE_CODE_REWARD"
SCRATCH = "/sandbox"
SCRATCH_BYTES = 64 << 20
PROCESS_LIMIT = 32
GRACE_S = 2.0
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness")  # a directory, run by its __main__.py
_INNER_HARNESS = "/sparrow/harness"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache",)
_MIN_VERSION = (0, 8, 0)
_ROOT_UID_BASE = 2_000_000_000
_ROOT_UID_COUNT = 1 << 20
_PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_HOST_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

_uid_counter = itertools.count(os.getpid() * 64)
_state_lock = threading.Lock()
_unsafe_accepted = False
_warned = False


@dataclass(frozen=True)
class Outcome:
    """What the judge reported: ``records[i]`` per test (``passed``, ``status``, ``detail``); ``finished`` if it
    wrote its end line; ``killed`` if it outran the run's timeout plus ``GRACE_S``; ``error`` its stderr tail."""

    records: dict[int, dict]
    finished: bool
    killed: bool
    error: str


def python() -> str:
    """The interpreter that runs the harness and the programs: the base installation, not a virtual environment,
    so the project's packages are not importable. The judge runs it with ``-S`` (it needs only the standard
    library, and skipping site saves a fifth of its start); programs get the usual site (``exit()`` and friends)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _under(path: str, roots) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _interpreter_dirs() -> list[str]:
    """Directories of the Python installation that the system directories do not already cover."""
    exe = python()
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix), os.path.dirname(exe)}
    system = [os.path.realpath(d) for d in _SYSTEM_DIRS if os.path.isdir(d)]
    keep = sorted(d for d in dirs if not _under(d, system))
    return [d for d in keep if not any(d != other and _under(d, [other]) for other in keep)]


def harness_files() -> list[str]:
    """The harness's sources: the only files of its directory the sandbox shows, each bound read-only (no
    ``__pycache__`` the host's imports left there, nothing else)."""
    return sorted(n for n in os.listdir(HARNESS) if n.endswith(".py") and os.path.isfile(os.path.join(HARNESS, n)))


@functools.cache
def _bwrap_argv(bwrap: str, as_root: bool) -> tuple[str, ...]:
    argv = [bwrap, "--die-with-parent", "--new-session", "--as-pid-1", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if as_root:
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"]
    else:
        argv += ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _SYSTEM_FILES:
        argv += ["--ro-bind-try", path, path]
    interpreter = _interpreter_dirs()
    made = {"/"}
    for path in [*interpreter, _INNER_HARNESS]:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if parent not in made:
                made.add(parent)
                argv += ["--perms", "0755", "--dir", parent]
    for path in interpreter:
        argv += ["--ro-bind", path, path]
    argv += ["--perms", "0755", "--dir", _INNER_HARNESS]  # in the new root, read-only once / is remounted
    for name in harness_files():
        argv += ["--ro-bind", os.path.join(HARNESS, name), f"{_INNER_HARNESS}/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "0755", "--size", str(SCRATCH_BYTES), "--tmpfs", SCRATCH, "--remount-ro", "/",
             "--chdir", SCRATCH, "--clearenv", "--setenv", "LANG", "C.UTF-8", "--setenv", "PATH", "/usr/bin:/bin",
             "--", python(), "-I", "-S", "-B", _INNER_HARNESS]
    return tuple(argv)


def _root_uid() -> int:
    with _state_lock:
        return _ROOT_UID_BASE + next(_uid_counter) % _ROOT_UID_COUNT


def _remove_tree(root: str) -> None:
    """Delete a run directory even if the program left folders without write or search permission."""
    os.chmod(root, 0o700)
    for folder, subfolders, _files in os.walk(root):
        for name in subfolders:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(root, ignore_errors=True)


def _read_report(file) -> tuple[dict[int, dict], bool]:
    file.seek(0)
    records, finished = {}, False
    for line in file.read().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("end") is True:
            finished = True
        elif isinstance(record.get("i"), int):
            records[record["i"]] = record
    return records, finished


def _launch(job: dict, sandboxed: bool, base_dir: str | None) -> Outcome:
    scratch = SCRATCH if sandboxed else tempfile.mkdtemp(prefix="sparrow-code-", dir=base_dir)
    as_root = os.geteuid() == 0
    job = dict(
        job,
        scratch=scratch,
        python=python(),
        env=_PROGRAM_ENV,
        uid=_root_uid() if sandboxed and as_root else None,
        process_limit=PROCESS_LIMIT if sandboxed else None,
    )
    if sandboxed:
        argv, cwd = _bwrap_argv(shutil.which("bwrap") or "bwrap", as_root), "/"
    else:
        argv, cwd = [python(), "-I", "-S", "-B", HARNESS], scratch
    try:
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
            fin.write(json.dumps(job).encode("utf-8"))
            fin.seek(0)
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd, env=_HOST_ENV,
                                    start_new_session=True)
            killed = not wait_exit(proc, job["timeout"] + GRACE_S)
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)  # not yet reaped, so the group id is still ours
                proc.wait()
            records, finished = _read_report(fout)
            size = ferr.seek(0, os.SEEK_END)
            ferr.seek(max(0, size - 4000))
            error = ferr.read().decode("utf-8", errors="replace")[-2000:]
    finally:
        if not sandboxed:
            _remove_tree(scratch)
    return Outcome(records, finished, killed, error)


_TRIAL = {"program": "print(6 * 7)", "cases": [["", "42"]], "tests": None, "timeout": 10.0, "memory_mb": 256,
          "output_limit": 1 << 16, "open_files": 64}


@functools.cache
def problem() -> str | None:
    """Why the sandbox cannot be used here (bwrap missing, too old, or failing a trial run), or None if it can."""
    if sys.platform != "linux":
        return f"the sandbox needs Linux namespaces; this system is {sys.platform}"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", subprocess.run([bwrap, "--version"], capture_output=True,
                                                              text=True).stdout)
    version = tuple(int(x) for x in found.groups()) if found else (0, 0, 0)
    if version < _MIN_VERSION:
        return f"bwrap {'.'.join(map(str, version))} is too old; expected {'.'.join(map(str, _MIN_VERSION))} or newer"
    outcome = _launch(_TRIAL, sandboxed=True, base_dir=None)
    if not (outcome.finished and outcome.records.get(0, {}).get("passed")):
        return (f"bwrap is installed but a trial run in it failed ({outcome.error.strip()[-300:] or 'no output'}); "
                "user namespaces may be disabled (sysctl user.max_user_namespaces, "
                "kernel.apparmor_restrict_unprivileged_userns)")
    return None


def unsafe_from_env() -> bool:
    """Whether SPARROW_UNSAFE_CODE_REWARD accepts running code rewards without a sandbox (a SparrowError naming a
    value that is not a yes or no)."""
    return env_flag(UNSAFE_ENV, False, "allow code rewards without a sandbox")


def require_sandbox(allow_unsafe: bool = False) -> str:
    """How code rewards will run: "bwrap", or "unsafe" when no sandbox works here but the user accepted that
    (``allow_unsafe``, or ``SPARROW_UNSAFE_CODE_REWARD=1``; the acceptance then holds for the whole process, and a
    warning goes to stderr once). Otherwise raises SparrowError naming the problem. Call it before loading a model.
    """
    global _unsafe_accepted, _warned
    reason = problem()
    if reason is None:
        return "bwrap"
    with _state_lock:
        if allow_unsafe or unsafe_from_env():
            _unsafe_accepted = True
        if not _unsafe_accepted:
            raise SparrowError(
                f"code reward: no sandbox available: {reason}. Model-written code is not run unsandboxed unless you "
                f"accept the risk: --unsafe-code-reward (config: unsafe_code_reward: true) or {UNSAFE_ENV}=1"
            )
        if not _warned:
            _warned = True
            sys.stderr.write(
                f"WARNING: code rewards run WITHOUT a sandbox ({reason}): model-written programs can read and write "
                "your files, use the network and signal your processes. Install bubblewrap to contain them.\n"
            )
            sys.stderr.flush()
    return "unsafe"


def run(job: dict, base_dir: str | None = None) -> Outcome:
    """Run one harness job in the sandbox, or unsandboxed when the user accepted that (see require_sandbox);
    ``base_dir`` holds the temporary run directory of an unsandboxed run (default: the system temp dir)."""
    return _launch(job, sandboxed=require_sandbox(_unsafe_accepted) == "bwrap", base_dir=base_dir)
