"""A markdown report with plots from one or more runs' metrics.jsonl (e.g. sparse vs dense rollouts).

Phase times are medians over steps: the first step also pays one-time costs (kernel build, allocator warm-up),
and a median keeps one slow step from deciding a comparison.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median

from sparrow.errors import SparrowError
from sparrow.io import atomic_write_text, read_jsonl, require_file, save_figure
from sparrow.measure.retention import MIN_INTERVAL_PROMPTS, paired_difference, too_few_prompts

PHASES = ("rollout", "reward", "recompute", "update")
ROLLOUT_PHASES = ("prefill", "decode", "sample")  # what the native engine reports of its rollout time


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_rows(path: Path, required: tuple[str, ...]) -> list[dict]:
    """The rows of a run's JSONL file; a row without a number under each `required` key (a key ending in "@" stands
    for any key starting with it, e.g. "eval/mean@4") is an error naming the file, line and key."""
    numbered = read_jsonl(path, torn_tail_ok=True)  # a killed run may end in a torn line
    previous = -1
    for number, row in numbered:
        for key in required:
            found = [k for k in row if k.startswith(key)] if key.endswith("@") else [key]
            if not found or not all(_is_number(row.get(k)) for k in found):
                shown = f"{key}k" if key.endswith("@") else key
                raise SparrowError(f"{path}:{number}: no number under {shown!r}; expected a row written by "
                                   "'sparrow train'")
        if row["step"] <= previous:  # two logs in one file, or one edited: the curves would double back
            where = "is negative" if row["step"] < 0 else f"comes after step {previous}"
            raise SparrowError(f"{path}:{number}: step {row['step']} {where}; expected steps from 0 up, each once, "
                               "as 'sparrow train' writes them")
        previous = row["step"]
    return [row for _, row in numbered]


def _rollout_breakdown(runs: dict[str, list[dict]]) -> list[str]:
    """Median seconds per step of the rollout phase's parts and of the exact monitor, for runs that logged them."""
    logged = {name: rows for name, rows in runs.items()
              if all(_is_number(r.get(f"time/rollout_{p}_s")) for r in rows for p in ROLLOUT_PHASES)}
    if not logged:
        return []
    lines = ["", "Where the rollout time goes (median seconds per step; the monitor is timed apart from the recompute or "
             "update it runs in):", "",
             "| run | " + " | ".join(f"{p} s" for p in ROLLOUT_PHASES) + " | other rollout s | monitor s |",
             "|---|" + "---|" * (len(ROLLOUT_PHASES) + 2)]
    for name, rows in logged.items():
        parts = [_median(rows, f"time/rollout_{p}_s") for p in ROLLOUT_PHASES]
        other = median(r["time/rollout_s"] - sum(r[f"time/rollout_{p}_s"] for p in ROLLOUT_PHASES) for r in rows)
        monitor = _median(rows, "time/monitor_s")
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in parts) + f" | {other:.2f} | "
                     + ("-" if math.isnan(monitor) else f"{monitor:.2f}") + " |")
    return lines


def load_runs(run_dirs: list[Path]) -> dict[str, list[dict]]:
    runs = {}
    for run in run_dirs:
        path = Path(run) / "metrics.jsonl"
        if not path.exists() and not path.is_symlink():
            raise SparrowError(f"{run} has no metrics.jsonl; is it a 'sparrow train' output directory?")
        require_file(path, "metrics file")
        runs[Path(run).name] = _read_rows(path, ("step", "reward/mean"))
    return runs


def _plot_curves(runs: dict, keys: list[tuple[str, str]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8))
    for ax, (key, label) in zip(axes if len(keys) > 1 else [axes], keys):
        for name, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run may lack a metric; an empty legend only warns
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


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


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return median(values) if values else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _throughput(rows: list[dict], seconds_key: str = "time/rollout_s") -> float:
    """Rollout tokens per rollout second over the whole run, or per second of `seconds_key` (time/step_s: of whole
    steps). Total over total: long steps weigh more, and a run whose answers got shorter is not credited for it,
    unlike a ratio of median times."""
    timed = [r for r in rows if _is_number(r.get("rollout/tokens_per_s")) and _is_number(r.get("time/rollout_s"))
             and _is_number(r.get(seconds_key))]
    tokens = sum(r["rollout/tokens_per_s"] * r["time/rollout_s"] for r in timed)
    seconds = sum(r[seconds_key] for r in timed)
    return tokens / seconds if seconds else float("nan")


