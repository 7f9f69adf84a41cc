"""Reading training runs' logs for the report: each run's metrics.jsonl and eval.jsonl as rows, and the medians,
ratios and totals the tables and plots take from them.

Phase times are medians over steps: the first step also pays one-time costs (kernel build, allocator warm-up),
and a median keeps one slow step from deciding a comparison.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median

from sparrow.errors import SparrowError
from sparrow.io import read_jsonl, require_file

PHASES = ("rollout", "reward", "recompute", "update")
ROLLOUT_PHASES = ("prefill", "decode", "sample")  # what the native engine reports of its rollout time


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_rows(path: Path, required: tuple[str, ...]) -> list[dict]:
    """The rows of a run's JSONL file; a row without a number under each `required` key (a key ending in "@" stands
    for any key starting with it, e.g. "eval/mean@4") is an error naming the file, line and key."""
    numbered = read_jsonl(path, torn_tail_ok=True)  # a killed run may end in a torn line
    previous = -1
    for number, row in numbered:
        for key in required:
            found = [k for k in row if k.startswith(key)] if key.endswith("@") else [key]
            if not found or not all(is_number(row.get(k)) for k in found):
                shown = f"{key}k" if key.endswith("@") else key
                raise SparrowError(f"{path}:{number}: no number under {shown!r}; expected a row written by "
                                   "'sparrow train'")
        if row["step"] <= previous:  # two logs in one file, or one edited: the curves would double back
            where = "is negative" if row["step"] < 0 else f"comes after step {previous}"
            raise SparrowError(f"{path}:{number}: step {row['step']} {where}; expected steps from 0 up, each once, "
                               "as 'sparrow train' writes them")
        previous = row["step"]
    return [row for _, row in numbered]


def load_runs(run_dirs: list[Path]) -> dict[str, list[dict]]:
    runs = {}
    for run in run_dirs:
        path = Path(run) / "metrics.jsonl"
        if not path.exists() and not path.is_symlink():
            raise SparrowError(f"{run} has no metrics.jsonl; is it a 'sparrow train' output directory?")
        require_file(path, "metrics file")
        runs[Path(run).name] = _read_rows(path, ("step", "reward/mean"))
    return runs


def load_evals(run_dirs: list[Path]) -> dict[str, list[dict]]:
    """Each run's eval.jsonl (held-out evaluations during training), with its mean@k under "eval/mean"."""
    evals = {}
    for run in run_dirs:
        path = Path(run) / "eval.jsonl"
        if path.is_file():
            rows = _read_rows(path, ("step", "eval/mean@"))
            for row in rows:
                row["eval/mean"] = next(v for k, v in row.items() if k.startswith("eval/mean@"))
            evals[Path(run).name] = rows
    return evals


def median_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return median(values) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def throughput(rows: list[dict], seconds_key: str = "time/rollout_s") -> float:
    """Rollout tokens per rollout second over the whole run, or per second of `seconds_key` (time/step_s: of whole
    steps). Total over total: long steps weigh more, and a run whose answers got shorter is not credited for it,
    unlike a ratio of median times."""
    timed = [r for r in rows if is_number(r.get("rollout/tokens_per_s")) and is_number(r.get("time/rollout_s"))
             and is_number(r.get(seconds_key))]
    tokens = sum(r["rollout/tokens_per_s"] * r["time/rollout_s"] for r in timed)
    seconds = sum(r[seconds_key] for r in timed)
    return tokens / seconds if seconds else float("nan")


def rollout_clock(rows: list[dict]) -> dict[int, float]:
    """Cumulative rollout seconds at the end of each step (step 0: before the first)."""
    clock, total = {0: 0.0}, 0.0
    for row in rows:
        total += row.get("time/rollout_s", 0.0) if is_number(row.get("time/rollout_s")) else 0.0
        clock[row["step"]] = total
    return clock


def bin_keys(runs: dict, prefix: str, suffix: str) -> list[str]:
    """The per-length-bin metric names `<prefix><start>/<suffix>` of any run, by bin start."""
    keys = {k for rows in runs.values() for r in rows for k in r if k.startswith(prefix) and k.endswith(suffix)}
    return sorted(keys, key=lambda k: int(k[len(prefix):].split("/")[0]))


RETENTION = "mismatch/reward_retention"


def checked_runs(runs: dict) -> dict[str, list[dict]]:
    """Per run, its steps with a reward check (a finite retention and interval); runs without checks left out."""
    checked = {name: [r for r in rows if all(is_number(r.get(RETENTION + s)) and math.isfinite(r[RETENTION + s])
                                             for s in ("", "_low", "_high"))] for name, rows in runs.items()}
    return {name: rows for name, rows in checked.items() if rows}
