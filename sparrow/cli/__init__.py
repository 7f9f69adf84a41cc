"""The `sparrow` command: one sub-command per module in this package, each thin over the library; app.py builds
the parser and runs one. Importing the package loads nothing more, so a command module imports only what it needs
(`report` and `schedule` load no torch until they run)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the `sparrow` command on `argv` (default: the process's arguments); the exit status."""
    from .app import main as run

    return run(argv)
