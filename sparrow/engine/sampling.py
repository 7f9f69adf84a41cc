"""Sampling settings, per-sequence random streams, and the per-step sampler (temperature, top-k, top-p, greedy).

Every sequence draws from its own random stream, derived from (seed, prompt key, sample index) alone, and each
sampled token takes the next uniform of that stream; the sampler turns a row's uniform into a token by inverse CDF
on that row's probabilities. A sequence's tokens therefore depend on its own logits and stream only, not on the
batch, the wave or the process that runs it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparrow.errors import SparrowError
from sparrow.typed_config import check_int

KEY_LIMIT = 2**32
"""Prompt keys and sample indices must be below this: each then takes one word of the stream's spawn key."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation.

    Log-probs are those of the rollout distribution after temperature and before top-k/top-p truncation (the
    policy whose ratio to the dense policy TIS corrects); with greedy decoding they are at temperature 1.
    `seed` (>= 0) fixes every sequence's random stream (see `sequence_stream`); None draws a fresh one per call.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_logprobs: int = 20
    ignore_eos: bool = False

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


def sequence_stream(seed: int, key: int, sample_index: int) -> np.random.Generator:
    """The random stream of sample `sample_index` of the prompt keyed `key` under `seed`.

    PCG64 seeded by `SeedSequence(seed, spawn_key=(key, sample_index))`, numpy's documented way to derive
    independent streams from one root seed; it depends on the three integers only. Token t of the sequence is
    drawn with the stream's t-th uniform (`draw_uniforms`).
    """
    for name, value in (("prompt key", key), ("sample index", sample_index)):
        if not 0 <= value < KEY_LIMIT:
            raise SparrowError(f"{name} must be in [0, 2**32), got {value}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(key, sample_index))))


def draw_uniforms(streams: Sequence[np.random.Generator], device: torch.device | str = "cpu") -> torch.Tensor:
    """The next uniform in [0, 1) of each stream, as a float64 tensor [len(streams)] on `device`."""
    return torch.tensor([stream.random() for stream in streams], dtype=torch.float64, device=device)


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


def truncate(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled logits [B, V] with the tokens outside top-k and the top-p nucleus set to -inf."""
    allowed = scaled
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        allowed = allowed.masked_fill(allowed < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = allowed.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        allowed = allowed.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return allowed


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token per row [B] of `probs` [B, V]: the first whose cumulative probability exceeds uniforms[b] * total.

    An exact multinomial draw given uniforms in [0, 1). The CDF is summed in float64 and the target is kept
    strictly below its last entry, so the chosen token always raises the CDF: a token of probability 0 is never
    chosen, not even at u -> 1 or u = 0.
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)  # only a row with non-finite probabilities could pass the end


def all_finite(values: torch.Tensor) -> torch.Tensor:
    """Per row of `values` [B, V], whether every entry is finite: max and min both finite (NaN propagates through
    both), two reductions instead of an elementwise pass."""
    return torch.isfinite(values.amax(dim=-1)) & torch.isfinite(values.amin(dim=-1))


def sample(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> StepSample:
    """Sample one token per row of `logits` [B, V], row b with `uniforms[b]` (ignored, and may be None, if greedy).

    A row's token, log-probs and `finite` flag depend on that row's logits and uniform only.
    """
    scaled = logits.float() / params.logprob_temperature
    finite = all_finite(scaled)
    logp = torch.log_softmax(scaled, dim=-1)
    if params.greedy:
        tokens = scaled.argmax(dim=-1)
    elif uniforms is None:
        raise ValueError("sampling at a temperature above 0 needs one uniform per row")
    else:
        tokens = inverse_cdf(truncate(scaled, params).softmax(dim=-1), uniforms)
    top = logp.topk(min(params.num_logprobs, logp.shape[-1]), dim=-1)
    return StepSample(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values, finite)
