"""The dense side of a GRPO step: the dense policy's forwards over the rollouts and what they give.

Rows run in shared-prompt pieces (`pieces`), so each prompt is computed once per piece; the update's micro-batches
of one group share one prompt forward and one backward through it. Each forward gives a piece's logits and the
log-probs of its sampled tokens; from them `record_old_policy` records pi_old and the top-K bounds on each token's
acceptance, and the monitor (monitor.py) compares its sparse forwards with the same dense logits. The recompute
runs `recompute_forwards` (no gradients) and `reference_logprobs` (the KL reference); the update runs
`update_forwards`, which, when the update's own forward is pi_old (`old_policy_from_update`), records pi_old, the
bounds, the TIS weights and the monitor there, and the recompute runs no forward.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sparrow.measure.batch import (RolloutBatch, piece_logits, piece_logprobs, piece_prompt, same_prompt,
                                   shared_prompt_pieces)
from sparrow.measure.bounds import acceptance_bounds

from .config import StepConfig
from .losses import tis_weights
from .step_state import Policy, StepBatch


def old_policy_from_update(policy: Policy, cfg: StepConfig) -> bool:
    """Whether pi_old comes from the update's own forward instead of a recompute. With one optimizer step per GRPO
    step the update's forwards all run the weights the rollouts' recompute would (the optimizer steps after the
    last micro-batch), so pi_old is their log-prob, detached, and the PPO ratio is 1 (TRL does the same with one
    iteration); the monitor compares its sparse forwards with these same dense logits. That saves a dense forward
    over every rollout, a sixth of a long-answer step. Not with several mini-batches (later ones run updated
    weights) or DistillSparse (its adapter step reads the recompute)."""
    return cfg.grpo.mini_batches == 1 and policy.distiller is None


def pieces(step: StepBatch, rows: torch.Tensor, cfg: StepConfig, grad: bool = True) -> list[torch.Tensor]:
    """Shared-prompt pieces of `rows`: `micro_batch_size` rows at most for the update, `log_prob_micro_batch_size`
    for the forwards without gradients (a whole group there computes a long prompt once instead of per piece)."""
    grpo = cfg.grpo
    size = grpo.micro_batch_size if grad or grpo.log_prob_micro_batch_size is None else grpo.log_prob_micro_batch_size
    return shared_prompt_pieces(step.batch, rows, size)


def record_old_policy(step: StepBatch, piece: torch.Tensor, span: slice, logits: torch.Tensor,
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


def recompute_forwards(policy: Policy, step: StepBatch, cfg: StepConfig) -> None:
    """pi_old and the bounds of every row from the dense policy's forward without gradients, and the monitor's
    sparse forwards against these logits, reusing the piece's prompt (the prefill is dense) unless a DistillSparse
    adapter changes it (the sparse actor's prefill is then its own)."""
    batch = step.batch
    for piece in pieces(step, torch.arange(batch.input_ids.shape[0]), cfg, grad=False):
        with torch.no_grad(), policy.dense():
            prompt = piece_prompt(policy.model, batch, piece)
            logits, span = piece_logits(policy.model, batch, piece, prompt.logits)
            record_old_policy(step, piece, span, logits, piece_logprobs(logits, batch, piece, span, batch.temperature))
        step.monitor.measure(policy, step, cfg, piece, logits, prompt if policy.distiller is None else None)


def reference_logprobs(policy: Policy, step: StepBatch, cfg: StepConfig) -> torch.Tensor:
    """The frozen KL reference's log-probs of the sampled tokens [N, T]."""
    batch = step.batch
    logp_ref = torch.zeros_like(step.logp_old)
    with torch.no_grad():
        for piece in pieces(step, torch.arange(len(step.completions)), cfg, grad=False):
            ref_logits, span = piece_logits(policy.reference, batch, piece)
            logp_ref[piece] = piece_logprobs(ref_logits, batch, piece, span, batch.temperature)
    return logp_ref


def update_forwards(policy: Policy, step: StepBatch, cfg: StepConfig, rows: torch.Tensor,
                    fused: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(micro-batch, its log-probs with gradients) over `rows` (a mini-batch), for the caller's loss and backward;
    a group's prompt forward is shared by its micro-batches and its backward runs after the caller's for the last of
    them. With `fused` (`old_policy_from_update`) these weights are pi_old: each micro-batch's pi_old, bounds, TIS
    weights and monitor are recorded from this forward."""
    batch, grpo = step.batch, cfg.grpo
    for micro, prompt in _with_shared_prompts(policy.model, batch, pieces(step, rows, cfg)):
        logits, span = piece_logits(policy.model, batch, micro, forward=prompt.logits)
        logp = piece_logprobs(logits, batch, micro, span, batch.temperature)
        if fused:
            with torch.no_grad():
                record_old_policy(step, micro, span, logits, logp)
                step.weights[micro] = tis_weights(step.logp_old[micro], batch.rollout_logprobs[micro],
                                                  grpo.tis_mode, grpo.tis_cap)
            step.monitor.measure(policy, step, cfg, micro, logits.detach(), prompt)
        yield micro, logp


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
