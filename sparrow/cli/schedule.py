"""`sparrow schedule show SPEC`: print a KV-budget schedule as a table or as its JSON bins, to check a spec.

Importing this module loads no torch: the schedule parser (and torch with it) is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from sparrow.typed_config import option

from .config import add_config_options, load_config


@dataclass
class ShowConfig:
    spec: str | None = option(None, "schedule to show", positional="SPEC")
    json: bool = option(False, "print only the bins as JSON")
    page_size: int = option(16, "tokens per KV page")
    parsed: object = field(default=None, init=False, repr=False, compare=False)  # the Schedule, from validate()
    kept: int = field(default=0, init=False, repr=False, compare=False)  # pages every sparse step keeps

    def validate(self) -> None:
        from sparrow.attention import SparseConfig
        from sparrow.schedules import parse_schedule

        self.kept = SparseConfig().always_kept_pages
        self.parsed = parse_schedule(self.spec, page_size=self.page_size, always_kept_pages=self.kept)


def add_parser(subparsers) -> None:
    """Register `schedule` with its required sub-command `show`."""
    parser = subparsers.add_parser("schedule", help="inspect KV-budget schedules",
                                   description="Inspect KV-budget schedules (budget per total cached length).")
    sub = parser.add_subparsers(dest="schedule_command", required=True, metavar="SUBCOMMAND")
    show = sub.add_parser("show", help="print a schedule's bins",
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          description="Print a schedule's bins: cached-length range, KV budget, top-k pages.",
                          epilog="SPEC: dense | const:N | steps:BIN:b1,b2,... | start:budget,... | "
                                 "a preset name (e.g. qwen3-4b-0.86) | a JSON file")
    add_config_options(show, ShowConfig)
    show.set_defaults(run=run_show)


def run_show(args: argparse.Namespace) -> int:
    """Parse and validate the spec, then print it."""
    config = load_config(ShowConfig, args)
    schedule, kept = config.parsed, config.kept
    if config.json:
        print(json.dumps(schedule.to_json()))
        return 0
    if schedule.is_dense:
        print(f"schedule {schedule.name}: dense (every cached token is attended)")
        return 0
    print(f"schedule {schedule.name} (page size {config.page_size}, {len(schedule.starts)} bins)")
    header = ("bin", "from token", "to token", "KV budget (tokens)", "top-k pages")
    rows = []
    for i, (start, budget) in enumerate(zip(schedule.starts, schedule.budgets)):
        end = str(schedule.starts[i + 1]) if i + 1 < len(schedule.starts) else "..."
        rows.append((str(i), str(start), end, str(budget), str(budget // config.page_size - kept)))
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    return 0
