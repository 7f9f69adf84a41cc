"""Rollouts as padded tensors, and the dense policy's view of them (the trainer's recompute step).

`RolloutBatch.from_completions` packs engine completions (prompt + generated tokens, right-padded) with the
per-token records the update needs: the rollout (sparse) log-probs, the rollout's top-K log-probs and the KV
budget in force. The rest splits a batch into pieces that share a prompt and computes their logits and the
log-probs of their sampled tokens, each prompt once (the recompute, the monitor and the update all use it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.attention.teacher_forced import SharedPrompt, shared_prompt_logits
from sparrow.engine import Completion
from sparrow.errors import SparrowError


@dataclass
class RolloutBatch:
    """B sequences of prompt + completion, right-padded to T; completion tensors are [B, T - 1], aligned with the
    logits that predict each token (position t predicts token t + 1), zero where `mask` is 0."""

    input_ids: torch.Tensor  # [B, T]
    prompt_lengths: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T-1] float: 1 where the predicted token is a generated one
    rollout_logprobs: torch.Tensor  # [B, T-1]
    top_ids: torch.Tensor  # [B, T-1, K]
    top_logprobs: torch.Tensor  # [B, T-1, K]
    kv_budget: torch.Tensor  # [B, T-1]
    positions: torch.Tensor  # [B, T-1] cached length when each generated token was produced
    temperature: float = 1.0  # that of the rollout log-probs, from the completions' sampling settings

    @classmethod
    def from_completions(cls, completions: list[Completion], pad_id: int = 0) -> RolloutBatch:
        if not completions:
            raise SparrowError("no completions to batch")
        if any(not c.token_ids for c in completions):
            raise SparrowError("a completion without tokens cannot be trained on")
        width = max(len(c.prompt_token_ids) + len(c.token_ids) for c in completions)
        k = min(len(c.top_token_ids[0]) for c in completions)
        b = len(completions)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        mask = torch.zeros(b, width - 1)
        logp = torch.zeros(b, width - 1)
        top_ids = torch.zeros(b, width - 1, k, dtype=torch.long)
        top_lp = torch.full((b, width - 1, k), float("-inf"))
        budget = torch.zeros(b, width - 1, dtype=torch.long)
        positions = torch.zeros(b, width - 1, dtype=torch.long)
        for row, c in enumerate(completions):
            p, n = len(c.prompt_token_ids), len(c.token_ids)
            ids[row, : p + n] = torch.tensor(c.prompt_token_ids + c.token_ids)
            span = slice(p - 1, p - 1 + n)
            mask[row, span] = 1.0
            logp[row, span] = torch.tensor(c.logprobs)
            top_ids[row, span] = torch.tensor([t[:k] for t in c.top_token_ids])
            top_lp[row, span] = torch.tensor([t[:k] for t in c.top_logprobs])
            budget[row, span] = torch.tensor(c.kv_budget)
            positions[row, span] = p + torch.arange(n)
        lengths = torch.tensor([len(c.prompt_token_ids) for c in completions])
        return cls(ids, lengths, mask, logp, top_ids, top_lp, budget, positions, _temperature(completions))

    def to(self, device) -> RolloutBatch:
        return RolloutBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                               for k, v in self.__dict__.items()})


def _temperature(completions: list[Completion]) -> float:
    """The one temperature of the completions' log-probs (1.0 for completions that do not record theirs)."""
    found = {c.sampling.logprob_temperature for c in completions if c.sampling is not None}
    if len(found) > 1:
        raise SparrowError(f"completions sampled at different temperatures {sorted(found)} cannot share a batch: "
                           "their log-probs are of different distributions")
    return found.pop() if found else 1.0


def same_prompt(batch: RolloutBatch, a: int, b: int) -> bool:
    """Whether rows `a` and `b` were sampled from the same prompt."""
    p = int(batch.prompt_lengths[a])
    return int(batch.prompt_lengths[b]) == p and torch.equal(batch.input_ids[a, :p], batch.input_ids[b, :p])


def shared_prompt_pieces(batch: RolloutBatch, rows: torch.Tensor, max_rows: int) -> list[torch.Tensor]:
    """Split `rows` into runs of consecutive rows with the same prompt, at most `max_rows` each.

    The engine returns the n completions of a prompt next to each other, so a GRPO group becomes one piece
    (or a few when `max_rows` < n), and each piece needs its prompt computed only once.
    """
    pieces, run = [], [int(rows[0])]
    for row in rows[1:].tolist():
        if len(run) < max_rows and same_prompt(batch, run[0], row):
            run.append(row)
        else:
            pieces.append(torch.tensor(run))
            run = [row]
    pieces.append(torch.tensor(run))
    return pieces


def piece_logits(model, batch: RolloutBatch, piece: torch.Tensor,
                 forward=shared_prompt_logits) -> tuple[torch.Tensor, slice]:
    """`forward(model, input_ids, prompt_length)` (the dense `shared_prompt_logits` by default; the sparse
    actor's is `sparse_completion_logits`) for one piece, trimmed to its longest sequence,
    and the slice of the [B, T-1] layout (mask, log-probs) its positions cover."""
    p = int(batch.prompt_lengths[piece[0]])
    end = int(batch.mask[piece].sum(dim=0).nonzero().max()) + 2
    return forward(model, batch.input_ids[piece, :end], p), slice(p - 1, end - 1)


def piece_prompt(model, batch: RolloutBatch, piece: torch.Tensor) -> SharedPrompt:
    """The `SharedPrompt` of a shared-prompt piece: its prompt's forward, for every forward of the piece whose
    prompt keys and values are the same (`piece_logits(..., prompt.logits)`)."""
    first = int(piece[0])
    return SharedPrompt(model, batch.input_ids[first:first + 1, :int(batch.prompt_lengths[first])])


def piece_logprobs(logits: torch.Tensor, batch: RolloutBatch, piece: torch.Tensor, span: slice,
                   temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of the sampled tokens of a piece, in the batch's [len(piece), T-1] layout (0 elsewhere)."""
    targets = batch.input_ids[piece, span.start + 1: span.stop + 1]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (span.start, batch.mask.shape[1] - span.stop))
