"""The report's plots: metric curves per step, reward against cumulative rollout seconds, time per phase and the
reward check's retention, each saved as a PNG (matplotlib loads only when one is drawn)."""

from __future__ import annotations

from pathlib import Path

from sparrow.io import save_figure

from .runs import PHASES, RETENTION, is_number, median_of, rollout_clock


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_curves(runs: dict, keys: list[tuple[str, str]], path: Path, title: str) -> None:
    plt = _pyplot()
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
    _save(plt, fig, path)


def plot_reward_vs_rollout_time(runs: dict, evals: dict, path: Path) -> None:
    """Training reward (and held-out reward, where evaluated) against the cumulative rollout seconds: what a
    faster rollout buys, if the reward keeps up."""
    plt = _pyplot()
    panels = [("reward/mean", "training reward (the rollouts')", runs)] + (
        [("eval/mean", "held-out reward (dense policy)", evals)] if evals else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (key, label, source) in zip(axes[0], panels):
        for name, rows in source.items():
            clock = rollout_clock(runs.get(name, []))
            points = [(clock[r["step"]], r[key]) for r in rows if r["step"] in clock and is_number(r.get(key))]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xlabel("cumulative rollout seconds")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Reward vs rollout time")
    _save(plt, fig, path)


def plot_phases(runs: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.8 * len(runs) + 3, 3.8))
    names = list(runs)
    bottom = [0.0] * len(names)
    for phase in PHASES:
        heights = [median_of(runs[n], f"time/{phase}_s") for n in names]
        ax.bar(names, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("median seconds per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Time per phase")
    _save(plt, fig, path)


def plot_retention(checked: dict, path: Path) -> None:
    """The reward check's retention per step with its 95% interval, per run of `checked` (`checked_runs`)."""
    plt = _pyplot()
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
    _save(plt, fig, path)
