"""The TRL integration's monitor on TRL-shaped tensors: its exact acceptance and tail equal sparrow.measure's on the
same tokens, its verdict is sparrow train's, and the run-time schedule drives the adaptive controller unchanged."""

import numpy as np
import pytest
import torch

from sparrow.attention import SparseConfig
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.errors import SparrowError
from sparrow.integrations.config import SparrowConfig
from sparrow.integrations.monitor import measure, rollout_batch, verdict
from sparrow.rl.step import monitored_rows
from sparrow.integrations.schedule_file import RunTimeSchedule
from sparrow.measure.acceptance import teacher_forced_acceptance
from sparrow.metrics.tail import bin_tails, by_bin
from sparrow.rl.config import MonitorSection
from sparrow.schedules import const, read_schedule_file
from sparrow.schedules.adaptive import start_state, update
from sparrow.vllm import env as plugin_env
from sparrow.vllm import state as plugin_state
from tests.conftest import random_prompts

SCHEDULE = const(48)
TEMPERATURE = 0.8


def trl_tensors(completions, pad_id=0):
    """What TRL's `_generate_and_score_completions` holds: prompts left-padded, completions right-padded."""
    prompts = [c.prompt_token_ids for c in completions]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    tokens = [c.token_ids for c in completions]
    width = max(map(len, tokens))
    completion_ids = torch.tensor([t + [pad_id] * (width - len(t)) for t in tokens])
    completion_mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tokens])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.fixture(scope="module")
def rollouts():
    from sparrow.models import load_model

    model, tok = load_model("tiny-llama")
    engine = RolloutEngine(model, tok, SparseConfig())
    completions = []
    for prompt, length in zip(random_prompts([150, 90], seed=4), (40, 25)):  # ragged: the padding is exercised
        sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=length, seed=2)
        completions += engine.generate([prompt], sampling, SCHEDULE, num_samples=3)
    return model, completions


def test_the_integrations_exact_tail_equals_sparrow_measure_on_the_same_tokens(rollouts):
    model, completions = rollouts
    batch = rollout_batch(*trl_tensors(completions))
    got = measure(model, batch, len(completions), {"current": SCHEDULE}, SparseConfig(), TEMPERATURE)
    reference = teacher_forced_acceptance(model, completions, SCHEDULE, SparseConfig(), TEMPERATURE)
    expected = np.concatenate([np.asarray(r) for r in reference])
    positions = np.concatenate([len(c.prompt_token_ids) + np.arange(len(c.token_ids)) for c in completions])
    np.testing.assert_allclose(got["current"].numpy(), expected, atol=1e-6)
    assert got["positions"].numpy().tolist() == positions.tolist()
    assert expected.min() < 0.999  # const:48 at 90-190 tokens is really sparse on this model

    monitor = MonitorSection(tau=0.9, bin_size=128)
    metrics, _ = verdict(got["current"].numpy(), got["positions"].numpy(), monitor)
    tails = bin_tails(expected, positions, 128, 0.9)
    assert [t.start for t in tails] == [0, 128]
    for t in tails:
        assert metrics[f"mismatch/bin_{t.start}/exact_p5"] == pytest.approx(t.p5, abs=1e-6)
        assert metrics[f"mismatch/bin_{t.start}/exact_p5_low"] == pytest.approx(t.p5_low, abs=1e-6)
        assert metrics[f"mismatch/bin_{t.start}/exact_p1"] == pytest.approx(t.p1, abs=1e-6)
        assert metrics[f"mismatch/bin_{t.start}/exact_mean"] == pytest.approx(t.mean, abs=1e-6)
        assert metrics[f"mismatch/bin_{t.start}/exact_frac_above_0999"] == pytest.approx(t.frac_above_0999)
    assert metrics["mismatch/exact/p5"] == pytest.approx(float(np.quantile(expected, 0.05)), abs=1e-6)
    assert metrics["mismatch/exact/tokens"] == expected.size


