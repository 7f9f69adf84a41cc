"""One GRPO step on a tiny model: weights move when rewards vary, and stay put when every group is flat."""

import pytest
import torch

from sparrow.datasets import Example
from sparrow.engine import RolloutEngine
from sparrow.models import load_model
from sparrow.rl.step import StepSettings, grpo_step, mismatch_metrics
from sparrow.schedules import const


def byte_mean(prompts, completions, **_):
    """Differs between almost any two completions of a random byte-level model."""
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]


def flat(prompts, completions, **_):
    return [1.0] * len(completions)


EXAMPLES = [Example(0, "the cat sat on the mat " * 12, "1", {}), Example(1, "a b c d e f g " * 20, "2", {})]
SETTINGS = StepSettings(num_generations=4, max_new_tokens=12, micro_batch_size=3, mini_batches=2)


def _setup():
    model, tok = load_model("tiny-qwen3")
    return model, RolloutEngine(model, tok), torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


def test_a_step_with_varied_rewards_changes_the_weights_and_reports_metrics():
    model, engine, optimizer = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    metrics = grpo_step(model, engine, optimizer, EXAMPLES, [("bytes", byte_mean, 1.0)], const(64), SETTINGS, seed=0)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert metrics["reward/frac_zero_std_groups"] < 1.0 and metrics["grad_norm"] > 0
    assert metrics["completions/max_length"] <= 12
    assert 0 < metrics["sampling/importance_sampling_ratio/min"] <= metrics["sampling/importance_sampling_ratio/max"]
    assert metrics["rollout/kv_budget_mean"] > 0
    assert 0 <= metrics["mismatch/acceptance_lower/p5"] <= metrics["mismatch/acceptance_lower/mean"] <= 1
    assert any(k.startswith("mismatch/bin_") for k in metrics)
    assert all(metrics[f"time/{phase}_s"] > 0 for phase in ("rollout", "reward", "recompute", "update"))
    assert metrics["rollout/tokens_per_s"] > 0


def test_bins_whose_tail_falls_below_tau_are_warned_about():
    model, engine, optimizer = _setup()
    strict = StepSettings(num_generations=4, max_new_tokens=12, micro_batch_size=3, tau=0.999, bin_size=64)
    metrics = grpo_step(model, engine, optimizer, EXAMPLES, [("bytes", byte_mean, 1.0)], const(48), strict, seed=0)
    assert metrics["mismatch/warnings"] and "below tau 0.999" in metrics["mismatch/warnings"][0]
    assert metrics["mismatch/acceptance_lower/p5"] <= metrics["mismatch/acceptance_upper/p5"] <= 1.0
    lenient = StepSettings(num_generations=4, max_new_tokens=12, micro_batch_size=3, tau=0.01, bin_size=64)
    assert grpo_step(model, engine, optimizer, EXAMPLES, [("bytes", byte_mean, 1.0)], const(48), lenient,
                     seed=0)["mismatch/warnings"] == []


def test_warnings_say_whether_a_bin_is_below_tau_or_only_may_be():
    # bin [0, 10): both bounds 0.9; bin [10, 20): lower 0.7, upper 0.9; bin [20, 30): both 0.5.
    bounds = torch.tensor([[0.9, 0.9]] * 10 + [[0.7, 0.9]] * 10 + [[0.5, 0.5]] * 10)
    metrics, warnings = mismatch_metrics(bounds, torch.arange(30), StepSettings(tau=0.8, bin_size=10))
    assert metrics["mismatch/bin_10/acceptance_lower_p5"] == pytest.approx(0.7)
    assert metrics["mismatch/bin_10/acceptance_upper_p5"] == pytest.approx(0.9)
    assert len(warnings) == 2
    assert warnings[0].startswith("length bin [10, 20): 5th percentile of acceptance may be below tau 0.8")
    assert warnings[1].startswith("length bin [20, 30): 5th percentile of acceptance is below tau 0.8")
    _, dense = mismatch_metrics(bounds, torch.arange(30), StepSettings(tau=0.8, bin_size=10), sparse=False)
    assert dense == warnings[1:]  # dense rollouts: only certain shortfalls


def test_flat_rewards_give_zero_advantages_and_leave_the_weights_unchanged():
    model, engine, optimizer = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    metrics = grpo_step(model, engine, optimizer, EXAMPLES, [("flat", flat, 1.0)], const(64), SETTINGS, seed=0)
    assert metrics["reward/frac_zero_std_groups"] == 1.0 and metrics["loss"] == 0.0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_bad_settings_are_refused():
    with pytest.raises(Exception, match="loss_aggregation"):
        StepSettings(loss_aggregation="sum")


def test_gradient_accumulation_over_micro_batches_equals_one_big_batch():
    results, metrics = [], []
    for micro in (2, 8):
        model, engine, optimizer = _setup()
        settings = StepSettings(num_generations=4, max_new_tokens=12, micro_batch_size=micro, mini_batches=1)
        metrics.append(grpo_step(model, engine, optimizer, EXAMPLES, [("bytes", byte_mean, 1.0)], const(64),
                                 settings, seed=0))
        results.append([p.detach().clone() for p in model.parameters()])
    assert abs(metrics[0]["loss"] - metrics[1]["loss"]) < 1e-7
    assert abs(metrics[0]["grad_norm"] - metrics[1]["grad_norm"]) < 1e-5
    # Adam normalizes each coordinate, so float noise in near-zero gradients shows up at up to ~lr * 3e-2 (the
    # summation order differs with the micro-batch and the thread count)
    assert all(torch.allclose(a, b, atol=3e-5) for a, b in zip(*results))


def test_kl_to_a_reference_adds_to_the_loss_and_is_zero_against_itself():
    model, engine, optimizer = _setup()
    reference = load_model("tiny-qwen3")[0]
    settings = StepSettings(num_generations=4, max_new_tokens=12, micro_batch_size=8, kl_coef=0.5)
    metrics = grpo_step(model, engine, optimizer, EXAMPLES, [("bytes", byte_mean, 1.0)], const(64), settings,
                        seed=0, reference=reference)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy before its first update is the reference
    second = grpo_step(model, engine, optimizer, EXAMPLES, [("bytes", byte_mean, 1.0)], const(64), settings,
                       seed=1, reference=reference)
    assert second["kl"] > 0
    with pytest.raises(Exception, match="reference"):
        grpo_step(model, engine, optimizer, EXAMPLES, [("bytes", byte_mean, 1.0)], const(64), settings, seed=2)


def test_a_step_survives_programs_that_hang_flood_write_outside_or_crash(tmp_path):
    from sparrow.rewards import run_code

    evil = ["while True:\n    pass\n", "print('x' * 10_000_000)\n", "open('../escape.txt', 'w').write('x')\n",
            "raise SystemExit(3)\n"]

    def contained(prompts, completions, **_):
        return [run_code(evil[i % 4], [{"input": "", "output": "ok"}], timeout=1.0, memory_mb=256,
                         base_dir=str(tmp_path)) for i in range(len(completions))]

    model, engine, optimizer = _setup()
    settings = StepSettings(num_generations=2, max_new_tokens=4, micro_batch_size=4)
    metrics = grpo_step(model, engine, optimizer, EXAMPLES, [("evil", contained, 1.0)], const(64), settings, seed=0)
    assert metrics["rewards/records"]["evil"] == {"timeout": 1, "output_limit": 1, "ok": 1, "crash": 1}
    assert {f["status"] for f in metrics["rewards/failures"]} == {"timeout", "output_limit", "crash"}
    assert metrics["reward/mean"] == 0.0 and list(tmp_path.iterdir()) == []
