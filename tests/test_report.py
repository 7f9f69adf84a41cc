"""`sparrow report` on hand-written run logs: throughput over the whole run, reward against cumulative rollout
seconds, and the held-out comparison paired over prompts."""

import json

import pytest
from scipy import stats

from sparrow.report import write_report
from sparrow.report.runs import rollout_clock, throughput


def _run(path, rows, evals):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if evals:
        (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def _row(step, reward, rollout_s, tokens):
    return {"step": step, "reward/mean": reward, "time/rollout_s": rollout_s, "time/step_s": 2 * rollout_s,
            "rollout/tokens_per_s": tokens / rollout_s, "completions/mean_length": 10.0}


def test_throughput_is_total_tokens_over_total_rollout_seconds():
    rows = [_row(1, 0.1, 10.0, 100), _row(2, 0.2, 30.0, 500)]
    assert throughput(rows) == pytest.approx(600 / 40)  # not the median of 10 and 16.7 tokens/s
    rows[1]["time/step_s"] = 90.0
    assert throughput(rows, "time/step_s") == pytest.approx(600 / 110)  # per whole-step second
    assert rollout_clock(rows) == {0: 0.0, 1: 10.0, 2: 40.0}


def test_the_report_pairs_held_out_prompts_and_plots_reward_against_rollout_time(tmp_path):
    dense_means, sparse_means = [0.2, 0.6, 0.4, 0.8], [0.3, 0.5, 0.6, 0.8]
    _run(tmp_path / "dense", [_row(1, 0.4, 20.0, 400), _row(2, 0.5, 20.0, 400)],
         [{"step": 0, "eval/mean@4": 0.5}, {"step": 2, "eval/mean@4": 0.5, "eval/mean_low": 0.1,
                                            "eval/mean_high": 0.9, "eval/per_example_mean": dense_means}])
    _run(tmp_path / "sparse", [_row(1, 0.3, 10.0, 400), _row(2, 0.5, 10.0, 200)],
         [{"step": 0, "eval/mean@4": 0.5}, {"step": 2, "eval/mean@4": 0.55, "eval/mean_low": 0.2,
                                            "eval/mean_high": 0.9, "eval/per_example_mean": sparse_means}])
    text = write_report([tmp_path / "dense", tmp_path / "sparse"], tmp_path / "r").read_text()
    sparse_row = next(line for line in text.splitlines() if line.startswith("| sparse |"))
    # rollout time 20/10 s; rollout throughput (600/20) / (800/40); step throughput (600/40) / (800/80)
    assert sparse_row.endswith("| 2.00x | 1.50x | 1.50x |")
    assert "- sparse: step 0 0.500 -> step 2 0.550 [0.200, 0.900]" in text
    diffs = [s - d for s, d in zip(sparse_means, dense_means)]
    low, high = stats.t.interval(0.95, 3, loc=sum(diffs) / 4, scale=stats.sem(diffs))
    assert f"- sparse minus dense at their last evaluation: +0.050 [{low:+.3f}, {high:+.3f}] (paired over 4 prompts)" in text
    assert (tmp_path / "r" / "reward-vs-rollout-time.png").stat().st_size > 1000


def test_rewards_by_prompt_length_and_the_tail_per_bin(tmp_path):
    rows = [{**_row(1, 0.5, 10.0, 100), "prompts/length": [1000, 5000], "reward/per_prompt": [0.8, 0.2],
             "mismatch/bin_0/exact_p5": 0.9, "mismatch/bin_0/exact_p1": 0.7},
            {**_row(2, 0.6, 10.0, 100), "prompts/length": [1500], "reward/per_prompt": [0.6],
             "mismatch/bin_0/exact_p5": 0.8, "mismatch/bin_0/exact_p1": 0.5, "mismatch/bin_4096/exact_p5": 0.6,
             "mismatch/bin_4096/exact_p1": 0.4}]
    _run(tmp_path / "mixed", rows, [{"step": 2, "eval/mean@2": 0.5, "eval/per_example_mean": [0.4, 0.6],
                                     "eval/prompt_length": [3000, 7000]}])
    text = write_report([tmp_path / "mixed"], tmp_path / "r").read_text()
    assert "| run | rewards | [0, 2048) | [2048, 4096) | [4096, 6144) | [6144, 8192) |" in text
    assert "| mixed | rollouts | 0.700 (2) | - | 0.200 (1) | - |" in text
    assert "| mixed | held-out (last) | - | 0.400 (1) | - | 0.600 (1) |" in text
    assert "| mixed | 0.850 / 0.600 | 0.600 / 0.400 |" in text  # medians over the steps that had the bin


def test_two_held_out_prompts_give_no_interval_and_a_known_range_bounds_the_difference(tmp_path):
    """The long demo's case: 2 held-out prompts (a row written before the rule carries -1.303..2.025 for a reward in
    [0, 1]); and with 3 prompts of a built-in reward the paired difference stays within [-1, 1]."""
    rows = [_row(1, 0.4, 20.0, 400)]
    _run(tmp_path / "dense", rows, [{"step": 4, "eval/mean@4": 0.361, "eval/mean_low": -1.303, "eval/mean_high": 2.025,
                                     "eval/per_example_mean": [0.230, 0.492]}])
    _run(tmp_path / "sparse", rows, [{"step": 4, "eval/mean@4": 0.4, "eval/mean_low": float("nan"),
                                      "eval/mean_high": float("nan"), "eval/per_example_mean": [0.3, 0.5]}])
    text = write_report([tmp_path / "dense", tmp_path / "sparse"], tmp_path / "r").read_text()
    assert "- dense: step 4 0.361 -> step 4 0.361 (2 prompts: too few for an interval (needs 3))" in text
    held_out = text[text.index("Held-out reward"):text.index("![held-out reward]")]
    assert "-1.303" not in held_out and "nan" not in held_out
    assert "- sparse minus dense at their last evaluation: +0.039 (paired; 2 prompts: too few for an interval" in text
    held = {"eval/mean_low": 0.0, "eval/mean_high": 1.0, "eval/reward_range": [0.0, 1.0]}
    for name, means in (("d3", [0.0, 0.0, 1.0]), ("s3", [1.0, 1.0, 0.0])):
        row = {"step": 4, "eval/mean@4": sum(means) / 3, **held, "eval/per_example_mean": means}
        _run(tmp_path / name, rows, [row])
    text = write_report([tmp_path / "d3", tmp_path / "s3"], tmp_path / "r3").read_text()
    assert "- s3 minus d3 at their last evaluation: +0.333 [-1.000, +1.000] (paired over 3 prompts)" in text


def test_exact_runs_get_their_tokens_per_verification_and_drafted_share(tmp_path):
    exact = [{**_row(step, 0.5, 10.0, 100), "rollout/tokens_per_verify": tpv, "rollout/drafted_share": share}
             for step, tpv, share in ((1, 2.5, 0.60), (2, 3.5, 0.70), (3, 3.0, 0.80))]
    _run(tmp_path / "dense", [_row(1, 0.5, 20.0, 100)], [])
    _run(tmp_path / "exact", exact, [])
    text = write_report([tmp_path / "dense", tmp_path / "exact"], tmp_path / "r").read_text()
    assert "| run | tokens per verification | drafted share of tokens |" in text
    assert "| exact | 3.00 | 70.0% |" in text  # medians over the steps
    assert "| dense |" not in text.split("tokens per verification")[1]  # a run without drafts gets no row
    _run(tmp_path / "sparse", [_row(1, 0.5, 10.0, 100)], [])
    assert "tokens per verification" not in write_report([tmp_path / "sparse"], tmp_path / "s").read_text()
