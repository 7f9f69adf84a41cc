"""The report's tables, as markdown lines: time per phase and speed relative to the first run, where the rollout
time goes, exact mode's drafts, held-out reward (paired over prompts), reward by prompt length, the exact tail per
length bin and the reward check's retention."""

from __future__ import annotations

import math
from statistics import median

from sparrow.measure.retention import MIN_INTERVAL_PROMPTS, paired_difference, too_few_prompts

from .runs import PHASES, RETENTION, ROLLOUT_PHASES, is_number, median_of, ratio, throughput


def phase_table(runs: dict[str, list[dict]]) -> list[str]:
    """The report's head: per run its steps, reward, length, median seconds per phase, and rollout and step speed
    and throughput relative to the first run."""
    first = next(iter(runs))
    base_rollout = median_of(runs[first], "time/rollout_s")
    base_step = median_of(runs[first], "time/step_s")
    base_throughput, base_step_throughput = throughput(runs[first]), throughput(runs[first], "time/step_s")
    lines = ["# Training report", "", f"Median seconds per step by phase; rollout and step speed relative to "
             f"`{first}`; throughput: generated tokens over the whole run's rollout (or step) seconds, so shorter "
             "answers earn nothing.", "", "| run | steps | reward first -> last | mean length | "
             + " | ".join(f"{p} s" for p in PHASES) + f" | step s | step speed vs {first} | rollout tokens/s | "
             f"rollout speed vs {first} | rollout throughput vs {first} | step throughput vs {first} |",
             "|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|---|---|"]
    for name, rows in runs.items():
        lengths = [r.get("completions/mean_length", 0.0) for r in rows]
        lines.append(f"| {name} | {len(rows)} | {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f} | "
                     f"{sum(lengths) / len(lengths):.1f} | "
                     + " | ".join(f"{median_of(rows, f'time/{p}_s'):.2f}" for p in PHASES)
                     + f" | {median_of(rows, 'time/step_s'):.2f} | "
                     f"{ratio(base_step, median_of(rows, 'time/step_s')):.2f}x"
                     + f" | {median_of(rows, 'rollout/tokens_per_s'):.1f} | "
                     f"{ratio(base_rollout, median_of(rows, 'time/rollout_s')):.2f}x | "
                     f"{ratio(throughput(rows), base_throughput):.2f}x | "
                     f"{ratio(throughput(rows, 'time/step_s'), base_step_throughput):.2f}x |")
    return lines


def rollout_breakdown(runs: dict[str, list[dict]]) -> list[str]:
    """Median seconds per step of the rollout phase's parts and of the exact monitor, for runs that logged them."""
    logged = {name: rows for name, rows in runs.items()
              if all(is_number(r.get(f"time/rollout_{p}_s")) for r in rows for p in ROLLOUT_PHASES)}
    if not logged:
        return []
    lines = ["", "Where the rollout time goes (median seconds per step; the monitor is timed apart from the recompute "
             "or update it runs in):", "",
             "| run | " + " | ".join(f"{p} s" for p in ROLLOUT_PHASES) + " | other rollout s | monitor s |",
             "|---|" + "---|" * (len(ROLLOUT_PHASES) + 2)]
    for name, rows in logged.items():
        parts = [median_of(rows, f"time/rollout_{p}_s") for p in ROLLOUT_PHASES]
        other = median(r["time/rollout_s"] - sum(r[f"time/rollout_{p}_s"] for p in ROLLOUT_PHASES) for r in rows)
        monitor = median_of(rows, "time/monitor_s")
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in parts) + f" | {other:.2f} | "
                     + ("-" if math.isnan(monitor) else f"{monitor:.2f}") + " |")
    return lines


def exact_rollouts(runs: dict[str, list[dict]]) -> list[str]:
    """For runs in exact mode: tokens per dense verification and the share of tokens that were accepted drafts."""
    exact = {name: rows for name, rows in runs.items() if any(is_number(r.get("rollout/tokens_per_verify"))
                                                              for r in rows)}
    if not exact:
        return []
    lines = ["", "Exact mode (the sparse schedule drafts, the dense policy verifies; rollouts are the dense "
             "policy's own samples, so TIS weights are 1): median per step.", "",
             "| run | tokens per verification | drafted share of tokens |", "|---|---|---|"]
    for name, rows in exact.items():
        lines.append(f"| {name} | {median_of(rows, 'rollout/tokens_per_verify'):.2f} | "
                     f"{median_of(rows, 'rollout/drafted_share'):.1%} |")
    return lines


def _prompt_count(row: dict) -> int | None:
    """The number of held-out prompts an eval.jsonl row averaged over, where it says."""
    means = row.get("eval/per_example_mean")
    return len(means) if isinstance(means, list) else row.get("eval/examples")


def _reward_range(row: dict) -> tuple[float, float] | None:
    """The range of the total reward an eval.jsonl row was scored with (built-in rewards), None where unknown."""
    bounds = row.get("eval/reward_range")
    return tuple(bounds) if isinstance(bounds, list) and len(bounds) == 2 and all(map(is_number, bounds)) else None


def _interval(row: dict) -> str:
    """' [low, high]' of a held-out evaluation's mean over prompts, or why there is none (too few prompts: rows
    written before that rule carry an interval from two prompts, too wide to use)."""
    count = _prompt_count(row)
    if isinstance(count, int) and count < MIN_INTERVAL_PROMPTS:
        return f" ({too_few_prompts(count)})"
    low, high = row.get("eval/mean_low"), row.get("eval/mean_high")
    if not (is_number(low) and is_number(high) and math.isfinite(low) and math.isfinite(high)):
        return ""
    return f" [{low:.3f}, {high:.3f}]"


def held_out(evals: dict) -> list[str]:
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


def by_prompt_length(runs: dict, evals: dict) -> list[str]:
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


def tail_by_bin(runs: dict, keys: list[str]) -> list[str]:
    """The median over steps of each length bin's exact p5 (and p1), per run."""
    starts = [int(k.split("/")[1][len("bin_"):]) for k in keys]
    lines = ["", "Exact acceptance per length bin (median over steps of p5 / p1; bins by cached tokens):", "",
             "| run | " + " | ".join(f"from {s}" for s in starts) + " |", "|---|" + "---|" * len(starts)]
    for name, rows in runs.items():
        cells = []
        for start in starts:
            p5, p1 = (median_of(rows, f"mismatch/bin_{start}/exact_{q}") for q in ("p5", "p1"))
            cells.append("-" if math.isnan(p5) else f"{p5:.3f} / {p1:.3f}")
        if any(c != "-" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def retention_lines(checked: dict[str, list[dict]], plot: str) -> list[str]:
    """Per run with reward checks (`checked_runs`), the median retention next to the check's and the step's median
    seconds, and the plot `plot`."""
    lines = ["", "Reward check (sparse over dense mean reward of paired samples; median over the check steps):", ""]
    lines += [f"- {name}: retention {median(r[RETENTION] for r in rows):.3f} over {len(rows)} checks, check "
              f"{median_of(rows, 'time/reward_check_s'):.2f} s of a {median_of(rows, 'time/step_s'):.2f} s step"
              for name, rows in checked.items()]
    return lines + ["", f"![reward retention]({plot})"]
