"""The `sparrow` command line: the parser of every sub-command, the check of the environment, and how an error,
a closed pipe, an interrupt (Ctrl-C) or a termination (SIGTERM, as `kill` and job schedulers send) ends a run (one
line, exit status; output already written is kept and flushed)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings

from tqdm import std as tqdm_std
from transformers.utils import logging as hf_logging

from sparrow import models
from sparrow.cpu import switches
from sparrow.errors import SparrowError
from sparrow.rewards import sandbox

from . import bench, calibrate, cost, evaluate, generate, profile, prompts, report, schedule, train

COMMANDS = (schedule, generate, bench, prompts, profile, calibrate, cost, train, evaluate, report)

EXIT_BAD_INPUT = 2
EXIT_BROKEN_PIPE = 128 + 13
"""What a shell reports for a writer killed by SIGPIPE (`yes | head`): the reader of stdout went away."""
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised wherever the run is, so that it ends as Ctrl-C ends it."""


def _terminate(signum, frame) -> None:
    raise Terminated


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparrow", description="Sparse-attention rollouts for RL of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if sys.stdout is None:  # started with stdout closed (`>&-`): Python has no stream to print to
        _print_error(args.command, "standard output is closed; redirect it to a file or /dev/null instead")
        return EXIT_BAD_INPUT
    hf_logging.disable_progress_bar()  # transformers' per-tensor loading bar on every command is noise
    warnings.showwarning = _show_warning
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set a handler
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        check_environment()
        code = args.run(args) or 0
        sys.stdout.flush()  # a closed pipe shows up here at the latest, while it can still be handled
        return code
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except (SparrowError, OSError) as err:
        _print_error(args.command, err if isinstance(err, SparrowError) else _one_line(err))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as err:
        terminated = isinstance(err, Terminated)
        _print_error(args.command, "terminated" if terminated else "interrupted", prefix="")
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


_default_show_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Sparrow's own warnings as the one line they are ("sparrow: ..."), without Python's source location;
    other libraries' as Python shows them."""
    text = str(message)
    if text.startswith("sparrow: "):
        print(f"warning: {text[len('sparrow: '):]}", file=file or sys.stderr)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


def check_environment() -> None:
    """Read every SPARROW_* variable the library reads deep inside a run, so that a value it does not understand is
    refused by name before any model loads (SPARROW_VLLM_* are checked where --backend vllm starts vLLM)."""
    switches.check_all()
    sandbox.unsafe_from_env()
    models.cache_dir()


def _print_error(command: str, message, prefix: str = "error: ") -> None:
    """`sparrow CMD: error: MESSAGE` on a line of its own: progress bars the error left open are closed first and
    pending standard output is written, so the message never lands in the middle of either."""
    for bar in list(tqdm_std.tqdm._instances):  # tqdm's registry of live bars (no public accessor)
        bar.close()
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        _discard_stdout()
    print(f"sparrow {command}: {prefix}{message}", file=sys.stderr)


def _one_line(err: OSError) -> str:
    """An operating-system error as one line naming the file, e.g. "'out.json': Permission denied"."""
    if err.filename is None:
        return " ".join(str(err).split())
    names = repr(str(err.filename)) + (f" -> {str(err.filename2)!r}" if err.filename2 is not None else "")
    return f"{names}: {err.strerror or err}"


def _discard_stdout() -> None:
    """Point the stdout file descriptor at /dev/null once its reader is gone, so the interpreter's final flush does
    not raise a second BrokenPipeError (the recipe of Python's signal docs). Standard output that is not a real
    file (captured in tests) has nothing to redirect."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
