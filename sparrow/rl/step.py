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
runs no forward (`old_policy_from_update`).
The dense policy's log-probs are computed with the model's own attention (no Sparrow context: dense).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from sparrow.datasets import Example
from sparrow.errors import SparrowError
from sparrow.lora import without_adapter
from sparrow.measure.acceptance import monitored_rows, piece_acceptance
from sparrow.measure.batch import (RolloutBatch, piece_logits, piece_logprobs, piece_prompt, same_prompt,
                                   shared_prompt_pieces)
from sparrow.measure.bounds import acceptance_bounds
from sparrow.rewards.runner import ScoreResult
from sparrow.rewards.scoring import score_examples
from sparrow.rollout import RolloutBackend
from sparrow.schedules import DENSE, Schedule

from .activation_checkpointing import checkpointed_layers
from .config import StepConfig
from .losses import accumulation_share, compute_advantages, kl_penalty, policy_loss, tis_weights


@dataclass
class Policy:
    """The trained side: the model, its optimizer, the frozen KL reference and the DistillSparse distiller."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pad_id: int = 0
    reference: torch.nn.Module | None = None
    distiller: object | None = None

    def dense(self) -> contextlib.AbstractContextManager:
        """The dense policy: the model with its adapter (if any) off."""
        return without_adapter(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass
class StepBatch:
    """Everything one step knows about its rollouts, filled phase by phase."""

    examples: list[Example]
    schedule: Schedule
    completions: list = field(default_factory=list)
    scored: ScoreResult | None = None
    rewards: torch.Tensor | None = None  # [prompts, n]
    advantages: torch.Tensor | None = None  # [prompts * n]
    batch: RolloutBatch | None = None
    logp_old: torch.Tensor | None = None
    bounds: torch.Tensor | None = None  # [tokens, 2] lower / upper acceptance bounds
    exact: torch.Tensor | None = None  # [tokens] exact acceptance of the monitored rows (positions in exact_at)
    exact_at: torch.Tensor | None = None
    measure: dict = field(default_factory=dict)  # name -> schedule, also teacher-forced on the monitored rows
    measured: dict = field(default_factory=dict)  # name -> [tokens] their exact acceptance (positions in exact_at)
    logp_ref: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    timing: dict = field(default_factory=dict)
    update: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    dense_rewards: list[float] | None = None  # the reward check's dense samples, on check steps only
    monitor: Monitor | None = None  # the monitored rows and what they measured, until recorded in exact/measured


class _Clock:
    def __init__(self, step: StepBatch, name: str):
        self.step, self.name = step, name

    def __enter__(self):
        self.began = time.perf_counter()

    def __exit__(self, *exc):
        self.step.timing[f"time/{self.name}_s"] = time.perf_counter() - self.began


def _pieces(step: StepBatch, rows: torch.Tensor, cfg: StepConfig, grad: bool = True) -> list[torch.Tensor]:
    """Shared-prompt pieces of `rows`: `micro_batch_size` rows at most for the update, `log_prob_micro_batch_size`
    for the forwards without gradients (a whole group there computes a long prompt once instead of per piece)."""
    grpo = cfg.grpo
    size = grpo.micro_batch_size if grad or grpo.log_prob_micro_batch_size is None else grpo.log_prob_micro_batch_size
    return shared_prompt_pieces(step.batch, rows, size)


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
    with _Clock(step, "reward_check"):
        dense = backend.generate([ex.prompt for ex in examples], cfg.sampling.params(seed), DENSE,
                                 check_samples(cfg), adapter=False)
        step.dense_rewards = score_examples(reward_fns, examples, dense).totals


def check_samples(cfg: StepConfig) -> int:
    """Samples per prompt of the reward check: `reward_check_samples`, at most the group's."""
    return min(cfg.monitor.reward_check_samples, cfg.grpo.num_generations)


def rollout(backend: RolloutBackend, step: StepBatch, cfg: StepConfig, seed: int) -> None:
    """The step's rollouts; on a terminal, with a progress bar (a long-answer step decodes for minutes)."""
    with _Clock(step, "rollout"):
        step.completions = backend.generate([ex.prompt for ex in step.examples], cfg.sampling.params(seed),
                                            step.schedule, cfg.grpo.num_generations, draft_tokens=cfg.draft_tokens,
                                            progress=sys.stderr.isatty())
    for phase, seconds in getattr(backend, "timing", {}).items():
        step.timing[f"time/rollout_{phase}_s"] = seconds


