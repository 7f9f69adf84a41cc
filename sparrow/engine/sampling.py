"""Sampling settings, per-sequence random keys, and the per-step sampler (temperature, top-k, top-p, greedy).

Every sequence has its own key, derived from (seed, prompt key, sample index) alone. Token t of a sequence is drawn
by the Gumbel-max rule, `argmax_v(log p(v) + g[t, v])`, where the noise `g[t, v]` is a counter-based hash of the
sequence's key, t and v: the same numbers on every device, in any batch, and for any distribution they are applied
to. So a sequence's tokens depend on its own logits and key only, not on the batch, the wave or the process that
runs it; and two distributions at the same position (a sparse draft and the dense policy, `engine.exact`) draw with
the same noise, so they pick the same token whenever their argmax agrees (the coupling that makes exact rollouts
return the dense policy's own samples).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from sparrow.errors import SparrowError
from sparrow.typed_config import check_int

EXACT_RULES = ("coupled", "residual")
"""coupled: a draft is kept when the dense policy draws the same token with the same Gumbel noise (the dense
sampler's own tokens for the seed); residual: speculative sampling's rejection rule (`residual_rule`): the dense
policy's distribution, other tokens, more drafts kept."""

RESIDUAL_STREAM, ACCEPT_STREAM = 1, 2
"""The random streams of the residual rule: redraws and acceptance uniforms (stream 0 draws the tokens)."""

KEY_LIMIT = 2**32
"""Prompt keys and sample indices must be below this: each then takes one word of the key's spawn key."""



@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation.

    Log-probs are those of the rollout distribution after temperature and before top-k/top-p truncation (the
    policy whose ratio to the dense policy TIS corrects; why not the truncated one: docs/metrics.md, "Top-p and
    top-k in the correction"); with greedy decoding they are at temperature 1.
    `seed` (>= 0) fixes every sequence's random key (see `sequence_key`); None draws a fresh one per call.
    `exact_rule`: how exact mode judges a draft (`EXACT_RULES`); other modes ignore it.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_logprobs: int = 20
    ignore_eos: bool = False
    exact_rule: str = "coupled"

    def __post_init__(self):
        ints = {"max_new_tokens": (self.max_new_tokens, 1), "top_k": (self.top_k, 0),
                "num_logprobs": (self.num_logprobs, 0)}
        if self.seed is not None:
            ints["seed"] = (self.seed, 0)
        for name, (value, minimum) in ints.items():
            object.__setattr__(self, name, check_int(name, value, minimum))
        if not _real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SparrowError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SparrowError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if any(not s for s in self.stop):
            raise SparrowError("stop strings must be non-empty")
        if self.exact_rule not in EXACT_RULES:
            raise SparrowError(f"unknown exact rule {self.exact_rule!r}: expected one of {', '.join(EXACT_RULES)}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the rollout log-probs are at (1 for greedy decoding)."""
        return 1.0 if self.greedy else float(self.temperature)


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def sequence_key(seed: int, key: int, sample_index: int) -> tuple[int, int]:
    """The random key of sample `sample_index` of the prompt keyed `key` under `seed`: two 32-bit words from
    `SeedSequence(seed, spawn_key=(key, sample_index))`, numpy's documented way to derive independent streams from
    one root seed, as int32 values. It depends on the three integers only."""
    for name, value in (("prompt key", key), ("sample index", sample_index)):
        if not 0 <= value < KEY_LIMIT:
            raise SparrowError(f"{name} must be in [0, 2**32), got {value}")
    words = np.random.SeedSequence(seed, spawn_key=(key, sample_index)).generate_state(2, np.uint32)
    return _signed32(int(words[0])), _signed32(int(words[1]))


def _signed32(value: int) -> int:
    """A 32-bit word as the int32 holding the same bits."""
    return value - 2**32 if value >= 2**31 else value


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' 32-bit integer hash 'lowbias32' of an int32 tensor, bit for bit (logical shifts by masking,
    multiplication modulo 2**32 by int32's two's-complement wrap-around, as PyTorch's CPU and CUDA kernels do;
    tests pin it against a pure-Python reference)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _signed32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _signed32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


_VOCAB_HASH: dict[tuple[int, torch.device], torch.Tensor] = {}


def _vocab_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """hash32 of every token id [V], computed once per vocabulary size and device."""
    found = _VOCAB_HASH.get((vocab, device))
    if found is None:
        found = _VOCAB_HASH[(vocab, device)] = hash32(torch.arange(vocab, dtype=torch.int32, device=device))
    return found


def _row_hash(keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One int32 per row from its key [B, 2], position [B] and stream (0: the token draws; others: the residual
    rule's uniforms and redraws, independent of them)."""
    keys = keys.to(torch.int32)
    golden = _signed32(0x9E3779B9)
    row = hash32(keys[:, 0] ^ hash32(keys[:, 1] + positions.to(torch.int32) * golden))  # [B]
    return hash32(row ^ _signed32(stream * 0x85EBCA6B % 2**32)) if stream else row


UNIT_MAX = 1.0 - 2.0**-24
"""The largest float32 below 1."""


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """24 random bits k of each int32 as a float in (0, 1): (k + 0.5) / 2**24 rounded to float32, at most `UNIT_MAX`.
    The largest k rounds to 1.0, whose Gumbel noise is infinite: added to a token outside top-p (-inf) it makes NaN,
    which argmax picks, so once in 2**24 entries a truncated token would be drawn; it is held at UNIT_MAX instead."""
    return ((((bits >> 8) & 0xFFFFFF).float() + 0.5) * 2.0**-24).clamp_max(UNIT_MAX)


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = 0) -> torch.Tensor:
    """Gumbel noise [B, V] (float32) for rows with `keys` [B, 2] (from `sequence_key`) at generated-token index
    `positions` [B]. A counter-based draw: entry (b, v) is a hash of (key b, position b, v) alone, so the same on
    every device and in every batch. `stream` selects an independent draw of the same counters.

    The uniforms have 24 bits, so the noise lies in about [-2.9, 16.6]: a token whose logit is more than ~20 below
    the best one's is never drawn (its probability is below 2e-9)."""
    return GumbelNoise(keys, positions, vocab, stream).full()


@dataclass(frozen=True)
class GumbelNoise:
    """`gumbel_noise` of rows with `keys` [B, 2] at `positions` [B], made where a draw needs it: for the whole
    vocabulary (`full`) or for a few token ids per row (`at`: the candidates of a top-p draw, a few hundred numbers
    a row instead of the vocabulary's 49K); entry (b, v) is the same number either way."""

    keys: torch.Tensor
    positions: torch.Tensor
    vocab: int
    stream: int = 0

    def full(self) -> torch.Tensor:
        """The noise of every token [B, V]."""
        return self._of(_vocab_hash(self.vocab, self.keys.device)[None, :])

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """The noise at token ids [B, n] of each row."""
        return self._of(_vocab_hash(self.vocab, ids.device)[ids])

    def _of(self, token_hashes: torch.Tensor) -> torch.Tensor:
        row = _row_hash(self.keys, self.positions, self.stream)
        return -torch.log(-torch.log(_unit(hash32(token_hashes ^ row[:, None]))))

    def rows(self, index: torch.Tensor) -> GumbelNoise:
        return GumbelNoise(self.keys[index], self.positions[index], self.vocab, self.stream)

    @staticmethod
    def stack(noises: list[GumbelNoise]) -> GumbelNoise:
        """The noises of the same rows at successive positions as one [rows * len(noises)] noise, row-major (row r's
        positions together), as a span's logits [rows, span, V] flatten."""
        keys = torch.stack([n.keys for n in noises], dim=1).flatten(0, 1)
        positions = torch.stack([n.positions for n in noises], dim=1).flatten()
        return GumbelNoise(keys, positions, noises[0].vocab, noises[0].stream)


def uniforms(keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One uniform in (0, 1) per row [B], counter-based like `gumbel_noise` (stream > 0)."""
    return _unit(hash32(_row_hash(keys, positions, stream) ^ _signed32(0x27D4EB2F)))


@dataclass
class StepSample:
    """One sampled token per row with its log-prob and the row's top log-probs.

    finite: per row, whether its logits after temperature were all finite; the other fields of a row where it is
    False are meaningless (the engine stops with an error naming the row).
    """

    tokens: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B]
    top_ids: torch.Tensor  # [B, K]
    top_logprobs: torch.Tensor  # [B, K]
    finite: torch.Tensor  # [B] bool


@dataclass
class HostSample:
    """A `StepSample` read to the host in one transfer: per row, the token, its log-prob, the top ids and
    log-probs as Python numbers, and whether its logits were finite."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    finite: list[bool]

    @staticmethod
    def read(step: StepSample) -> HostSample:
        """`step`'s fields packed into one float64 tensor [B, 3 + 2K] and read with one `tolist`: ids and float32
        values are exact in float64, so the numbers are those each field's own read would give."""
        k = step.top_ids.shape[1]
        columns = [step.tokens[:, None], step.logprobs[:, None], step.finite[:, None], step.top_ids, step.top_logprobs]
        rows = torch.cat([c.to(torch.float64) for c in columns], dim=1).tolist()
        return HostSample([int(r[0]) for r in rows], [r[1] for r in rows],
                          [[int(i) for i in r[3:3 + k]] for r in rows], [r[3 + k:] for r in rows],
                          [r[2] == 1.0 for r in rows])


def truncate(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled logits [B, V] with the tokens outside top-k and the top-p nucleus set to -inf."""
    allowed = top_k(scaled, params)
    return nucleus(allowed, params.top_p) if params.top_p < 1.0 else allowed


def top_k(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled logits [B, V] with the tokens below the k-th largest set to -inf (all of them kept if top_k is 0)."""
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        return scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled


NUCLEUS_CANDIDATES = 256
"""Tokens ranked per row before top-p looks for its nucleus; only rows whose nucleus is larger rank the whole
vocabulary: sorting every row's logits (49K on SmolLM2) would be the slowest part of a small model's sampled step
(benchmarks/bench_sampler.py times both)."""


def nucleus(allowed: torch.Tensor, top_p: float) -> torch.Tensor:
    """`allowed` [B, V] with the tokens outside the top-p nucleus set to -inf. Ranked by logit, a token is kept
    while the probability of the tokens ranked before it (of the distribution over `allowed`) is at most top_p:
    the smallest prefix reaching top_p. The same tokens whether a row is decided among the candidates or sorted."""
    ids, kept, wide, log_norm = nucleus_candidates(allowed, top_p)
    out = _only(allowed, ids, kept)
    if len(wide):
        out[wide] = _sorted_nucleus(allowed[wide], log_norm[wide], top_p)
    return out


def nucleus_candidates(allowed: torch.Tensor,
                       top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-p nucleus of each row of `allowed` [B, V] among its `NUCLEUS_CANDIDATES` top-ranked tokens: their ids
    and logits [B, n], -inf past the nucleus; the rows [W] whose nucleus reaches past them (`_sorted_nucleus` decides
    those); each row's log normaliser [B, 1]."""
    log_norm = allowed.logsumexp(dim=-1, keepdim=True)
    ranked, ids = allowed.topk(min(NUCLEUS_CANDIDATES, allowed.shape[-1]), dim=-1)
    drop = _past_nucleus(ranked, log_norm, top_p)
    partial = ranked.shape[-1] < allowed.shape[-1]
    wide = (~drop[:, -1]).nonzero()[:, 0] if partial else ids.new_zeros(0)  # the last candidate still inside
    return ids, ranked.masked_fill(drop, float("-inf")), wide, log_norm


def _sorted_nucleus(rows: torch.Tensor, log_norm: torch.Tensor, top_p: float) -> torch.Tensor:
    """`rows` [W, V] with the tokens outside the nucleus at -inf, from the whole vocabulary sorted."""
    ranked, order = rows.sort(dim=-1, descending=True)
    drop = _past_nucleus(ranked, log_norm, top_p)
    return _only(rows, order, ranked.masked_fill(drop, float("-inf")))


def _past_nucleus(ranked: torch.Tensor, log_norm: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per ranked logit (descending), whether the probability ranked before it exceeds top_p."""
    probs = (ranked - log_norm).exp()
    return probs.cumsum(dim=-1) - probs > top_p


def _only(like: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A tensor shaped as `like`, -inf except `values` at `index` along the last dim."""
    return torch.full_like(like, float("-inf")).scatter(-1, index, values)


def all_finite(values: torch.Tensor) -> torch.Tensor:
    """Per row of `values` [B, V], whether every entry is finite: max and min both finite (NaN propagates through
    both), two reductions instead of an elementwise pass."""
    return torch.isfinite(values.amax(dim=-1)) & torch.isfinite(values.amin(dim=-1))


def choose(scaled: torch.Tensor, params: SamplingParams, noise: GumbelNoise | torch.Tensor | None) -> torch.Tensor:
    """The token per row of `scaled` [B, V] (logits over the sampling temperature): the argmax if greedy, else the
    Gumbel-max draw with `noise` (a `GumbelNoise`, or given numbers [B, V]), an exact draw from the top-k/top-p
    truncated distribution. With top-p and a `GumbelNoise`, the draw is among the nucleus candidates, with noise
    made for them alone; the token is the one the whole vocabulary's argmax gives (ties: the lowest id)."""
    if params.greedy:
        return scaled.argmax(dim=-1)
    if noise is None:
        raise ValueError("sampling at a temperature above 0 needs Gumbel noise per row")
    if isinstance(noise, torch.Tensor):
        return (truncate(scaled, params) + noise).argmax(dim=-1)
    allowed = top_k(scaled, params)
    if params.top_p == 1.0:
        return (allowed + noise.full()).argmax(dim=-1)
    ids, kept, wide, log_norm = nucleus_candidates(allowed, params.top_p)
    perturbed = kept + noise.at(ids)
    tokens = ids.masked_fill(perturbed < perturbed.amax(dim=-1, keepdim=True), scaled.shape[-1]).amin(dim=-1)
    if len(wide):
        truncated = _sorted_nucleus(allowed[wide], log_norm[wide], params.top_p)
        tokens[wide] = (truncated + noise.rows(wide).full()).argmax(dim=-1)
    return tokens


def sample(logits: torch.Tensor, params: SamplingParams, noise: GumbelNoise | torch.Tensor | None) -> StepSample:
    """Sample one token per row of `logits` [B, V], row b with `noise[b]` (ignored, and may be None, if greedy).

    A row's token, log-probs and `finite` flag depend on that row's logits and noise only.
    """
    scaled = logits.float() / params.logprob_temperature
    finite = all_finite(scaled)
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = choose(scaled, params, noise)
    top = logp.topk(min(params.num_logprobs, logp.shape[-1]), dim=-1)
    return StepSample(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values, finite)


def residual_rule(draft_scaled: torch.Tensor, dense_scaled: torch.Tensor, drafts: torch.Tensor, accept_u: torch.Tensor,
                  noise: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's rejection rule over K drafted positions of R rows. q and p: the draft's and the
    dense policy's distributions after temperature, top-k and top-p (from `*_scaled`, logits over the temperature,
    [R, K, V]). Draft x at a position (drawn from q) is accepted when u q(x) <= p(x) (`accept_u` [R, K] uniform:
    probability min(1, p(x) / q(x))); the first rejected position draws from the residual max(0, p - q), normalised
    (Gumbel-max with `noise` [R, K, V]; p itself where rounding leaves no residual). The committed token is then
    distributed as p exactly, whatever q; a draft is kept with probability sum_v min(p, q), the acceptance alpha.
    Returns (accepted drafts per row [R], the residual draw at each position [R, K])."""
    rows, count, vocab = dense_scaled.shape
    p = truncate(dense_scaled.reshape(-1, vocab), params).softmax(-1).view(rows, count, vocab)
    q = truncate(draft_scaled.reshape(-1, vocab), params).softmax(-1).view(rows, count, vocab)
    at = drafts[..., None]
    kept = accept_u * q.gather(-1, at)[..., 0] <= p.gather(-1, at)[..., 0]
    accepted = torch.cumprod(kept.long(), dim=1).sum(dim=1)
    residual = (p - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return accepted, (residual.log() + noise).argmax(dim=-1)
