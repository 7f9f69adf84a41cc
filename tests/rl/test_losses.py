"""GRPO loss pieces against hand-computed values and verl's / TRL's formulas: advantages, TIS weights, PPO-clip with
dual clip, KL estimators, the registries a config chooses from."""

import math

import pytest
import torch

from sparrow.errors import SparrowError
from sparrow.rl.losses import (
    ADVANTAGE_ESTIMATORS,
    GROUP_STDS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    TIS_MODES,
    accumulation_share,
    check_mask,
    compute_advantages,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    tis_stats,
    tis_weights,
)

D = torch.float64


def _t(values, **kw):
    return torch.tensor(values, dtype=D, **kw)


def _close(actual, expected, tol=1e-9):
    assert torch.allclose(actual, _t(expected), atol=tol, rtol=0), (actual, expected)


def test_registries_list_the_names_a_config_may_use():
    assert tuple(ADVANTAGE_ESTIMATORS) == ("grpo", "dr_grpo", "rloo")
    assert tuple(GROUP_STDS) == ("sample", "population")
    assert tuple(POLICY_LOSSES) == ("ppo_clip", "gspo")
    assert tuple(TIS_MODES) == ("truncate", "mask", "off")
    assert tuple(LOSS_AGGREGATIONS) == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    assert tuple(KL_ESTIMATORS) == ("k1", "k2", "k3")


# --- advantages ---------------------------------------------------------------------------------------------------
# Reference formulas, written out as verl (core_algos.compute_grpo_outcome_advantage / compute_rloo_outcome_advantage)
# and TRL (GRPOTrainer._generate_and_score_completions) compute them, group by group.
REWARDS = [[1.0, 0.0], [0.3, 0.9], [1.0, 0.0, 0.0, 1.0], [0.2, 0.5, 0.5, 0.9], [0.0, 0.0, 0.0, 0.0, 1.0]]


def _verl_grpo(scores, eps=1e-6, norm_adv_by_std_in_grpo=True):
    scores = torch.tensor(scores, dtype=D)
    centered = scores - torch.mean(scores)
    return (centered / (torch.std(scores) + eps) if norm_adv_by_std_in_grpo else centered).tolist()


