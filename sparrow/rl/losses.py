"""GRPO loss pieces as pure tensor functions (SPEC section 7), in the style of verl's core_algos.

    L = - E_t [ min(pi_old / pi_rollout, C) * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) ],
    r_t = pi_theta / pi_old

`pi_rollout` is the sparse actor that sampled the tokens, `pi_old` the dense policy's recomputed log-prob of the
same tokens. Every choice a config makes (advantage estimator and its group std, policy loss, TIS mode, loss
aggregation, KL estimator, the full-vocabulary KL direction of DistillSparse) is looked up by name in a registry
dict, so a config can be validated against `tuple(REGISTRY)` before a run starts.
Log-probs are per token, shape [B, T]; `mask` marks valid (response) tokens with 1/True.
The policy losses read nothing from the device: their metrics are 0-d tensors, and the mask's values, which only a
host read can check, are checked once per update by the caller (`check_mask`).
"""

from __future__ import annotations

import torch

from sparrow.errors import SparrowError

_MAX_LOG_RATIO = 20.0
_MAX_K3 = 10.0


def _check_name(name: str, known, what: str) -> None:
    if name not in known:
        raise SparrowError(f"unknown {what} {name!r}: expected one of {', '.join(map(repr, known))}")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise SparrowError(f"shape mismatch: {listed}; expected all the same shape")


def _as_float(t: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are promoted to float32 (exp of log-ratios is too coarse in bf16)."""
    return t.float() if not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16) else t


def _as_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as a bool tensor, without reading it."""
    return mask if mask.dtype == torch.bool else mask != 0


def check_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as a bool tensor; it must hold only 0/1 (or be bool) and mark at least one token. Reads the device,
    so an update checks its whole mask once, before its micro-batches (the losses do not check it)."""
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise SparrowError(f"mask holds {mask[bad].flatten()[0].item()!r}: expected only 0/1 or a bool tensor")
        mask = mask != 0
    if not bool(mask.any()):
        raise SparrowError(f"mask of shape {tuple(mask.shape)} marks no valid token: expected at least one")
    return mask


def _check_cap(cap: float) -> None:
    if not cap > 0:
        raise SparrowError(f"TIS cap {cap!r} is invalid: expected a value > 0")


def _group_rewards(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Rewards [num_groups, group_size] as float, checked."""
    if rewards.dim() != 2:
        raise SparrowError(f"rewards have shape {tuple(rewards.shape)}: expected [num_groups, group_size]")
    if not eps >= 0:
        raise SparrowError(f"eps {eps!r} is invalid: expected a value >= 0")
    rewards = _as_float(rewards)
    if not bool(torch.isfinite(rewards).all()):
        raise SparrowError("rewards contain NaN or inf: expected finite rewards")
    return rewards


def _adv_grpo(rewards: torch.Tensor, std: str, eps: float) -> torch.Tensor:
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (rewards.std(dim=1, correction=GROUP_STDS[std], keepdim=True) + eps)


def _adv_dr_grpo(rewards: torch.Tensor, std: str, eps: float) -> torch.Tensor:
    return rewards - rewards.mean(dim=1, keepdim=True)


def _adv_rloo(rewards: torch.Tensor, std: str, eps: float) -> torch.Tensor:
    n = rewards.shape[1]
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (n / (n - 1))


ADVANTAGE_ESTIMATORS = {"grpo": _adv_grpo, "dr_grpo": _adv_dr_grpo, "rloo": _adv_rloo}
GROUP_STDS = {"sample": 1, "population": 0}


def compute_advantages(rewards: torch.Tensor, estimator: str = "grpo", std: str = "sample",
                       eps: float = 1e-6) -> torch.Tensor:
    """Per-rollout advantages [P, n] from rewards [P, n] (one group = the n rollouts of a prompt), as verl names them.

    "grpo": (r - group mean) / (group std + eps); `std` "sample" is the Bessel-corrected std (n - 1), as verl,
    TRL and so the authors' release use, "population" divides by n (larger advantages for small n, e.g. by
    sqrt(2) at n = 2). "dr_grpo": r - group mean (Dr. GRPO, verl's
    norm_adv_by_std_in_grpo=False). "rloo": r minus the mean of the group's other rewards, n / (n - 1) (r - mean).
    `std` applies to grpo only. Groups whose rewards are all equal (a group of one included) carry no signal and
    get exactly 0, where verl would divide float noise by eps (and use mean 0, std 1 for a group of one).
    """
    _check_name(estimator, ADVANTAGE_ESTIMATORS, "advantage estimator")
    _check_name(std, GROUP_STDS, "group std")
    rewards = _group_rewards(rewards, eps)
    constant = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    if bool(constant.all()):
        return torch.zeros_like(rewards)
    advantages = ADVANTAGE_ESTIMATORS[estimator](rewards, std, eps)
    return torch.where(constant, torch.zeros_like(advantages), advantages)


def _tis_truncate(ratio: torch.Tensor, cap: float) -> torch.Tensor:
    return ratio.clamp(max=cap)


def _tis_mask(ratio: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))


