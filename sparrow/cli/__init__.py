"""The `sparrow` command: one sub-command per module in this package, each thin over the library."""

from __future__ import annotations

import argparse
import sys

from transformers.utils import logging as hf_logging

from sparrow.errors import SparrowError

from . import bench, calibrate, cost, evaluate, generate, profile, prompts, report, schedule, train

COMMANDS = (schedule, generate, bench, prompts, profile, calibrate, cost, train, evaluate, report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparrow", description="Sparse-attention rollouts for RL of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()  # transformers' per-tensor loading bar on every command is noise
    try:
        return args.run(args) or 0
    except SparrowError as err:
        print(f"sparrow {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sparrow {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