def _trl(rewards, num_generations, scale_rewards=True):
    rewards = torch.tensor(rewards, dtype=D).flatten()
    mean = rewards.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations)
    std = rewards.view(-1, num_generations).std(dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    return (advantages / (std + 1e-4) if scale_rewards else advantages).view(-1, num_generations).tolist()


def _verl_rloo(scores):
    scores, n = torch.tensor(scores, dtype=D), len(scores)
    return (scores * n / (n - 1) - torch.mean(scores) * n / (n - 1)).tolist()


@pytest.mark.parametrize("group", REWARDS)
def test_grpo_default_is_verls_sample_std(group):
    expected = _verl_grpo(group)
    _close(compute_advantages(_t([group])), [expected], tol=1e-12)
    _close(compute_advantages(_t([group]), "grpo", std="sample"), [expected], tol=1e-12)


def test_grpo_matches_trl_with_trls_eps_over_several_groups():
    for n in (2, 4):
        groups = [g for g in REWARDS if len(g) == n]
        _close(compute_advantages(_t(groups), eps=1e-4), _trl(groups, n), tol=1e-12)
        _close(compute_advantages(_t(groups), "dr_grpo"), _trl(groups, n, scale_rewards=False), tol=1e-12)


def test_sample_std_changes_small_groups_and_population_is_an_option():
    _close(compute_advantages(_t([[1, 0]]), eps=0.0), [[math.sqrt(0.5), -math.sqrt(0.5)]], tol=1e-12)  # std 0.707
    _close(compute_advantages(_t([[1, 0]]), std="population", eps=0.0), [[1, -1]], tol=1e-12)           # std 0.5
    s = math.sqrt(2 / 3)
    _close(compute_advantages(_t([[0, 1, 2]]), std="population", eps=0.0), [[-1 / s, 0, 1 / s]], tol=1e-12)
    _close(compute_advantages(_t([[0, 1, 2]]), eps=0.0), [[-1, 0, 1]], tol=1e-12)


@pytest.mark.parametrize("group", REWARDS)
def test_dr_grpo_and_rloo_match_verl(group):
    _close(compute_advantages(_t([group]), "dr_grpo"), [_verl_grpo(group, norm_adv_by_std_in_grpo=False)],
           tol=1e-12)
    rloo = compute_advantages(_t([group]), "rloo")
    _close(rloo, [_verl_rloo(group)], tol=1e-12)
    others = [(sum(group) - r) / (len(group) - 1) for r in group]
    _close(rloo, [[r - o for r, o in zip(group, others)]], tol=1e-12)
    assert torch.equal(compute_advantages(_t([group]), "rloo", std="population"), rloo)  # std is grpo's option


@pytest.mark.parametrize("estimator", list(ADVANTAGE_ESTIMATORS))
def test_constant_groups_and_groups_of_one_get_exactly_zero(estimator):
    adv = compute_advantages(_t([[1, 0, 1, 0], [0.1, 0.1, 0.1, 0.1]]), estimator)
    assert (adv[1] == 0).all() and (adv[0] != 0).all()
    assert torch.equal(compute_advantages(_t([[0.3], [1.0]]), estimator), torch.zeros(2, 1, dtype=D))


# --- truncated importance sampling --------------------------------------------------------------------------------

def _tis_inputs():
    logp_old = _t([math.log(0.5), 0.0, math.log(3.0)], requires_grad=True)
    return logp_old, torch.zeros(3, dtype=D)


@pytest.mark.parametrize("mode, expected", [("truncate", [0.5, 1, 2]), ("mask", [0.5, 1, 0]), ("off", [1, 1, 1])])
def test_tis_weights_per_mode_at_cap_2(mode, expected):
    logp_old, logp_rollout = _tis_inputs()
    w = tis_weights(logp_old, logp_rollout, mode=mode, cap=2.0)
    _close(w, expected, tol=1e-12)
    assert not w.requires_grad


def test_tis_stats_over_valid_tokens():
    logp_old = _t([math.log(0.5), 0.0, math.log(3.0), math.log(10.0)])
    stats = tis_stats(logp_old, torch.zeros(4, dtype=D), torch.tensor([1, 1, 1, 0]), cap=2.0)
    assert stats == pytest.approx({"ratio_min": 0.5, "ratio_mean": 1.5, "ratio_max": 3.0, "frac_above_cap": 1 / 3})
    assert all(type(v) is float for v in stats.values())


# --- PPO clip loss ------------------------------------------------------------------------------------------------
# Tokens (r, A): inside the range, clipped high with A>0, clipped low with A<0, dual-clipped (r=5, A<0),
# r=2 with A<0 (above 1+high but not clipped: the min keeps r*A; dual bound -3 not reached), r=0.5 with A>0.
RATIOS = [1.1, 1.5, 0.5, 5.0, 2.0, 0.5]
ADVS = [2.0, 1.0, -1.0, -1.0, -1.0, 1.0]
LOSSES = [-2.2, -1.28, 0.8, 3.0, 2.0, -0.5]       # -surrogate per token
GRADS = [-2.2, 0.0, 0.0, 0.0, 2.0, -0.5]          # d loss_t / d logp_t = -A * r on the unclipped branch, else 0


def _ppo_inputs():
    logp_old = _t([[-1.0] * 6])
    logp = (logp_old + torch.log(_t([RATIOS]))).detach().requires_grad_(True)
    return logp, logp_old, _t(ADVS), torch.ones(1, 6, dtype=torch.bool)


def test_ppo_clip_loss_values_gradients_and_metrics():
    logp, logp_old, adv, mask = _ppo_inputs()
    loss, m = ppo_clip_loss(logp, logp_old, adv.unsqueeze(0), mask)
    assert loss.item() == pytest.approx(sum(LOSSES) / 6)   # 1.82 / 6
    loss.backward()
    _close(logp.grad, [[g / 6 for g in GRADS]], tol=1e-12)
    assert {k: float(v) for k, v in m.items()} == pytest.approx({"clip_frac": 2 / 6, "clip_frac_low": 1 / 6, "clip_frac_high": 1 / 6,
                               "dual_clip_frac": 1 / 6, "ratio_mean": 10.6 / 6,
                               "approx_kl": sum(0.5 * math.log(r) ** 2 for r in RATIOS) / 6})
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in m.values())  # read by the caller, once


