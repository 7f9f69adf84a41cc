"""The online reward check: dense samples paired with the sparse rollouts by seed, logged as a retention with its
interval on check steps only, warned about only when the interval lies below the level, never part of the
update."""

import json

import pytest
import torch

from sparrow.datasets import Example
from sparrow.errors import SparrowError
from sparrow.models import load_model
from sparrow.rl.config import TrainConfig
from sparrow.rl.step import Policy, StepConfig
from sparrow.rl.step_metrics import reward_check_metrics
from sparrow.rl.trainer import train
from sparrow.rollout import NativeBackend
from sparrow.schedules import DENSE, const
from sparrow.typed_config import build
from tests.steps import grpo_step

EXAMPLES = [Example(0, "the cat sat on the mat " * 12, "1", {}), Example(1, "a b c d e f g " * 20, "2", {})]
KEYS = ("mismatch/reward_retention", "mismatch/reward_retention_low", "mismatch/reward_retention_high",
        "time/reward_check_s")


def byte_mean(prompts, completions, **_):
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]


BYTES = [("bytes", byte_mean, 1.0)]


class Recording(NativeBackend):
    """The native backend, remembering each call's prompts, seed, schedule, samples and adapter switch."""

    calls: list

    def generate(self, prompts, sampling, schedule, num_samples=1, **kwargs):
        self.calls.append((len(prompts), sampling.seed, schedule, num_samples, kwargs.get("adapter", True)))
        return super().generate(prompts, sampling, schedule, num_samples, **kwargs)


def _cfg(**options) -> StepConfig:
    return build(StepConfig, {"num_generations": 4, "max_new_tokens": 12, "micro_batch_size": 4, **options})


def _setup():
    model, tok = load_model("tiny-qwen3")
    backend = Recording(model, tok)
    backend.calls = []
    return Policy(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tok.pad_token_id or 0), backend


def test_the_check_samples_the_first_prompts_densely_with_the_rollout_seed_and_never_enters_the_update():
    metrics, weights, calls = [], [], []
    for every in (0, 1):
        policy, backend = _setup()
        metrics.append(grpo_step(policy, backend, EXAMPLES, BYTES, const(48), _cfg(reward_check_every=every),
                                 seed=7, number=1))
        weights.append([p.detach().clone() for p in policy.model.parameters()])
        calls.append(backend.calls)
    assert calls[0] == [(2, 7, const(48), 4, True)]
    assert calls[1] == [(1, 7, DENSE, 4, False), (2, 7, const(48), 4, True)]  # reward_check_samples 4: all of 4
    off, on = metrics
    assert not any(key in off for key in KEYS) and all(key in on for key in KEYS)
    for key in ("loss", "grad_norm", "reward/mean", "sampling/importance_sampling_ratio/mean"):
        assert off[key] == on[key], key
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_a_budget_covering_the_sequence_keeps_exactly_the_dense_reward():
    policy, backend = _setup()
    metrics = grpo_step(policy, backend, EXAMPLES, BYTES, const(1024),
                        _cfg(reward_check_every=1, reward_check_prompts=2), seed=0, number=1)
    assert metrics["mismatch/reward_retention"] == 1.0
    assert metrics["mismatch/reward_retention_low"] == metrics["mismatch/reward_retention_high"] == 1.0
    assert metrics["mismatch/reward_check_dense_mean"] == pytest.approx(metrics["reward/mean"])  # reward/mean: float32
    assert not any("retention" in w for w in metrics["mismatch/warnings"])


def test_the_check_pairs_its_first_samples_with_the_rollouts_first_samples_of_each_prompt():
    """Two of each group's four samples, of both prompts: dense sample s is the rollout's sample s (the budget
    covers the sequence, so they are the same tokens), whatever the samples after it."""
    policy, backend = _setup()
    metrics = grpo_step(policy, backend, EXAMPLES, BYTES, const(1024),
                        _cfg(reward_check_every=1, reward_check_prompts=2, reward_check_samples=2), seed=3, number=1)
    assert backend.calls[0] == (2, 3, DENSE, 2, False)
    assert metrics["mismatch/reward_retention"] == 1.0 and metrics["mismatch/reward_retention_high"] == 1.0
    assert not any("retention" in w for w in metrics["mismatch/warnings"])


