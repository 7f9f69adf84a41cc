"""Reward-aware profiling and calibration: paired sparse/dense probes, retention per schedule, --min-retention."""

import json

import numpy as np
import pytest

from sparrow.cli import main
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.measure.calibration import calibrate
from sparrow.rollout import NativeBackend
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

REWARD = '''
def length_reward(prompts, completions, answer, **columns):
    return [1.0 + len(c) % 5 + (a == "7") for c, a in zip(completions, answer)]
'''


def test_a_budget_covering_the_sequence_samples_what_the_dense_policy_samples(llama):
    """Same seed, prompt keys and sample indices: sample s of prompt i is the same draw under both."""
    model, tok = llama
    backend = NativeBackend(model, tok)
    prompts = random_prompts([150, 90], seed=3)
    sampling = SamplingParams(max_new_tokens=16, seed=5)
    sparse = backend.generate(prompts, sampling, const(4096), 3)
    dense = backend.generate(prompts, sampling, DENSE, 3, adapter=False)
    assert [(c.prompt_index, c.sample_index) for c in sparse] == [(c.prompt_index, c.sample_index) for c in dense]
    assert [c.token_ids for c in sparse] == [c.token_ids for c in dense]
    assert len({tuple(c.token_ids) for c in dense}) > 1  # the samples differ: the test is not vacuous


def test_profile_with_a_reward_writes_retention_per_schedule(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "x" * n, "answer": str(n % 10)}) + "\n" for n in (120, 77, 200)))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    out = tmp_path / "prof"
    code = main(["profile", "--model", "tiny-llama", "--prompts", str(prompts), "--schedules", "const:4096,const:48",
                 "--samples-per-prompt", "2", "--max-new-tokens", "24", "--bin-size", "64", "--out", str(out),
                 "--reward", f"{reward}:length_reward"])
    assert code == 0
    printed = capsys.readouterr().out
    profile = json.loads((out / "profile.json").read_text())
    assert profile["meta"]["reward"] == [f"{reward}:length_reward"]
    full = profile["schedules"]["const:4096"]["reward"]
    assert full["retention"] == {"value": 1.0, "low": 1.0, "high": 1.0, "sparse_mean": full["mean"],
                                 "dense_mean": full["dense_mean"], "pairs": 6, "prompts": 3}
    sparse = profile["schedules"]["const:48"]["reward"]
    assert sparse["dense_mean"] == full["dense_mean"] > 1.0  # one dense pass serves every schedule
    assert sparse["retention"]["value"] == pytest.approx(sparse["mean"] / sparse["dense_mean"])
    assert json.loads((out / "dense-rewards.json").read_text()) and "retention" in printed
    assert "const:4096" in printed and "1.000 [1.000, 1.000]" in printed
    bins = profile["schedules"]["const:48"]["bins"]
    assert all(b["p1"] <= b["p5"] and b["seq_min_p5"] <= b["seq_min_mean"] <= 1.0 for b in bins)
    assert profile["schedules"]["const:48"]["overall"]["sequences"] == 6
    assert (out / "profile.csv").read_text().splitlines()[0].endswith(",p1,p5,p50,frac_above_0.999,sequences,"
                                                                      "seq_min_mean,seq_min_p5")


def _profile(table, retention, bin_size=1000):
    """table: {budget: [p5 per bin]} of const schedules; retention: {budget: (value, low, high)} or None."""
    schedules = {}
    for budget, p5s in table.items():
        schedules[f"const:{budget}"] = {
            "budgets": [{"start": 0, "kv_budget": budget}],
            "bins": [{"bin": k, "start": k * bin_size, "end": (k + 1) * bin_size, "count": 500, "p5": p}
                     for k, p in enumerate(p5s)],
        }
        if retention is not None:
            value, low, high = retention[budget]
            schedules[f"const:{budget}"]["reward"] = {"mean": value, "dense_mean": 1.0, "retention": {
                "value": value, "low": low, "high": high, "sparse_mean": value, "dense_mean": 1.0, "pairs": 16,
                "prompts": 8}}
    return {"meta": {"length_origin": "total", "bin_size": bin_size}, "schedules": schedules}