def test_ppo_clipped_token_alone_has_zero_gradient():
    logp = _t([[math.log(1.5)]], requires_grad=True)
    loss, m = ppo_clip_loss(logp, _t([[0.0]]), _t([1.0]), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(-1.28) and logp.grad.item() == 0.0 and m["clip_frac_high"] == 1.0


def test_dual_clip_caps_the_negative_advantage_loss_and_none_disables_it():
    logp, logp_old, _, mask = _ppo_inputs()
    loss, m = ppo_clip_loss(logp[:, 3:4], logp_old[:, 3:4], _t([-1.0]), mask[:, 3:4])
    assert loss.item() == pytest.approx(3.0) and m["dual_clip_frac"] == 1.0
    loss, m = ppo_clip_loss(logp[:, 3:4], logp_old[:, 3:4], _t([-1.0]), mask[:, 3:4], dual_clip=None)
    assert loss.item() == pytest.approx(5.0) and m["dual_clip_frac"] == 0.0


def test_weights_multiply_the_per_token_loss_and_are_detached():
    logp, logp_old, adv, mask = _ppo_inputs()
    w = _t([[0.5, 1, 1, 1, 1, 2]], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, logp_old, adv.unsqueeze(0), mask, weights=w)
    assert loss.item() == pytest.approx((0.5 * -2.2 - 1.28 + 0.8 + 3.0 + 2.0 + 2 * -0.5) / 6)
    loss.backward()
    assert w.grad is None
    _close(logp.grad, [[0.5 * -2.2 / 6, 0, 0, 0, 2.0 / 6, 2 * -0.5 / 6]], tol=1e-12)


@pytest.mark.parametrize("aggregation, expected", [
    ("token-mean", -7 / 3),                          # (-1 - 2 - 4) / 3 valid tokens
    ("seq-mean-token-mean", (-1.5 + -4.0) / 2),      # row means; the empty third row is left out
    ("seq-mean-token-sum", (-3.0 + -4.0) / 2),       # row sums
])
def test_aggregations_on_a_ragged_mask(aggregation, expected):
    nan = float("nan")
    logp = torch.zeros(3, 3, dtype=D, requires_grad=True)        # r = 1 everywhere, so loss_t = -A_t
    adv = _t([[1, 2, nan], [4, nan, 6], [nan, 8, 9]])             # padding may hold anything
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    loss, m = ppo_clip_loss(logp, torch.zeros(3, 3, dtype=D), adv, mask, aggregation=aggregation)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[mask == 0] == 0).all()
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == 1.0 and m["approx_kl"] == 0.0


def test_per_sequence_advantages_broadcast_over_tokens():
    logp = _t([[0.1, -0.2], [0.3, 0.0]])
    per_token, _ = ppo_clip_loss(logp, torch.zeros(2, 2, dtype=D), _t([[1, 1], [-2, -2]]), torch.ones(2, 2))
    per_seq, _ = ppo_clip_loss(logp, torch.zeros(2, 2, dtype=D), _t([1, -2]), torch.ones(2, 2))
    assert per_seq.item() == per_token.item()


def test_half_precision_inputs_are_computed_in_float32():
    loss, _ = ppo_clip_loss(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.bfloat16),
                            torch.ones(1), torch.ones(1, 2))
    assert loss.dtype == torch.float32 and loss.item() == -1.0


# --- KL estimators ------------------------------------------------------------------------------------------------

def test_kl_estimators_by_hand():
    logp, ref = _t([math.log(0.5)]), _t([0.0])
    _close(kl_penalty(logp, ref, "k1"), [-math.log(2)], tol=1e-12)
    _close(kl_penalty(logp, ref, "k2"), [0.5 * math.log(2) ** 2], tol=1e-12)
    _close(kl_penalty(logp, ref, "k3"), [1 - math.log(2)], tol=1e-12)    # 2 - log 2 - 1


