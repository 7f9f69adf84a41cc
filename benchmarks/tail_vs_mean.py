"""Tail or mean? One table over sparse runs, each paired with the dense run of the same prompts and seed (issue 19).

Per sparse run: mean acceptance (token-weighted over steps), p5 and p1 (medians over steps of the exact monitor's),
the worst length bin's p5 (below), reward retention (its rollouts' mean reward over the dense run's, step for step),
held-out difference from dense at the last evaluation (paired over prompts, 95% interval), and whether it fell
behind, shown per criterion: in training (retention below --behind-below) and held-out (the interval wholly below
0); either counts. Then Spearman's rho of each statistic against retention, and the pairs whose means agree within
0.01 while their p5 differ by >= 0.05. Runs known only from earlier tables can be added with --extra (a JSON list of
{"name", "mean", "p5", "p1", "retention", "behind"}).

The worst bin's p5 comes from the exact monitor's per-length-bin figures (`mismatch/bin_<start>/exact_p5` and
`.../exact_tokens`; bins of cached length, prompt included, of the run's monitor.bin_size). A bin counts at a step
when it holds at least --min-bin-tokens tokens there (default 200: its p5 then rests on >= 10 tokens below it); each
bin's p5 is the median over the monitored steps where it counts (as the overall p5 is over steps), and the
statistic is the lowest of these, shown with its bin's start (a run whose tokens all fall in one bin gets its
p5). A run with no bin that counts at any step (the --extra summaries, logs without per-bin figures, steps of fewer
tokens) gets a blank and is left out of that correlation only; the correlations are then repeated over just the
runs that have it, so the statistics compare on equal runs.

    .venv/bin/python benchmarks/tail_vs_mean.py runs/bench/promise/sparse-0-3072-seed0=runs/bench/promise/dense-seed0

A pair may end in `=LABEL` to name the run in the table (default: the sparse run's directory name).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from scipy import stats

from sparrow.errors import SparrowError
from sparrow.io import read_jsonl
from sparrow.measure.retention import paired_difference

STATISTICS = ("mean", "p5", "p1", "worst_bin_p5")
BIN_P5 = re.compile(r"mismatch/bin_(\d+)/exact_p5")


@dataclass(frozen=True)
class RunOutcome:
    """One sparse run: its acceptance statistics and how its reward compares with the matching dense run."""

    name: str
    mean: float
    p5: float
    p1: float
    retention: float  # sparse mean reward / dense mean reward
    behind: bool  # the run fell behind dense (the caller's rule, e.g. retention or held-out interval below)
    worst_bin_p5: float = math.nan  # the lowest per-length-bin p5 (nan: no bin with enough tokens)
    worst_bin: int | None = None  # that bin's start (cached tokens)


def bin_p5s(rows: list[dict], min_tokens: int) -> dict[int, float]:
    """Per length bin (its start in cached tokens), the median over steps of the exact monitor's p5 in that bin,
    over the steps where the bin holds at least `min_tokens` tokens; bins that never do are left out."""
    counted: dict[int, list[float]] = {}
    for row in rows:
        for key, p5 in row.items():
            match = BIN_P5.fullmatch(key)
            if match and row.get(f"mismatch/bin_{match[1]}/exact_tokens", 0) >= min_tokens:
                counted.setdefault(int(match[1]), []).append(p5)
    return {start: median(values) for start, values in sorted(counted.items())}


def worst_bin(rows: list[dict], min_tokens: int) -> tuple[float, int | None]:
    """The lowest of `bin_p5s` and its bin's start; (nan, None) when no bin has enough tokens at any step."""
    per_bin = bin_p5s(rows, min_tokens)
    if not per_bin:
        return math.nan, None
    start = min(per_bin, key=per_bin.get)
    return per_bin[start], start


def rank_correlations(runs: list[RunOutcome]) -> dict[str, tuple[float, float, int]]:
    """Per statistic, Spearman's rho against retention, its two-sided p-value and the number of runs it was
    taken over: the runs where the statistic is known (not nan); (nan, nan, n) below 3 runs or for constant
    values."""
    out = {}
    for name in STATISTICS:
        known = [r for r in runs if not math.isnan(getattr(r, name))]
        values, retention = [getattr(r, name) for r in known], [r.retention for r in known]
        if len(known) < 3 or len(set(values)) < 2 or len(set(retention)) < 2:
            out[name] = (float("nan"), float("nan"), len(known))
            continue
        rho, p = stats.spearmanr(values, retention)
        out[name] = (float(rho), float(p), len(known))
    return out


def contrast_pairs(runs: list[RunOutcome], mean_within: float = 0.01, p5_apart: float = 0.05) -> list[dict]:
    """Pairs of runs whose mean acceptance is within `mean_within` while their p5 differ by at least `p5_apart`,
    with which statistic orders their retention correctly (the one whose higher value went with the higher
    retention)."""
    if mean_within < 0 or p5_apart < 0:
        raise SparrowError(f"mean_within and p5_apart must be >= 0, got {mean_within} and {p5_apart}")
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if abs(a.mean - b.mean) <= mean_within and abs(a.p5 - b.p5) >= p5_apart:
                better = a if a.retention > b.retention else b if b.retention > a.retention else None
                other = b if better is a else a
                right = [s for s in STATISTICS if better is not None and getattr(better, s) > getattr(other, s)]
                pairs.append({"runs": (a.name, b.name), "mean": (a.mean, b.mean), "p5": (a.p5, b.p5),
                              "retention": (a.retention, b.retention), "predicted_by": right})
    return pairs


def _rows(run: Path, name: str) -> list[dict]:
    path = run / name
    return [row for _, row in read_jsonl(path, torn_tail_ok=True)] if path.is_file() else []


