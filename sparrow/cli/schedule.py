"""`sparrow schedule show SPEC`: print a KV-budget schedule as a table or as its JSON bins, to check a spec."""

from __future__ import annotations

import argparse
import json

from sparrow.attention import SparseConfig
from sparrow.schedules import parse_schedule


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
    show.add_argument("spec", metavar="SPEC", help="schedule to show")
    show.add_argument("--json", action="store_true", help="print only the bins as JSON")
    show.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    show.set_defaults(run=run_show)


def run_show(args: argparse.Namespace) -> int:
    """Parse and validate the spec, then print it."""
    kept = SparseConfig().always_kept_pages
    schedule = parse_schedule(args.spec, page_size=args.page_size, always_kept_pages=kept)
    if args.json:
        print(json.dumps(schedule.to_json()))
        return 0
    if schedule.is_dense:
        print(f"schedule {schedule.name}: dense (every cached token is attended)")
        return 0
    print(f"schedule {schedule.name} (page size {args.page_size}, {len(schedule.starts)} bins)")
    header = ("bin", "from token", "to token", "KV budget (tokens)", "top-k pages")
    rows = []
    for i, (start, budget) in enumerate(zip(schedule.starts, schedule.budgets)):
        end = str(schedule.starts[i + 1]) if i + 1 < len(schedule.starts) else "..."
        rows.append((str(i), str(start), end, str(budget), str(budget // args.page_size - kept)))
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    return 0