def _verl_low_var_kl(logprob, ref_logprob):
    """verl core_algos.kl_penalty(..., "low_var_kl"), verbatim in formula."""
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def test_k3_is_clamped_as_verl_clamps_it():
    assert kl_penalty(_t([0.0]), _t([5.0])).item() == 10.0 == _verl_low_var_kl(_t([0.0]), _t([5.0])).item()
    assert kl_penalty(_t([5.0]), _t([0.0])).item() == pytest.approx(math.exp(-5) + 4)   # e^-5 - (-5) - 1
    x = torch.linspace(-30, 30, 601, dtype=D)
    logp = torch.zeros_like(x)
    _close(kl_penalty(logp, x), _verl_low_var_kl(logp, x).tolist(), tol=1e-12)
    _close(kl_penalty(_t([0.0, 0.0]), _t([-5.0, 1.0])), [math.exp(-5) + 4, math.e - 2], tol=1e-12)


def test_a_clamped_k3_token_has_no_gradient():
    logp = _t([0.0, 0.0], requires_grad=True)
    kl_penalty(logp, _t([5.0, 1.0])).sum().backward()
    _close(logp.grad, [0.0, 1 - math.e], tol=1e-12)                      # d/dlogp (e^x - x - 1) = 1 - e^x


def test_k3_is_non_negative_and_zero_at_equality():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_penalty(logp, ref) >= 0).all()
    near = logp + torch.randn(1000, generator=g) * 1e-7
    assert (kl_penalty(logp, near) >= 0).all()
    assert (kl_penalty(logp, logp) == 0).all()


def test_policy_loss_by_name_is_the_registered_loss():
    logp, logp_old, adv, mask = _ppo_inputs()
    by_name = policy_loss("ppo_clip", logp, logp_old, adv.unsqueeze(0), mask, dual_clip=None, clip_high=0.2)
    direct = ppo_clip_loss(logp, logp_old, adv.unsqueeze(0), mask, dual_clip=None, clip_high=0.2)
    assert by_name[0].item() == direct[0].item()
    assert {k: float(v) for k, v in by_name[1].items()} == {k: float(v) for k, v in direct[1].items()}


# --- validation ---------------------------------------------------------------------------------------------------

def _ppo(**kw):
    args = {"logp": torch.zeros(2, 3), "logp_old": torch.zeros(2, 3), "advantages": torch.ones(2),
            "mask": torch.ones(2, 3)}
    args.update(kw)
    return ppo_clip_loss(**args)