def _tis_off(ratio: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.ones_like(ratio)


TIS_MODES = {"truncate": _tis_truncate, "mask": _tis_mask, "off": _tis_off}


def _tis_ratio(logp_old: torch.Tensor, logp_rollout: torch.Tensor) -> torch.Tensor:
    _check_same_shape(logp_old=logp_old, logp_rollout=logp_rollout)
    return torch.exp(_as_float(logp_old).detach() - _as_float(logp_rollout).detach())


def tis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mode: str = "truncate",
                cap: float = 2.0) -> torch.Tensor:
    """Detached per-token weight for the rollout/trainer mismatch, from ratio = pi_old / pi_rollout.

    "truncate": min(ratio, cap), no lower bound (SPEC 7); "mask": ratio where ratio <= cap else 0, dropping
    tokens the sparse actor badly under-sampled; "off": ones.
    """
    _check_name(mode, TIS_MODES, "TIS mode")
    _check_cap(cap)
    return TIS_MODES[mode](_tis_ratio(logp_old, logp_rollout), cap)


def tis_stats(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
              cap: float = 2.0) -> dict[str, float]:
    """min / mean / max of ratio = pi_old / pi_rollout over valid tokens and the fraction above cap, for logging."""
    _check_cap(cap)
    ratio = _tis_ratio(logp_old, logp_rollout)
    _check_same_shape(logp_old=logp_old, mask=mask)
    valid = ratio[check_mask(mask)]
    return {"ratio_min": valid.min().item(), "ratio_mean": valid.mean().item(), "ratio_max": valid.max().item(),
            "frac_above_cap": int((valid > cap).sum()) / valid.numel()}


def _agg_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return loss.masked_fill(~mask, 0.0).sum() / mask.sum()


def _agg_seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    counts = mask.sum(dim=1)
    rows = counts > 0
    return (loss.masked_fill(~mask, 0.0).sum(dim=1)[rows] / counts[rows]).mean()


def _agg_seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows = mask.sum(dim=1) > 0
    return loss.masked_fill(~mask, 0.0).sum(dim=1)[rows].mean()


LOSS_AGGREGATIONS = {
    "token-mean": _agg_token_mean,
    "seq-mean-token-mean": _agg_seq_mean_token_mean,
    "seq-mean-token-sum": _agg_seq_mean_token_sum,
}


def ppo_clip_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  weights: torch.Tensor | None = None, clip_low: float = 0.2, clip_high: float = 0.28,
                  dual_clip: float | None = 3.0, aggregation: str = "token-mean") -> tuple[torch.Tensor, dict]:
    """Asymmetric PPO-clip policy loss with dual clip and TIS weights; returns (scalar loss, metrics as 0-d tensors).

    Per token, r = exp(logp - logp_old) and surrogate = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); for
    A < 0 the dual clip bounds it below by dual_clip * A (loss at most -dual_clip * A) so a token with a huge
    ratio cannot dominate. Loss per token = -weights * surrogate. `advantages` is [B] (per sequence) or [B, T].
    Aggregations: "token-mean" over all valid tokens of the batch; "seq-mean-token-mean" / "seq-mean-token-sum"
    average per-sequence token means / sums over the sequences that have at least one valid token.
    Metrics (over valid tokens): clip_frac = clip_frac_low (A < 0, r < 1 - clip_low) + clip_frac_high (A > 0,
    r > 1 + clip_high), dual_clip_frac, ratio_mean, approx_kl = mean 0.5 * (logp - logp_old)^2.
    Values at masked positions are ignored (padding may hold anything); the log-ratio is clamped to +-20 as in verl.
    `mask` is not checked here (`check_mask`, once per update).
    """
    adv, valid = _check_loss_inputs(logp, logp_old, advantages, mask, weights, clip_low, clip_high, dual_clip,
                                    aggregation)
    log_ratio = torch.where(valid, _as_float(logp) - _as_float(logp_old).detach(), 0.0)
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _clipped_loss(log_ratio, log_ratio, adv, valid, weights, clip_low, clip_high, dual_clip, aggregation)


