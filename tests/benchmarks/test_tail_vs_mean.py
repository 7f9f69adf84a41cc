"""benchmarks/tail_vs_mean.py: rank correlations of acceptance statistics with reward retention, the contrasting
pairs, and the table it prints from run directories."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from benchmarks.tail_vs_mean import (RunOutcome, _correlation_lines, bin_p5s, contrast_pairs, main,
                                    rank_correlations, worst_bin)

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
    below_3 = rank_correlations(RUNS[:2])
    assert all(math.isnan(rho) for rho, _, _ in below_3.values()) and below_3["mean"][2] == 2
    assert below_3["worst_bin_p5"][2] == 0  # none of RUNS has per-bin figures
    unknown = [*RUNS, RunOutcome("no p1", 0.97, 0.9, math.nan, 0.99, False)]
    assert rank_correlations(unknown)["p1"] == rank_correlations(RUNS)["p1"]  # taken over the runs that know it
    assert rank_correlations(unknown)["p5"][2] == 5


def bins(**per_bin):
    """A monitor row's per-bin figures: bin_START=(p5, tokens)."""
    row = {}
    for name, (p5, tokens) in per_bin.items():
        row[f"mismatch/{name}/exact_p5"] = p5
        row[f"mismatch/{name}/exact_tokens"] = tokens
    return row


def test_the_worst_bin_is_the_lowest_median_over_the_steps_where_a_bin_has_enough_tokens():
    rows = [bins(bin_3072=(0.90, 300), bin_3584=(0.70, 250), bin_4096=(0.50, 150)),  # 4096: too few tokens here
            bins(bin_3072=(0.80, 300), bin_3584=(0.76, 300), bin_4096=(0.60, 210)),
            {**bins(bin_3072=(0.84, 300), bin_3584=(0.74, 300)), "mismatch/bin_4608/exact_p5": 0.1}]  # no count
    assert bin_p5s(rows, 200) == pytest.approx({3072: 0.84, 3584: 0.74, 4096: 0.60})  # medians of .90/.80/.84 ...
    assert worst_bin(rows, 200) == (pytest.approx(0.60), 4096)  # ... 4096 counts at step 2 only
    assert worst_bin(rows, 250) == (pytest.approx(0.74), 3584)  # 4096 never has 250; 3584's 250 at step 1 counts
    assert bin_p5s(rows, 260) == pytest.approx({3072: 0.84, 3584: 0.75})  # median of .76 and .74
    value, start = worst_bin(rows, 301)
    assert math.isnan(value) and start is None
    assert math.isnan(worst_bin([{"mismatch/exact/p5": 0.8}], 0)[0])  # logs without per-bin figures


def test_the_worst_bin_correlation_leaves_out_only_the_runs_without_it():
    runs = [RunOutcome(r.name, r.mean, r.p5, r.p1, r.retention, r.behind, wb, 3072)
            for r, wb in zip(RUNS, (0.70, 0.60, 0.65, 0.90))] + [RunOutcome("no bins", 0.99, 0.95, 0.9, 0.99, False)]
    rho = rank_correlations(runs)
    known = runs[:4]
    assert rho["worst_bin_p5"] == (pytest.approx(stats.spearmanr([0.70, 0.60, 0.65, 0.90],
                                                                  [r.retention for r in known])[0]),
                                   pytest.approx(stats.spearmanr([0.70, 0.60, 0.65, 0.90],
                                                                 [r.retention for r in known])[1]), 4)
    assert rho["worst_bin_p5"][0] == pytest.approx(0.4)  # ranks 3 1 2 4 against 2 3 1 4
    assert rho["mean"][2] == 5
    lines = _correlation_lines(runs)
    assert "4 runs where it is known; 1 runs without it left out of this one only" in lines[3]
    assert lines[4].startswith("- Over the 4 runs with a worst bin only: mean ") and "worst_bin_p5 +0.40" in lines[4]
    assert len(_correlation_lines(runs[:4])) == 4  # all have it: no repeat


