"""One GRPO step on a tiny model: its phases, weights that move when rewards vary and stay put when every group
is flat, the fake backend, exact monitoring, non-finite updates."""

import math

import pytest
import torch

from sparrow.datasets import Example
from sparrow.engine import SamplingParams
from sparrow.errors import SparrowError
from sparrow.measure import teacher_forced_acceptance
from sparrow.models import load_model
from sparrow.rl.step import Policy, StepConfig
from sparrow.rl.step_metrics import bound_metrics, exact_metrics
from sparrow.rollout import NativeBackend
from sparrow.schedules import const
from sparrow.typed_config import build
from tests.fake_backend import ReplayBackend
from tests.steps import grpo_step


def byte_mean(prompts, completions, **_):
    """Differs between almost any two completions of a random byte-level model."""
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]


def flat(prompts, completions, **_):
    return [1.0] * len(completions)


EXAMPLES = [Example(0, "the cat sat on the mat " * 12, "1", {}), Example(1, "a b c d e f g " * 20, "2", {})]
BYTES = [("bytes", byte_mean, 1.0)]


def _cfg(**options) -> StepConfig:
    return build(StepConfig, {"num_generations": 4, "max_new_tokens": 12, "micro_batch_size": 3, "mini_batches": 2,
                              **options})


def _setup(lr=1e-3):
    model, tok = load_model("tiny-qwen3")
    policy = Policy(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), tok.pad_token_id or 0)
    return policy, NativeBackend(model, tok)


def test_a_step_with_varied_rewards_changes_the_weights_and_reports_metrics():
    policy, backend = _setup()
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = grpo_step(policy, backend, EXAMPLES, BYTES, const(64), _cfg(), seed=0)
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.model.parameters()))
    assert metrics["reward/frac_zero_std_groups"] < 1.0 and metrics["grad_norm"] > 0
    assert metrics["completions/max_length"] <= 12
    assert 0 < metrics["sampling/importance_sampling_ratio/min"] <= metrics["sampling/importance_sampling_ratio/max"]
    assert metrics["rollout/kv_budget_mean"] > 0
    assert 0 <= metrics["mismatch/acceptance_lower/p5"] <= metrics["mismatch/acceptance_lower/mean"] <= 1
    assert any(k.startswith("mismatch/bin_") for k in metrics)
    assert all(metrics[f"time/{phase}_s"] > 0 for phase in ("rollout", "reward", "recompute", "update", "monitor"))
    assert metrics["rollout/tokens_per_s"] > 0 and metrics["update/skipped_mini_batches"] == 0


def test_the_step_runs_on_any_backend_and_syncs_it_after_the_update():
    policy, native = _setup()
    completions = native.generate([ex.prompt for ex in EXAMPLES], SamplingParams(max_new_tokens=12, seed=0),
                                  const(64), 4)
    fake = ReplayBackend(completions)
    metrics = grpo_step(policy, fake, EXAMPLES, BYTES, const(64), _cfg(), seed=0)
    assert fake.calls == [(2, 4, const(64))] and fake.synced == [policy.model]
    assert metrics["completions/mean_length"] == sum(len(c.token_ids) for c in completions) / 8
    # each group's prompt length and mean reward, for rewards by prompt length
    assert metrics["prompts/length"] == [len(completions[0].prompt_token_ids), len(completions[4].prompt_token_ids)]
    per_prompt = metrics["reward/per_prompt"]
    assert len(per_prompt) == 2 and per_prompt[0] != per_prompt[1]
    assert sum(per_prompt) / 2 == pytest.approx(metrics["reward/mean"])


