"""One child process of the program (a stdin/stdout case, or the worker): started under its limits, waited for,
killed with everything it started, and how it ended. It runs only in the harness process and imports its siblings
top-level."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from processes import limits, reap_all, wait_exit
from protocol import DETAIL_CHARS

_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


class Run:
    """One child process of the program (a stdin/stdout case, or the worker) and its captured output."""

    def __init__(self, job: dict, argv: list[str], workdir: str, stdin_text: str = "", pass_fds=()):
        self.limit = job["output_limit"]
        self.stdout = os.memfd_create("stdout")
        self.stderr = os.memfd_create("stderr")
        stdin = os.memfd_create("stdin")
        os.write(stdin, stdin_text.encode("utf-8"))
        os.lseek(stdin, 0, os.SEEK_SET)
        env = dict(job["env"], HOME=workdir, TMPDIR=workdir)
        uid = job["uid"]
        self.proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=self.stdout,
            stderr=self.stderr,
            cwd=workdir,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
            preexec_fn=limits(job),
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
        )
        os.close(stdin)
        self.timed_out = False
        self.returncode: int | None = None

    def wait(self, deadline: float) -> None:
        self.timed_out = not wait_exit(self.proc, deadline - time.monotonic())
        self.finish()

    def finish(self) -> None:
        """Kill the program and everything it started (the whole sandbox when this is its pid 1)."""
        if self.returncode is not None:
            return
        early = self.proc.poll()
        try:
            if os.getpid() == 1:
                os.kill(-1, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.wait()
        self.returncode = code if early is None else early
        if os.getpid() == 1:
            reap_all()

    def output(self) -> str:
        os.lseek(self.stdout, 0, os.SEEK_SET)
        return os.read(self.stdout, self.limit).decode("utf-8", errors="replace")

    def stderr_tail(self) -> str:
        size = os.fstat(self.stderr).st_size
        os.lseek(self.stderr, max(0, size - 4 * DETAIL_CHARS), os.SEEK_SET)
        return os.read(self.stderr, 4 * DETAIL_CHARS).decode("utf-8", errors="replace")[-DETAIL_CHARS:]

    def status(self) -> str:
        """How the process ended: ok, timeout, crash, memory or output_limit (the first that applies, in the order
        output_limit, timeout, memory, crash)."""
        rc, tail = self.returncode, self.stderr_tail()
        sizes = os.fstat(self.stdout).st_size, os.fstat(self.stderr).st_size
        if max(sizes) >= self.limit or rc == -signal.SIGXFSZ or (rc != 0 and "File too large" in tail):
            return "output_limit"
        if self.timed_out or rc == -signal.SIGXCPU:
            return "timeout"
        if rc != 0 and any(marker in tail for marker in _MEMORY_MARKERS):
            return "memory"
        return "crash" if rc != 0 else "ok"
