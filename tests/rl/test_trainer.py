"""The training loop on a tiny model: metrics log, checkpoints, and a resumed run equal to an uninterrupted one."""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparrow.errors import SparrowError
from sparrow.models import load_model
from sparrow.rl.config import TrainConfig
from sparrow.rl.trainer import train
from sparrow.typed_config import build, flatten_mapping


def byte_mean(prompts, completions, **_):
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": "abc " * (10 + i), "answer": str(i)}) + "\n" for i in range(5)))
    return path


def _config(data, out, **overrides):
    values = dict(model="tiny-qwen3", data=str(data), reward=["tests.rl.test_trainer:byte_mean"], steps=2,
                  prompts_per_step=2, num_generations=3, max_new_tokens=8, learning_rate=1e-3,
                  schedule="const:48", micro_batch_size=4, output_dir=str(out))
    return build(TrainConfig, {**values, **overrides})


def _weights(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_two_steps_log_metrics_and_a_resumed_run_ends_with_the_same_parameters(data, tmp_path):
    full = tmp_path / "full"
    history = train(_config(data, full), log=lambda *_: None)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] == [h["step"] for h in history]
    logged = {"reward/mean", "reward/std", "reward/frac_zero_std_groups", "completions/mean_length",
              "completions/max_length", "completions/clipped_ratio", "loss", "clip_ratio", "clip_ratio/low_mean",
              "clip_ratio/high_mean", "clip_ratio/dual_mean", "grad_norm", "learning_rate", "time/rollout_s",
              "time/reward_s", "time/recompute_s", "time/update_s", "time/step_s", "rollout/tokens_per_s",
              "rollout/kv_budget_mean", "sampling/importance_sampling_ratio/min",
              "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max",
              "sampling/importance_sampling_ratio/frac_truncated", "sampling/sampling_logp_difference/mean",
              "sampling/sampling_logp_difference/max", "mismatch/acceptance_lower/p5",
              "mismatch/acceptance_lower/mean", "mismatch/acceptance_upper/p5", "mismatch/acceptance_upper/mean",
              "mismatch/bin_0/acceptance_lower_p5", "mismatch/bin_0/acceptance_upper_p5", "mismatch/warnings"}
    assert all(logged <= set(r) for r in rows), logged - set(rows[0])
    assert rows[0]["learning_rate"] == 1e-3
    assert sorted(p.name for p in full.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

    split = tmp_path / "split"
    train(_config(data, split, steps=1), log=lambda *_: None)
    train(_config(data, split, steps=2, resume=True), log=lambda *_: None)
    a, b = _weights(full / "checkpoint-2"), _weights(split / "checkpoint-2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    initial = AutoModelForCausalLM.from_pretrained(full / "checkpoint-1").state_dict()
    assert any(not torch.equal(initial[k], a[k]) for k in a)


def test_an_existing_run_is_not_overwritten_without_resume(data, tmp_path):
    train(_config(data, tmp_path / "run", steps=1), log=lambda *_: None)
    with pytest.raises(SparrowError, match="--resume"):
        train(_config(data, tmp_path / "run", steps=1), log=lambda *_: None)


def test_resume_of_a_directory_without_a_run_says_it_starts_at_step_0(data, tmp_path):
    """A mistyped --resume path starts a new run (a job restarted before its first checkpoint must too), but says so."""
    lines = []
    train(_config(data, tmp_path / "typo", steps=1, resume=True), log=lines.append)
    assert f"--resume: {tmp_path / 'typo'} holds no run; starting at step 0" in lines


@pytest.mark.parametrize("overrides, message", [
    ({"data": "missing.jsonl"}, "does not exist"),
    ({"reward": ["nope_module:fn"]}, "nope_module"),
    ({"schedule": "const:50"}, "multiple of the page size"),
    ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
])
def test_bad_configs_stop_before_any_work(data, tmp_path, overrides, message):
    with pytest.raises(SparrowError, match=message):
        _config(overrides.pop("data", data), tmp_path / "x", **overrides).validate()


@pytest.mark.parametrize("text, message", [
    ("steps: [1\n", "is not valid YAML"),
    ("stepz: 3\n", "unknown option 'stepz'"),
    ("grpo: {stepz: 3}\n", "unknown option 'grpo.stepz'"),
    ("grpo: {steps: many}\n", "steps is 'many'; expected an integer"),
    ("steps: many\n", "steps is 'many'; expected an integer"),
    ("learning_rate: fast\n", "learning_rate is 'fast'; expected a number"),
    ("reward: [1, 2]\n", "reward is [1, 2]; expected a list of str"),
])
def test_a_malformed_config_file_stops_the_command_with_one_message(tmp_path, capsys, text, message):
    from sparrow.cli import main

    config = tmp_path / "cfg.yaml"
    config.write_text(text)
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "out").exists()


def test_the_train_command_reads_yaml_and_flags(data, tmp_path, capsys):
    from sparrow.cli import main

    config = tmp_path / "cfg.yaml"
    config.write_text(f"model: tiny-qwen3\ndata: {data}\nreward: [tests.rl.test_trainer:byte_mean]\nsteps: 5\n"
                      "prompts_per_step: 1\nnum_generations: 2\nmax_new_tokens: 4\n")
    out = tmp_path / "cli"
    assert main(["train", "--config", str(config), "--steps", "1", "--output-dir", str(out),
                 "--reward-weights", "2.0"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert main(["train", "--config", str(config), "--output-dir", str(out), "--reward", "nope:fn"]) == 2
    assert "nope" in capsys.readouterr().err


def test_the_tiny_example_config_runs(tmp_path):
    from sparrow.cli import main

    out = tmp_path / "tiny"
    assert main(["train", "--config", "examples/tiny.yaml", "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and (out / "checkpoint-2" / "config.json").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_held_out_evaluation_runs_before_training_every_n_steps_and_at_the_end(data, tmp_path):
    out = tmp_path / "eval"
    train(_config(data, out, steps=3, eval_data=str(data), eval_every=2, eval_generations=2), log=lambda *_: None)
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 3]
    assert all(0 <= r["eval/mean@2"] <= 1 and r["eval/samples_per_example"] == 2 for r in rows)
    assert rows[0]["eval/mean@2"] != rows[-1]["eval/mean@2"]  # same samples' seed, changed policy
    for row in rows:  # each prompt's mean, and the interval of their mean
        means = row["eval/per_example_mean"]
        assert len(means) == row["eval/examples"] and sum(means) / len(means) == pytest.approx(row["eval/mean@2"])
        assert row["eval/mean_low"] < row["eval/mean@2"] < row["eval/mean_high"]
    assert "held-out" in (out / "report.md").read_text() and (out / "heldout.png").stat().st_size > 1000
    with pytest.raises(SparrowError, match="eval_data file 'nope.jsonl' does not exist"):
        _config(data, tmp_path / "x", eval_data="nope.jsonl").validate()
    skipped = tmp_path / "no-start"  # a run compared with one that scored step 0 may skip it; the rest is equal
    train(_config(data, skipped, steps=3, eval_data=str(data), eval_every=2, eval_generations=2, eval_at_start=False),
          log=lambda *_: None)
    later = [json.loads(line) for line in (skipped / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in later] == [2, 3] and later[-1]["eval/mean@2"] == rows[-1]["eval/mean@2"]


def test_report_compares_runs_with_plots(data, tmp_path):
    from sparrow.cli import main

    for name, schedule in (("sparse", "const:48"), ("dense", "dense")):
        train(_config(data, tmp_path / name, schedule=schedule, bin_size=16), log=lambda *_: None)
    assert (tmp_path / "sparse" / "report.md").exists()
    assert main(["report", str(tmp_path / "sparse"), str(tmp_path / "dense"), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "| sparse | 2 |" in text and "| dense | 2 |" in text
    rows = {}
    for line in text.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), []).append(line)
    assert rows["sparse"][0].endswith("| 1.00x |") and "rollout speed vs sparse" in text  # the first run is the base
    assert re.search(r"\| \d+\.\d\dx \|$", rows["dense"][0])
    assert "| 1.00x | " in rows["sparse"][0] and "step speed vs sparse" in text
    # step speed, rollout tokens/s, rollout speed, rollout throughput, step throughput
    assert re.search(r"\| \d+\.\d\dx \| \d+\.\d \| \d+\.\d\dx \| \d+\.\d\dx \| \d+\.\d\dx \|$", rows["dense"][0])
    assert (tmp_path / "r" / "reward-vs-rollout-time.png").stat().st_size > 1000
    assert "Where the rollout time goes" in text  # prefill, decode, sample, other, monitor (dense runs none)
    assert re.fullmatch(r"\| sparse( \| -?\d+\.\d\d){5} \|", rows["sparse"][1])
    assert rows["dense"][1].endswith("| - |")
    for row in map(json.loads, (tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()):
        parts = [row[f"time/rollout_{p}_s"] for p in ("prefill", "decode", "sample")]
        assert all(v > 0 for v in parts) and sum(parts) <= row["time/rollout_s"]
    for plot in ("curves.png", "mismatch.png", "phases.png"):
        assert (tmp_path / "r" / plot).stat().st_size > 1000


@pytest.mark.parametrize("path", ["examples/tiny.yaml", "examples/tiny-distill.yaml", "examples/qwen3-1.7b-gpu.yaml",
                                  "examples/smollm2-passkey.yaml", "examples/smollm2-distill.yaml",
                                  "examples/smollm2-manifest.yaml", "examples/smollm2-longanswer.yaml",
                                  "examples/smollm2-code.yaml"])
def test_the_example_configs_name_only_known_options(path):
    import yaml

    flatten_mapping(TrainConfig, yaml.safe_load(open(path)), path)


def _from_mapping(mapping: dict) -> TrainConfig:
    """A validated TrainConfig from a (nested or flat) mapping, as a YAML file holds it."""
    config = build(TrainConfig, flatten_mapping(TrainConfig, mapping, "config"))
    config.validate()
    return config


def test_the_long_answer_config_validates_with_its_decode_bound_settings(tmp_path):
    """examples/smollm2-longanswer.yaml builds and validates once its data file exists: answers of up to
    1400 tokens at temperature 1 and top-p 0.9, number_f1, one prompt x 8 samples, an adaptive schedule from the
    schedule calibrated at tau 0.86, monitored every step."""
    import yaml

    mapping = yaml.safe_load(open("examples/smollm2-longanswer.yaml"))
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "copy", "answer": ["12345"]}\n')
    mapping["data"]["path"] = str(data)
    config = _from_mapping(mapping)
    assert (config.sampling.max_new_tokens, config.sampling.temperature, config.sampling.top_p) == (1400, 1.0, 0.9)
    assert config.data.reward == ["number_f1"] and config.sparse.schedule == "adaptive"
    assert (config.adaptive.start, config.monitor.tau, config.monitor.monitor_every) == ("0:2048,3584:4096", 0.86, 1)
    assert (config.grpo.prompts_per_step, config.grpo.num_generations) == (1, 8)


def test_nested_sections_and_flat_names_build_the_same_config(data, tmp_path):
    flat = _from_mapping({"data": str(data), "learning_rate": 3e-4, "distill": True, "distill_lr": 0.01,
                          "eval_every": 3, "model": "tiny-llama", "reward": ["tests.rl.test_trainer:byte_mean"]})
    nested = _from_mapping({"data": {"path": str(data), "reward": ["tests.rl.test_trainer:byte_mean"]},
                            "grpo": {"learning_rate": 3e-4}, "distill": {"enabled": True, "lr": 0.01},
                            "eval": {"every": 3}, "model": {"name": "tiny-llama"}})
    assert flat == nested and flat.grpo.learning_rate == 3e-4 and flat.distill.lr == 0.01
    assert flat.parsed.schedule.is_dense and flat.model.name == "tiny-llama"


def test_a_resume_with_changed_options_is_refused_unless_allowed(data, tmp_path):
    out = tmp_path / "run"
    train(_config(data, out, steps=1), log=lambda *_: None)
    with pytest.raises(SparrowError, match=r"grpo.learning_rate: 0.001 -> 0.002"):
        train(_config(data, out, steps=2, resume=True, learning_rate=2e-3), log=lambda *_: None)
    with pytest.raises(SparrowError, match="cannot change in a resumed run even with --allow-changes"):
        train(_config(data, out, steps=2, resume=True, allow_changes=True, seed=5), log=lambda *_: None)
    logged = []
    train(_config(data, out, steps=2, resume=True, allow_changes=True, eval_every=7), log=logged.append)
    assert any("changed option: eval.every: 10 -> 7" in line for line in logged)


def test_a_resume_repairs_the_metrics_log_and_skips_a_damaged_newest_checkpoint(data, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    train(_config(data, full, steps=3), log=lambda *_: None)
    train(_config(data, split, steps=3), log=lambda *_: None)
    (split / "checkpoint-3" / "model.safetensors").write_bytes(b"garbage")  # the newest checkpoint is damaged
    with open(split / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "reward/me')  # a torn line of a killed write
    logged = []
    train(_config(data, split, steps=3, resume=True), log=logged.append)
    assert any("skipping damaged checkpoint" in line and "checkpoint-3" in line for line in logged)
    rows = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    a, b = _weights(full / "checkpoint-3"), _weights(split / "checkpoint-3")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_run_on_a_locked_directory_stops_at_once(data, tmp_path):
    from sparrow.rl.run_dir import RunLock

    out = tmp_path / "locked"
    with RunLock(out, log=lambda *_: None), pytest.raises(SparrowError, match=f"pid {__import__('os').getpid()}"):
        train(_config(data, out, steps=1), log=lambda *_: None)


def test_the_adaptive_schedule_moves_budgets_is_logged_and_a_resumed_run_equals_an_uninterrupted_one(data,
                                                                                                     tmp_path):
    options = dict(schedule="adaptive", adaptive_start="const:64", adaptive_min_tokens=10, adaptive_patience=1,
                   tau=0.5, bin_size=32, steps=3, max_new_tokens=12)
    full, split = tmp_path / "full", tmp_path / "split"
    logged = []
    history = train(_config(data, full, **options), log=logged.append)
    budgets = [{k: v for k, v in h.items() if k.startswith("adaptive/") and k.endswith("/budget")} for h in history]
    assert budgets[0] and all(set(b) == set(budgets[0]) for b in budgets)
    evidence = [v for h in history for k, v in h.items() if k.startswith("adaptive/") and "/cheaper_p5" in k]
    assert evidence and all(0.0 <= v <= 1.0 for v in evidence)  # the tails one rung cheaper, logged beside them
    assert any("budget down" in line for line in logged)  # tau 0.5 is easy: budgets fall toward the ladder's foot
    assert min(min(b.values()) for b in budgets) >= 48  # never below the always-kept pages
    assert (full / "schedule.png").stat().st_size > 1000 and "schedule.png" in (full / "report.md").read_text()
    train(_config(data, split, **{**options, "steps": 2}), log=lambda *_: None)
    resumed = train(_config(data, split, **{**options, "resume": True}), log=lambda *_: None)
    assert {k: v for k, v in resumed[0].items() if k.startswith("adaptive/") and k.endswith("/budget")} == budgets[2]
    a, b = _weights(full / "checkpoint-3"), _weights(split / "checkpoint-3")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SparrowError, match="needs monitor exact"):
        _config(data, tmp_path / "x", schedule="adaptive", monitor="bounds").validate()


def test_a_step_after_a_bin_fell_with_the_exact_fallback_rolls_out_in_exact_mode(data, tmp_path):
    """tau 0.999 is out of reach of 48 tokens: after the first (sparse) step a bin falls, and the next steps roll
    out in exact mode (dense verification of the schedule's drafts), where the fallen bin stays (its p5 cannot
    clear tau + margin above 1); the log says which bin moved, and on what evidence."""
    options = dict(schedule="adaptive", adaptive_start="const:48", adaptive_min_tokens=10, adaptive_fallback="exact",
                   tau=0.999, bin_size=32, steps=3, max_new_tokens=12)
    logged = []
    history = train(_config(data, tmp_path / "run", **options), log=logged.append)
    assert [h["adaptive/exact"] for h in history] == [0, 1, 1]
    assert "rollout/tokens_per_verify" not in history[0]
    assert all("rollout/tokens_per_verify" in h for h in history[1:])  # exact rollouts: dense verifications
    moved = [k for k, v in history[0].items() if k.endswith("/move") and v == 1]
    assert moved and all(history[0][k.replace("/move", "/fallen")] == 1 for k in moved)
    assert all(history[0][k.replace("/move", "/p5")] < 0.999 for k in moved)
    assert any("next step rolls out in exact mode" in line for line in logged)
    with pytest.raises(SparrowError, match="--rollout-mode exact rolls out every step in exact mode already"):
        _config(data, tmp_path / "x", **options, rollout_mode="exact").validate()
    with pytest.raises(SparrowError, match="adaptive_fallback 'never': expected one of budget, dense, exact"):
        _config(data, tmp_path / "x", **{**options, "adaptive_fallback": "never"}).validate()


def test_exact_mode_trains_on_dense_samples_monitors_for_free_and_resumes(data, tmp_path):
    """Exact rollouts are the dense policy's own: the same rewards and losses as dense rollouts with the same seed
    and the same update to float rounding (Adam turns rounding in near-zero gradients into whole steps, so the
    updates are compared as vectors), every drafted token's acceptance logged with no teacher-forced pass."""
    logs = []
    exact = train(_config(data, tmp_path / "exact", rollout_mode="exact", draft_tokens=3, monitor="exact"),
                  log=logs.append)
    dense = train(_config(data, tmp_path / "dense", schedule="dense"), log=lambda *_: None)
    assert [h["reward/mean"] for h in exact] == [h["reward/mean"] for h in dense]
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(exact, dense))
    a, b = _weights(tmp_path / "exact" / "checkpoint-2"), _weights(tmp_path / "dense" / "checkpoint-2")
    start = load_model("tiny-qwen3")[0].state_dict()
    moved = torch.cat([(a[k] - start[k]).flatten() for k in a])
    apart = torch.cat([(a[k] - b[k]).flatten() for k in a])
    assert apart.norm() < 0.01 * moved.norm()
    for row in exact:
        assert 1 <= row["rollout/tokens_per_verify"] <= 4 and 0 < row["rollout/drafted_share"] < 1
        assert 0 < row["mismatch/exact/p5"] <= row["mismatch/exact/mean"] <= 1
        assert 0 <= row["mismatch/exact/p1"] <= row["mismatch/exact/p5"]
        counts = [v for k, v in row.items() if k.startswith("mismatch/bin_") and k.endswith("/exact_tokens")]
        assert counts and sum(counts) == row["mismatch/exact/tokens"]  # every drafted token in one length bin
        assert all(row[k.replace("_tokens", "_p1")] <= row[k.replace("_tokens", "_p5")] for k in row
                   if k.startswith("mismatch/bin_") and k.endswith("/exact_tokens"))
        assert row["time/monitor_s"] == 0  # recorded while decoding
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    assert any("exact mode" in line and "are 1" in line for line in logs)

    split = tmp_path / "split"
    train(_config(data, split, steps=1, rollout_mode="exact", draft_tokens=3), log=lambda *_: None)
    train(_config(data, split, steps=2, resume=True, rollout_mode="exact", draft_tokens=3), log=lambda *_: None)
    c = _weights(split / "checkpoint-2")
    assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("overrides, message", [
    ({"rollout_mode": "exact", "schedule": "dense"}, "drafts with a sparse schedule"),
    ({"rollout_mode": "dense", "schedule": "adaptive", "monitor": "exact"}, "has nothing to move"),
    ({"rollout_mode": "exact", "draft_tokens": -1},
     r"draft_tokens must be an integer in \[1, 64\] or 'auto' \(or 0\), got -1"),
])
def test_bad_rollout_modes_are_refused_up_front(data, tmp_path, overrides, message):
    with pytest.raises(SparrowError, match=message):
        _config(data, tmp_path / "run", **overrides).validate()
