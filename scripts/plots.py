"""Draw the README's pictures from the records in `benchmarks/` (one command: `.venv/bin/python scripts/plots.py`).

- `decode-speed.png`: decode tokens/s against cached length, dense and sparse, in our engine and in vLLM with the
  plugin (BENCHMARKS.md "Decode speed").
- `reward-vs-rollout-time.png`: training and held-out reward against cumulative rollout seconds on the long task,
  dense against sparse rollouts (drawn by `sparrow report`'s own plot).
- `p5-vs-budget.png`: the exact acceptance's 5th percentile per length bin against the KV budget, with tau.

Each figure reads only committed records, so the pictures change only when a record does.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks"

# Decode speed at the demo's shape and at 8K / batch 8, AMD EPYC (AVX-512), 2026-12-03: our engine's decode paths
# measured alternately in one process, twice; vLLM with the plugin (KV blocks of 16 in huge pages) against stock vLLM
ENGINE_RECORDS = ["engine/decode-paths-2026-12-03.jsonl", "engine/decode-paths-2026-12-03-run2.jsonl"]
VLLM_RECORDS = ["vllm/demo-shape-block16-hugepages-2026-12-03.txt", "vllm/8k-b8-block16-hugepages-2026-12-03.txt",
                "vllm/8k-b8-block16-hugepages-2026-12-03-run2.txt", "vllm/8k-b8-block16-hugepages-2026-12-03-run3.txt"]
LONG_TASK_RUNS = {"dense": "promise/seed0/dense-seed0", "sparse 0:3072": "promise/seed0/sparse-0-3072-seed0",
                  "DistillSparse 0:1024": "promise-distill/seed0/sparse-0-1024-distill-seed0"}
PROFILE = "mixed/profile/profile.json"
TAU = 0.75  # the tau this profile's schedule was calibrated for (BENCHMARKS.md "Schedules for mixed lengths")


def engine_points(records: Path) -> dict[str, list[tuple[int, int, float]]]:
    """(cached tokens, batch, tokens/s) of our engine's dense and sparse decode, from the decode-path records."""
    names = {"dense kernel+packed": "ours dense", "sparse packed": "ours sparse"}
    points: dict[str, list] = {label: [] for label in names.values()}
    from sparrow.io import parse_jsonl, read_jsonl_text

    for name in ENGINE_RECORDS:
        for _, row in parse_jsonl(read_jsonl_text(records / name), str(records / name))[0]:
            if row.get("config") in names:
                rate = row["batch"] * 1000.0 / row["ms_per_step"]
                points[names[row["config"]]].append((row["context"], row["batch"], rate))
    return points


def vllm_points(records: Path) -> dict[str, list[tuple[int, int, float]]]:
    """(cached tokens, batch, tokens/s) of vLLM with the plugin, dense and sparse, from `sparrow bench` logs."""
    points: dict[str, list] = {"vLLM + plugin dense": [], "vLLM + plugin sparse": []}
    for name in VLLM_RECORDS:
        text = (records / name).read_text(errors="replace")
        shape = re.search(r"prefill: (\d+) distinct prompts of (\d+) tokens", text)
        plugin = text.split("vLLM with Sparrow's plugin:", 1)[-1]
        rates = {kind: re.search(rf"{kind}:\s+([\d.]+) tokens/s", plugin) for kind in ("dense", "sparse")}
        if shape is None or "vLLM with Sparrow's plugin:" not in text or None in rates.values():
            from sparrow.errors import SparrowError

            raise SparrowError(f"record {str(records / name)!r} is not the `sparrow bench --backend vllm` log the "
                               "figure reads (its prefill shape or the plugin's dense and sparse tokens/s are missing)")
        for kind, rate in rates.items():
            points[f"vLLM + plugin {kind}"].append((int(shape.group(2)), int(shape.group(1)), float(rate.group(1))))
    return points