def score(step: StepBatch, reward_fns: list) -> None:
    with _Clock(step, "reward"):
        step.scored = score_examples(reward_fns, step.examples, step.completions)
        step.rewards = torch.tensor(step.scored.totals, dtype=torch.float32).view(len(step.examples), -1)


def advantages(step: StepBatch, cfg: StepConfig) -> None:
    step.advantages = compute_advantages(step.rewards, cfg.grpo.advantage_estimator, cfg.grpo.advantage_std).flatten()


def _monitored(policy: Policy, step: StepBatch, cfg: StepConfig, number: int) -> set[int]:
    """Rows whose exact acceptance is measured this step: the first `monitor_share` of them (prompts are drawn at
    random and a group's samples alike, so a random share; a share of a single group is a share of its rows),
    every `monitor_every`-th step. Dense rollouts of a model without an adapter are the dense policy itself:
    nothing to measure."""
    mon = cfg.monitor
    if mon.monitor != "exact" or number % mon.monitor_every or (step.schedule.is_dense and policy.distiller is None):
        return set()
    return set(range(monitored_rows(len(step.completions), mon.monitor_share)))


@dataclass
class Monitor:
    """The exact monitor of one step: its rows, and per row and position the acceptance their sparse teacher-forced
    forward had against the dense logits (`exact`, and `extra` per `measure` schedule; NaN where not measured)."""

    rows: set[int]
    exact: torch.Tensor
    extra: dict[str, torch.Tensor]
    seconds: float = 0.0

    def measure(self, policy: Policy, step: StepBatch, cfg: StepConfig, piece: torch.Tensor,
                dense_logits: torch.Tensor, prompt) -> None:
        """The acceptance of a piece's monitored rows against `dense_logits` (the piece's); `prompt`: a
        SharedPrompt of the same weights (the sparse actor's prefill is dense), or None for a prefill of its own
        (an adapter's)."""
        chosen = torch.tensor([int(row) in self.rows for row in piece])
        if not chosen.any():
            return
        piece, dense_logits = piece[chosen], dense_logits[chosen.to(dense_logits.device)]
        began, batch = time.perf_counter(), step.batch
        with torch.no_grad():
            for name, schedule in [(None, step.schedule), *step.measure.items()]:
                alpha = piece_acceptance(policy.model, batch, piece, schedule, cfg.sparse, batch.temperature,
                                         dense_logits=dense_logits, prompt=prompt)
                (self.exact if name is None else self.extra[name])[piece] = alpha
        self.seconds += time.perf_counter() - began

    def record(self, step: StepBatch, cfg: StepConfig) -> None:
        """Into the step: the measured tokens' acceptance and positions, and the monitor's time. Exact mode's rows
        all carry the acceptance their drafts had while decoding."""
        batch, exact, rows = step.batch, self.exact, self.rows
        if cfg.draft_tokens is not None:
            exact, rows = free_monitor(step.completions, batch.mask), set(range(len(step.completions)))
        if rows:
            measured = batch.mask.bool() & ~exact.isnan()
            step.exact, step.exact_at = exact[measured], batch.positions[measured]
            step.measured = {name: values[measured] for name, values in self.extra.items()}
            step.timing["time/monitor_s"] = self.seconds


def old_policy_from_update(policy: Policy, cfg: StepConfig) -> bool:
    """Whether pi_old comes from the update's own forward instead of a recompute. With one optimizer step per GRPO
    step the update's forwards all run the weights the rollouts' recompute would (the optimizer steps after the
    last micro-batch), so pi_old is their log-prob, detached, and the PPO ratio is 1 (TRL does the same with one
    iteration); the monitor compares its sparse forwards with these same dense logits. That saves a dense forward
    over every rollout, a sixth of a long-answer step. Not with several mini-batches (later ones run updated
    weights) or DistillSparse (its adapter step reads the recompute)."""
    return cfg.grpo.mini_batches == 1 and policy.distiller is None


def _dense_outputs(step: StepBatch, piece: torch.Tensor, span: slice, logits: torch.Tensor,
                   logp: torch.Tensor) -> None:
    """Record a piece's dense log-probs as pi_old and the top-K bounds on each token's acceptance from its dense
    logits (no gradients)."""
    batch = step.batch
    step.logp_old[piece] = logp.detach()
    valid = batch.mask[piece, span].bool()
    low, high = acceptance_bounds(batch.top_ids[piece, span][valid], batch.top_logprobs[piece, span][valid],
                                  logits.detach()[valid], batch.temperature)
    found = torch.zeros(*valid.shape, 2, device=valid.device)
    found[valid] = torch.stack([low, high], dim=-1)
    step.bounds[piece.tolist(), span] = found


