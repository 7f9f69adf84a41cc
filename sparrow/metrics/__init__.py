"""Pure math on next-token distributions (no I/O, no model): the exact acceptance rate and its input checks.

Below the engine in the layer table, so that exact rollouts record the acceptance of every drafted token with the
same function that `sparrow.measure` uses for teacher-forced measurement."""

from .divergence import acceptance_rate

__all__ = ["acceptance_rate"]