def _per_example(run: Path) -> list | None:
    """Per-prompt held-out means of a run's last evaluation: from eval.jsonl, or for logs older than that field
    from `eval-step<N>-per-prompt.json` beside it (`sparrow eval --json` of the step-N checkpoint)."""
    rows = _rows(run, "eval.jsonl")
    if not rows:
        return None
    if "eval/per_example_mean" in rows[-1]:
        return rows[-1]["eval/per_example_mean"]
    redone = run / f"eval-step{rows[-1].get('step')}-per-prompt.json"
    return json.loads(redone.read_text()).get("per_example_mean") if redone.is_file() else None


def _held_out(sparse: Path, dense: Path) -> tuple[float, float, float] | None:
    x, y = _per_example(sparse), _per_example(dense)
    if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y) or len(x) < 2:
        return None
    return paired_difference(x, y)


def _only_bin_p1(row: dict) -> float:
    """A step's p1 from its one length bin, for logs older than the overall p1 (nan with several bins)."""
    bins = [v for k, v in row.items() if k.startswith("mismatch/bin_") and k.endswith("/exact_p1")]
    return bins[0] if len(bins) == 1 else math.nan


def _fell_behind(retention: float, held: tuple | None, behind_below: float) -> tuple[bool, bool]:
    """(in training: retention below `behind_below`, held-out: the paired interval wholly below 0)."""
    return retention < behind_below, held is not None and held[2] < 0


def summarise(sparse: Path, dense: Path, behind_below: float, label: str | None = None, min_bin_tokens: int = 200
              ) -> tuple[RunOutcome, tuple | None]:
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
    behind = any(_fell_behind(retention, held, behind_below))
    return RunOutcome(label or sparse.name, mean, median(r["mismatch/exact/p5"] for r in monitored),
                      median(p1s) if not any(map(math.isnan, p1s)) else math.nan, retention, behind,
                      *worst_bin(monitored, min_bin_tokens)), held


def _cell(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.3f}"


def _correlation_lines(runs: list[RunOutcome]) -> list[str]:
    """Each statistic's rho over the runs that know it, then all of them again over the runs with a worst bin."""
    lines = []
    for name, (rho, p, count) in rank_correlations(runs).items():
        left = f"; {len(runs) - count} runs without it left out of this one only" if count < len(runs) else ""
        lines.append(f"- Spearman rho of {name} against retention: {rho:+.2f} (p {p:.2g}, {count} runs where it is "
                     f"known{left})")
    binned = [r for r in runs if not math.isnan(r.worst_bin_p5)]
    if 0 < len(binned) < len(runs):
        rhos = ", ".join(f"{name} {rho:+.2f} (p {p:.2g}, {count})"
                         for name, (rho, p, count) in rank_correlations(binned).items())
        lines.append(f"- Over the {len(binned)} runs with a worst bin only: {rhos}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", nargs="*", help="SPARSE_RUN_DIR=DENSE_RUN_DIR[=LABEL]")
    parser.add_argument("--extra", help="JSON list of earlier runs' summaries")
    parser.add_argument("--behind-below", type=float, default=0.9, help="retention below which a run fell behind")
    parser.add_argument("--min-bin-tokens", type=int, default=200,
                        help="tokens a length bin needs at a step to count towards the worst bin's p5")
    args = parser.parse_args(argv)
    runs, held = [], {}
    for pair in args.pairs:
        parts = pair.split("=")
        if len(parts) not in (2, 3) or not all(parts):
            sys.exit(f"expected SPARSE_RUN_DIR=DENSE_RUN_DIR or SPARSE_RUN_DIR=DENSE_RUN_DIR=LABEL, got {pair!r}")
        label = parts[2] if len(parts) == 3 else None
        run, outcome = summarise(Path(parts[0]), Path(parts[1]), args.behind_below, label, args.min_bin_tokens)
        if run.name in held:
            sys.exit(f"two runs are named {run.name!r}; give them labels (SPARSE_RUN_DIR=DENSE_RUN_DIR=LABEL)")
        held[run.name] = outcome
        runs.append(run)
    if args.extra:
        runs += [RunOutcome(**row) for row in json.loads(Path(args.extra).read_text())]
    print("| run | mean acceptance | p5 | p1 | worst bin's p5 (bin start) | reward retention | held-out vs dense [95%] "
          "| fell behind: training / held-out |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        h = held.get(r.name)
        shown = f"{h[0]:+.3f} [{h[1]:+.3f}, {h[2]:+.3f}]" if h else "-"
        in_training, held_out = ("yes" if b else "no" for b in _fell_behind(r.retention, h, args.behind_below))
        verdict = f"{in_training} / {held_out if h else '-'}" if r.name in held else ("yes" if r.behind else "no")
        binned = f"{_cell(r.worst_bin_p5)} ({r.worst_bin})" if r.worst_bin is not None else _cell(r.worst_bin_p5)
        print(f"| {r.name} | {r.mean:.3f} | {r.p5:.3f} | {_cell(r.p1)} | {binned} | {r.retention:.2f} | {shown} "
              f"| {verdict} |")
    print()
    print("\n".join(_correlation_lines(runs)))
    for pair in contrast_pairs(runs):
        a, b = pair["runs"]
        print(f"- {a} vs {b}: mean {pair['mean'][0]:.3f} / {pair['mean'][1]:.3f}, p5 {pair['p5'][0]:.3f} / "
              f"{pair['p5'][1]:.3f}, retention {pair['retention'][0]:.2f} / {pair['retention'][1]:.2f}; ordered "
              f"rightly by: {', '.join(pair['predicted_by']) or 'none of ' + '/'.join(STATISTICS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