def recompute(policy: Policy, step: StepBatch, cfg: StepConfig, number: int = 0) -> None:
    """pi_old of the sampled tokens, the top-K bounds [N, 2] on each token's acceptance, the exact acceptance of
    the monitored rows (their sparse teacher-forced forward against these very dense logits), the KL reference's
    log-probs and the TIS weights. Rows run in shared-prompt pieces, so each prompt is computed once per piece, and
    the monitor's sparse forwards reuse it (the prefill is dense) unless a DistillSparse adapter changes it.
    When the update gives pi_old (`old_policy_from_update`), no row runs here: the update records pi_old, the
    bounds, the TIS weights and the monitor from its own forward."""
    clock = time.perf_counter()
    batch = step.batch = RolloutBatch.from_completions(step.completions, pad_id=policy.pad_id).to(policy.device)
    step.advantages = step.advantages.to(policy.device)
    step.logp_old = torch.zeros_like(batch.rollout_logprobs)
    step.bounds = torch.zeros(*batch.mask.shape, 2, device=batch.mask.device)
    rows = _monitored(policy, step, cfg, number) if cfg.draft_tokens is None else set()
    step.monitor = Monitor(rows, torch.full_like(batch.mask, float("nan")),
                           {name: torch.full_like(batch.mask, float("nan")) for name in step.measure})
    fused = old_policy_from_update(policy, cfg)
    for piece in [] if fused else _pieces(step, torch.arange(batch.input_ids.shape[0]), cfg, grad=False):
        with torch.no_grad(), policy.dense():
            prompt = piece_prompt(policy.model, batch, piece)
            logits, span = piece_logits(policy.model, batch, piece, prompt.logits)
            _dense_outputs(step, piece, span, logits, piece_logprobs(logits, batch, piece, span, batch.temperature))
        # an adapter's sparse actor has a prefill of its own
        step.monitor.measure(policy, step, cfg, piece, logits, prompt if policy.distiller is None else None)
    if cfg.grpo.kl_coef > 0:
        if policy.reference is None:
            raise SparrowError("kl_coef > 0 needs a reference model")
        step.logp_ref = torch.zeros_like(step.logp_old)
        with torch.no_grad():
            for piece in _pieces(step, torch.arange(len(step.completions)), cfg, grad=False):
                ref_logits, span = piece_logits(policy.reference, batch, piece)
                step.logp_ref[piece] = piece_logprobs(ref_logits, batch, piece, span, batch.temperature)
    if not fused:
        step.weights = tis_weights(step.logp_old, batch.rollout_logprobs, cfg.grpo.tis_mode, cfg.grpo.tis_cap)
        step.bounds = step.bounds[batch.mask.bool()]
        step.monitor.record(step, cfg)
    step.timing["time/recompute_s"] = time.perf_counter() - clock - step.monitor.seconds


def free_monitor(completions, mask: torch.Tensor) -> torch.Tensor:
    """Exact mode's monitor [N, T]: the acceptance each drafted token's distribution had against the dense one
    (recorded while decoding, `Completion.draft_acceptance`) at its place in the batch; NaN where none was drafted."""
    alpha = torch.full(mask.shape, float("nan"), device=mask.device)
    for row, completion in enumerate(completions):
        values = torch.tensor([float("nan") if a is None else a for a in completion.draft_acceptance])
        alpha[row, mask[row].bool()] = values.to(mask.device)
    return alpha