def test_only_a_share_of_the_rows_is_measured(rollouts):
    model, completions = rollouts
    batch = rollout_batch(*trl_tensors(completions))
    rows = monitored_rows(len(completions), 0.5)
    got = measure(model, batch, rows, {"current": SCHEDULE}, SparseConfig(), TEMPERATURE)
    assert rows == 3 and got["current"].numel() == sum(len(c.token_ids) for c in completions[:3])


def test_tool_result_tokens_stay_in_the_context_but_are_not_measured(rollouts):
    """TRL's tool_mask: 0 on tokens a tool wrote. They are context for later tokens, not samples of the actor."""
    model, completions = rollouts
    tensors = trl_tensors(completions)
    tool_mask = torch.ones_like(tensors[3])
    tool_mask[:, 5:12] = 0  # every completion is >= 25 tokens: 7 tool tokens in each
    plain = measure(model, rollout_batch(*tensors), len(completions), {"current": SCHEDULE}, SparseConfig(),
                    TEMPERATURE)
    tooled = measure(model, rollout_batch(*tensors, tool_mask=tool_mask), len(completions), {"current": SCHEDULE},
                     SparseConfig(), TEMPERATURE)
    keep = np.concatenate([np.r_[np.ones(5), np.zeros(7), np.ones(len(c.token_ids) - 12)] for c in completions])
    assert tooled["current"].numel() == plain["current"].numel() - 7 * len(completions)
    np.testing.assert_allclose(tooled["current"].numpy(), plain["current"].numpy()[keep == 1], atol=1e-6)
    assert tooled["positions"].numpy().tolist() == plain["positions"].numpy()[keep == 1].tolist()
    with pytest.raises(SparrowError, match="tool mask"):
        rollout_batch(*tensors, tool_mask=tool_mask[:, :3])


def test_the_verdict_words_below_tau_only_when_the_interval_is_below():
    gen = np.random.default_rng(0)
    positions = np.concatenate([np.full(400, 10), np.full(400, 130)])
    alpha = np.concatenate([gen.uniform(0.95, 1.0, 400), gen.uniform(0.5, 0.8, 400)])
    _, warnings = verdict(alpha, positions, MonitorSection(tau=0.9, bin_size=128))
    assert len(warnings) == 1 and warnings[0].startswith("length bin [128, 256): 5th percentile of exact acceptance "
                                                         "is below tau 0.9")
    few = np.array([0.85, 0.95, 0.99, 1.0, 1.0])
    _, warnings = verdict(few, np.zeros(5), MonitorSection(tau=0.9, bin_size=128))
    assert len(warnings) == 1 and "undecided" in warnings[0]
    with pytest.raises(SparrowError, match="no generated tokens"):
        verdict(np.zeros(0), np.zeros(0), MonitorSection())


