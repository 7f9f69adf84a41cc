"""`sparrow report RUN_DIR [RUN_DIR ...]`: one markdown report with plots comparing training runs.

Importing this module loads no torch: the output path is checked before the report's code is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparrow.io import check_output
from sparrow.typed_config import option

from .config import add_config_options, load_config


@dataclass
class ReportConfig:
    runs: list[str] | None = option(None, "'sparrow train' output directories", positional="runs")
    out: str = option("runs/report", "where report.md and the plots go")

    def validate(self) -> None:
        check_output(self.out, "output directory", directory=True)


def run(args) -> int:
    config = load_config(ReportConfig, args)
    from sparrow.report import write_report

    report = write_report([Path(d) for d in config.runs], Path(config.out))
    print(f"wrote {report}")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("report", help="compare training runs (e.g. sparse vs dense rollouts) in one report")
    add_config_options(parser, ReportConfig)
    parser.set_defaults(run=run)
