"""A markdown report with plots from one or more training runs' logs (e.g. sparse vs dense rollouts): `runs.py`
reads the logs, `tables.py` writes the tables, `plots.py` draws the plots."""

from __future__ import annotations

from pathlib import Path

from sparrow.io import atomic_write_text

from .plots import plot_curves, plot_phases, plot_retention, plot_reward_vs_rollout_time
from .runs import bin_keys, checked_runs, load_evals, load_runs
from .tables import (by_prompt_length, exact_rollouts, held_out, phase_table, retention_lines, rollout_breakdown,
                     tail_by_bin)


def write_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """report.md plus curves.png, mismatch.png, phases.png and reward-vs-rollout-time.png in `out_dir`; rollout
    speed is relative to the first run given (pass the dense-rollout run first to read sparse speedups)."""
    runs, evals = load_runs(run_dirs), load_evals(run_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(runs, [("reward/mean", "mean reward"), ("completions/mean_length", "mean response length")],
                out_dir / "curves.png", "Reward and length")
    tail_keys = bin_keys(runs, "mismatch/bin_", "/exact_p5") or bin_keys(runs, "mismatch/bin_", "acceptance_lower_p5")
    if tail_keys:
        exact = tail_keys[0].endswith("exact_p5")
        plot_curves(runs, [(k, k.split("/")[1].replace("bin_", "p5, bin from ")) for k in tail_keys[:4]],
                    out_dir / "mismatch.png", "5th percentile of the " + ("exact acceptance" if exact else
                                                                         "acceptance lower bound") + " per length bin")
    budget_keys = bin_keys(runs, "adaptive/bin_", "/budget")
    if budget_keys:
        plot_curves(runs, [(k, k.split("/")[1].replace("bin_", "KV budget, bin from ")) for k in budget_keys[:4]],
                    out_dir / "schedule.png", "Adaptive schedule: the budget in force per length bin")
    plot_phases(runs, out_dir / "phases.png")
    lines = phase_table(runs) + rollout_breakdown(runs) + exact_rollouts(runs)
    if evals:
        plot_curves(evals, [("eval/mean", "held-out mean reward")], out_dir / "heldout.png", "Held-out reward")
        lines += held_out(evals) + ["", "![held-out reward](heldout.png)"]
    plot_reward_vs_rollout_time(runs, evals, out_dir / "reward-vs-rollout-time.png")
    lines += ["", "![reward vs cumulative rollout seconds](reward-vs-rollout-time.png)",
              "", "![reward and length](curves.png)", "", "![time per phase](phases.png)"]
    if tail_keys:
        if tail_keys[0].endswith("exact_p5"):
            lines += tail_by_bin(runs, tail_keys)
        lines += ["", "![tail acceptance per bin](mismatch.png)"]
    lines += by_prompt_length(runs, evals)
    if budget_keys:
        lines += ["", "![adaptive schedule](schedule.png)"]
    checked = checked_runs(runs)
    if checked:
        plot_retention(checked, out_dir / "retention.png")
        lines += retention_lines(checked, "retention.png")
    warnings = [f"- {name}, step {r['step']}: {w}" for name, rows in runs.items() for r in rows
                for w in r.get("mismatch/warnings", [])]
    lines += ["", "## Mismatch warnings", ""] + (warnings or ["none"])
    report = out_dir / "report.md"
    atomic_write_text(report, "\n".join(lines) + "\n")
    return report
