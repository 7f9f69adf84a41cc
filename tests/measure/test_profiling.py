"""Profiling on a tiny model: exact acceptance against the dense policy, files written, resume, calibration."""

import json

import numpy as np
import pytest

from sparrow.attention import SparseConfig
from sparrow.cli import main
from sparrow.engine import SamplingParams
from sparrow.measure.profiling import ScheduleSample, plot_profile, profile_schedule, summarize
from sparrow.rollout import NativeBackend
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts


def test_profiled_acceptance_is_one_for_dense_and_below_one_for_an_aggressive_budget(llama):
    model, tok = llama
    backend = NativeBackend(model, tok)
    prompts = random_prompts([150, 90], seed=8)
    sampling = SamplingParams(max_new_tokens=20, seed=0, ignore_eos=True)
    dense = profile_schedule(backend, model, prompts, DENSE, sampling, 2, SparseConfig())
    np.testing.assert_allclose(dense.alpha, 1.0, atol=1e-5)
    sparse = profile_schedule(backend, model, prompts, const(48), sampling, 2, SparseConfig())
    assert sparse.alpha.size == 4 * 20 == sparse.kv_budget.size
    assert abs(sparse.alpha[0] - 1.0) < 1e-6  # the first token comes from the dense prefill
    assert sparse.alpha.min() < 0.999 and ((0.0 <= sparse.alpha) & (sparse.alpha <= 1.0 + 1e-6)).all()
    assert (sparse.total_position == np.concatenate([p + np.arange(20) for p in (150, 150, 90, 90)])).all()


def test_summary_and_plots_from_raw_values(tmp_path):
    """Per-bin stats of the raw values (5th percentile, 0.999 tail) and the two plots; no unused tau option."""
    alpha = np.concatenate([np.linspace(0.5, 1.0, 20), np.ones(20)])
    sample = ScheduleSample(alpha, np.arange(100, 140), np.arange(40), np.full(40, 48))
    summary = summarize({"const:48": sample}, 20, "total", fit_beta=False)["const:48"]
    assert summary["tokens"] == 40 and [b["start"] for b in summary["bins"]] == [100, 120]
    assert summary["bins"][0]["p5"] == pytest.approx(np.percentile(alpha[:20], 5))
    assert summary["bins"][1]["frac_above_tail"] == 1.0 and summary["overall"]["frac_above_tail"] == 21 / 40
    paths = plot_profile(tmp_path, {"const:48": summary}, {"const:48": sample}, "total")
    assert [p.name for p in paths] == ["p5_vs_length.png", "alpha_hist.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    with pytest.raises(TypeError, match="tau"):
        plot_profile(tmp_path, {"const:48": summary}, {"const:48": sample}, "total", tau=0.9)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in (120, 170, 200)))
    return path


def _profile(prompts_file, out, schedules, capsys):
    code = main(["profile", "--model", "tiny-llama", "--prompts", str(prompts_file), "--schedules", schedules,
                 "--samples-per-prompt", "2", "--max-new-tokens", "24", "--bin-size", "64", "--out", str(out)])
    assert code == 0
    return capsys.readouterr().out


def test_profile_writes_stats_csv_plots_and_resumes(prompts_file, tmp_path, capsys):
    out = tmp_path / "prof"
    _profile(prompts_file, out, "const:48,dense", capsys)
    profile = json.loads((out / "profile.json").read_text())
    assert list(profile["schedules"]) == ["const:48", "dense"]
    dense = profile["schedules"]["dense"]
    assert 3 * 2 <= dense["tokens"] <= 3 * 2 * 24 and dense["overall"]["p5"] > 0.999999
    sparse = profile["schedules"]["const:48"]
    assert sparse["overall"]["mean"] < 1.0 and sum(b["count"] for b in sparse["bins"]) == sparse["tokens"]
    assert all(b["start"] % 64 == 0 for b in sparse["bins"])
    assert (out / "profile.csv").read_text().startswith("schedule,bin,start,end,count")
    assert (out / "p5_vs_length.png").stat().st_size > 1000 and (out / "alpha_hist.png").exists()
    before = (out / "tokens-const_48.npz").stat().st_mtime_ns
    printed = _profile(prompts_file, out, "const:48,const:96,dense", capsys)
    assert (out / "tokens-const_48.npz").stat().st_mtime_ns == before
    assert "const:96" in json.loads((out / "profile.json").read_text())["schedules"]
    assert "const:96" in printed


def test_profile_refuses_a_directory_made_with_other_settings(prompts_file, tmp_path, capsys):
    out = tmp_path / "prof"
    _profile(prompts_file, out, "dense", capsys)
    code = main(["profile", "--model", "tiny-llama", "--prompts", str(prompts_file), "--schedules", "dense",
                 "--max-new-tokens", "24", "--samples-per-prompt", "2", "--seed", "9", "--out", str(out)])
    assert code == 2 and "sampling" in capsys.readouterr().err


def test_calibrate_command_writes_a_schedule_the_engine_accepts(prompts_file, tmp_path, capsys):
    out = tmp_path / "prof"
    _profile(prompts_file, out, "const:48,const:96,dense", capsys)
    schedule_path = tmp_path / "calibrated.json"
    code = main(["calibrate", "--profile", str(out / "profile.json"), "--tau", "0.5", "--min-tokens", "1",
                 "--out", str(schedule_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "predicted speedup" in printed
    assert main(["schedule", "show", str(schedule_path), "--json"]) == 0
    bins = json.loads(capsys.readouterr().out)
    assert bins[0]["start"] == 0 and all(b["kv_budget"] % 16 == 0 for b in bins)


def test_exact_mode_profiles_the_drafters_acceptance_recorded_while_decoding(llama, prompts_file, tmp_path, capsys):
    model, tok = llama
    backend = NativeBackend(model, tok)
    prompts = random_prompts([150, 90], seed=8)
    sampling = SamplingParams(max_new_tokens=20, seed=0, ignore_eos=True)
    exact = profile_schedule(backend, model, prompts, const(48), sampling, 2, SparseConfig(), draft_tokens=3,
                             log=lambda *_: None)
    completions = backend.generate(prompts, sampling, const(48), 2, draft_tokens=3)
    recorded = [a for c in completions for a in c.draft_acceptance if a is not None]
    np.testing.assert_allclose(exact.alpha, recorded)  # no teacher-forced pass: the values decoding recorded
    assert 0 < exact.alpha.size < 4 * 20 and exact.alpha.size == exact.kv_budget.size == exact.total_position.size

    out = tmp_path / "prof"
    code = main(["profile", "--model", "tiny-llama", "--prompts", str(prompts_file), "--schedules", "const:48,dense",
                 "--samples-per-prompt", "2", "--max-new-tokens", "24", "--bin-size", "64", "--out", str(out),
                 "--rollout-mode", "exact", "--draft-tokens", "3"])
    assert code == 0 and "tokens per verification" in capsys.readouterr().err  # a progress line
    profile = json.loads((out / "profile.json").read_text())
    assert profile["meta"]["rollout"] == {"mode": "exact", "draft_tokens": 3}
    assert profile["schedules"]["const:48"]["overall"]["mean"] < 1.0
    _profile(prompts_file, tmp_path / "other", "dense", capsys)
    code = main(["profile", "--model", "tiny-llama", "--prompts", str(prompts_file), "--schedules", "const:48",
                 "--samples-per-prompt", "2", "--max-new-tokens", "24", "--bin-size", "64", "--out", str(out)])
    assert code == 2 and "rollout" in capsys.readouterr().err  # a sparse-mode resume of an exact profile
