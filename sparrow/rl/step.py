"""One GRPO step on sparse rollouts: generate, score, normalize, recompute dense, TIS-weighted PPO update.

This is the core the trainer command wraps (groundwork for it: logging, checkpoints and monitoring live
around this function, not in it). The dense policy's log-probs `pi_old` are recomputed with the model's own
attention (no Sparrow context, so dense), and the update runs on those same dense forward passes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from sparrow.datasets import Example
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.errors import SparrowError
from sparrow.metrics import acceptance_bounds, tail_stats
from sparrow.rewards.runner import score
from sparrow.schedules import Schedule

from .batch import RolloutBatch, piece_logits, piece_logprobs, shared_prompt_pieces
from .losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    grpo_advantages,
    kl_penalty,
    ppo_clip_loss,
    tis_stats,
    tis_weights,
)


@dataclass(frozen=True)
class StepSettings:
    """Per-step GRPO settings; the defaults follow the release (SPEC section 7)."""

    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    tis_mode: str = "truncate"
    tis_cap: float = 2.0
    loss_aggregation: str = "token-mean"
    mini_batches: int = 1
    micro_batch_size: int = 4
    max_grad_norm: float = 1.0
    tau: float = 0.86
    bin_size: int = 2000
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    num_logprobs: int = 20

    def __post_init__(self):
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise SparrowError(f"unknown loss_aggregation {self.loss_aggregation!r}: expected one of "
                               f"{', '.join(LOSS_AGGREGATIONS)}")
        for name in ("num_generations", "max_new_tokens", "mini_batches", "micro_batch_size", "bin_size",
                     "num_logprobs"):
            if getattr(self, name) < 1:
                raise SparrowError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kl_coef < 0:
            raise SparrowError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise SparrowError(f"unknown kl_estimator {self.kl_estimator!r}: expected one of "
                               f"{', '.join(KL_ESTIMATORS)}")
        if self.max_grad_norm <= 0:
            raise SparrowError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")


def _pieces(batch: RolloutBatch, rows: torch.Tensor, settings: StepSettings) -> list[torch.Tensor]:
    return shared_prompt_pieces(batch, rows, settings.micro_batch_size)


def _policy_logprobs(model, batch: RolloutBatch, piece: torch.Tensor, temperature: float) -> torch.Tensor:
    logits, span = piece_logits(model, batch, piece)
    return piece_logprobs(logits, batch, piece, span, temperature)


def _recompute(model, batch: RolloutBatch, settings: StepSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_old of the sampled tokens, and bounds [N, 2] (lower, upper) on each generated token's acceptance rate.

    The bounds come from the rollout's top-K log-probs against the full dense distribution (SPEC section 2):
    full sparse distributions are not kept. Rows run in shared-prompt pieces (`shared_prompt_logits`), so each
    prompt is computed once per group.
    """
    logp_old = torch.zeros_like(batch.rollout_logprobs)
    bounds = torch.zeros(*batch.mask.shape, 2, device=batch.mask.device)
    for piece in _pieces(batch, torch.arange(batch.input_ids.shape[0]), settings):
        logits, span = piece_logits(model, batch, piece)
        logp_old[piece] = piece_logprobs(logits, batch, piece, span, settings.temperature)
        valid = batch.mask[piece, span].bool()
        low, high = acceptance_bounds(batch.top_ids[piece, span][valid], batch.top_logprobs[piece, span][valid],
                                      logits[valid], settings.temperature)
        found = torch.zeros(*valid.shape, 2, device=valid.device)
        found[valid] = torch.stack([low, high], dim=-1)
        bounds[piece.tolist(), span] = found
    return logp_old, bounds[batch.mask.bool()]


