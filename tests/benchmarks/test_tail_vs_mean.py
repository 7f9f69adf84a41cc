"""benchmarks/tail_vs_mean.py: rank correlations of acceptance statistics with reward retention, the contrasting
pairs, and the table it prints from run directories."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from benchmarks.tail_vs_mean import RunOutcome, contrast_pairs, rank_correlations

SCRIPT = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tail_vs_mean.py")

RUNS = [RunOutcome("const", 0.950, 0.78, 0.60, 0.55, True),  # same mean as "growing", lower tail, lost reward
        RunOutcome("growing", 0.955, 0.86, 0.70, 0.95, False),
        RunOutcome("small", 0.920, 0.70, 0.50, 0.30, True),
        RunOutcome("large", 0.980, 0.93, 0.85, 0.97, False)]


def test_rank_correlations_are_spearmans_against_retention():
    rho = rank_correlations(RUNS)
    retention = [r.retention for r in RUNS]
    assert rho["p5"][0] == pytest.approx(stats.spearmanr([r.p5 for r in RUNS], retention)[0]) == 1.0
    assert rho["mean"][0] == pytest.approx(stats.spearmanr([r.mean for r in RUNS], retention)[0])
    assert all(math.isnan(rho) and n == 2 for rho, _, n in rank_correlations(RUNS[:2]).values())  # below 3 runs
    unknown = [*RUNS, RunOutcome("no p1", 0.97, 0.9, math.nan, 0.99, False)]
    assert rank_correlations(unknown)["p1"] == rank_correlations(RUNS)["p1"]  # taken over the runs that know it
    assert rank_correlations(unknown)["p5"][2] == 5


def test_a_pair_with_equal_means_and_distant_tails_names_the_statistic_that_ordered_it():
    pairs = contrast_pairs(RUNS)
    assert [p["runs"] for p in pairs] == [("const", "growing")]
    assert pairs[0]["predicted_by"] == ["mean", "p5", "p1"]  # growing is higher in all three here
    flipped = [RunOutcome("a", 0.955, 0.78, 0.60, 0.9, False), RunOutcome("b", 0.950, 0.86, 0.70, 0.5, True)]
    assert contrast_pairs(flipped)[0]["predicted_by"] == ["mean"]


def test_the_script_pairs_sparse_with_dense_runs(tmp_path):
    def run(name, rows, evals):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / name / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))

    run("dense", [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.3}],
        [{"step": 2, "eval/per_example_mean": [0.5, 0.5, 0.6]}])
    exact = {"mismatch/exact/tokens": 100, "mismatch/exact/p1": 0.5}
    run("sparse", [{"step": 1, "reward/mean": 0.4, "mismatch/exact/mean": 0.9, "mismatch/exact/p5": 0.8, **exact},
                   {"step": 2, "reward/mean": 0.2, "mismatch/exact/mean": 0.95, "mismatch/exact/p5": 0.9, **exact}],
        [{"step": 2, "eval/per_example_mean": [0.4, 0.5, 0.4]}])
    out = subprocess.run([sys.executable, SCRIPT, f"{tmp_path}/sparse={tmp_path}/dense"],
                         capture_output=True, text=True, check=True).stdout
    # retention 0.6 / 0.8; held-out differences -0.1, 0, -0.2
    assert "| sparse | 0.925 | 0.850 | 0.500 | 0.75 | -0.100 [" in out and "| yes / no |" in out
    labelled = subprocess.run([sys.executable, SCRIPT, f"{tmp_path}/sparse={tmp_path}/dense=mine",
                               "--behind-below", "0.7"], capture_output=True, text=True, check=True).stdout
    assert "| mine | 0.925 |" in labelled and "| no / no |" in labelled
    twice = subprocess.run([sys.executable, SCRIPT, f"{tmp_path}/sparse={tmp_path}/dense",
                            f"{tmp_path}/sparse={tmp_path}/dense"], capture_output=True, text=True)
    assert twice.returncode != 0 and "two runs are named 'sparse'" in twice.stderr


def test_the_script_reads_a_redone_per_prompt_evaluation_for_older_logs(tmp_path):
    for name, reward, held in (("dense", 0.5, [0.5, 0.5, 0.6]), ("sparse", 0.4, [0.4, 0.5, 0.4])):
        (tmp_path / name).mkdir()
        row = {"step": 1, "reward/mean": reward}
        if name == "sparse":
            row.update({"mismatch/exact/mean": 0.9, "mismatch/exact/p5": 0.8, "mismatch/exact/p1": 0.5,
                        "mismatch/exact/tokens": 10})
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        (tmp_path / name / "eval.jsonl").write_text(json.dumps({"step": 10, "eval/mean@4": sum(held) / 3}) + "\n")
    script = [sys.executable, SCRIPT, f"{tmp_path}/sparse={tmp_path}/dense"]
    assert "| - | yes / - |" in subprocess.run(script, capture_output=True, text=True, check=True).stdout
    for name, held in (("dense", [0.5, 0.5, 0.6]), ("sparse", [0.4, 0.5, 0.4])):
        (tmp_path / name / "eval-step10-per-prompt.json").write_text(json.dumps({"per_example_mean": held}))
    out = subprocess.run(script, capture_output=True, text=True, check=True).stdout
    assert "| 0.80 | -0.100 [" in out and "| yes / no |" in out