TABLE = {256: [0.90, 0.84, 0.80], 512: [0.95, 0.87, 0.83], 1024: [0.99, 0.93, 0.90]}
RETENTION = {256: (0.70, 0.60, 0.80), 512: (0.97, 0.93, 1.01), 1024: (0.99, 0.96, 1.02)}


def test_min_retention_drops_schedules_that_lose_the_reward_and_floors_every_bin():
    profile = _profile(TABLE, RETENTION)
    assert calibrate(profile, 0.86)[0].budgets == (256, 512, 1024)  # the tail alone allows 256 in bin 0
    schedule, choices = calibrate(profile, 0.86, min_retention=0.95)
    assert [c.source for c in choices] == ["const:512", "const:512", "const:1024"]
    assert schedule.starts == (0, 2000) and schedule.budgets == (512, 1024)
    schedule, choices = calibrate(profile, 0.80, min_retention=0.98)  # only const:1024 keeps 0.98: the floor
    assert schedule.budgets == (1024,) and all(c.source == "const:1024" for c in choices)


def test_the_floor_lifts_bins_an_ineligible_cheaper_budget_would_hold():
    """const:512 holds tau in every bin but keeps too little reward; const:1024 keeps it: no bin gets 512."""
    profile = _profile({512: [0.95, 0.95], 1024: [0.99, 0.99]}, {512: (0.80, 0.7, 0.9), 1024: (1.0, 0.98, 1.02)})
    assert calibrate(profile, 0.86, min_retention=0.9)[0].budgets == (1024,)


@pytest.mark.parametrize("min_retention, match", [
    (0.0, r"min_retention must be in \(0, 1\]"), (1.5, r"min_retention must be in \(0, 1\]"),
    (0.995, "no profiled schedule keeps a reward retention of 0.995 .*const:1024 0.990"),
])
def test_bad_or_unreachable_min_retention(min_retention, match):
    with pytest.raises(SparrowError, match=match):
        calibrate(_profile(TABLE, RETENTION), 0.86, min_retention=min_retention)


def test_a_profile_without_rewards_is_refused_with_min_retention(tmp_path, capsys):
    with pytest.raises(SparrowError, match="no reward data .* re-run 'sparrow profile' with --reward"):
        calibrate(_profile(TABLE, None), 0.86, min_retention=0.9)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile(TABLE, None)))
    args = ["calibrate", "--profile", str(path), "--out", str(tmp_path / "s.json")]
    assert main(args + ["--min-retention", "0.9"]) == 2
    assert "--reward" in capsys.readouterr().err
    assert main(args) == 0  # without --min-retention, as before