def test_the_adaptive_schedule_drives_rl_adaptive_unchanged_and_writes_versions(tmp_path):
    config = SparrowConfig(schedule="adaptive", tau=0.9, bin_size=256, adaptive_start="const:128",
                           adaptive_patience=1, adaptive_min_tokens=10, adaptive_margin=0.0)
    path = tmp_path / "schedule.json"
    runtime = RunTimeSchedule(config, path, 512, writer=True)
    runtime.start()
    reference = start_state(const(128), 256, 512, 16, 3)
    assert runtime.state == reference
    assert read_schedule_file(path)[1] == 1
    positions = np.concatenate([np.full(200, 100), np.full(200, 300)])
    current = np.concatenate([np.full(200, 0.5), np.full(200, 1.0)])  # bin 0 fails tau, bin 1 holds it easily
    cheaper = np.concatenate([np.full(200, 0.4), np.full(200, 0.99)])
    moved = runtime.update(current, cheaper, positions)
    expected, events = update(reference, by_bin(current, positions, 256), by_bin(cheaper, positions, 256), 0.9, 0.0,
                              1, 10)
    assert moved == events and len(moved) == 2 and runtime.state == expected
    schedule, version = read_schedule_file(path)
    assert version == 2 and list(schedule.budgets) == expected.budgets == [256, 64]
    evidence = {f"adaptive/bin_{start}/{name}": value for start, values in (
        (0, {"p5": 0.5, "p5_low": 0.5, "p5_high": 0.5, "move": 1.0, "next_budget": 256.0}),
        (256, {"p5": 1.0, "p5_low": 1.0, "p5_high": 1.0, "move": -1.0, "next_budget": 64.0}))
        for name, value in {**values, "tokens": 200.0, "down_streak": 0.0}.items()}
    assert runtime.metrics(2) == {"sparrow/schedule_version": 2.0, "adaptive/bin_0/budget": 256.0,
                                  "adaptive/bin_256/budget": 64.0,  # the budgets written next and the tails one
                                  "adaptive/bin_0/cheaper_p5": 0.4, "adaptive/bin_0/cheaper_p5_low": 0.4,  # rung
                                  "adaptive/bin_256/cheaper_p5": 0.99, "adaptive/bin_256/cheaper_p5_low": 0.99,
                                  **evidence}  # what each bin measured under the schedule in force, what moved
    follower = RunTimeSchedule(config, tmp_path / "other.json", 512, writer=False)
    follower.update(current, cheaper, positions)
    assert follower.state == runtime.state and not (tmp_path / "other.json").exists()  # only the writer writes


def test_the_schedule_in_force_is_read_from_the_plugins_report(tmp_path):
    path = tmp_path / "schedule.json"
    runtime = RunTimeSchedule(SparrowConfig(schedule="const:64"), path, 512, writer=True)
    runtime.start()
    with pytest.raises(SparrowError, match=r"reported no schedule .*SPARROW_VLLM_SCHEDULE=@"):
        runtime.in_force()
    before = plugin_state.active()
    try:
        plugin_state.activate(plugin_env.from_environment({"SPARROW_VLLM_SCHEDULE": f"@{path}"}))
        plugin_state.active()  # the engine's first step: the report is written
        schedule, version, warnings = runtime.in_force()
        assert (schedule.budgets, version, warnings) == ((64,), 1, [])
        runtime.version += 1  # as if a version 2 had been written and refused by the plugin
        path.write_text('{"bins": [{"start": 0, "kv_budget": 8}]}')
        plugin_state.active()
        schedule, version, warnings = runtime.in_force()
        assert (schedule.budgets, version) == ((64,), 1)
        assert len(warnings) == 1 and "not version 2" in warnings[0] and "refused" in warnings[0]
    finally:
        plugin_state.activate(before)


def test_a_bad_sparrow_config_names_the_value():
    for kwargs, message in (({"schedule": "const:20"}, "SparrowConfig.schedule: .*budget 20"),
                            ({"adaptive_start": "nope"}, "SparrowConfig.adaptive_start"),
                            ({"tau": 1.5}, "tau must be a finite number >= 0 and <= 1, got 1.5"),
                            ({"monitor_share": 0.0}, "monitor_share must be .* > 0"),
                            ({"landmark": "median"}, "median")):
        with pytest.raises(SparrowError, match=message):
            SparrowConfig(**kwargs)


def test_each_prompt_runs_once_for_the_dense_and_every_sparse_forward(rollouts):
    model, completions = rollouts
    batch = rollout_batch(*trl_tensors(completions))
    prompt_lengths = {len(c.prompt_token_ids) for c in completions}
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        got = measure(model, batch, len(completions), {"current": SCHEDULE, "probe": const(64)}, SparseConfig(),
                      TEMPERATURE)
    finally:
        hook.remove()
    assert sorted(n for n in seen if n in prompt_lengths) == sorted(prompt_lengths)  # one prompt forward per group
    reference = teacher_forced_acceptance(model, completions, const(64), SparseConfig(), TEMPERATURE)
    np.testing.assert_allclose(got["probe"].numpy(), np.concatenate([np.asarray(r) for r in reference]), atol=1e-6)
