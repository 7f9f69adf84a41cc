"""Write summary.json for the long-answer stability runs: per run its held-out reward and its median rollout phase
and whole step by time; per non-dense arm its held-out difference against dense, paired per prompt and pooled over
the seeds (a t interval over the paired prompt means, sparrow.measure.retention.paired_difference).

    .venv/bin/python benchmarks/longanswer/stable/summarize.py benchmarks/longanswer/stable

Reads <dir>/seed<S>/<arm>/metrics.jsonl and <dir>/seed<S>/heldout-eval-<arm>.json for every arm and seed there.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from sparrow.io import atomic_write_text
from sparrow.measure.retention import paired_difference


def run_entry(seed_dir: Path, arm: str) -> dict:
    rows = [json.loads(line) for line in (seed_dir / arm / "metrics.jsonl").read_text().splitlines() if line.strip()]
    held = json.loads((seed_dir / f"heldout-eval-{arm}.json").read_text())
    return {"arm": arm, "seed": int(seed_dir.name.removeprefix("seed")), "steps": len(rows),
            "heldout_reward": held["mean@2"], "heldout_per_prompt": held["per_example_mean"],
            "rollout_s": statistics.median(r["time/rollout_s"] for r in rows),
            "step_s": statistics.median(r["time/step_s"] for r in rows),
            "reward_per_step": [r["reward/mean"] for r in rows], "tail": [step_tail(r) for r in rows]}


def step_tail(row: dict) -> dict:
    """Per monitored length bin of one step: its p5, the budget it ran at, the move (+1 up, -1 down) and the budget
    of the next step (adaptive runs; empty otherwise)."""
    bins = sorted(int(k.split("/")[1][4:]) for k in row if k.startswith("adaptive/bin_") and k.endswith("/p5"))
    return {"step": row["step"], "bins": [
        {"bin": b, **{key: row[f"adaptive/bin_{b}/{key}"] for key in ("p5", "p5_low", "p5_high", "tokens", "budget",
                                                                       "move", "next_budget")}} for b in bins]}


def pooled(runs: list[dict]) -> list[dict]:
    dense = {r["seed"]: r for r in runs if r["arm"] == "dense"}
    out = []
    for arm in sorted({r["arm"] for r in runs} - {"dense"}):
        paired = [(r, dense[r["seed"]]) for r in runs if r["arm"] == arm and r["seed"] in dense]
        a = [x for r, _ in paired for x in r["heldout_per_prompt"]]
        b = [x for _, d in paired for x in d["heldout_per_prompt"]]
        diff, low, high = paired_difference(a, b)
        out.append({"arm": arm, "seeds": [r["seed"] for r, _ in paired], "diff": diff, "low": low, "high": high,
                    "rollout_vs_dense": [d["rollout_s"] / r["rollout_s"] for r, d in paired],
                    "step_vs_dense": [d["step_s"] / r["step_s"] for r, d in paired]})
    return out


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    runs = [run_entry(seed_dir, arm.name) for seed_dir in sorted(root.glob("seed*"))
            for arm in sorted(p for p in seed_dir.iterdir() if (p / "metrics.jsonl").is_file())]
    summary = {"runs": runs, "pooled": pooled(runs)}
    atomic_write_text(root / "summary.json", json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["pooled"], indent=1))


if __name__ == "__main__":
    main()
