"""Pure math on next-token distributions (no I/O, no model): the exact acceptance rate, its input checks, and the
tail of per-token acceptance per length bin (tail.py).

Below the engine in the layer table, so that exact rollouts record the acceptance of every drafted token with the
same function that `sparrow.measure` uses for teacher-forced measurement, and the schedule controllers
(`sparrow.schedules`) decide on the same tail statistics that `sparrow.measure` reports."""

from .divergence import acceptance_rate

__all__ = ["acceptance_rate"]
