"""A markdown report with plots from one or more runs' metrics.jsonl (e.g. sparse vs dense rollouts)."""

from __future__ import annotations

from pathlib import Path

from sparrow.errors import SparrowError
from sparrow.io import atomic_write_text, read_jsonl

PHASES = ("rollout", "reward", "recompute", "update")


def load_runs(run_dirs: list[Path]) -> dict[str, list[dict]]:
    runs = {}
    for run in run_dirs:
        path = Path(run) / "metrics.jsonl"
        if not path.is_file():
            raise SparrowError(f"{run} has no metrics.jsonl; is it a 'sparrow train' output directory?")
        runs[Path(run).name] = [row for _, row in read_jsonl(path)]
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
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bins(rows: list[dict]) -> list[str]:
    keys = {k for r in rows for k in r if k.startswith("mismatch/bin_") and k.endswith("acceptance_lower_p5")}
    return sorted(keys, key=lambda k: int(k.split("_")[1].split("/")[0]))


def write_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """report.md plus curves.png, mismatch.png and phases.png in `out_dir`."""
    runs = load_runs(run_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot_curves(runs, [("reward/mean", "mean reward"), ("completions/mean_length", "mean response length")],
                 out_dir / "curves.png", "Reward and length")
    bin_keys = sorted({k for rows in runs.values() for k in _bins(rows)},
                      key=lambda k: int(k.split("_")[1].split("/")[0]))
    if bin_keys:
        _plot_curves(runs, [(k, k.split("/")[1].replace("bin_", "p5, bin from ")) for k in bin_keys[:4]],
                     out_dir / "mismatch.png", "5th percentile of the acceptance lower bound per length bin")
    lines = ["# Training report", "", "| run | steps | reward first -> last | mean length | "
             + " | ".join(f"{p} s/step" for p in PHASES) + " | rollout tokens/s |",
             "|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for name, rows in runs.items():
        mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
        lines.append(f"| {name} | {len(rows)} | {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f} | "
                     f"{mean('completions/mean_length'):.1f} | "
                     + " | ".join(f"{mean(f'time/{p}_s'):.2f}" for p in PHASES)
                     + f" | {mean('rollout/tokens_per_s'):.1f} |")
    lines += ["", "![reward and length](curves.png)"]
    if bin_keys:
        lines += ["", "![tail acceptance per bin](mismatch.png)"]
    warnings = [f"- {name}, step {r['step']}: {w}" for name, rows in runs.items() for r in rows
                for w in r.get("mismatch/warnings", [])]
    lines += ["", "## Mismatch warnings", ""] + (warnings or ["none"])
    report = out_dir / "report.md"
    atomic_write_text(report, "\n".join(lines) + "\n")
    return report
