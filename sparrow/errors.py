"""The one exception type users see: a message that names the bad value and what was expected."""


class SparrowError(ValueError):
    """Bad input or an impossible request, reported as one clear message (no traceback in the CLI)."""
