"""Bounds on the acceptance rate when the rollout policy p is known only on its top-K tokens.

Training keeps the rollout engine's top-K log-probs, not full sparse distributions, so alpha = sum_v min(p, q)
cannot be computed exactly there; these bounds bracket it with the dense logits of the recompute (SPEC 2).
"""

from __future__ import annotations

import torch

from sparrow.errors import SparrowError
from sparrow.metrics.checks import (
    check_int_tensor,
    check_logits,
    check_temperature,
    describe,
    first_index,
    position_name,
    raise_bad_rows,
)
from sparrow.metrics.divergence import chunk_rows, scaled

_BOUNDS_TEMPS = 4  # float32 [rows, vocab] temporaries alive at once
_PROB_SUM_TOL = 1e-2


def acceptance_bounds(top_ids: torch.Tensor, top_logprobs_p: torch.Tensor, logits_q: torch.Tensor,
                      temperature: float = 1.0, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds on alpha when p is known only on a top-K set S (as the engine records it).

    lower = sum_{v in S} min(p(v), q(v)); upper = lower + min(1 - p(S), 1 - q(S)). `top_logprobs_p` are log p
    after temperature; `logits_q` are raw dense logits, softmaxed here after dividing by `temperature`.
    """
    lead, vocab = check_logits(logits_q, "logits_q")
    temp = check_temperature(temperature)
    ids = check_int_tensor(top_ids, "top_ids")
    if not isinstance(top_logprobs_p, torch.Tensor) or not top_logprobs_p.is_floating_point():
        raise SparrowError(f"top_logprobs_p must be a floating-point torch.Tensor, got {describe(top_logprobs_p)}")
    if ids.dim() != len(lead) + 1 or tuple(ids.shape[:-1]) != lead:
        raise SparrowError(f"top_ids has shape {tuple(ids.shape)}: expected {lead + ('K',)} to match logits_q "
                           f"of shape {tuple(logits_q.shape)}")
    if top_logprobs_p.shape != ids.shape:
        raise SparrowError(f"top_logprobs_p has shape {tuple(top_logprobs_p.shape)}: expected the shape of top_ids "
                           f"{tuple(ids.shape)}")
    k = ids.shape[-1]
    if k > vocab:
        raise SparrowError(f"top-K size {k} exceeds the vocabulary size {vocab}")
    device = logits_q.device
    ids = ids.reshape(-1, k).to(device=device, dtype=torch.long)
    logprobs = top_logprobs_p.reshape(-1, k).to(device)
    _check_top_set(ids, logprobs, lead, vocab)
    flat_q = logits_q.reshape(-1, vocab)
    n = flat_q.shape[0]
    step = chunk_rows(chunk_size, vocab, _BOUNDS_TEMPS)
    lower = torch.empty(n, dtype=torch.float32, device=device)
    upper = torch.empty(n, dtype=torch.float32, device=device)
    for s in range(0, n, step):
        e = min(n, s + step)
        lq = scaled(flat_q[s:e], temp)
        lse = torch.logsumexp(lq, -1, keepdim=True)
        raise_bad_rows(~torch.isfinite(lse).squeeze(-1), s, (flat_q, "logits_q"), None, lead, temp)
        q_s = lq.gather(-1, ids[s:e]).sub_(lse).exp_()
        del lq
        p_s = logprobs[s:e].float().exp()
        low = torch.minimum(p_s, q_s).sum(-1)
        gap = torch.minimum((1 - p_s.sum(-1)).clamp_(min=0), (1 - q_s.sum(-1)).clamp_(min=0))
        lower[s:e] = low.clamp(0, 1)
        upper[s:e] = (low + gap).clamp_(0, 1)
    return lower.reshape(lead), upper.reshape(lead)


def _check_top_set(ids: torch.Tensor, logprobs: torch.Tensor, lead, vocab: int) -> None:
    """Top-K ids must be in range and distinct per position; log-probs real with total probability <= 1."""
    bad = ((ids < 0) | (ids >= vocab)).any(-1)
    if bad.any():
        i = first_index(bad)
        row = ids[i]
        j = first_index((row < 0) | (row >= vocab))
        raise SparrowError(f"top_ids at {position_name(i, lead)} holds id {int(row[j])}: expected ids in "
                           f"[0, {vocab})")
    if ids.shape[-1] > 1:
        sorted_ids = ids.sort(-1).values
        dup = sorted_ids[:, 1:] == sorted_ids[:, :-1]
        bad = dup.any(-1)
        if bad.any():
            i = first_index(bad)
            value = int(sorted_ids[i, 1:][dup[i]][0])
            raise SparrowError(f"top_ids at {position_name(i, lead)} lists id {value} twice: expected distinct ids")
    nan = torch.isnan(logprobs).any(-1)
    if nan.any():
        raise SparrowError(f"top_logprobs_p has NaN at {position_name(first_index(nan), lead)}: expected "
                           f"log-probabilities")
    total = logprobs.double().exp().sum(-1)
    over = total > 1 + _PROB_SUM_TOL
    if over.any():
        i = first_index(over)
        raise SparrowError(f"top_logprobs_p at {position_name(i, lead)} sums to probability {float(total[i]):.6g} "
                           f"> 1: expected log-probabilities (after temperature), not logits")
