"""Per-token mismatch between the sparse rollout policy p and the dense policy q (SPEC section 2).

The central quantity is the acceptance rate alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q). Full-vocabulary
metrics run in chunks of positions so a [32K, 152K] pair of logits needs only a bounded amount of extra memory;
everything is computed in float32 whatever the input dtype. `tail_stats` summarizes alpha per length bin with
the statistic that predicts stability: the 5th percentile, not the mean (SPEC 2; p1 and p50 come with it).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from sparrow.errors import SparrowError

_CHUNK_BYTES = 512 * 2**20
_ALPHA_TEMPS = 6
_FULL_TEMPS = 10
_BOUNDS_TEMPS = 4
_PROB_SUM_TOL = 1e-2
_ALPHA_TOL = 1e-5
_MIN_BETA_TAIL = 20
_DIVERGENCES = ("alpha", "tv", "kl_pq", "kl_qp")
TAIL_THRESHOLD = 0.999


def acceptance_rate(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0,
                    chunk_size: int | None = None) -> torch.Tensor:
    """Exact per-position alpha = sum_v min(p(v), q(v)) of softmax(logits / temperature); shape [...] float32."""
    return _full_pass(logits_p, logits_q, temperature, chunk_size, ("alpha",), None)["alpha"]


def divergences(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0,
                tokens: torch.Tensor | None = None, chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """alpha, tv, kl_pq, kl_qp (and with `tokens`: ratio = q/p and logp_diff = log p - log q) in one pass.

    KL uses 0 * log 0 = 0 and is +inf where a token is unmasked under one model and masked (-inf) under the other.
    """
    want = _DIVERGENCES + (("ratio", "logp_diff") if tokens is not None else ())
    return _full_pass(logits_p, logits_q, temperature, chunk_size, want, tokens)


def tv_distance(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0,
                chunk_size: int | None = None) -> torch.Tensor:
    """Total variation 0.5 * sum_v |p(v) - q(v)| per position (= 1 - alpha)."""
    return _full_pass(logits_p, logits_q, temperature, chunk_size, ("tv",), None)["tv"]


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0, direction: str = "pq",
                  chunk_size: int | None = None) -> torch.Tensor:
    """KL(p || q) per position for direction "pq", KL(q || p) for "qp"."""
    if direction not in ("pq", "qp"):
        raise SparrowError(f"unknown KL direction {direction!r}: expected 'pq' (KL(p||q)) or 'qp' (KL(q||p))")
    key = f"kl_{direction}"
    return _full_pass(logits_p, logits_q, temperature, chunk_size, (key,), None)[key]


def importance_ratio(logits_p: torch.Tensor, logits_q: torch.Tensor, tokens: torch.Tensor,
                     temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """q(token) / p(token) per position: the dense / rollout importance ratio of the sampled tokens."""
    if tokens is None:
        raise SparrowError("importance_ratio needs tokens: an integer tensor with the sampled token per position")
    return _full_pass(logits_p, logits_q, temperature, chunk_size, ("ratio",), tokens)["ratio"]


def acceptance_bounds(top_ids: torch.Tensor, top_logprobs_p: torch.Tensor, logits_q: torch.Tensor,
                      temperature: float = 1.0, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds on alpha when p is known only on a top-K set S (as the engine records it).

    lower = sum_{v in S} min(p(v), q(v)); upper = lower + min(1 - p(S), 1 - q(S)). `top_logprobs_p` are log p
    after temperature; `logits_q` are raw dense logits, softmaxed here after dividing by `temperature`.
    """
    lead, vocab = _check_logits(logits_q, "logits_q")
    temp = _check_temperature(temperature)
    ids = _check_int_tensor(top_ids, "top_ids")
    if not isinstance(top_logprobs_p, torch.Tensor) or not top_logprobs_p.is_floating_point():
        raise SparrowError(f"top_logprobs_p must be a floating-point torch.Tensor, got {_describe(top_logprobs_p)}")
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
    step = _chunk_rows(chunk_size, vocab, _BOUNDS_TEMPS)
    lower = torch.empty(n, dtype=torch.float32, device=device)
    upper = torch.empty(n, dtype=torch.float32, device=device)
    for s in range(0, n, step):
        e = min(n, s + step)
        lq = _scaled(flat_q[s:e], temp)
        lse = torch.logsumexp(lq, -1, keepdim=True)
        _raise_bad_rows(~torch.isfinite(lse).squeeze(-1), s, (flat_q, "logits_q"), None, lead, temp)
        q_s = lq.gather(-1, ids[s:e]).sub_(lse).exp_()
        del lq
        p_s = logprobs[s:e].float().exp()
        low = torch.minimum(p_s, q_s).sum(-1)
        gap = torch.minimum((1 - p_s.sum(-1)).clamp_(min=0), (1 - q_s.sum(-1)).clamp_(min=0))
        lower[s:e] = low.clamp(0, 1)
        upper[s:e] = (low + gap).clamp_(0, 1)
    return lower.reshape(lead), upper.reshape(lead)


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, equal to numpy's default `np.percentile`.

    Uses kthvalue, not torch.quantile (which refuses large tensors).
    """
    q = _check_number(q, "percentile q")
    if not 0 <= q <= 100:
        raise SparrowError(f"percentile q must be in [0, 100], got {q}")
    flat = _as_float_tensor(values, "values").reshape(-1)
    if flat.numel() == 0:
        raise SparrowError("cannot take a percentile of an empty tensor: expected at least one value")
    if torch.isnan(flat).any():
        raise SparrowError(f"values contain NaN (first at flat index {_first(torch.isnan(flat))}): "
                           f"expected real numbers")
    n = flat.numel()
    lo, hi, gamma = _interp_indices(n, q)
    a = float(flat.kthvalue(lo + 1).values)
    b = a if hi == lo else float(flat.kthvalue(hi + 1).values)
    return _lerp(a, b, gamma)


def tail_stats(alpha, positions, bin_size: int, fit_beta: bool = False, sequences=None) -> dict:
    """Distribution of per-token alpha per position bin [k*bin_size, (k+1)*bin_size), as a JSON-ready dict.

    Keys: bins (non-empty, increasing; bin, start, end, count, mean, p1, p5, p50, frac_above_tail = share of
    alpha >= 0.999), overall (same stats over all tokens), pearson_alpha_position (over tokens), pearson_p5_bin
    (per-bin 5th percentile vs bin index), bin_size, and with `fit_beta` the scaled-Beta fit of the tail
    (alpha < 0.999) on [0, 0.999] as beta_fit = {a, b, scale, n, ks} (None when fewer than 20 tail values or the
    fit fails). With `sequences` (the sequence id of each token) every bin and overall also hold the minimum
    alpha of each sequence (over its tokens there): sequences, seq_min_mean and seq_min_p5 over sequences.
    Positions use whatever length origin the caller chooses.
    """
    if isinstance(bin_size, bool) or not isinstance(bin_size, (int, np.integer)) or bin_size < 1:
        raise SparrowError(f"bin_size must be an integer >= 1, got {bin_size!r}")
    bin_size = int(bin_size)
    a = _as_float_tensor(alpha, "alpha").detach().to("cpu", torch.float64)
    pos = _as_positions(positions)
    if a.shape != pos.shape:
        raise SparrowError(f"alpha has shape {tuple(a.shape)} but positions has shape {tuple(pos.shape)}: "
                           f"expected one position per alpha value")
    a, pos = a.reshape(-1), pos.reshape(-1)
    if a.numel() == 0:
        raise SparrowError("tail_stats got no tokens: expected at least one alpha value")
    if torch.isnan(a).any():
        raise SparrowError(f"alpha contains NaN (first at index {_first(torch.isnan(a))}): expected values in [0, 1]")
    outside = (a < -_ALPHA_TOL) | (a > 1 + _ALPHA_TOL)
    if outside.any():
        i = _first(outside)
        raise SparrowError(f"alpha[{i}] = {float(a[i])} is outside [0, 1]: expected acceptance rates in [0, 1]")
    if (pos < 0).any():
        i = _first(pos < 0)
        raise SparrowError(f"positions[{i}] = {int(pos[i])} is negative: expected positions >= 0")
    a = a.clamp(0, 1)
    seq = None if sequences is None else _as_positions(sequences).reshape(-1)
    if seq is not None and seq.shape != a.shape:
        raise SparrowError(f"sequences has {seq.numel()} ids for {a.numel()} alpha values: expected one per value")
    bins = torch.div(pos, bin_size, rounding_mode="floor")
    by_alpha = torch.argsort(a, stable=True)
    order = by_alpha[torch.argsort(bins[by_alpha], stable=True)]
    sorted_alpha, sorted_bins = a[order], bins[order]
    ids, counts = torch.unique_consecutive(sorted_bins, return_counts=True)
    rows, start = [], 0
    for k, c in zip(ids.tolist(), counts.tolist()):
        stats = _sorted_stats(sorted_alpha[start:start + c])
        if seq is not None:
            stats.update(_sequence_minima(sorted_alpha[start:start + c], seq[order[start:start + c]]))
        rows.append({"bin": k, "start": k * bin_size, "end": (k + 1) * bin_size, **stats})
        start += c
    overall_sorted = torch.sort(a).values
    overall = _sorted_stats(overall_sorted)
    if seq is not None:
        overall.update(_sequence_minima(a, seq))
    out = {
        "bins": rows,
        "overall": overall,
        "pearson_alpha_position": _pearson(a, pos.to(torch.float64)),
        "pearson_p5_bin": (_pearson(torch.tensor([float(r["bin"]) for r in rows], dtype=torch.float64),
                                    torch.tensor([r["p5"] for r in rows], dtype=torch.float64))
                           if len(rows) >= 3 else None),
        "bin_size": bin_size,
    }
    if fit_beta:
        out["beta_fit"] = _fit_beta(overall_sorted, TAIL_THRESHOLD)
    return out


def _full_pass(logits_p, logits_q, temperature, chunk_size, want, tokens) -> dict[str, torch.Tensor]:
    """One chunked pass over positions computing the requested quantities; validates inputs as it goes."""
    lead, vocab = _check_logits(logits_p, "logits_p")
    _check_logits(logits_q, "logits_q")
    if logits_p.shape != logits_q.shape:
        raise SparrowError(f"logits_p has shape {tuple(logits_p.shape)} but logits_q has shape "
                           f"{tuple(logits_q.shape)}: expected identical shapes [..., vocab]")
    if logits_p.device != logits_q.device:
        raise SparrowError(f"logits_p is on {logits_p.device} but logits_q is on {logits_q.device}: "
                           f"expected the same device")
    temp = _check_temperature(temperature)
    device = logits_p.device
    flat_p, flat_q = logits_p.reshape(-1, vocab), logits_q.reshape(-1, vocab)
    n = flat_p.shape[0]
    tok = None
    if tokens is not None:
        tok = _check_int_tensor(tokens, "tokens")
        if tuple(tok.shape) != lead:
            raise SparrowError(f"tokens has shape {tuple(tok.shape)}: expected {lead}, the leading dims of the logits")
        tok = tok.reshape(-1).to(device=device, dtype=torch.long)
        bad = (tok < 0) | (tok >= vocab)
        if bad.any():
            i = _first(bad)
            raise SparrowError(f"token {int(tok[i])} at {_where(i, lead)} is out of range: expected ids in "
                               f"[0, {vocab})")
    need_probs = any(k in want for k in _DIVERGENCES)
    step = _chunk_rows(chunk_size, vocab, _FULL_TEMPS if len(want) > 1 or "alpha" not in want else _ALPHA_TEMPS)
    out = {k: torch.empty(n, dtype=torch.float32, device=device) for k in want}
    for s in range(0, n, step):
        e = min(n, s + step)
        logp = _scaled(flat_p[s:e], temp)
        logq = _scaled(flat_q[s:e], temp)
        lse_p = torch.logsumexp(logp, -1, keepdim=True)
        lse_q = torch.logsumexp(logq, -1, keepdim=True)
        bad = ~(torch.isfinite(lse_p) & torch.isfinite(lse_q)).squeeze(-1)
        _raise_bad_rows(bad, s, (flat_p, "logits_p"), (flat_q, "logits_q"), lead, temp)
        logp.sub_(lse_p)
        logq.sub_(lse_q)
        if tok is not None:
            t = tok[s:e, None]
            tp, tq = logp.gather(-1, t).squeeze(-1), logq.gather(-1, t).squeeze(-1)
            masked = torch.isneginf(tp)
            if masked.any():
                i = s + _first(masked)
                raise SparrowError(f"token {int(tok[i])} at {_where(i, lead)} has probability 0 under p (logits_p "
                                   f"is -inf there): the ratio q/p is undefined; expected tokens sampled from p")
            diff = tp - tq
            if "ratio" in out:
                out["ratio"][s:e] = torch.exp(-diff)
            if "logp_diff" in out:
                out["logp_diff"][s:e] = diff
        if not need_probs:
            continue
        p, q = logp.exp(), logq.exp()
        if "alpha" in out:
            out["alpha"][s:e] = torch.minimum(p, q).sum(-1).clamp_(0, 1)
        if "tv" in out:
            out["tv"][s:e] = (p - q).abs_().sum(-1).mul_(0.5).clamp_(0, 1)
        if "kl_pq" in out:
            out["kl_pq"][s:e] = _kl_rows(p, logp, logq)
        if "kl_qp" in out:
            out["kl_qp"][s:e] = _kl_rows(q, logq, logp)
    return {k: v.reshape(lead) for k, v in out.items()}


def _kl_rows(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """sum_v p (log p - log q) per row with 0 log 0 = 0 and +inf where p > 0 and q = 0 (masked)."""
    terms = (logp - logq).mul_(p)
    p_zero = torch.isneginf(logp)
    terms.masked_fill_(p_zero, 0.0)
    terms.masked_fill_(torch.isneginf(logq) & ~p_zero, math.inf)
    return terms.sum(-1).clamp_(min=0)


def _scaled(chunk: torch.Tensor, temp: float) -> torch.Tensor:
    """A fresh float32 copy of chunk / temperature (safe to modify in place)."""
    return torch.div(chunk.to(torch.float32), temp)


def _chunk_rows(chunk_size, vocab: int, temps: int) -> int:
    """Rows per chunk: the caller's chunk_size, or as many as keep `temps` float32 [rows, vocab] under 512 MB."""
    if chunk_size is None:
        return max(1, _CHUNK_BYTES // (vocab * 4 * temps))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise SparrowError(f"chunk_size must be None or an integer >= 1, got {chunk_size!r}")
    return int(chunk_size)


def _raise_bad_rows(bad: torch.Tensor, offset: int, first, second, lead, temp: float) -> None:
    """Explain the first row whose log-normalizer is not finite: NaN, +inf, all -inf, or overflow."""
    if not bad.any():
        return
    row = offset + _first(bad)
    where = _where(row, lead)
    for flat, name in (first, second) if second is not None else (first,):
        x = flat[row]
        nan = torch.isnan(x)
        if nan.any():
            raise SparrowError(f"{name} has NaN at {where} (vocab index {_first(nan)}): expected real-valued logits "
                               f"(-inf allowed for masked tokens)")
        pos_inf = torch.isposinf(x)
        if pos_inf.any():
            raise SparrowError(f"{name} has +inf at {where} (vocab index {_first(pos_inf)}): expected finite "
                               f"logits or -inf for masked tokens")
        if torch.isneginf(x).all():
            raise SparrowError(f"{name} is -inf for every token at {where}: expected at least one unmasked token")
    names = first[1] if second is None else f"{first[1]} or {second[1]}"
    raise SparrowError(f"{names} at {where} overflow float32 after dividing by temperature {temp}: expected "
                       f"logits within float32 range")


def _check_top_set(ids: torch.Tensor, logprobs: torch.Tensor, lead, vocab: int) -> None:
    """Top-K ids must be in range and distinct per position; log-probs real with total probability <= 1."""
    bad = ((ids < 0) | (ids >= vocab)).any(-1)
    if bad.any():
        i = _first(bad)
        row = ids[i]
        j = _first((row < 0) | (row >= vocab))
        raise SparrowError(f"top_ids at {_where(i, lead)} holds id {int(row[j])}: expected ids in [0, {vocab})")
    if ids.shape[-1] > 1:
        sorted_ids = ids.sort(-1).values
        dup = sorted_ids[:, 1:] == sorted_ids[:, :-1]
        bad = dup.any(-1)
        if bad.any():
            i = _first(bad)
            value = int(sorted_ids[i, 1:][dup[i]][0])
            raise SparrowError(f"top_ids at {_where(i, lead)} lists id {value} twice: expected distinct ids")
    nan = torch.isnan(logprobs).any(-1)
    if nan.any():
        raise SparrowError(f"top_logprobs_p has NaN at {_where(_first(nan), lead)}: expected log-probabilities")
    total = logprobs.double().exp().sum(-1)
    over = total > 1 + _PROB_SUM_TOL
    if over.any():
        i = _first(over)
        raise SparrowError(f"top_logprobs_p at {_where(i, lead)} sums to probability {float(total[i]):.6g} > 1: "
                           f"expected log-probabilities (after temperature), not logits")


def _check_logits(x, name: str) -> tuple[tuple[int, ...], int]:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise SparrowError(f"{name} must be a floating-point torch.Tensor [..., vocab], got {_describe(x)}")
    if x.dim() < 1:
        raise SparrowError(f"{name} is a 0-dim tensor: expected shape [..., vocab] with at least 1 dim")
    if x.shape[-1] == 0:
        raise SparrowError(f"{name} has shape {tuple(x.shape)} with an empty vocab dim: expected vocab >= 1")
    return tuple(x.shape[:-1]), x.shape[-1]


def _check_int_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise SparrowError(f"{name} must be an integer torch.Tensor of token ids, got {_describe(x)}")
    return x


def _check_temperature(temperature) -> float:
    t = _check_number(temperature, "temperature")
    if not (t > 0 and math.isfinite(t)):
        raise SparrowError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def _check_number(value, name: str) -> float:
    if isinstance(value, bool):
        raise SparrowError(f"{name} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise SparrowError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(out):
        raise SparrowError(f"{name} must be a number, got NaN")
    return out


def _as_float_tensor(values, name: str) -> torch.Tensor:
    """A tensor view of values (tensor, numpy array or list); integers become float64."""
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(np.asarray(values))
        except (TypeError, ValueError, RuntimeError):
            raise SparrowError(f"{name} must be a tensor or array of numbers, got {_describe(values)}") from None
    if values.dtype == torch.bool or values.is_complex():
        raise SparrowError(f"{name} must hold real numbers, got dtype {values.dtype}")
    if values.dtype not in (torch.float32, torch.float64):
        values = values.to(torch.float64)
    return values


def _as_positions(positions) -> torch.Tensor:
    """Integer positions as a CPU int64 tensor; floats are accepted only when integral."""
    if not isinstance(positions, torch.Tensor):
        try:
            positions = torch.as_tensor(np.asarray(positions))
        except (TypeError, ValueError, RuntimeError):
            raise SparrowError(f"positions must be a tensor or array of integers, got {_describe(positions)}") \
                from None
    positions = positions.detach().cpu()
    if positions.dtype == torch.bool or positions.is_complex():
        raise SparrowError(f"positions must be integers, got dtype {positions.dtype}")
    if positions.is_floating_point():
        frac = ~torch.isfinite(positions) | (positions != torch.round(positions))
        if frac.any():
            i = _first(frac.reshape(-1))
            raise SparrowError(f"positions[{i}] = {float(positions.reshape(-1)[i])} is not an integer: "
                               f"expected integer positions")
    return positions.to(torch.int64)


def _interp_indices(n: int, q: float) -> tuple[int, int, float]:
    """numpy's 'linear' method: virtual index (n - 1) * q / 100 split into neighbours and weight."""
    h = (n - 1) * (q / 100.0)
    if h >= n - 1:
        return n - 1, n - 1, 0.0
    lo = math.floor(h)
    return lo, lo + 1, h - lo


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's _lerp, which interpolates from the nearer end for accuracy."""
    d = b - a
    return b - d * (1 - t) if t >= 0.5 else a + d * t


def _percentile_sorted(sorted_values: torch.Tensor, q: float) -> float:
    lo, hi, gamma = _interp_indices(sorted_values.numel(), q)
    return _lerp(float(sorted_values[lo]), float(sorted_values[hi]), gamma)


def _sorted_stats(values: torch.Tensor) -> dict:
    """count, mean, p1, p5, p50 and the share >= TAIL_THRESHOLD of an ascending float64 tensor."""
    n = values.numel()
    threshold = torch.tensor([TAIL_THRESHOLD], dtype=values.dtype)
    above = n - int(torch.searchsorted(values, threshold, right=False)[0])
    return {
        "count": n,
        "mean": float(values.mean()),
        "p1": _percentile_sorted(values, 1.0),
        "p5": _percentile_sorted(values, 5.0),
        "p50": _percentile_sorted(values, 50.0),
        "frac_above_tail": above / n,
    }


def _sequence_minima(values: torch.Tensor, sequences: torch.Tensor) -> dict:
    """Over sequences, the mean and 5th percentile (numpy's linear) of each sequence's smallest value."""
    order = np.argsort(sequences.numpy(), kind="stable")
    ids = sequences.numpy()[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    minima = np.minimum.reduceat(values.numpy()[order], starts)
    return {"sequences": int(minima.size), "seq_min_mean": float(minima.mean()),
            "seq_min_p5": float(np.percentile(minima, 5))}


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Pearson r of two float64 vectors; None when fewer than 2 points or either is constant."""
    if x.numel() < 2 or bool(x.min() == x.max()) or bool(y.min() == y.max()):
        return None
    xc, yc = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    if denom == 0 or not math.isfinite(denom):
        return None
    return max(-1.0, min(1.0, float((xc * yc).sum()) / denom))


def _fit_beta(sorted_alpha: torch.Tensor, thr: float) -> dict | None:
    """MLE Beta(a, b) with loc 0 and scale thr on the tail alpha < thr, with its KS statistic.

    Exact zeros are moved to 1e-12 * thr since the Beta log-likelihood is -inf there.
    """
    from scipy import stats

    tail = sorted_alpha[sorted_alpha < thr].numpy()
    if tail.size < _MIN_BETA_TAIL:
        return None
    tail = np.clip(tail, 1e-12 * thr, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, b, _, _ = stats.beta.fit(tail, floc=0.0, fscale=thr)
            ks = stats.kstest(tail, "beta", args=(a, b, 0.0, thr)).statistic
    except (RuntimeError, ValueError, FloatingPointError):
        return None
    if not all(math.isfinite(v) and v > 0 for v in (a, b)) or not math.isfinite(ks):
        return None
    return {"a": float(a), "b": float(b), "scale": float(thr), "n": int(tail.size), "ks": float(ks)}


def _first(mask: torch.Tensor) -> int:
    """Index of the first True in a 1-D bool tensor."""
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def _where(flat_index: int, lead: tuple[int, ...]) -> str:
    """'position i' or 'position (i, j, ...)' for a flat index into the leading dims."""
    if len(lead) == 0:
        return "position ()"
    idx = tuple(int(i) for i in np.unravel_index(flat_index, lead))
    return f"position {idx[0]}" if len(idx) == 1 else f"position {idx}"


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__}"