@pytest.mark.parametrize("call, match", [
    (lambda: compute_advantages(torch.ones(4)), r"shape \(4,\).*\[num_groups, group_size\]"),
    (lambda: compute_advantages(torch.ones(2, 4), "ppo"),
     r"unknown advantage estimator 'ppo': expected one of 'grpo', 'dr_grpo', 'rloo'"),
    (lambda: compute_advantages(torch.ones(2, 4), std="unbiased"),
     r"unknown group std 'unbiased': expected one of 'sample', 'population'"),
    (lambda: compute_advantages(torch.ones(2, 4), eps=-1.0), r"eps -1.0.*>= 0"),
    (lambda: compute_advantages(torch.tensor([[1.0, float("nan")]])), r"NaN.*finite"),
    (lambda: policy_loss("vanilla", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1)),
     r"unknown policy loss 'vanilla': expected one of 'ppo_clip'"),
    (lambda: tis_weights(torch.zeros(3), torch.zeros(4)), r"logp_old \(3,\), logp_rollout \(4,\)"),
    (lambda: tis_weights(torch.zeros(3), torch.zeros(3), mode="clip"), r"'clip'.*'truncate', 'mask', 'off'"),
    (lambda: tis_weights(torch.zeros(3), torch.zeros(3), cap=0.0), r"cap 0.0.*> 0"),
    (lambda: tis_stats(torch.zeros(3), torch.zeros(3), torch.zeros(3), cap=-1.0), r"cap -1.0.*> 0"),
    (lambda: tis_stats(torch.zeros(3), torch.zeros(3), torch.zeros(3)), r"no valid token"),
    (lambda: tis_stats(torch.zeros(3), torch.zeros(3), torch.tensor([1, 2, 0])), r"mask holds 2.*0/1"),
    (lambda: tis_stats(torch.zeros(3), torch.zeros(3), torch.ones(4)), r"mask \(4,\)"),
    (lambda: _ppo(logp_old=torch.zeros(2, 4)), r"logp \(2, 3\), logp_old \(2, 4\)"),
    (lambda: _ppo(mask=torch.ones(3, 3)), r"mask \(3, 3\)"),
    (lambda: check_mask(torch.full((2, 3), 0.5)), r"mask holds 0.5.*0/1"),
    (lambda: check_mask(torch.zeros(2, 3, dtype=torch.bool)), r"no valid token"),
    (lambda: _ppo(logp=torch.zeros(6), logp_old=torch.zeros(6), mask=torch.ones(6)), r"\(6,\).*\[batch, tokens\]"),
    (lambda: _ppo(advantages=torch.ones(3)), r"advantages have shape \(3,\).*\[2\].*\[2, 3\]"),
    (lambda: _ppo(weights=torch.ones(2, 2)), r"weights \(2, 2\)"),
    (lambda: _ppo(clip_low=-0.1), r"clip_low -0.1.*>= 0"),
    (lambda: _ppo(clip_high=-0.2), r"clip_high -0.2.*>= 0"),
    (lambda: _ppo(dual_clip=1.0), r"dual_clip 1.0.*> 1 or None"),
    (lambda: _ppo(aggregation="sum"), r"'sum'.*'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum'"),
    (lambda: kl_penalty(torch.zeros(3), torch.zeros(3), kind="k4"), r"'k4'.*'k1', 'k2', 'k3'"),
    (lambda: kl_penalty(torch.zeros(3), torch.zeros(2)), r"logp \(3,\), logp_ref \(2,\)"),
])
def test_bad_inputs_raise_a_clear_error(call, match):
    with pytest.raises(SparrowError, match=match):
        call()


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_accumulated_micro_batches_give_the_whole_batchs_loss(aggregation):
    gen = torch.Generator().manual_seed(0)
    logp, logp_old = -torch.rand(6, 9, generator=gen), -torch.rand(6, 9, generator=gen)
    advantages = torch.randn(6, generator=gen)
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    whole, _ = ppo_clip_loss(logp, logp_old, advantages, mask, aggregation=aggregation)
    tokens, total = mask.sum(), torch.tensor(0.0)
    for rows in (torch.tensor([0, 1]), torch.tensor([2, 3, 4]), torch.tensor([5])):
        part, _ = ppo_clip_loss(logp[rows], logp_old[rows], advantages[rows], mask[rows], aggregation=aggregation)
        total = total + part * accumulation_share(mask[rows], tokens, len(rows), 6, aggregation)
    assert float(total) == pytest.approx(float(whole), rel=1e-6)


def test_gspo_gives_every_token_the_sequences_geometric_mean_ratio():
    """Two tokens with log-ratios 0.1 and 0.3: GSPO's ratio is exp(0.2) for both (PPO's: exp(0.1), exp(0.3)), and
    each token's gradient is that ratio times its own log-prob's (seq-mean-token-mean halves it)."""
    logp = torch.tensor([[0.1, 0.3, 5.0]], requires_grad=True)
    old, mask, adv = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([1.0])
    loss, stats = policy_loss("gspo", logp, old, adv, mask, clip_high=10.0, aggregation="seq-mean-token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(0.2))
    assert logp.grad.tolist()[0] == pytest.approx([-math.exp(0.2) / 2, -math.exp(0.2) / 2, 0.0])
    assert float(stats["ratio_mean"]) == pytest.approx(math.exp(0.2))
    assert float(stats["approx_kl"]) == pytest.approx((0.5 * 0.1**2 + 0.5 * 0.3**2) / 2)
    ppo, _ = policy_loss("ppo_clip", logp.detach(), old, adv, mask, clip_high=10.0, aggregation="seq-mean-token-mean")
    assert ppo.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.3)) / 2)


def test_gspo_clips_the_whole_sequence_at_once():
    """A sequence whose mean log-ratio is above log(1 + clip_high) is clipped at every token (zero gradient for a
    positive advantage), even a token whose own ratio is inside the range."""
    logp = torch.tensor([[0.0, 0.8]], requires_grad=True)
    loss, stats = policy_loss("gspo", logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.28)
    assert logp.grad.abs().sum().item() == 0.0
    assert float(stats["clip_frac_high"]) == 1.0