def test_a_pair_with_equal_means_and_distant_tails_names_the_statistic_that_ordered_it():
    pairs = contrast_pairs(RUNS)
    assert [p["runs"] for p in pairs] == [("const", "growing")]
    assert pairs[0]["predicted_by"] == ["mean", "p5", "p1"]  # growing is higher in all three here
    flipped = [RunOutcome("a", 0.955, 0.78, 0.60, 0.9, False), RunOutcome("b", 0.950, 0.86, 0.70, 0.5, True)]
    assert contrast_pairs(flipped)[0]["predicted_by"] == ["mean"]


def test_the_script_pairs_sparse_with_dense_runs(tmp_path, capsys):
    def run(name, rows, evals):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / name / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))

    run("dense", [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.3}],
        [{"step": 2, "eval/per_example_mean": [0.5, 0.5, 0.6]}])
    exact = {"mismatch/exact/tokens": 100, "mismatch/exact/p1": 0.5}
    run("sparse", [{"step": 1, "reward/mean": 0.4, "mismatch/exact/mean": 0.9, "mismatch/exact/p5": 0.8, **exact,
                    **bins(bin_1024=(0.70, 100), bin_1536=(0.85, 300))},
                   {"step": 2, "reward/mean": 0.2, "mismatch/exact/mean": 0.95, "mismatch/exact/p5": 0.9, **exact,
                    **bins(bin_1024=(0.75, 250), bin_1536=(0.90, 300))}],
        [{"step": 2, "eval/per_example_mean": [0.4, 0.5, 0.4]}])
    out = subprocess.run([sys.executable, SCRIPT, f"{tmp_path}/sparse={tmp_path}/dense"],
                         capture_output=True, text=True, check=True).stdout
    # retention 0.6 / 0.8; held-out differences -0.1, 0, -0.2; worst bin: 1024 at step 2 only (100 tokens at step 1)
    assert "| sparse | 0.925 | 0.850 | 0.500 | 0.750 (1024) | 0.75 | -0.100 [" in out and "| yes / no |" in out
    # the same script in this process (the run above checked its command line)
    assert main([f"{tmp_path}/sparse={tmp_path}/dense=mine", "--behind-below", "0.7", "--min-bin-tokens", "260"]) == 0
    labelled = capsys.readouterr().out
    assert "| mine | 0.925 | 0.850 | 0.500 | 0.875 (1536) |" in labelled and "| no / no |" in labelled
    with pytest.raises(SystemExit, match="two runs are named 'sparse'"):
        main([f"{tmp_path}/sparse={tmp_path}/dense", f"{tmp_path}/sparse={tmp_path}/dense"])


def test_the_script_reads_a_redone_per_prompt_evaluation_for_older_logs(tmp_path, capsys):
    for name, reward, held in (("dense", 0.5, [0.5, 0.5, 0.6]), ("sparse", 0.4, [0.4, 0.5, 0.4])):
        (tmp_path / name).mkdir()
        row = {"step": 1, "reward/mean": reward}
        if name == "sparse":
            row.update({"mismatch/exact/mean": 0.9, "mismatch/exact/p5": 0.8, "mismatch/exact/p1": 0.5,
                        "mismatch/exact/tokens": 10})
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        (tmp_path / name / "eval.jsonl").write_text(json.dumps({"step": 10, "eval/mean@4": sum(held) / 3}) + "\n")
    pair = [f"{tmp_path}/sparse={tmp_path}/dense"]
    assert main(pair) == 0
    first = capsys.readouterr().out
    assert "| 0.500 |  | 0.80 | - | yes / - |" in first  # no per-bin figures: a blank worst bin
    for name, held in (("dense", [0.5, 0.5, 0.6]), ("sparse", [0.4, 0.5, 0.4])):
        (tmp_path / name / "eval-step10-per-prompt.json").write_text(json.dumps({"per_example_mean": held}))
    assert main(pair) == 0
    out = capsys.readouterr().out
    assert "| 0.80 | -0.100 [" in out and "| yes / no |" in out
