"""Stdin/stdout cases: the program runs once per case, in a fresh folder, and its output is compared here. It
runs only in the harness process and imports its siblings top-level."""

from __future__ import annotations

import time

from child import Run
from processes import close, workdir


def same_output(actual: str, expected: str) -> bool:
    """Equal after stripping surrounding whitespace, trailing spaces on each line and CRLF differences."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return norm(actual) == norm(expected)


def run_cases(job: dict, program: str, report, deadline: float) -> None:
    python = job["python"]
    for index, (stdin, expected) in enumerate(job["cases"]):
        if time.monotonic() >= deadline:
            report(index, False, "timeout", "the run's time was used up by earlier cases")
            continue
        folder = workdir(job["scratch"], index)
        run = Run(job, [python, "-I", "-B", program], folder, stdin)
        run.wait(deadline)
        close(folder)
        status = run.status()
        report(index, status == "ok" and same_output(run.output(), expected), status, run.stderr_tail())
