"""Tail or mean? One table over sparse runs, each paired with the dense run of the same prompts and seed (issue 19).

Per sparse run: mean acceptance (token-weighted over steps), p5 and p1 (medians over steps of the exact monitor's),
reward retention (its rollouts' mean reward over the dense run's, step for step), held-out difference from dense
at the last evaluation (paired over prompts, 95% interval), and whether it fell behind (retention below
--behind-below, or the held-out interval wholly below 0). Then Spearman's rho of each statistic against retention,
and the pairs whose means agree within 0.01 while their p5 differ by >= 0.05. Runs known only from earlier
tables can be added with --extra (a JSON list of {"name", "mean", "p5", "p1", "retention", "behind"}).

    .venv/bin/python scripts/tail_vs_mean.py runs/bench/promise/sparse-0-3072-seed0=runs/bench/promise/dense-seed0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from statistics import median

from sparrow.io import read_jsonl
from sparrow.measure.predictors import STATISTICS, RunOutcome, contrast_pairs, rank_correlations
from sparrow.measure.retention import paired_difference


def _rows(run: Path, name: str) -> list[dict]:
    path = run / name
    return [row for _, row in read_jsonl(path, torn_tail_ok=True)] if path.is_file() else []


def _held_out(sparse: Path, dense: Path) -> tuple[float, float, float] | None:
    a, b = _rows(sparse, "eval.jsonl"), _rows(dense, "eval.jsonl")
    if not a or not b:
        return None
    x, y = a[-1].get("eval/per_example_mean"), b[-1].get("eval/per_example_mean")
    if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y) or len(x) < 2:
        return None
    return paired_difference(x, y)


def _only_bin_p1(row: dict) -> float:
    """A step's p1 from its one length bin, for logs older than the overall p1 (nan with several bins)."""
    bins = [v for k, v in row.items() if k.startswith("mismatch/bin_") and k.endswith("/exact_p1")]
    return bins[0] if len(bins) == 1 else math.nan


def summarise(sparse: Path, dense: Path, behind_below: float) -> tuple[RunOutcome, tuple | None]:
    rows, base = _rows(sparse, "metrics.jsonl"), _rows(dense, "metrics.jsonl")
    if not rows or not base:
        sys.exit(f"{sparse} or {dense} has no metrics.jsonl")
    steps = {r["step"]: r["reward/mean"] for r in base}
    paired = [(r["reward/mean"], steps[r["step"]]) for r in rows if r["step"] in steps]
    retention = sum(s for s, _ in paired) / max(1e-12, sum(d for _, d in paired))
    monitored = [r for r in rows if "mismatch/exact/mean" in r]
    if not monitored:
        sys.exit(f"{sparse} has no exact monitor metrics (mismatch/exact/*); was it a sparse run?")
    tokens = sum(r["mismatch/exact/tokens"] for r in monitored)
    mean = sum(r["mismatch/exact/mean"] * r["mismatch/exact/tokens"] for r in monitored) / tokens
    p1s = [r.get("mismatch/exact/p1", _only_bin_p1(r)) for r in monitored]
    held = _held_out(sparse, dense)
    behind = retention < behind_below or (held is not None and held[2] < 0)
    return RunOutcome(sparse.name, mean, median(r["mismatch/exact/p5"] for r in monitored),
                      median(p1s) if not any(map(math.isnan, p1s)) else math.nan, retention, behind), held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", nargs="*", help="SPARSE_RUN_DIR=DENSE_RUN_DIR")
    parser.add_argument("--extra", help="JSON list of earlier runs' summaries")
    parser.add_argument("--behind-below", type=float, default=0.9, help="retention below which a run fell behind")
    args = parser.parse_args(argv)
    runs, held = [], {}
    for pair in args.pairs:
        if "=" not in pair:
            sys.exit(f"expected SPARSE_RUN_DIR=DENSE_RUN_DIR, got {pair!r}")
        sparse, dense = (Path(p) for p in pair.split("=", 1))
        run, held[sparse.name] = summarise(sparse, dense, args.behind_below)
        runs.append(run)
    if args.extra:
        runs += [RunOutcome(**row) for row in json.loads(Path(args.extra).read_text())]
    print("| run | mean acceptance | p5 | p1 | reward retention | held-out vs dense [95%] | fell behind |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        h = held.get(r.name)
        shown = f"{h[0]:+.3f} [{h[1]:+.3f}, {h[2]:+.3f}]" if h else "-"
        print(f"| {r.name} | {r.mean:.3f} | {r.p5:.3f} | {r.p1:.3f} | {r.retention:.2f} | {shown} | "
              f"{'yes' if r.behind else 'no'} |")
    print()
    for name, (rho, p, count) in rank_correlations(runs).items():
        print(f"- Spearman rho of {name} against retention: {rho:+.2f} (p {p:.2g}, {count} runs where it is known)")
    for pair in contrast_pairs(runs):
        a, b = pair["runs"]
        print(f"- {a} vs {b}: mean {pair['mean'][0]:.3f} / {pair['mean'][1]:.3f}, p5 {pair['p5'][0]:.3f} / "
              f"{pair['p5'][1]:.3f}, retention {pair['retention'][0]:.2f} / {pair['retention'][1]:.2f}; ordered "
              f"rightly by: {', '.join(pair['predicted_by']) or 'none of ' + '/'.join(STATISTICS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
