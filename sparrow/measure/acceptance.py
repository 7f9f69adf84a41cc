"""Exact acceptance of finished rollouts: alpha = sum_v min(p_sparse(v), p_dense(v)) for every generated token.

Any backend's completions can be measured afterwards: their tokens are teacher-forced through our sparse forward
(the decode's selection rule at every position, `sparse_completion_logits`) and our dense forward, both after
temperature; a DistillSparse adapter is on for the sparse actor and off for the dense policy. `profile`, the
DistillSparse probes and training-time monitoring all call `piece_acceptance` / `teacher_forced_acceptance`.

`lockstep_acceptance` is the independent reference: it replays the tokens through our decode path, a sparse and
a dense KV cache side by side, one token at a time. Tests hold the two equal; it is far slower.
"""

from __future__ import annotations

import functools
import math

import torch
from tqdm.auto import tqdm

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import SharedPrompt, sparse_completion_logits
from sparrow.engine import Completion
from sparrow.lora import has_adapter, without_adapter
from sparrow.metrics.divergence import acceptance_rate
from .batch import RolloutBatch, piece_logits, piece_prompt, shared_prompt_pieces
from sparrow.schedules import DENSE, Schedule


def monitored_rows(rows: int, share: float) -> int:
    """How many of `rows` rollouts the exact monitor measures: the first ceil(share * rows) (the trainer, the TRL
    integration and the cost model's price of a monitored step)."""
    return min(rows, math.ceil(share * rows))


def piece_acceptance(model, batch: RolloutBatch, piece: torch.Tensor, schedule: Schedule, sparse: SparseConfig,
                     temperature: float, dense_logits: torch.Tensor | None = None,
                     prompt: SharedPrompt | None = None) -> torch.Tensor:
    """Exact acceptance [len(piece), T-1] of one shared-prompt piece (0 where `mask` is 0).

    `dense_logits` (the dense forward of the same rows, e.g. the trainer's recompute, possibly over a longer span
    when they are some rows of a larger piece) saves a forward; `prompt`
    (the `SharedPrompt` of that forward, when the sparse actor has the same weights: no adapter, or the same one on
    in both) saves the sparse forward's prompt. Without `dense_logits`, both forwards run here and share the prompt
    unless an adapter makes the sparse actor's prefill differ from the dense policy's."""
    with torch.no_grad():
        if dense_logits is None:
            with without_adapter(model):
                prompt = piece_prompt(model, batch, piece)
                dense_logits, _ = piece_logits(model, batch, piece, prompt.logits)
            if has_adapter(model):
                prompt = None
        actor = functools.partial(sparse_completion_logits, schedule=schedule, sparse=sparse, prompt=prompt)
        sparse_logits, span = piece_logits(model, batch, piece, actor)
        dense_logits = dense_logits[:, :sparse_logits.shape[1]]  # both spans start at the prompt's end
    valid = batch.mask[piece, span].bool()
    out = torch.zeros(len(piece), batch.mask.shape[1], device=batch.mask.device)
    window = out[:, span]
    window[valid] = acceptance_rate(sparse_logits[valid], dense_logits[valid], temperature).to(out.device)
    return out


def teacher_forced_acceptance(model, completions: list[Completion], schedule: Schedule, sparse: SparseConfig,
                              temperature: float, max_rows: int = 8, pad_id: int = 0,
                              progress: bool = False) -> list[list[float]]:
    """Per completion, the exact acceptance of each generated token under `schedule` against the dense policy
    (`progress`: a bar over the shared-prompt pieces, minutes on long prompts)."""
    device = next(model.parameters()).device
    batch = RolloutBatch.from_completions(completions, pad_id=pad_id).to(device)
    alpha = torch.zeros_like(batch.mask)
    pieces = shared_prompt_pieces(batch, torch.arange(len(completions)), max_rows)
    for piece in tqdm(pieces, desc="measuring", unit="group", disable=not progress):
        alpha[piece] = piece_acceptance(model, batch, piece, schedule, sparse, temperature)
    return [alpha[row][batch.mask[row].bool()].tolist() for row in range(len(completions))]


@torch.no_grad()
def lockstep_acceptance(engine, completion: Completion, schedule: Schedule, temperature: float) -> list[float]:
    """The reference measurement: `completion`'s tokens fed one at a time through the engine's sparse and dense
    decode (two caches), acceptance of each token from the two next-token distributions on the same prefix."""
    prompt, tokens = completion.prompt_token_ids, completion.token_ids
    rows = torch.zeros(1, dtype=torch.long, device=engine.device)
    caches = [engine.new_cache(1, len(prompt) + len(tokens)) for _ in range(2)]
    with without_adapter(engine.model):
        dense = engine.prefill(caches[1], prompt, rows)[None]
    actor = engine.prefill(caches[0], prompt, rows)[None]
    alphas = []
    for i, token in enumerate(tokens):
        alphas.append(float(acceptance_rate(actor, dense, temperature)[0]))
        if i + 1 == len(tokens):
            break
        step = torch.tensor([token], device=engine.device)
        actor, _ = engine.decode_step(caches[0], step, schedule)
        with without_adapter(engine.model):
            dense, _ = engine.decode_step(caches[1], step, DENSE)
    return alphas