def plot_decode_speed(records: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparrow.io import save_figure

    series = {**engine_points(records), **vllm_points(records)}
    styles = {"ours dense": ("C0", "o", "--"), "ours sparse": ("C0", "o", "-"),
              "vLLM + plugin dense": ("C1", "s", "--"), "vLLM + plugin sparse": ("C1", "s", "-")}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, rows in series.items():
        by_length: dict[int, list] = {}
        for context, batch, rate in rows:
            by_length.setdefault(context, []).append((batch, rate))
        xs = sorted(by_length)
        ys = [statistics.median(r for _, r in by_length[x]) for x in xs]  # median over the runs
        color, marker, line = styles[label]
        ax.plot(xs, ys, color=color, marker=marker, linestyle=line, label=label)
        for x, y in zip(xs, ys):
            if label == "ours sparse":
                ax.annotate(f"batch {by_length[x][0][0]}", (x, y), textcoords="offset points", xytext=(4, 6),
                            fontsize=7, color="0.35")
    ax.set_xlabel("cached tokens per sequence")
    ax.set_ylabel("decode tokens/s (all rows)")
    ax.set_title("SmolLM2-135M decode on 2 CPU cores: dense vs sparse (budget 512-1024)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = save_figure(fig, out / "decode-speed.png", dpi=110)
    plt.close(fig)
    return path


def plot_reward_vs_rollout_time(records: Path, out: Path) -> Path:
    """`sparrow report`'s reward-against-rollout-seconds figure for the long task's seed-0 runs."""
    from sparrow.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for label, rel in LONG_TASK_RUNS.items():
            link = Path(tmp) / "runs" / label.replace(" ", "_").replace(":", "-")
            link.parent.mkdir(exist_ok=True)
            shutil.copytree(records / rel, link)
            runs.append(link)
        write_report(runs, Path(tmp) / "report")
        return Path(shutil.copyfile(Path(tmp) / "report" / "reward-vs-rollout-time.png",
                                    out / "reward-vs-rollout-time.png"))


def plot_p5_vs_budget(records: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparrow.io import save_figure

    from sparrow.measure.profiling import read_profile

    profile = read_profile(str(records / PROFILE))["schedules"]
    budgets = {name: int(name.split(":")[1]) for name in profile}
    by_bin: dict[tuple[int, int], list] = {}
    for name, stats in profile.items():
        for b in stats["bins"]:
            by_bin.setdefault((b["start"], b["end"]), []).append((budgets[name], b["p5"]))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (start, end), rows in sorted(by_bin.items()):
        rows.sort()
        ax.plot(*zip(*rows), marker="o", label=f"{start // 1024}-{end // 1024}K cached")
    ax.axhline(TAU, color="k", linestyle=":", label=f"tau {TAU}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(budgets.values())), [str(b) for b in sorted(set(budgets.values()))])
    ax.set_xlabel("KV budget (tokens)")
    ax.set_ylabel("5th percentile of exact acceptance")
    ax.set_title("SmolLM2-135M, mixed-length passkey prompts: tail vs budget per length bin")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = save_figure(fig, out / "p5-vs-budget.png", dpi=110)
    plt.close(fig)
    return path


def check_paths(records: Path, out: Path) -> None:
    """Before any figure: the records folder and every record the figures read, and the output folder, each
    refused by name with what it is instead (sparrow.io's checks)."""
    from sparrow.errors import SparrowError
    from sparrow.io import check_output, file_problem, require_file

    problem = file_problem(records)
    if problem != "is a directory; expected a file":
        raise SparrowError(f"records folder {str(records)!r} "
                           f"{'is a file; expected a folder' if problem is None else problem}")
    needed = [*ENGINE_RECORDS, *VLLM_RECORDS, PROFILE, *(f"{run}/metrics.jsonl" for run in LONG_TASK_RUNS.values())]
    if not any((records / name).exists() for name in needed):
        raise SparrowError(f"records folder {str(records)!r} holds none of the records the figures read (such as "
                           f"{needed[0]}); expected the repository's benchmarks/ folder")
    for name in needed:
        require_file(records / name, "record")
    check_output(str(out), "--out", directory=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=Path, default=RECORDS, help="the benchmarks folder (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go (%(default)s)")
    args = parser.parse_args(argv)
    from sparrow.errors import SparrowError

    try:
        check_paths(args.records, args.out)
        args.out.mkdir(parents=True, exist_ok=True)
        for draw in (plot_decode_speed, plot_reward_vs_rollout_time, plot_p5_vs_budget):
            print(f"[plots] {draw(args.records, args.out)}", file=sys.stderr)
    except SparrowError as err:
        print(f"plots: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        where = f"{str(err.filename)!r}: " if err.filename is not None else ""
        print(f"plots: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