def test_the_warning_comes_only_when_the_whole_interval_lies_below_the_level():
    same = [0.2, 0.6, 0.4, 0.8] * 2
    assert reward_check_metrics(same, same, 4, 4, 0.9)[1] == []
    _, above_one = reward_check_metrics(same, same, 4, 4, 1.5)
    assert above_one == [("reward retention 1.000 (95% interval 1.000..1.000, 8 paired samples of 2 prompt(s)) is "
                          "below min_retention 1.5")]
    noisy = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]  # 5/8 of the dense reward on 8 pairs of one prompt: undecided
    metrics, warnings = reward_check_metrics(noisy, [1.0] * 8, 8, 8, 0.9)
    assert metrics["mismatch/reward_retention_low"] < 0.9 < metrics["mismatch/reward_retention_high"]
    assert warnings == []
    lost = [0.1, 0.0, 0.2, 0.1, 0.0, 0.1, 0.2, 0.1]
    metrics, warnings = reward_check_metrics(lost, [1.0] * 8, 8, 8, 0.9)
    assert metrics["mismatch/reward_retention_high"] < 0.9 and len(warnings) == 1
    assert warnings[0].startswith("reward retention 0.100 (95% interval 0.")
    first_two = reward_check_metrics([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0], [1.0] * 4, 4, 2, 0.9)[0]
    assert first_two["mismatch/reward_retention"] == 0.75  # samples 0-1 of each group of 4: (1 + 1 + .5 + .5) / 4
    nothing = reward_check_metrics([0.0] * 4, [0.0] * 4, 4, 4, 0.9)  # dense mean 0: undefined, no warning
    assert nothing[0]["mismatch/reward_retention"] != nothing[0]["mismatch/reward_retention"] and nothing[1] == []


def test_dense_rollouts_and_unnumbered_steps_are_not_checked():
    policy, backend = _setup()
    dense = grpo_step(policy, backend, EXAMPLES, BYTES, DENSE, _cfg(reward_check_every=1), seed=0, number=1)
    unnumbered = grpo_step(policy, backend, EXAMPLES, BYTES, const(48), _cfg(reward_check_every=1), seed=0)
    assert not any(key in m for m in (dense, unnumbered) for key in KEYS)
    assert backend.calls == [(2, 0, DENSE, 4, True), (2, 0, const(48), 4, True)]  # the rollouts alone


def test_training_logs_the_check_on_its_steps_warns_naming_the_step_and_plots_it(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "abc " * (10 + i), "answer": str(i)}) + "\n" for i in range(5)))
    out = tmp_path / "run"
    config = build(TrainConfig, {"model": "tiny-qwen3", "data": str(data),
                                 "reward": ["tests.rl.test_reward_check:byte_mean"], "steps": 3, "prompts_per_step": 2,
                                 "num_generations": 3, "max_new_tokens": 8,
                                 "schedule": "const:1024", "output_dir": str(out), "min_retention": 1.5,
                                 "reward_check_every": 2})
    logged = []
    history = train(config, log=logged.append)
    assert [all(key in h for key in KEYS) for h in history] == [False, True, False]
    assert not any(key in h for key in KEYS for h in history[::2])
    assert history[1]["mismatch/reward_retention"] == 1.0
    assert [line for line in logged if "reward retention" in line] == [
        ("warning: step 2: reward retention 1.000 (95% interval 1.000..1.000, 3 paired samples of 1 prompt(s)) is "
         "below min_retention 1.5")]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "mismatch/reward_retention_high" in rows[1] and "time/reward_check_s" in rows[1]
    assert (out / "retention.png").stat().st_size > 1000 and "retention.png" in (out / "report.md").read_text()


@pytest.mark.parametrize("option, value", [("reward_check_every", -1), ("reward_check_prompts", 0),
                                           ("reward_check_samples", 0), ("min_retention", 0.0)])
def test_bad_check_options_are_refused(option, value):
    with pytest.raises(SparrowError, match=option):
        build(StepConfig, {option: value}).monitor.validate()
