"""What a long command is doing: one line per phase on stderr, so that stdout keeps only the result."""

from __future__ import annotations

import sys
import time


def phase_log(command: str):
    """A log that writes each message to stderr as '[command m:ss] message', m:ss the time since this call."""
    start = time.perf_counter()

    def log(message: str) -> None:
        elapsed = int(time.perf_counter() - start)
        print(f"[{command} {elapsed // 60}:{elapsed % 60:02d}] {message}", file=sys.stderr, flush=True)

    return log