def mismatch_metrics(bounds: torch.Tensor, positions: torch.Tensor, settings: StepSettings,
                     sparse: bool = True) -> tuple[dict, list[str]]:
    """Per length bin: the 5th percentile and mean of the acceptance lower and upper bounds ([N, 2]); a warning
    for each bin whose tail is below tau (upper bound's p5 < tau) or, for sparse rollouts, may be (only the lower
    bound's is). Dense rollouts differ from the dense policy only by numerics, where the loose lower bound of a
    flat distribution would warn for nothing."""
    metrics, warnings, tails = {}, [], {}
    for column, side in enumerate(("lower", "upper")):
        stats = tail_stats(bounds[:, column].cpu(), positions.cpu(), settings.bin_size)
        metrics[f"mismatch/acceptance_{side}/p5"] = stats["overall"]["p5"]
        metrics[f"mismatch/acceptance_{side}/mean"] = stats["overall"]["mean"]
        for b in stats["bins"]:
            metrics[f"mismatch/bin_{b['start']}/acceptance_{side}_p5"] = b["p5"]
            metrics[f"mismatch/bin_{b['start']}/acceptance_{side}_mean"] = b["mean"]
            tails.setdefault((b["start"], b["end"], b["count"]), []).append(b["p5"])
    for (start, end, count), (low, high) in tails.items():
        if high < settings.tau:
            warnings.append(f"length bin [{start}, {end}): 5th percentile of acceptance is below tau {settings.tau} "
                            f"(bounds {low:.3f}..{high:.3f} over {count} tokens)")
        elif low < settings.tau and sparse:
            warnings.append(f"length bin [{start}, {end}): 5th percentile of acceptance may be below tau "
                            f"{settings.tau} (bounds {low:.3f}..{high:.3f} over {count} tokens; more top-K "
                            f"log-probs per token (num_logprobs) tighten them)")
    return metrics, warnings


