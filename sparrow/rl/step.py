"""One GRPO step on sparse rollouts, in phases over one `StepBatch`:

    (reward check) -> rollout -> score -> advantages -> recompute -> update -> sync

(its metrics and warnings: step_metrics.py).

The reward check, on some steps, samples a few prompts densely with the rollouts' seeds to measure how much
reward the sparse actor keeps; it is logged only and never enters the update. `rollout` asks the backend for
completions; `score` runs the reward functions; `advantages` normalizes them per group (an estimator chosen by
name); `recompute` runs the dense policy over the rollouts (pi_old, the top-K acceptance bounds, the exact
acceptance of a share of the groups, the KL reference, the TIS weights); `update` takes the clipped-PPO steps
(and DistillSparse's adapter step); the backend then gets the new weights. With one optimizer step per GRPO step
the update's own forward gives pi_old, the bounds, the TIS weights and the monitor's dense side, and the recompute
runs no forward (`old_policy_from_update`). The dense forwards of both live in dense.py, the exact monitor in
monitor.py, the step's state (`Policy`, `StepBatch`) in step_state.py.
The dense policy's log-probs are computed with the model's own attention (no Sparrow context: dense).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch

from sparrow.datasets import Example
from sparrow.errors import SparrowError
from sparrow.measure.acceptance import monitored_rows
from sparrow.measure.batch import RolloutBatch
from sparrow.rewards.scoring import score_examples
from sparrow.rollout import RolloutBackend
from sparrow.schedules import DENSE, Schedule

from .activation_checkpointing import checkpointed_layers
from .config import StepConfig
from .dense import old_policy_from_update, recompute_forwards, reference_logprobs, update_forwards
from .losses import (accumulation_share, check_mask, compute_advantages, kl_penalty, policy_loss, read_floats,
                     tis_weights)
from .monitor import Monitor, free_monitor, monitored
from .step_state import Clock, Policy, StepBatch

__all__ = ["Policy", "StepBatch", "StepConfig", "Monitor", "free_monitor", "monitored_rows", "old_policy_from_update",
           "reward_check", "check_samples", "rollout", "score", "advantages", "recompute", "update", "run_step"]


# -- phases ---------------------------------------------------------------------------------------------------


def reward_check(backend: RolloutBackend, step: StepBatch, reward_fns: list, cfg: StepConfig, seed: int,
                 number: int) -> None:
    """On every `reward_check_every`-th step (numbered from 1) of sparse rollouts: the first `reward_check_samples`
    samples of the first `reward_check_prompts` prompts drawn by the dense policy (adapter off) with the rollouts'
    seed, prompt keys and sample indices, so dense sample s pairs with sparse sample s (sample s of n is sample s
    of the rollout's num_generations), and scored by the same rewards. Runs before the rollout, so the backend's
    timing and stats stay the rollout's; its samples never reach the update."""
    every = cfg.monitor.reward_check_every
    if not every or number < 1 or number % every or step.schedule.is_dense or cfg.draft_tokens is not None:
        return  # dense rollouts, and exact mode's (the dense policy's own tokens), have nothing to check
    examples = step.examples[:cfg.monitor.reward_check_prompts]
    with Clock(step, "reward_check"):
        dense = backend.generate([ex.prompt for ex in examples], cfg.sampling.params(seed), DENSE,
                                 check_samples(cfg), adapter=False)
        step.dense_rewards = score_examples(reward_fns, examples, dense).totals


def check_samples(cfg: StepConfig) -> int:
    """Samples per prompt of the reward check: `reward_check_samples`, at most the group's."""
    return min(cfg.monitor.reward_check_samples, cfg.grpo.num_generations)


def rollout(backend: RolloutBackend, step: StepBatch, cfg: StepConfig, seed: int) -> None:
    """The step's rollouts; on a terminal, with a progress bar (a long-answer step decodes for minutes)."""
    with Clock(step, "rollout"):
        step.completions = backend.generate([ex.prompt for ex in step.examples], cfg.sampling.params(seed),
                                            step.schedule, cfg.grpo.num_generations, draft_tokens=cfg.draft_tokens,
                                            progress=sys.stderr.isatty())
    for phase, seconds in getattr(backend, "timing", {}).items():
        step.timing[f"time/rollout_{phase}_s"] = seconds


def score(step: StepBatch, reward_fns: list) -> None:
    with Clock(step, "reward"):
        step.scored = score_examples(reward_fns, step.examples, step.completions)
        step.rewards = torch.tensor(step.scored.totals, dtype=torch.float32).view(len(step.examples), -1)


def advantages(step: StepBatch, cfg: StepConfig) -> None:
    step.advantages = compute_advantages(step.rewards, cfg.grpo.advantage_estimator, cfg.grpo.advantage_std).flatten()


def recompute(policy: Policy, step: StepBatch, cfg: StepConfig, number: int = 0) -> None:
    """pi_old of the sampled tokens, the top-K bounds [N, 2] on each token's acceptance, the exact acceptance of
    the monitored rows (their sparse teacher-forced forward against these very dense logits), the KL reference's
    log-probs and the TIS weights (dense.py's forwards). When the update gives pi_old (`old_policy_from_update`),
    no row runs here: the update records pi_old, the bounds, the TIS weights and the monitor from its own forward."""
    clock = time.perf_counter()
    batch = step.batch = RolloutBatch.from_completions(step.completions, pad_id=policy.pad_id).to(policy.device)
    step.advantages = step.advantages.to(policy.device)
    step.logp_old = torch.zeros_like(batch.rollout_logprobs)
    step.bounds = torch.zeros(*batch.mask.shape, 2, device=batch.mask.device)
    rows = monitored(policy, step, cfg, number) if cfg.draft_tokens is None else set()
    step.monitor = Monitor(rows, torch.full_like(batch.mask, float("nan")),
                           {name: torch.full_like(batch.mask, float("nan")) for name in step.measure})
    fused = old_policy_from_update(policy, cfg)
    if not fused:
        recompute_forwards(policy, step, cfg)
    if cfg.grpo.kl_coef > 0:
        if policy.reference is None:
            raise SparrowError("kl_coef > 0 needs a reference model")
        step.logp_ref = reference_logprobs(policy, step, cfg)
    if not fused:
        step.weights = tis_weights(step.logp_old, batch.rollout_logprobs, cfg.grpo.tis_mode, cfg.grpo.tis_cap)
        step.bounds = step.bounds[batch.mask.bool()]
        step.monitor.record(step, cfg)
    step.timing["time/recompute_s"] = time.perf_counter() - clock - step.monitor.seconds


@dataclass
class _Totals:
    """What the update's mini-batches add up to, for its metrics. The micro-batches' clip statistics and KL values
    stay on the device (0-d tensors) until `metrics` reads them all at once."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    clip_stats: list[dict] = field(default_factory=list)
    kl_values: list = field(default_factory=list)
    skipped: int = 0

    def metrics(self, optimizer: torch.optim.Optimizer) -> dict:
        keys = ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac")
        values = iter(read_floats([s[k] for s in self.clip_stats for k in keys] + self.kl_values))
        clip = [dict(zip(keys, values)) for _ in self.clip_stats]
        kl_values = list(values)
        n = max(len(clip), 1)
        return {
            "loss": sum(self.losses) / len(self.losses) if self.losses else float("nan"),
            **({"kl": sum(kl_values) / len(kl_values)} if kl_values else {}),
            "grad_norm": max(self.grad_norms) if self.grad_norms else float("nan"),
            "update/skipped_mini_batches": self.skipped,
            "clip_ratio": sum(s["clip_frac"] for s in clip) / n,
            "clip_ratio/low_mean": sum(s["clip_frac_low"] for s in clip) / n,
            "clip_ratio/high_mean": sum(s["clip_frac_high"] for s in clip) / n,
            "clip_ratio/dual_mean": sum(s["dual_clip_frac"] for s in clip) / n,
            "learning_rate": optimizer.param_groups[0]["lr"],
        }


def update(policy: Policy, step: StepBatch, cfg: StepConfig, number: int = 0) -> None:
    """The clipped-PPO update over `mini_batches` optimizer steps, micro-batches accumulated; a mini-batch whose
    loss or gradient is not finite is skipped (or stops the run: `non_finite: stop`) and never applied."""
    grpo, batch = cfg.grpo, step.batch
    fused = old_policy_from_update(policy, cfg)
    if fused:
        step.weights = torch.zeros_like(step.logp_old)
    totals = _Totals()
    check_mask(batch.mask)  # once: the losses of the micro-batches read nothing from the device
    with Clock(step, "update"):
        policy.model.train()
        with policy.dense(), checkpointed_layers(policy.model, grpo.gradient_checkpointing):
            for mini in torch.arange(len(step.completions)).chunk(grpo.mini_batches):
                policy.optimizer.zero_grad(set_to_none=True)
                _apply(policy, step, cfg, _accumulate(policy, step, cfg, mini, fused, totals), totals, number)
        policy.model.eval()
        _check_parameters(policy.model, number)
    if fused:
        step.bounds = step.bounds[batch.mask.bool()]
        step.monitor.record(step, cfg)
        step.timing["time/update_s"] -= step.monitor.seconds
    step.update = totals.metrics(policy.optimizer)
    if policy.distiller is not None:
        step.update.update(policy.distiller.step(batch, step.logp_old, step.advantages, step.schedule, cfg))


def _accumulate(policy: Policy, step: StepBatch, cfg: StepConfig, mini: torch.Tensor, fused: bool,
                totals: _Totals) -> float:
    """One mini-batch's gradient, accumulated over its micro-batches; returns its loss, read from the device once
    after the last micro-batch (the micro-batches' losses added in order as floats)."""
    grpo, batch = cfg.grpo, step.batch
    tokens, parts = batch.mask[mini].sum(), []
    for micro, logp in update_forwards(policy, step, cfg, mini, fused):
        loss, stats = policy_loss(grpo.policy_loss, logp, step.logp_old[micro], step.advantages[micro],
                                  batch.mask[micro], weights=step.weights[micro],
                                  clip_low=grpo.clip_low, clip_high=grpo.clip_high,
                                  dual_clip=grpo.dual_clip, aggregation=grpo.loss_aggregation)
        if step.logp_ref is not None:
            kl = kl_penalty(logp, step.logp_ref[micro], grpo.kl_estimator)
            kl = (kl * batch.mask[micro]).sum() / batch.mask[micro].sum().clamp(min=1)
            loss = loss + grpo.kl_coef * kl
            totals.kl_values.append(kl.detach())
        share = accumulation_share(batch.mask[micro], tokens, len(micro), len(mini), grpo.loss_aggregation)
        (loss * share).backward()
        parts.append(loss.detach() * share)
        totals.clip_stats.append(stats)
    mini_loss = 0.0
    for part in read_floats(parts):
        mini_loss += part
    return mini_loss


def _apply(policy: Policy, step: StepBatch, cfg: StepConfig, mini_loss: float, totals: _Totals,
           number: int) -> None:
    """The optimizer step of a mini-batch whose loss and clipped gradient norm are finite; otherwise skipped (a
    warning) or, with `non_finite: stop`, an error before anything is applied."""
    norm = float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.grpo.max_grad_norm))
    if not (math.isfinite(mini_loss) and math.isfinite(norm)):
        what = f"loss {mini_loss} and gradient norm {norm}"
        if cfg.grpo.non_finite == "stop":
            raise SparrowError(f"step {number}: {what} of a mini-batch are not finite; stopping before "
                               "the update is applied (non_finite: skip would skip it)")
        step.warnings.append(f"{what} of a mini-batch are not finite: its update was skipped")
        policy.optimizer.zero_grad(set_to_none=True)
        totals.skipped += 1
        return
    policy.optimizer.step()
    totals.losses.append(mini_loss)
    totals.grad_norms.append(norm)