def gspo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              weights: torch.Tensor | None = None, clip_low: float = 0.2, clip_high: float = 0.28,
              dual_clip: float | None = 3.0, aggregation: str = "token-mean") -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form: every token of a sequence
    gets the sequence's importance ratio s = exp(mean over its tokens of (logp - logp_old)), the length-normalised
    (geometric-mean) ratio, with the gradient of its own log-prob: r_t = exp(sg[log s] + logp_t - sg[logp_t]).
    Clipping, dual clip, TIS weights, aggregation and metrics as `ppo_clip_loss`; GSPO's paper uses far smaller
    clip ranges (3e-4 / 4e-4) and "seq-mean-token-mean", which verl's `gspo` loss defaults to (same numbers)."""
    adv, valid = _check_loss_inputs(logp, logp_old, advantages, mask, weights, clip_low, clip_high, dual_clip,
                                    aggregation)
    logp = _as_float(logp)
    token = torch.where(valid, logp - _as_float(logp_old).detach(), 0.0)
    counts = valid.sum(dim=1, keepdim=True).clamp(min=1)
    sequence = (token.sum(dim=1, keepdim=True) / counts).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    log_ratio = torch.where(valid, sequence.detach() + logp - logp.detach(), 0.0)
    return _clipped_loss(log_ratio, token, adv, valid, weights, clip_low, clip_high, dual_clip, aggregation)


def _check_loss_inputs(logp, logp_old, advantages, mask, weights, clip_low, clip_high, dual_clip,
                       aggregation) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks every policy loss makes, none of which reads the device; returns (advantages [B, 1] or [B, T] as
    floats, zero where masked; the valid-token mask)."""
    _check_name(aggregation, LOSS_AGGREGATIONS, "loss aggregation")
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if not value >= 0:
            raise SparrowError(f"{name} {value!r} is invalid: expected a value >= 0")
    if dual_clip is not None and not dual_clip > 1:
        raise SparrowError(f"dual_clip {dual_clip!r} is invalid: expected a value > 1 or None")
    if logp.dim() != 2:
        raise SparrowError(f"logp has shape {tuple(logp.shape)}: expected [batch, tokens]")
    _check_same_shape(logp=logp, logp_old=logp_old, mask=mask)
    if weights is not None:
        _check_same_shape(logp=logp, weights=weights)
    if advantages.shape == logp.shape[:1]:
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != logp.shape:
        raise SparrowError(f"advantages have shape {tuple(advantages.shape)}: expected [{logp.shape[0]}] "
                           f"(per sequence) or {list(logp.shape)} (per token)")
    valid = _as_mask(mask)
    return torch.where(valid, _as_float(advantages).detach(), 0.0), valid


def _clipped_loss(log_ratio, token_log_ratio, adv, valid, weights, clip_low, clip_high, dual_clip,
                  aggregation) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate of ratio r = exp(log_ratio) (zero where masked), its aggregation and metrics;
    approx_kl is of the per-token `token_log_ratio`. The metrics stay on the device (0-d tensors, the fractions
    in float64 as `int(count) / n` would give them) for the caller to read once (`read_floats`)."""
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    dual = torch.zeros_like(valid)
    if dual_clip is not None:
        dual = (adv < 0) & (surrogate < dual_clip * adv)
        surrogate = torch.where(dual, dual_clip * adv, surrogate)
    if weights is not None:
        surrogate = torch.where(valid, _as_float(weights).detach(), 0.0) * surrogate
    total = LOSS_AGGREGATIONS[aggregation](-surrogate, valid)

    with torch.no_grad():
        r = ratio[valid]
        a = adv.expand_as(ratio)[valid]
        n = r.numel()
        low = ((a < 0) & (r < 1 - clip_low)).sum().double() / n
        high = ((a > 0) & (r > 1 + clip_high)).sum().double() / n
        metrics = {"clip_frac": low + high, "clip_frac_low": low, "clip_frac_high": high,
                   "dual_clip_frac": dual.expand_as(ratio)[valid].sum().double() / n, "ratio_mean": r.mean(),
                   "approx_kl": (0.5 * token_log_ratio[valid] ** 2).mean()}
    return total, metrics