@pytest.mark.parametrize("mini_batches", [2, 1])  # 1: the monitor's dense logits are the update's own forward
def test_exact_monitoring_equals_teacher_forcing_the_rollouts_and_is_bracketed_by_the_bounds(mini_batches):
    policy, native = _setup()
    completions = native.generate([ex.prompt for ex in EXAMPLES], SamplingParams(max_new_tokens=12, seed=0),
                                  const(48), 4)
    alphas = teacher_forced_acceptance(policy.model, completions, const(48), native.engine.sparse, 1.0)
    expected = torch.tensor([a for row in alphas for a in row], dtype=torch.float64)
    metrics = grpo_step(policy, ReplayBackend(completions), EXAMPLES, BYTES, const(48),
                        _cfg(bin_size=4096, mini_batches=mini_batches), seed=0)
    assert metrics["mismatch/exact/tokens"] == expected.numel()
    assert metrics["mismatch/exact/mean"] == pytest.approx(float(expected.mean()), abs=1e-6)
    assert metrics["mismatch/exact/p5"] == pytest.approx(float(torch.quantile(expected, 0.05)), abs=1e-6)
    assert metrics["mismatch/exact/p1"] == pytest.approx(float(torch.quantile(expected, 0.01)), abs=1e-6)
    assert metrics["mismatch/acceptance_lower/mean"] <= metrics["mismatch/exact/mean"]
    assert metrics["mismatch/exact/mean"] <= metrics["mismatch/acceptance_upper/mean"] + 1e-6
    low, high = metrics["mismatch/bin_0/exact_p5_low"], metrics["mismatch/bin_0/exact_p5_high"]
    assert low <= metrics["mismatch/exact/p5"] <= high
    half = grpo_step(policy, ReplayBackend(completions), EXAMPLES, BYTES, const(48),
                     _cfg(bin_size=4096, monitor_share=0.5, mini_batches=mini_batches), seed=0)
    assert half["mismatch/exact/tokens"] == sum(len(c.token_ids) for c in completions[:4])
    # a share of one group is a share of its rows (the first 2 of group 0, inside pieces of 3 or of the group)
    fresh, _ = _setup()  # the weights `alphas` were measured on (the steps above moved these)
    quarter = grpo_step(fresh, ReplayBackend(completions), EXAMPLES, BYTES, const(48),
                        _cfg(bin_size=4096, monitor_share=0.25, mini_batches=mini_batches), seed=0)
    first_two = torch.tensor([a for row in alphas[:2] for a in row], dtype=torch.float64)
    assert quarter["mismatch/exact/tokens"] == first_two.numel()
    assert quarter["mismatch/exact/mean"] == pytest.approx(float(first_two.mean()), abs=1e-6)
    bounds_only = grpo_step(policy, ReplayBackend(completions), EXAMPLES, BYTES, const(48),
                            _cfg(monitor="bounds"), seed=0)
    assert "mismatch/exact/p5" not in bounds_only and "time/monitor_s" not in bounds_only


def test_exact_warnings_say_below_only_when_the_interval_is_below_and_count_tokens_when_undecided():
    monitor = _cfg(tau=0.8, bin_size=1000).monitor
    below = torch.linspace(0.0, 0.75, 400)  # every token below tau
    metrics, warnings = exact_metrics(below, torch.zeros(400, dtype=torch.long), monitor)
    assert len(warnings) == 1 and "is below tau 0.8" in warnings[0]
    assert metrics["mismatch/bin_0/exact_p5_high"] < 0.8 and metrics["mismatch/exact/tokens"] == 400
    assert metrics["mismatch/bin_0/exact_p1"] == pytest.approx(float(torch.quantile(below.double(), 0.01)))
    above = torch.linspace(0.85, 1.0, 400)
    assert exact_metrics(above, torch.zeros(400, dtype=torch.long), monitor)[1] == []
    mixed = torch.cat([torch.full((6,), 0.5), torch.full((94,), 0.95)])  # 6% below tau, 100 tokens: undecided
    _, undecided = exact_metrics(mixed, torch.zeros(100, dtype=torch.long), monitor)
    assert len(undecided) == 1 and "undecided" in undecided[0] and "more tokens would decide it" in undecided[0]
    more = int(undecided[0].split("about ")[1].split(" ")[0])
    # at 6% below tau the binomial test against 5% needs about 1.96^2 * 0.0475 / 0.01^2 = 1825 tokens
    assert more == math.ceil(1.959964 ** 2 * 0.05 * 0.95 / 0.01 ** 2 - 100)
    # 50 of 1001 below tau: a share of 4.995% would need ~7e7 more tokens: it sits at tau, no count printed
    at_tau = torch.cat([torch.full((50,), 0.5), torch.full((951,), 0.95)])
    _, undecided = exact_metrics(at_tau, torch.zeros(1001, dtype=torch.long), monitor)
    assert len(undecided) == 1 and "it sits at tau (over 1000 times the tokens measured" in undecided[0]


