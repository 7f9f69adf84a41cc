"""Code reward: run a completion's Python program against test cases in a child process with resource limits.

Containment, stated plainly: this is process isolation with resource limits, NOT a security sandbox. There is no
seccomp filter, no namespace, no chroot and no user switch; the child runs as the same user as the trainer. It is
meant to contain accidents and runaway code from a model (infinite loops, huge allocations, megabytes of output,
stray files, leftover subprocesses), not an adversary. What it does:

* a fresh per-run directory, deleted afterwards, holds the program; the child's cwd, HOME and TMPDIR are a
  ``work/`` folder inside it, so files written by relative path, under ``~`` or via ``tempfile`` stay there;
* the environment is stripped to PATH, HOME, TMPDIR, a UTF-8 locale and single-threaded BLAS settings, and the
  interpreter runs with ``-I -B`` (no user site, no PYTHON* variables, no script dir on sys.path, no .pyc writes);
* ``setrlimit`` caps address space (``memory_mb``), CPU seconds, the size of any file written (which also caps
  stdout and stderr, as those are files) and open files, and disables core dumps;
* stdin, stdout and stderr are unnamed temporary files, so no pipe can fill up and the parent reads at most
  ``output_limit_bytes`` of output and a short stderr tail;
* the child leads its own process group, which is killed on the wall-clock timeout and after every run.

Limits: absolute paths (or enough ``../``) reach anything the trainer's user can write or read, the network is
open, and a process that leaves its process group (``setsid``) outlives the run. Assert-style tests are appended to
the program, so a program that reads its own source could see them.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sparrow.errors import SparrowError

STATUSES = ("ok", "timeout", "crash", "memory", "output_limit")
OUTPUT_LIMIT_BYTES = 1 << 20
OPEN_FILES_LIMIT = 64
STDERR_TAIL_CHARS = 2000
_PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PLAIN_BLOCK = re.compile(r"```[ \t]*\n(.*?)```", re.DOTALL)
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


@dataclass(frozen=True)
class CodeResult:
    """Outcome of one program on its tests: ``status`` is the first non-"ok" run's status, else "ok"."""

    passed: int
    total: int
    status: str
    stderr_tail: str

    @property
    def reward(self) -> float:
        return self.passed / self.total


@dataclass(frozen=True)
class _Run:
    returncode: int
    status: str
    stdout: str
    stderr_tail: str


def extract_program(completion: str) -> str:
    """The last fenced ```python block, else the last unlabelled ``` block, else the whole completion."""
    for pattern in (_PYTHON_BLOCK, _PLAIN_BLOCK):
        blocks = pattern.findall(completion)
        if blocks:
            return blocks[-1]
    return completion


def _normalize_tests(tests) -> list[tuple[str, str]] | str:
    """Stdin/stdout cases as (input, output) pairs, or an assert block as a str; JSON-encoded lists accepted."""
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            pass
    if isinstance(tests, str):
        if not tests.strip():
            raise SparrowError("tests is an empty string; expected Python assert statements")
        return tests
    if not isinstance(tests, (list, tuple)) or not tests:
        raise SparrowError(
            f"tests is {tests!r:.80}; expected a non-empty list of {{'input': str, 'output': str}} or a str of asserts"
        )
    cases = []
    for i, case in enumerate(tests):
        if not (isinstance(case, dict) and isinstance(case.get("input"), str) and isinstance(case.get("output"), str)):
            raise SparrowError(f"test case {i} is {case!r:.80}; expected {{'input': str, 'output': str}}")
        cases.append((case["input"], case["output"]))
    return cases


