"""`sparrow report RUN_DIR [RUN_DIR ...]`: one markdown report with plots comparing training runs."""

from __future__ import annotations

from pathlib import Path

from sparrow.io import check_output
from sparrow.rl.report import write_report


def run(args) -> int:
    check_output(args.out, "output directory", directory=True)
    report = write_report([Path(d) for d in args.runs], Path(args.out))
    print(f"wrote {report}")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("report", help="compare training runs (e.g. sparse vs dense rollouts) in one report")
    parser.add_argument("runs", nargs="+", help="'sparrow train' output directories")
    parser.add_argument("--out", default="runs/report", help="where report.md and the plots go")
    parser.set_defaults(run=run)