def _status_counts(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return counts


def grpo_step(model, engine: RolloutEngine, optimizer: torch.optim.Optimizer, examples: list[Example],
              reward_fns: list, schedule: Schedule, settings: StepSettings, seed: int, reference=None,
              distill=None) -> dict:
    """Run one step on `examples` and return its metrics (plain floats, TRL/verl-style names; the list
    `mismatch/warnings` names the length bins whose tail acceptance fell below tau).

    With `distill` (a `sparrow.rl.distill.Distiller`), the recompute and the policy update run with its adapter
    disabled, and after the policy step the adapter takes its own step (DistillSparse, `distill/...` metrics).
    """
    dense = distill.dense if distill is not None else contextlib.nullcontext
    n = settings.num_generations
    sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                              num_logprobs=settings.num_logprobs,
                              top_p=settings.top_p, seed=seed)
    model.eval()
    clock = time.perf_counter()
    completions = engine.generate([ex.prompt for ex in examples], sampling, schedule, num_samples=n)
    timing = {"time/rollout_s": time.perf_counter() - clock}
    clock = time.perf_counter()
    prompts = [examples[c.prompt_index].prompt for c in completions]
    columns = {"answer": [examples[c.prompt_index].answer for c in completions]}
    for key in examples[0].columns:
        columns.setdefault(key, [examples[c.prompt_index].columns.get(key) for c in completions])
    scored = score(reward_fns, prompts, [c.text for c in completions], columns)
    rewards = torch.tensor(scored.totals, dtype=torch.float32).view(len(examples), n)
    advantages = grpo_advantages(rewards).flatten()
    timing["time/reward_s"] = time.perf_counter() - clock
    clock = time.perf_counter()

    batch = RolloutBatch.from_completions(completions, pad_id=engine.tokenizer.pad_token_id or 0)
    device = next(model.parameters()).device
    batch = batch.to(device)
    advantages = advantages.to(device)
    with torch.no_grad(), dense():
        logp_old, bounds = _recompute(model, batch, settings)
    mismatch, warnings = mismatch_metrics(bounds, batch.positions[batch.mask.bool()], settings,
                                          sparse=not schedule.is_dense)
    logp_ref = None
    if settings.kl_coef > 0:
        if reference is None:
            raise SparrowError("kl_coef > 0 needs a reference model")
        with torch.no_grad():
            logp_ref = torch.zeros_like(logp_old)
            for piece in _pieces(batch, torch.arange(len(completions)), settings):
                logp_ref[piece] = _policy_logprobs(reference, batch, piece, settings.temperature)
    weights = tis_weights(logp_old, batch.rollout_logprobs, settings.tis_mode, settings.tis_cap)
    timing["time/recompute_s"] = time.perf_counter() - clock
    clock = time.perf_counter()

    model.train()
    order = torch.arange(len(completions))
    losses, grad_norms, clip_stats, kl_values = [], [], [], []
    with dense():
        for mini in order.chunk(settings.mini_batches):
            optimizer.zero_grad(set_to_none=True)
            tokens = batch.mask[mini].sum()
            for micro in _pieces(batch, mini, settings):
                logp = _policy_logprobs(model, batch, micro, settings.temperature)
                loss, stats = ppo_clip_loss(logp, logp_old[micro], advantages[micro], batch.mask[micro],
                                            weights=weights[micro], clip_low=settings.clip_low,
                                            clip_high=settings.clip_high, dual_clip=settings.dual_clip,
                                            aggregation=settings.loss_aggregation)
                if logp_ref is not None:
                    kl = kl_penalty(logp, logp_ref[micro], settings.kl_estimator)
                    kl = (kl * batch.mask[micro]).sum() / batch.mask[micro].sum().clamp(min=1)
                    loss = loss + settings.kl_coef * kl
                    kl_values.append(float(kl.detach()))
                share = (batch.mask[micro].sum() / tokens if settings.loss_aggregation == "token-mean"
                         else torch.tensor(len(micro) / len(mini)))
                (loss * share).backward()
                losses.append(float(loss.detach() * share))
                clip_stats.append(stats)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)))
            optimizer.step()
    model.eval()
    timing["time/update_s"] = time.perf_counter() - clock
    distilled = distill.step(batch, logp_old, advantages, schedule, settings) if distill is not None else {}

    valid = batch.mask.bool()
    diff = (batch.rollout_logprobs - logp_old)[valid].abs()
    ratio = tis_stats(logp_old, batch.rollout_logprobs, batch.mask, settings.tis_cap)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/frac_zero_std_groups": float((rewards.std(dim=1, unbiased=False) == 0).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "loss": sum(losses) / settings.mini_batches,
        **({"kl": sum(kl_values) / len(kl_values)} if kl_values else {}),
        "grad_norm": max(grad_norms),
        "clip_ratio": sum(s["clip_frac"] for s in clip_stats) / len(clip_stats),
        "clip_ratio/low_mean": sum(s["clip_frac_low"] for s in clip_stats) / len(clip_stats),
        "clip_ratio/high_mean": sum(s["clip_frac_high"] for s in clip_stats) / len(clip_stats),
        "clip_ratio/dual_mean": sum(s["dual_clip_frac"] for s in clip_stats) / len(clip_stats),
        "learning_rate": optimizer.param_groups[0]["lr"],
        "sampling/importance_sampling_ratio/min": ratio["ratio_min"],
        "sampling/importance_sampling_ratio/mean": ratio["ratio_mean"],
        "sampling/importance_sampling_ratio/max": ratio["ratio_max"],
        "sampling/importance_sampling_ratio/frac_truncated": ratio["frac_above_cap"],
        "sampling/sampling_logp_difference/mean": float(diff.mean()),
        "sampling/sampling_logp_difference/max": float(diff.max()),
        "rewards/records": {name: _status_counts(rows) for name, rows in scored.records.items()},
        "rewards/failures": [{"reward": name, "sample": i, "prompt_index": completions[i].prompt_index, **row}
                             for name, rows in scored.records.items() for i, row in enumerate(rows)
                             if row["status"] != "ok"][:8],
        "rollout/kv_budget_mean": float(batch.kv_budget[valid].float().mean()),
        "rollout/tokens_per_s": float(lengths.sum()) / timing["time/rollout_s"],
        **timing,
        **mismatch,
        "mismatch/warnings": warnings,
        **distilled,
    }