def test_calibrate_prints_each_candidates_retention_and_verdict(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile(TABLE, RETENTION)))
    assert main(["calibrate", "--profile", str(path), "--out", str(tmp_path / "s.json"), "--tau", "0.86",
                 "--min-retention", "0.95"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = {line.split()[0]: line.split() for line in lines if line.startswith("const:")}
    assert row["const:256"][1:6] == ["0.700", "[0.600,", "0.800]", "lost", "no"]
    assert row["const:512"][1:6] == ["0.970", "[0.930,", "1.010]", "undecided", "yes"]
    assert row["const:1024"][1:6] == ["0.990", "[0.960,", "1.020]", "held", "yes"]
    assert row["const:256"][6:] == ["0.900", "0.840", "0.800"]
    assert any("at least the budget of const:512" in line for line in lines)
    assert json.loads((tmp_path / "s.json").read_text())


def test_retention_is_read_back_as_written():
    """The retention the profile writes is what calibrate reads (Retention.to_json round trip)."""
    from sparrow.measure.calibration import profile_retention
    from sparrow.measure.profiling import reward_summary

    summary = reward_summary(np.array([1.0, 0.0, 1.0, 1.0]), np.array([1.0, 1.0, 1.0, 0.0]), 2)
    profile = _profile({256: [0.9]}, None)
    profile["schedules"]["const:256"]["reward"] = json.loads(json.dumps(summary))
    retention = profile_retention(profile)["const:256"]
    assert retention.value == 1.0 and retention.prompts == 2 and retention.pairs == 4


def test_a_resumed_profile_with_other_answers_is_refused(tmp_path, capsys):
    """Stored rewards were scored against the answers of the first run: new answers must not reuse them."""
    prompts, reward, out = tmp_path / "prompts.jsonl", tmp_path / "reward.py", tmp_path / "prof"
    reward.write_text(REWARD)
    args = ["profile", "--model", "tiny-llama", "--prompts", str(prompts), "--schedules", "const:48",
            "--samples-per-prompt", "2", "--max-new-tokens", "8", "--bin-size", "64", "--out", str(out),
            "--reward", f"{reward}:length_reward"]
    prompts.write_text("".join(json.dumps({"prompt": "x" * n, "answer": "7"}) + "\n" for n in (120, 77)))
    assert main(args) == 0
    assert main(args) == 0 and "done earlier" in capsys.readouterr().err  # same answers: resumes
    prompts.write_text("".join(json.dumps({"prompt": "x" * n, "answer": "3"}) + "\n" for n in (120, 77)))
    assert main(args) != 0
    assert "answers_hash differ" in capsys.readouterr().err


def test_each_bin_names_the_criterion_that_bound_its_budget(tmp_path, capsys):
    """Bin 0: every budget holds tau and 256 loses the reward, so the floor (512) binds; bin 1: 256 misses tau
    too, both bind; bin 2: only 1024 holds tau; bin 3: 512 would do, but bin 2's 1024 carries over; bin 4: no
    profiled budget holds tau, so it runs dense. Without the floor, bin 0's smallest budget already holds tau."""
    table = {256: [0.95, 0.80, 0.70, 0.90, 0.50], 512: [0.95, 0.90, 0.80, 0.95, 0.60],
             1024: [0.99, 0.95, 0.90, 0.95, 0.70], 2048: [0.99, 0.99, 0.95, 0.99, 0.80]}
    retention = {256: (0.70, 0.6, 0.8), 512: (0.97, 0.93, 1.01), 1024: (0.99, 0.96, 1.02),
                 2048: (0.99, 0.96, 1.02)}
    profile = _profile(table, retention)
    with pytest.raises(SparrowError, match=r"\[4000, 5000\).*or --unreached dense"):
        calibrate(profile, 0.86, min_retention=0.95)
    schedule, choices = calibrate(profile, 0.86, min_retention=0.95, unreached="dense")
    assert [c.bound_by for c in choices] == ["reward floor", "tau + reward floor", "tau", "non-decreasing",
                                             "dense: tau unreached"]
    assert [schedule.budget_at(c.start) for c in choices] == [512, 512, 1024, 1024, 5008]
    assert choices[4].source == "none (best const:2048)" and choices[4].p5 == 0.80
    _, alone = calibrate(_profile({k: v[:4] for k, v in table.items()}, None), 0.86)
    assert [c.bound_by for c in alone] == ["smallest profiled", "tau", "tau", "non-decreasing"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    args = ["calibrate", "--profile", str(path), "--out", str(tmp_path / "s.json"), "--min-retention", "0.95"]
    assert main(args + ["--unreached", "dense"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("[")}
    assert "tau + reward floor" in rows["[1000,"] and "dense: tau unreached" in rows["[4000,"]
    assert main(args + ["--unreached", "largest"]) == 2
    assert "unknown --unreached 'largest': expected one of fail, dense" in capsys.readouterr().err
    with pytest.raises(SparrowError, match="unreached"):
        calibrate(profile, 0.86, unreached="largest")