def read_floats(values: list[torch.Tensor]) -> list[float]:
    """0-d tensors (losses, metrics) as floats, in one read of the device; float64 holds each value exactly."""
    if not values:
        return []
    return torch.stack([v.detach().double() for v in values]).tolist()


def accumulation_share(mask: torch.Tensor, tokens: torch.Tensor, rows: int, total_rows: int,
                       aggregation: str) -> torch.Tensor:
    """The weight of one micro-batch's loss when micro-batches are accumulated into one optimizer step: its share
    of the step's tokens (`mask` its token mask, `tokens` the step's) under token-mean aggregation, else its share
    of the rows (each micro-batch's loss is already a mean over its own rows). Summing `loss * share` over the
    micro-batches gives the loss of the whole batch at once."""
    _check_name(aggregation, LOSS_AGGREGATIONS, "loss aggregation")
    if aggregation == "token-mean":
        return mask.sum() / tokens
    return torch.tensor(rows / total_rows)


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss}


def policy_loss(name: str, logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, **options) -> tuple[torch.Tensor, dict]:
    """The policy loss registered as `name` (see POLICY_LOSSES), called with the loss's own keyword options."""
    _check_name(name, POLICY_LOSSES, "policy loss")
    return POLICY_LOSSES[name](logp, logp_old, advantages, mask, **options)


def _kl_k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    return logp - logp_ref


def _kl_k2(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - logp_ref) ** 2


def _kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    x = (logp_ref - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.expm1(x) - x).clamp(0.0, _MAX_K3)


KL_ESTIMATORS = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from sampled-token log-probs, for a KL-to-reference term.

    k1 = logp - logp_ref (unbiased, can be negative); k2 = 0.5 (logp - logp_ref)^2;
    k3 = exp(x) - x - 1 with x = logp_ref - logp (unbiased and non-negative; computed with expm1), clamped as
    verl's "low_var_kl" and the release clamp it: x to [-20, 20], the value to at most 10 (verl's [-10, 10]; k3
    is never negative). Without the clamp one token with x = 5 gives 142 and can dominate DistillSparse's KL
    term; a clamped token has zero gradient.
    """
    _check_name(kind, KL_ESTIMATORS, "KL estimator")
    _check_same_shape(logp=logp, logp_ref=logp_ref)
    return KL_ESTIMATORS[kind](_as_float(logp), _as_float(logp_ref).detach())


def _kl_full_forward(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)


def _kl_full_reverse(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    return (logp.exp() * (logp - logp_ref)).sum(-1)


FULL_KL_DIRECTIONS = {"forward": _kl_full_forward, "reverse": _kl_full_reverse}


def full_kl(logits: torch.Tensor, logits_ref: torch.Tensor, direction: str = "reverse",
            temperature: float = 1.0) -> torch.Tensor:
    """Exact per-position KL over the whole vocabulary between softmax(logits / T) and the detached reference.

    "forward" = KL(ref || pi) (mass-covering, as in distillation from a teacher); "reverse" = KL(pi || ref)
    (the quantity k3 estimates from sampled tokens). Inputs [..., V]; output [...] in float32, differentiable
    with respect to `logits` only.
    """
    _check_name(direction, FULL_KL_DIRECTIONS, "KL direction")
    _check_same_shape(logits=logits, logits_ref=logits_ref)
    if not temperature > 0:
        raise SparrowError(f"temperature {temperature!r} is invalid: expected a value > 0")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp_ref = torch.log_softmax(logits_ref.detach().float() / temperature, dim=-1)
    return FULL_KL_DIRECTIONS[direction](logp, logp_ref)
