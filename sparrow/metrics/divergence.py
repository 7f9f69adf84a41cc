"""Exact acceptance rate of two next-token distributions given as full logits (SPEC section 2).

alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q) is the per-token mismatch between the sparse rollout policy p and the
dense policy q. Logits of one long completion are large ([32K, 152K]), so the pass runs over chunks of positions
that keep the float32 temporaries under 512 MB, whatever the input dtype; `bounds` chunks the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from sparrow.errors import SparrowError
from sparrow.metrics.checks import check_logits, check_temperature, raise_bad_rows

_CHUNK_BYTES = 512 * 2**20
_ALPHA_TEMPS = 6  # float32 [rows, vocab] temporaries alive at once in acceptance_rate


def acceptance_rate(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0,
                    chunk_size: int | None = None) -> torch.Tensor:
    """Exact per-position alpha = sum_v min(p(v), q(v)) of softmax(logits / temperature); shape [...] float32."""
    lead, vocab = check_logits(logits_p, "logits_p")
    check_logits(logits_q, "logits_q")
    if logits_p.shape != logits_q.shape:
        raise SparrowError(f"logits_p has shape {tuple(logits_p.shape)} but logits_q has shape "
                           f"{tuple(logits_q.shape)}: expected identical shapes [..., vocab]")
    if logits_p.device != logits_q.device:
        raise SparrowError(f"logits_p is on {logits_p.device} but logits_q is on {logits_q.device}: "
                           f"expected the same device")
    temp = check_temperature(temperature)
    flat_p, flat_q = logits_p.reshape(-1, vocab), logits_q.reshape(-1, vocab)
    n = flat_p.shape[0]
    step = chunk_rows(chunk_size, vocab, _ALPHA_TEMPS)
    alpha = torch.empty(n, dtype=torch.float32, device=logits_p.device)
    for s in range(0, n, step):
        e = min(n, s + step)
        logp = scaled(flat_p[s:e], temp)
        logq = scaled(flat_q[s:e], temp)
        lse_p = torch.logsumexp(logp, -1, keepdim=True)
        lse_q = torch.logsumexp(logq, -1, keepdim=True)
        bad = ~(torch.isfinite(lse_p) & torch.isfinite(lse_q)).squeeze(-1)
        raise_bad_rows(bad, s, (flat_p, "logits_p"), (flat_q, "logits_q"), lead, temp)
        p, q = logp.sub_(lse_p).exp(), logq.sub_(lse_q).exp()
        alpha[s:e] = torch.minimum(p, q).sum(-1).clamp_(0, 1)
    return alpha.reshape(lead)


def scaled(chunk: torch.Tensor, temp: float) -> torch.Tensor:
    """A fresh float32 copy of chunk / temperature (safe to modify in place)."""
    return torch.div(chunk.to(torch.float32), temp)


def chunk_rows(chunk_size, vocab: int, temps: int) -> int:
    """Rows per chunk: the caller's chunk_size, or as many as keep `temps` float32 [rows, vocab] under 512 MB."""
    if chunk_size is None:
        return max(1, _CHUNK_BYTES // (vocab * 4 * temps))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise SparrowError(f"chunk_size must be None or an integer >= 1, got {chunk_size!r}")
    return int(chunk_size)