def _rollout_clock(rows: list[dict]) -> dict[int, float]:
    """Cumulative rollout seconds at the end of each step (step 0: before the first)."""
    clock, total = {0: 0.0}, 0.0
    for row in rows:
        total += row.get("time/rollout_s", 0.0) if _is_number(row.get("time/rollout_s")) else 0.0
        clock[row["step"]] = total
    return clock


def _plot_reward_vs_rollout_time(runs: dict, evals: dict, path: Path) -> None:
    """Training reward (and held-out reward, where evaluated) against the cumulative rollout seconds: what a
    faster rollout buys, if the reward keeps up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward/mean", "training reward (the rollouts')", runs)] + (
        [("eval/mean", "held-out reward (dense policy)", evals)] if evals else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (key, label, source) in zip(axes[0], panels):
        for name, rows in source.items():
            clock = _rollout_clock(runs.get(name, []))
            points = [(clock[r["step"]], r[key]) for r in rows if r["step"] in clock and _is_number(r.get(key))]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xlabel("cumulative rollout seconds")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Reward vs rollout time")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def _prompt_count(row: dict) -> int | None:
    """The number of held-out prompts an eval.jsonl row averaged over, where it says."""
    means = row.get("eval/per_example_mean")
    return len(means) if isinstance(means, list) else row.get("eval/examples")


def _reward_range(row: dict) -> tuple[float, float] | None:
    """The range of the total reward an eval.jsonl row was scored with (built-in rewards), None where unknown."""
    bounds = row.get("eval/reward_range")
    return tuple(bounds) if isinstance(bounds, list) and len(bounds) == 2 and all(map(_is_number, bounds)) else None


def _interval(row: dict) -> str:
    """' [low, high]' of a held-out evaluation's mean over prompts, or why there is none (too few prompts: rows
    written before that rule carry an interval from two prompts, too wide to use)."""
    count = _prompt_count(row)
    if isinstance(count, int) and count < MIN_INTERVAL_PROMPTS:
        return f" ({too_few_prompts(count)})"
    low, high = row.get("eval/mean_low"), row.get("eval/mean_high")
    if not (_is_number(low) and _is_number(high) and math.isfinite(low) and math.isfinite(high)):
        return ""
    return f" [{low:.3f}, {high:.3f}]"


def _held_out(evals: dict) -> list[str]:
    """Each run's first and last held-out reward with the last one's 95% interval over prompts, and, for runs
    evaluated on as many prompts as the first run, the paired difference from it (same prompts, same seed)."""
    lines = ["", ("Held-out reward (mean over samples) at the first and last evaluation, with the last one's 95% "
                  "interval over prompts:"), ""]
    for name, rows in evals.items():
        last = rows[-1]
        lines.append(f"- {name}: step {rows[0]['step']} {rows[0]['eval/mean']:.3f} -> step {last['step']} "
                     f"{last['eval/mean']:.3f}{_interval(last)}")
    first, *others = evals
    base = evals[first][-1].get("eval/per_example_mean")
    for name in others:
        other = evals[name][-1].get("eval/per_example_mean")
        if isinstance(base, list) and isinstance(other, list) and len(base) == len(other) >= 1:
            bounds = _reward_range(evals[name][-1])  # known only when both runs were scored alike
            bounds = bounds if bounds == _reward_range(evals[first][-1]) else None
            mean, low, high = paired_difference(other, base, bounds=bounds)
            interval = (f"[{low:+.3f}, {high:+.3f}] (paired over {len(base)} prompts)" if math.isfinite(low)
                        else f"(paired; {too_few_prompts(len(base))})")
            lines.append(f"- {name} minus {first} at their last evaluation: {mean:+.3f} {interval}")
    return lines


LENGTH_BUCKET = 2048  # tokens of prompt per bucket of the by-length table


def _bucket_means(pairs) -> dict[int, list[float]]:
    """{bucket: rewards} from (prompt length, reward) pairs."""
    out: dict[int, list[float]] = {}
    for length, reward in pairs:
        out.setdefault(int(length) // LENGTH_BUCKET, []).append(reward)
    return out


def _by_prompt_length(runs: dict, evals: dict) -> list[str]:
    """Mean reward per prompt-length bucket: of the rollouts (every group of the run) and of the held-out
    evaluation (its last one), for runs whose prompts span more than one bucket."""
    train = {name: _bucket_means((n, m) for r in rows if isinstance(r.get("prompts/length"), list)
                                 for n, m in zip(r["prompts/length"], r["reward/per_prompt"]))
             for name, rows in runs.items()}
    held = {name: _bucket_means(zip(rows[-1].get("eval/prompt_length") or [], rows[-1].get("eval/per_example_mean")
                                    or [])) for name, rows in evals.items()}
    buckets = sorted({b for table in (*train.values(), *held.values()) for b in table})
    if len(buckets) < 2:
        return []

    def cell(values):
        return f"{sum(values) / len(values):.3f} ({len(values)})" if values else "-"

    header = " | ".join(f"[{b * LENGTH_BUCKET}, {(b + 1) * LENGTH_BUCKET})" for b in buckets)
    lines = ["", ("Mean reward by prompt length (tokens; in brackets the prompts, each group or held-out prompt "
                  "counted once):"), "", f"| run | rewards | {header} |", "|---|---|" + "---|" * len(buckets)]
    for name in runs:
        for what, table in (("rollouts", train.get(name)), ("held-out (last)", held.get(name))):
            if table:
                lines.append(f"| {name} | {what} | " + " | ".join(cell(table.get(b, [])) for b in buckets) + " |")
    return lines


def _tail_by_bin(runs: dict, keys: list[str]) -> list[str]:
    """The median over steps of each length bin's exact p5 (and p1), per run."""
    starts = [int(k.split("/")[1][len("bin_"):]) for k in keys]
    lines = ["", "Exact acceptance per length bin (median over steps of p5 / p1; bins by cached tokens):", "",
             "| run | " + " | ".join(f"from {s}" for s in starts) + " |", "|---|" + "---|" * len(starts)]
    for name, rows in runs.items():
        cells = []
        for start in starts:
            p5, p1 = (_median(rows, f"mismatch/bin_{start}/exact_{q}") for q in ("p5", "p1"))
            cells.append("-" if math.isnan(p5) else f"{p5:.3f} / {p1:.3f}")
        if any(c != "-" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _plot_phases(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.8 * len(runs) + 3, 3.8))
    names = list(runs)
    bottom = [0.0] * len(names)
    for phase in PHASES:
        heights = [_median(runs[n], f"time/{phase}_s") for n in names]
        ax.bar(names, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("median seconds per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Time per phase")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


RETENTION = "mismatch/reward_retention"


def _retention(runs: dict, path: Path) -> list[str]:
    """The reward check's retention per step with its 95% interval (retention.png) and, per run, its median
    next to the check's and the step's median seconds; nothing for runs without checks."""
    checked = {name: [r for r in rows if all(_is_number(r.get(RETENTION + s)) and math.isfinite(r[RETENTION + s])
                                             for s in ("", "_low", "_high"))] for name, rows in runs.items()}
    checked = {name: rows for name, rows in checked.items() if rows}
    if not checked:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, rows in checked.items():
        values = [r[RETENTION] for r in rows]
        ax.errorbar([r["step"] for r in rows], values, marker="o", capsize=3, label=name,
                    yerr=[[v - r[RETENTION + "_low"] for v, r in zip(values, rows)],
                          [r[RETENTION + "_high"] - v for v, r in zip(values, rows)]])
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("sparse / dense mean reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle("Reward retention on paired samples (95% interval)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    lines = ["", "Reward check (sparse over dense mean reward of paired samples; median over the check steps):", ""]
    lines += [f"- {name}: retention {median(r[RETENTION] for r in rows):.3f} over {len(rows)} checks, check "
              f"{_median(rows, 'time/reward_check_s'):.2f} s of a {_median(rows, 'time/step_s'):.2f} s step"
              for name, rows in checked.items()]
    return lines + ["", f"![reward retention]({path.name})"]


def _bin_keys(runs: dict, prefix: str, suffix: str) -> list[str]:
    """The per-length-bin metric names `<prefix><start>/<suffix>` of any run, by bin start."""
    keys = {k for rows in runs.values() for r in rows for k in r if k.startswith(prefix) and k.endswith(suffix)}
    return sorted(keys, key=lambda k: int(k[len(prefix):].split("/")[0]))


def _exact_rollouts(runs: dict[str, list[dict]]) -> list[str]:
    """For runs in exact mode: tokens per dense verification and the share of tokens that were accepted drafts."""
    exact = {name: rows for name, rows in runs.items() if any(_is_number(r.get("rollout/tokens_per_verify"))
                                                              for r in rows)}
    if not exact:
        return []
    lines = ["", "Exact mode (the sparse schedule drafts, the dense policy verifies; rollouts are the dense "
             "policy's own samples, so TIS weights are 1): median per step.", "",
             "| run | tokens per verification | drafted share of tokens |", "|---|---|---|"]
    for name, rows in exact.items():
        lines.append(f"| {name} | {_median(rows, 'rollout/tokens_per_verify'):.2f} | "
                     f"{_median(rows, 'rollout/drafted_share'):.1%} |")
    return lines


def write_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """report.md plus curves.png, mismatch.png, phases.png and reward-vs-rollout-time.png in `out_dir`; rollout
    speed is relative to the first run given (pass the dense-rollout run first to read sparse speedups)."""
    runs, evals = load_runs(run_dirs), load_evals(run_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot_curves(runs, [("reward/mean", "mean reward"), ("completions/mean_length", "mean response length")],
                 out_dir / "curves.png", "Reward and length")
    bin_keys = _bin_keys(runs, "mismatch/bin_", "/exact_p5") or _bin_keys(runs, "mismatch/bin_", "acceptance_lower_p5")
    if bin_keys:
        exact = bin_keys[0].endswith("exact_p5")
        _plot_curves(runs, [(k, k.split("/")[1].replace("bin_", "p5, bin from ")) for k in bin_keys[:4]],
                     out_dir / "mismatch.png", "5th percentile of the " + ("exact acceptance" if exact else
                                                                          "acceptance lower bound") + " per length bin")
    budget_keys = _bin_keys(runs, "adaptive/bin_", "/budget")
    if budget_keys:
        _plot_curves(runs, [(k, k.split("/")[1].replace("bin_", "KV budget, bin from ")) for k in budget_keys[:4]],
                     out_dir / "schedule.png", "Adaptive schedule: the budget in force per length bin")
    _plot_phases(runs, out_dir / "phases.png")
    first = next(iter(runs))
    base_rollout = _median(runs[first], "time/rollout_s")
    base_step = _median(runs[first], "time/step_s")
    base_throughput, base_step_throughput = _throughput(runs[first]), _throughput(runs[first], "time/step_s")
    lines = ["# Training report", "", f"Median seconds per step by phase; rollout and step speed relative to `{first}`; "
             "throughput: generated tokens over the whole run's rollout (or step) seconds, so shorter answers earn "
             "nothing.", "", "| run | steps | reward first -> last | mean length | "
             + " | ".join(f"{p} s" for p in PHASES) + f" | step s | step speed vs {first} | rollout tokens/s | "
             f"rollout speed vs {first} | rollout throughput vs {first} | step throughput vs {first} |",
             "|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|---|---|"]
    for name, rows in runs.items():
        lengths = [r.get("completions/mean_length", 0.0) for r in rows]
        lines.append(f"| {name} | {len(rows)} | {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f} | "
                     f"{sum(lengths) / len(lengths):.1f} | "
                     + " | ".join(f"{_median(rows, f'time/{p}_s'):.2f}" for p in PHASES)
                     + f" | {_median(rows, 'time/step_s'):.2f} | {_ratio(base_step, _median(rows, 'time/step_s')):.2f}x"
                     + f" | {_median(rows, 'rollout/tokens_per_s'):.1f} | "
                     f"{_ratio(base_rollout, _median(rows, 'time/rollout_s')):.2f}x | "
                     f"{_ratio(_throughput(rows), base_throughput):.2f}x | "
                     f"{_ratio(_throughput(rows, 'time/step_s'), base_step_throughput):.2f}x |")
    lines += _rollout_breakdown(runs)
    lines += _exact_rollouts(runs)
    if evals:
        _plot_curves(evals, [("eval/mean", "held-out mean reward")], out_dir / "heldout.png", "Held-out reward")
        lines += _held_out(evals)
        lines += ["", "![held-out reward](heldout.png)"]
    _plot_reward_vs_rollout_time(runs, evals, out_dir / "reward-vs-rollout-time.png")
    lines += ["", "![reward vs cumulative rollout seconds](reward-vs-rollout-time.png)"]
    lines += ["", "![reward and length](curves.png)"]
    lines += ["", "![time per phase](phases.png)"]
    if bin_keys:
        if bin_keys[0].endswith("exact_p5"):
            lines += _tail_by_bin(runs, bin_keys)
        lines += ["", "![tail acceptance per bin](mismatch.png)"]
    lines += _by_prompt_length(runs, evals)
    if budget_keys:
        lines += ["", "![adaptive schedule](schedule.png)"]
    lines += _retention(runs, out_dir / "retention.png")
    warnings = [f"- {name}, step {r['step']}: {w}" for name, rows in runs.items() for r in rows
                for w in r.get("mismatch/warnings", [])]
    lines += ["", "## Mismatch warnings", ""] + (warnings or ["none"])
    report = out_dir / "report.md"
    atomic_write_text(report, "\n".join(lines) + "\n")
    return report
