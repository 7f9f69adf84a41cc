"""The phase clock: where a `generate` call's time went, so that a slow rollout phase can be attributed.

Each lap is read after the GPU's queued work is done, so the seconds land in the phase that queued the work.
"""

from __future__ import annotations

import time

import torch

TIMED_PHASES = ("prefill", "decode", "verify", "sample")
"""Dense prompt forwards; decode forwards (sparse drafts in exact mode); exact mode's dense verification forwards;
sampling and bookkeeping."""


class PhaseClock:
    """Seconds per phase of `TIMED_PHASES` since the last `reset`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = dict.fromkeys(TIMED_PHASES, 0.0)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(TIMED_PHASES, 0.0)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, phase: str, since: float) -> float:
        """Add the time since `since` to `phase`; returns now."""
        now = self.now()
        self.seconds[phase] += now - since
        return now
