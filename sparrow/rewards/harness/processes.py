"""A program process's limits, waiting for it and reaping, and its scratch folder.

Sparrow imports this module (``wait_exit``, which sandbox.py waits on the judge with): standard library only, no
sibling imports (see __init__.py).
"""

from __future__ import annotations

import math
import os
import resource
import select
import subprocess


def wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to exit (True if it did) and reap it then. A pidfd wakes up the
    moment it exits; Popen.wait(timeout) polls with sleeps of up to 50 ms, which every run would pay."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        exited, _, _ = select.select([pidfd], [], [], max(timeout, 0))
    finally:
        os.close(pidfd)
    if exited:
        proc.wait()
    return bool(exited)


def reap_all() -> None:
    """Wait for every child left (as pid 1 of the sandbox, the orphans of the program are the judge's)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def limits(job: dict):
    """preexec_fn for a program process: the rlimits, set between fork and exec (the judge has one thread)."""
    memory = job["memory_mb"] << 20
    cpu = math.ceil(job["timeout"]) + 1
    limit = job["output_limit"]
    pairs = [
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (limit, limit)),
        (resource.RLIMIT_NOFILE, (job["open_files"], job["open_files"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if job["process_limit"] is not None:
        pairs.append((resource.RLIMIT_NPROC, (job["process_limit"], job["process_limit"])))

    def apply() -> None:
        for which, pair in pairs:
            resource.setrlimit(which, pair)

    return apply


def workdir(scratch: str, index: int) -> str:
    """A fresh writable folder for one run: ``scratch/run-N/work``; ``run-N`` is closed again by ``close``."""
    run = os.path.join(scratch, f"run-{index}")
    work = os.path.join(run, "work")
    os.makedirs(work)
    os.chmod(run, 0o777)
    os.chmod(work, 0o777)
    return work


def close(work: str) -> None:
    os.chmod(os.path.dirname(work), 0)
