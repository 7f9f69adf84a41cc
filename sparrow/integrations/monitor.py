"""The exact tail monitor for rollouts another framework sampled: its tensors in, Sparrow's verdict out.

A step's rollouts arrive as TRL holds them (left-padded prompt ids, right-padded completion ids, masks).
`rollout_batch` packs them as a `RolloutBatch`; `measure` teacher-forces a share of them through the training
model, sparse (the decode's selection rule, `piece_acceptance`) against dense logits of the same model, both after
temperature; `gather_rows` concatenates every process's measured tokens (one verdict per step, not one per
rank); `verdict` words the metrics and warnings exactly as `sparrow train` does (`rl.step_metrics.exact_metrics`:
"below tau" only when the p5's interval is below), plus each bin's share of tokens above 0.999.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from sparrow.attention import SparseConfig
from sparrow.attention.interface import base_model
from sparrow.errors import SparrowError
from sparrow.measure.acceptance import piece_acceptance
from sparrow.measure.batch import RolloutBatch, piece_logits, piece_prompt, shared_prompt_pieces
from sparrow.metrics.tail import by_bin
from sparrow.rl.config import MonitorSection
from sparrow.rl.step_metrics import exact_metrics
from sparrow.schedules import Schedule


def rollout_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor, pad_id: int = 0,
                  tool_mask: torch.Tensor | None = None) -> RolloutBatch:
    """TRL's rollout tensors ([B, P] left-padded prompts, [B, C] right-padded completions, 1/0 masks) as a
    RolloutBatch: prompt + completion right-padded per row, `mask` over the generated tokens, `positions` the
    cached length at which each was decoded. With TRL's `tool_mask` ([B, C], 0 on tool results) the tokens a tool
    wrote stay in the context but leave the mask: the sparse actor did not sample them. Fields the monitor does not
    read (log-probs, top-K, budgets) are 0."""
    if prompt_ids.shape != prompt_mask.shape or completion_ids.shape != completion_mask.shape:
        raise SparrowError(f"prompt ids {tuple(prompt_ids.shape)} / mask {tuple(prompt_mask.shape)} and completion "
                           f"ids {tuple(completion_ids.shape)} / mask {tuple(completion_mask.shape)}: expected each "
                           "mask to have its ids' shape")
    if tool_mask is not None and tool_mask.shape != completion_ids.shape:
        raise SparrowError(f"tool mask {tuple(tool_mask.shape)} and completion ids {tuple(completion_ids.shape)}: "
                           "expected the tool mask to have the completion ids' shape")
    rows = prompt_ids.shape[0]
    prompt_lengths = prompt_mask.sum(dim=1).long().cpu()
    lengths = completion_mask.sum(dim=1).long().cpu()
    width = int((prompt_lengths + lengths).max())
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, width - 1)
    positions = torch.zeros(rows, width - 1, dtype=torch.long)
    for row in range(rows):
        p, n = int(prompt_lengths[row]), int(lengths[row])
        ids[row, :p] = prompt_ids[row][prompt_mask[row].bool()].cpu()
        ids[row, p:p + n] = completion_ids[row, :n].cpu()
        mask[row, p - 1:p - 1 + n] = 1.0 if tool_mask is None else tool_mask[row, :n].float().cpu()
        positions[row, p - 1:p - 1 + n] = p + torch.arange(n)
    zeros = torch.zeros(rows, width - 1)
    return RolloutBatch(ids, prompt_lengths, mask, zeros, zeros.long()[..., None], zeros[..., None], zeros.long(),
                        positions)


@contextlib.contextmanager
def measuring(model):
    """The model in eval mode (no dropout; transformers drops the KV cache the shared-prompt forwards need when a
    model trains with gradient checkpointing, TRL's default), then back in its mode and attention implementation,
    whatever the sparse forward switched it to."""
    inner = base_model(model)
    before, training = inner.config._attn_implementation, model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
        if inner.config._attn_implementation != before:
            inner.set_attn_implementation(before)


@torch.no_grad()
def measure(model, batch: RolloutBatch, rows: int, schedules: dict[str, Schedule], sparse: SparseConfig,
            temperature: float, max_rows: int = 8) -> dict[str, torch.Tensor]:
    """Per token of the first `rows` rows (in order): its position and its exact acceptance under each of
    `schedules` against the model's dense logits (computed once per shared-prompt piece, with the model as it is:
    a LoRA adapter TRL trains stays on, as it is in the weights vLLM samples with). The prompt's forward runs once
    per piece for the dense and every sparse forward (the prefill is dense: the same keys and values)."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    alpha = {name: torch.zeros_like(batch.mask) for name in schedules}
    with measuring(model):
        for piece in shared_prompt_pieces(batch, torch.arange(rows), max_rows):
            prompt = piece_prompt(model, batch, piece)
            dense, _ = piece_logits(model, batch, piece, prompt.logits)
            for name, schedule in schedules.items():
                alpha[name][piece] = piece_acceptance(model, batch, piece, schedule, sparse, temperature, dense,
                                                      prompt)
    valid = batch.mask[:rows].bool()
    out = {name: values[:rows][valid].double().cpu() for name, values in alpha.items()}
    out["positions"] = batch.positions[:rows][valid].double().cpu()
    return out


def gather_rows(values: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Every process's [n_rank, k] rows concatenated in rank order ([n, k] as given in one process): the per-token
    values of all ranks, so quantiles are taken once over the whole step. `device`: where the collective runs (the
    process group's device: CUDA for NCCL)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = values.device if device is None else torch.device(device)
    local = values.to(device)
    count = torch.tensor([local.shape[0]], device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    width = int(max(int(c) for c in counts))
    padded = torch.zeros((width, *local.shape[1:]), dtype=local.dtype, device=device)
    padded[:local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([part[:int(c)] for part, c in zip(parts, counts)]).to(values.device)


def verdict(alpha: np.ndarray, positions: np.ndarray, monitor: MonitorSection) -> tuple[dict, list[str]]:
    """The step's exact tail (sparrow train's `mismatch/exact/...` and `mismatch/bin_<start>/exact_...` metrics,
    and its warnings) plus `mismatch/bin_<start>/exact_frac_above_0999` per bin."""
    if len(alpha) == 0:
        raise SparrowError("the monitor got no generated tokens: expected at least one")
    metrics, warnings = exact_metrics(torch.as_tensor(alpha), torch.as_tensor(positions).long(), monitor)
    for b, values in by_bin(alpha, positions.astype(np.int64), monitor.bin_size).items():
        metrics[f"mismatch/bin_{b * monitor.bin_size}/exact_frac_above_0999"] = float(np.mean(values > 0.999))
    return metrics, warnings
