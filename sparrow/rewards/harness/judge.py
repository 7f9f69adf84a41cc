"""The judge's main: read the job, run its cases or its assert tests, report one JSON line per test (see
__init__.py). It runs only in the harness process and imports its siblings top-level."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from asserts import run_asserts
from cases import run_cases
from protocol import DETAIL_CHARS

_PR_SET_DUMPABLE = 4


def _not_dumpable() -> None:
    """No other process of the same user may read this one's memory or open its files through /proc."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main() -> None:
    """The judge: read the job, run the tests, write one JSON line per test and a final ``{"end": true}``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as pid 1, signals without a handler from inside are dropped
    _not_dumpable()
    job = json.loads(sys.stdin.buffer.read())
    os.close(0)
    channel = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # test code that prints cannot write into the report
    deadline = time.monotonic() + job["timeout"]

    def report(index: int, passed: bool, status: str, detail: str) -> None:
        record = {"i": index, "passed": bool(passed), "status": status, "detail": str(detail)[-DETAIL_CHARS:]}
        channel.write(json.dumps(record) + "\n")
        channel.flush()

    program = os.path.join(job["scratch"], "main.py")
    with open(program, "w", encoding="utf-8") as f:
        f.write(job["program"])
    os.chmod(program, 0o444)
    if job["cases"] is not None:
        run_cases(job, program, report, deadline)
    else:
        run_asserts(job, program, report, deadline)
    channel.write('{"end": true}\n')
    channel.flush()