def test_bound_warnings_say_whether_a_bin_is_below_tau_or_only_may_be():
    # bin [0, 10): both bounds 0.9; bin [10, 20): lower 0.7, upper 0.9; bin [20, 30): both 0.5.
    bounds = torch.tensor([[0.9, 0.9]] * 10 + [[0.7, 0.9]] * 10 + [[0.5, 0.5]] * 10)
    monitor = _cfg(tau=0.8, bin_size=10).monitor
    metrics, warnings = bound_metrics(bounds, torch.arange(30), monitor)
    assert metrics["mismatch/bin_10/acceptance_lower_p5"] == pytest.approx(0.7)
    assert metrics["mismatch/bin_10/acceptance_upper_p5"] == pytest.approx(0.9)
    assert len(warnings) == 2
    assert warnings[0].startswith("length bin [10, 20): 5th percentile of acceptance may be below tau 0.8")
    assert warnings[1].startswith("length bin [20, 30): 5th percentile of acceptance is below tau 0.8")
    _, dense = bound_metrics(bounds, torch.arange(30), monitor, sparse=False)
    assert dense == warnings[1:]  # dense rollouts: only certain shortfalls


def test_flat_rewards_give_zero_advantages_and_leave_the_weights_unchanged():
    policy, backend = _setup()
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = grpo_step(policy, backend, EXAMPLES, [("flat", flat, 1.0)], const(64), _cfg(), seed=0)
    assert metrics["reward/frac_zero_std_groups"] == 1.0 and metrics["loss"] == 0.0
    assert all(torch.equal(b, p) for b, p in zip(before, policy.model.parameters()))


def test_a_non_finite_gradient_skips_the_update_or_stops_the_run():
    policy, backend = _setup()
    next(policy.model.parameters()).register_hook(lambda grad: grad * float("inf"))
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = grpo_step(policy, backend, EXAMPLES, BYTES, const(64), _cfg(mini_batches=1), seed=0, number=3)
    assert metrics["update/skipped_mini_batches"] == 1
    assert any("not finite" in w for w in metrics["mismatch/warnings"])
    assert all(torch.equal(b, p) for b, p in zip(before, policy.model.parameters()))
    with pytest.raises(SparrowError, match="step 3: .* not finite"):
        grpo_step(policy, backend, EXAMPLES, BYTES, const(64), _cfg(mini_batches=1, non_finite="stop"), seed=0,
                  number=3)


def test_gradient_accumulation_over_micro_batches_equals_one_big_batch():
    results, metrics = [], []
    for micro in (2, 8):
        policy, backend = _setup()
        metrics.append(grpo_step(policy, backend, EXAMPLES, BYTES, const(64),
                                 _cfg(micro_batch_size=micro, mini_batches=1), seed=0))
        results.append([p.detach().clone() for p in policy.model.parameters()])
    assert abs(metrics[0]["loss"] - metrics[1]["loss"]) < 1e-7
    assert abs(metrics[0]["grad_norm"] - metrics[1]["grad_norm"]) < 1e-5
    # Adam normalizes each coordinate, so float noise in near-zero gradients shows up at up to ~lr * 3e-2 (the
    # summation order differs with the micro-batch and the thread count)
    assert all(torch.allclose(a, b, atol=3e-5) for a, b in zip(*results))


def test_log_prob_pieces_of_a_whole_group_give_the_same_step(monkeypatch):
    """Recompute and monitor forwards without gradients may take a whole group (its prompt computed once) while the
    update keeps its micro-batches: same log-probs, acceptance, loss and weights as pieces of 2 rows."""
    import sparrow.rl.dense as dense_module

    sizes, metrics, weights = [], [], []
    real = dense_module.shared_prompt_pieces
    monkeypatch.setattr(dense_module, "shared_prompt_pieces",
                        lambda batch, rows, size: sizes.append(size) or real(batch, rows, size))
    for log_prob in (None, 8):
        policy, backend = _setup()
        sizes.clear()
        metrics.append(grpo_step(policy, backend, EXAMPLES, BYTES, const(64),
                                 _cfg(micro_batch_size=2, mini_batches=2, log_prob_micro_batch_size=log_prob,
                                      monitor="exact"), seed=0))  # 2 mini-batches: the recompute runs
        weights.append([p.detach().clone() for p in policy.model.parameters()])
        assert sizes == [log_prob or 2, 2, 2]  # recompute (and monitor) pieces, then each mini-batch's
    assert abs(metrics[0]["loss"] - metrics[1]["loss"]) < 1e-6
    for key in ("mismatch/exact/p5", "mismatch/exact/mean", "sampling/importance_sampling_ratio/mean"):
        assert abs(metrics[0][key] - metrics[1][key]) < 1e-5, key
    assert all(torch.allclose(a, b, atol=3e-5) for a, b in zip(*weights))