def _check_parameters(model: torch.nn.Module, number: int) -> None:
    """Stop before a policy with non-finite weights can be saved or sampled from."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise SparrowError(f"step {number}: parameter {name} is not finite after the update (learning rate too "
                               "high?); stopping without saving it")


def run_step(policy: Policy, backend: RolloutBackend, examples: list[Example], reward_fns: list,
             schedule: Schedule, cfg: StepConfig, seed: int, number: int = 0,
             measure: dict[str, Schedule] | None = None) -> StepBatch:
    """Run one step (number `number`, for messages) on `examples`; returns its filled `StepBatch`.

    `measure` names further schedules whose exact acceptance is measured on the monitored rows (the adaptive
    schedule's cheaper candidate). With `policy.distiller` (DistillSparse), the recompute and the policy update
    run with its adapter disabled, and after the policy step the adapter takes its own step (`distill/...`).
    """
    step = StepBatch(examples, schedule, measure=dict(measure or {}))
    policy.model.eval()
    reward_check(backend, step, reward_fns, cfg, seed, number)
    rollout(backend, step, cfg, seed)
    score(step, reward_fns)
    advantages(step, cfg)
    recompute(policy, step, cfg, number)
    update(policy, step, cfg, number)
    with Clock(step, "sync"):
        backend.sync_weights(policy.model)
    return step