def update(policy: Policy, step: StepBatch, cfg: StepConfig, number: int = 0) -> None:
    """The clipped-PPO update over `mini_batches` optimizer steps, micro-batches accumulated; a mini-batch whose
    loss or gradient is not finite is skipped (or stops the run: `non_finite: stop`) and never applied."""
    grpo, batch = cfg.grpo, step.batch
    fused = old_policy_from_update(policy, cfg)
    if fused:
        step.weights = torch.zeros_like(step.logp_old)
    with _Clock(step, "update"):
        policy.model.train()
        losses, grad_norms, clip_stats, kl_values, skipped = [], [], [], [], 0
        with policy.dense(), checkpointed_layers(policy.model, grpo.gradient_checkpointing):
            for mini in torch.arange(len(step.completions)).chunk(grpo.mini_batches):
                policy.optimizer.zero_grad(set_to_none=True)
                tokens = batch.mask[mini].sum()
                mini_loss = 0.0
                for micro, prompt in _with_shared_prompts(policy.model, batch, _pieces(step, mini, cfg)):
                    logits, span = piece_logits(policy.model, batch, micro, forward=prompt.logits)
                    logp = piece_logprobs(logits, batch, micro, span, batch.temperature)
                    if fused:  # these weights are pi_old: record it, the bounds, the TIS weights, the monitor
                        with torch.no_grad():
                            _dense_outputs(step, micro, span, logits, logp)
                            step.weights[micro] = tis_weights(step.logp_old[micro], batch.rollout_logprobs[micro],
                                                              grpo.tis_mode, grpo.tis_cap)
                        step.monitor.measure(policy, step, cfg, micro, logits.detach(), prompt)
                    loss, stats = policy_loss(grpo.policy_loss, logp, step.logp_old[micro], step.advantages[micro],
                                              batch.mask[micro], weights=step.weights[micro],
                                              clip_low=grpo.clip_low, clip_high=grpo.clip_high,
                                              dual_clip=grpo.dual_clip, aggregation=grpo.loss_aggregation)
                    if step.logp_ref is not None:
                        kl = kl_penalty(logp, step.logp_ref[micro], grpo.kl_estimator)
                        kl = (kl * batch.mask[micro]).sum() / batch.mask[micro].sum().clamp(min=1)
                        loss = loss + grpo.kl_coef * kl
                        kl_values.append(float(kl.detach()))
                    share = accumulation_share(batch.mask[micro], tokens, len(micro), len(mini), grpo.loss_aggregation)
                    (loss * share).backward()
                    mini_loss += float(loss.detach() * share)
                    clip_stats.append(stats)
                norm = float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), grpo.max_grad_norm))
                if not (math.isfinite(mini_loss) and math.isfinite(norm)):
                    what = f"loss {mini_loss} and gradient norm {norm}"
                    if grpo.non_finite == "stop":
                        raise SparrowError(f"step {number}: {what} of a mini-batch are not finite; stopping before "
                                           "the update is applied (non_finite: skip would skip it)")
                    step.warnings.append(f"{what} of a mini-batch are not finite: its update was skipped")
                    policy.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                policy.optimizer.step()
                losses.append(mini_loss)
                grad_norms.append(norm)
        policy.model.eval()
        _check_parameters(policy.model, number)
    if fused:
        step.bounds = step.bounds[batch.mask.bool()]
        step.monitor.record(step, cfg)
        step.timing["time/update_s"] -= step.monitor.seconds
    n = max(len(clip_stats), 1)
    step.update = {
        "loss": sum(losses) / len(losses) if losses else float("nan"),
        **({"kl": sum(kl_values) / len(kl_values)} if kl_values else {}),
        "grad_norm": max(grad_norms) if grad_norms else float("nan"),
        "update/skipped_mini_batches": skipped,
        "clip_ratio": sum(s["clip_frac"] for s in clip_stats) / n,
        "clip_ratio/low_mean": sum(s["clip_frac_low"] for s in clip_stats) / n,
        "clip_ratio/high_mean": sum(s["clip_frac_high"] for s in clip_stats) / n,
        "clip_ratio/dual_mean": sum(s["dual_clip_frac"] for s in clip_stats) / n,
        "learning_rate": policy.optimizer.param_groups[0]["lr"],
    }
    if policy.distiller is not None:
        step.update.update(policy.distiller.step(batch, step.logp_old, step.advantages, step.schedule, cfg))


def _with_shared_prompts(model, batch: RolloutBatch, pieces: list[torch.Tensor]):
    """Each piece with the `SharedPrompt` of its prompt, so that consecutive pieces of a group share one prompt
    forward; a prompt's backward runs once the caller is done with its last piece."""
    prompt, row = None, -1
    for piece in pieces:
        first = int(piece[0])
        if prompt is None or not same_prompt(batch, row, first):
            if prompt is not None:
                prompt.backward()
            prompt, row = piece_prompt(model, batch, piece), first
        yield piece, prompt
    if prompt is not None:
        prompt.backward()


def _check_parameters(model: torch.nn.Module, number: int) -> None:
    """Stop before a policy with non-finite weights can be saved or sampled from."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise SparrowError(f"step {number}: parameter {name} is not finite after the update (learning rate too "
                               "high?); stopping without saving it")


# -- metrics --------------------------------------------------------------------------------------------------


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
    with _Clock(step, "sync"):
        backend.sync_weights(policy.model)
    return step