@pytest.mark.parametrize("monitor, checkpointing", [("bounds", False), ("exact", False), ("exact", True)])
def test_with_one_mini_batch_the_updates_forward_is_pi_old_and_the_step_equals_the_recompute(monkeypatch, monitor,
                                                                                           checkpointing):
    """One optimizer step per GRPO step: pi_old, the TIS weights, the acceptance bounds and the monitor's dense
    logits come from the update's own forward, and the recompute runs none: the same loss, IS ratios, bounds, exact
    acceptance and new weights as with the recompute, one dense forward fewer per row."""
    import sparrow.rl.dense as dense_module
    import sparrow.rl.step as step_module

    prompts, metrics, weights = [], [], []
    real = dense_module.piece_prompt
    monkeypatch.setattr(dense_module, "piece_prompt", lambda model, batch, piece: prompts.append(len(piece)) or
                        real(model, batch, piece))
    for fused in (True, False):
        monkeypatch.setattr(step_module, "old_policy_from_update", lambda policy, cfg, fused=fused: fused)
        policy, backend = _setup()
        prompts.clear()
        cfg = _cfg(mini_batches=1, monitor=monitor, monitor_share=0.5, log_prob_micro_batch_size=4,
                   gradient_checkpointing=checkpointing)
        metrics.append(grpo_step(policy, backend, EXAMPLES, BYTES, const(48), cfg, seed=0))
        weights.append([p.detach().clone() for p in policy.model.parameters()])
        # prompt forwards: the update's, one per group, which the monitor reuses; the recompute's, one per group
        recomputed = 0 if fused else 2
        assert prompts == [4] * recomputed + [3, 3], (fused, prompts)
    assert abs(metrics[0]["loss"] - metrics[1]["loss"]) < 1e-6
    keys = ["mismatch/acceptance_lower/p5", "mismatch/acceptance_lower/mean", "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max"]
    keys += ["mismatch/exact/p5", "mismatch/exact/mean"] if monitor == "exact" else []
    for key in keys:
        assert abs(metrics[0][key] - metrics[1][key]) < 1e-5, key
    assert all(torch.allclose(a, b, atol=3e-5) for a, b in zip(*weights))


def test_several_mini_batches_or_an_adapter_keep_the_recompute():
    from sparrow.rl.step import old_policy_from_update

    policy, _ = _setup()
    assert old_policy_from_update(policy, _cfg(mini_batches=1))
    assert not old_policy_from_update(policy, _cfg(mini_batches=2))  # later mini-batches run updated weights
    policy.distiller = object()
    assert not old_policy_from_update(policy, _cfg(mini_batches=1))


def test_kl_to_a_reference_adds_to_the_loss_and_is_zero_against_itself():
    policy, backend = _setup()
    cfg = _cfg(micro_batch_size=8, mini_batches=1, kl_coef=0.5)
    with pytest.raises(SparrowError, match="reference"):
        grpo_step(policy, backend, EXAMPLES, BYTES, const(64), cfg, seed=2)
    policy, backend = _setup()
    policy.reference = load_model("tiny-qwen3")[0]
    metrics = grpo_step(policy, backend, EXAMPLES, BYTES, const(64), cfg, seed=0)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy before its first update is the reference
    assert grpo_step(policy, backend, EXAMPLES, BYTES, const(64), cfg, seed=1)["kl"] > 0


def test_a_step_survives_programs_that_hang_flood_write_outside_or_crash(tmp_path):
    from sparrow.rewards import run_code

    evil = ["while True:\n    pass\n", "print('x' * 10_000_000)\n", "open('../escape.txt', 'w').write('x')\n",
            "raise SystemExit(3)\n"]

    def contained(prompts, completions, **_):
        return [run_code(evil[i % 4], [{"input": "", "output": "ok"}], timeout=1.0, memory_mb=256,
                         base_dir=str(tmp_path)) for i in range(len(completions))]

    policy, backend = _setup()
    metrics = grpo_step(policy, backend, EXAMPLES, [("evil", contained, 1.0)], const(64),
                        _cfg(num_generations=2, max_new_tokens=4, micro_batch_size=4, mini_batches=1), seed=0)
    assert metrics["rewards/records"]["evil"] == {"timeout": 1, "output_limit": 1, "ok": 1, "crash": 1}
    assert {f["status"] for f in metrics["rewards/failures"]} == {"timeout", "output_limit", "crash"}
    assert metrics["reward/mean"] == 0.0 and list(tmp_path.iterdir()) == []