def _same_output(actual: str, expected: str) -> bool:
    """Equal after stripping surrounding whitespace, trailing spaces on each line and CRLF differences."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return norm(actual) == norm(expected)


def _limits(timeout: float, memory_mb: int, output_limit_bytes: int):
    """preexec_fn for the child: rlimits set between fork and exec, so they hold from the first instruction.

    The pairs are built here, in the parent, so the forked child only calls setrlimit (nothing that could wait on
    a lock another thread held at fork time, which is why preexec_fn is otherwise unsafe with threads).
    """
    memory = memory_mb << 20
    cpu = math.ceil(timeout) + 1
    limits = (
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (output_limit_bytes, output_limit_bytes)),
        (resource.RLIMIT_NOFILE, (OPEN_FILES_LIMIT, OPEN_FILES_LIMIT)),
        (resource.RLIMIT_CORE, (0, 0)),
    )
    setrlimit = resource.setrlimit

    def apply() -> None:
        for which, pair in limits:
            setrlimit(which, pair)

    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(file, chars: int) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - 4 * chars))
    return file.read().decode("utf-8", errors="replace")[-chars:]


def _remove_tree(root: str) -> None:
    """Delete the run directory even if the child left folders without write or search permission."""
    os.chmod(root, 0o700)
    for folder, subfolders, _files in os.walk(root):
        for name in subfolders:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(root, ignore_errors=True)


def _execute(program: str, stdin: str, timeout: float, memory_mb: int, output_limit_bytes: int, base_dir) -> _Run:
    """Run ``program`` once in a fresh directory with ``stdin``; classify how it ended."""
    root = tempfile.mkdtemp(prefix="sparrow-code-", dir=base_dir)
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        script = os.path.join(root, "main.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(program)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": work,
            "TMPDIR": work,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
            fin.write(stdin.encode("utf-8"))
            fin.seek(0)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", script],
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=work,
                env=env,
                start_new_session=True,
                preexec_fn=_limits(timeout, memory_mb, output_limit_bytes),
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
            out_size = fout.seek(0, os.SEEK_END)
            err_size = ferr.seek(0, os.SEEK_END)
            fout.seek(0)
            stdout = fout.read(output_limit_bytes).decode("utf-8", errors="replace")
            stderr_tail = _tail(ferr, STDERR_TAIL_CHARS)
    finally:
        _remove_tree(root)
    rc = proc.returncode
    if (
        out_size >= output_limit_bytes
        or err_size >= output_limit_bytes
        or rc == -signal.SIGXFSZ
        or (rc != 0 and "File too large" in stderr_tail)
    ):
        status = "output_limit"
    elif timed_out or rc == -signal.SIGXCPU:
        status = "timeout"
    elif rc != 0 and any(marker in stderr_tail for marker in _MEMORY_MARKERS):
        status = "memory"
    elif rc != 0:
        status = "crash"
    else:
        status = "ok"
    return _Run(rc, status, stdout, stderr_tail)


def run_code(
    program: str,
    tests,
    timeout: float = 5.0,
    memory_mb: int = 512,
    *,
    output_limit_bytes: int = OUTPUT_LIMIT_BYTES,
    base_dir: str | None = None,
) -> CodeResult:
    """Run ``program`` on ``tests`` (stdin/stdout cases, one process each; or an assert block appended to it).

    A stdin/stdout case passes when the program exits 0 and its output matches; an assert block passes when the
    program plus the asserts exits 0. ``timeout`` is wall-clock seconds per process; ``base_dir`` is where the
    per-run directories are made (default: the system temp dir).
    """
    if not isinstance(program, str):
        raise SparrowError(f"program is a {type(program).__name__}; expected a str")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise SparrowError(f"timeout={timeout!r}; expected a positive number of seconds")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 32:
        raise SparrowError(f"memory_mb={memory_mb!r}; expected an int >= 32 (the interpreter needs room to start)")
    if isinstance(output_limit_bytes, bool) or not isinstance(output_limit_bytes, int) or output_limit_bytes < 1024:
        raise SparrowError(f"output_limit_bytes={output_limit_bytes!r}; expected an int >= 1024")
    cases = _normalize_tests(tests)
    limits = (timeout, memory_mb, output_limit_bytes, base_dir)
    if isinstance(cases, str):
        run = _execute(program + "\n\n" + cases + "\n", "", *limits)
        return CodeResult(int(run.status == "ok"), 1, run.status, run.stderr_tail)
    passed, status, tail = 0, "ok", None
    for stdin, expected in cases:
        run = _execute(program, stdin, *limits)
        ok = run.status == "ok" and _same_output(run.stdout, expected)
        passed += ok
        if status == "ok" and run.status != "ok":
            status = run.status
        if tail is None and not ok:
            tail = run.stderr_tail
    return CodeResult(passed, len(cases), status, tail if tail is not None else run.stderr_tail)


def code_reward(prompts, completions, tests, timeout=5.0, memory_mb=512, workers: int = 1, **_) -> list[float]:
    """Reward function (TRL-style): fraction of each completion's tests its extracted program passes."""
    return [r.reward for r in code_results(prompts, completions, tests, timeout, memory_mb, workers)]


def code_results(prompts, completions, tests, timeout=5.0, memory_mb=512, workers: int = 1, **_) -> list[CodeResult]:
    """Like code_reward, but one CodeResult per completion, so the trainer can record what each run did
    (timeout, crash, memory, output_limit). ``workers`` > 1 runs that many completions at once."""
    if len(tests) != len(completions):
        raise SparrowError(
            f"code_reward got {len(completions)} completions but {len(tests)} test sets; expected equal lengths"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SparrowError(f"workers={workers!r}; expected an int >= 1")
    for i, completion in enumerate(completions):
        if not isinstance(completion, str):
            raise SparrowError(f"completion {i} is a {type(completion).__name__}; expected a str")

    def one(pair) -> CodeResult:
        completion, case = pair
        return run_code(extract_program(completion), case, timeout, memory_mb)

    pairs = list(zip(completions, tests, strict=True))
    if workers == 1:
        return [one(pair) for pair in pairs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, pairs))
