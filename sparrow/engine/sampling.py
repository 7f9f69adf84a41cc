"""Sampling settings and the per-step sampler (temperature, top-k, top-p, greedy) with log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.errors import SparrowError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation.

    Log-probs are those of the rollout distribution after temperature and before top-k/top-p truncation (the
    policy whose ratio to the dense policy TIS corrects); with greedy decoding they are at temperature 1.
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
        if self.max_new_tokens < 1:
            raise SparrowError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise SparrowError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SparrowError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SparrowError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.num_logprobs < 0:
            raise SparrowError(f"num_logprobs must be >= 0, got {self.num_logprobs}")
        if any(not s for s in self.stop):
            raise SparrowError("stop strings must be non-empty")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class StepSample:
    """One sampled token per row with its log-prob and the row's top log-probs."""

    tokens: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B]
    top_ids: torch.Tensor  # [B, K]
    top_logprobs: torch.Tensor  # [B, K]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> StepSample:
    """Sample one token per row of `logits` [B, V]."""
    scaled = logits.float() / (params.temperature if not params.greedy else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    if params.greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        allowed = scaled
        if params.top_k and params.top_k < scaled.shape[-1]:
            kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
            allowed = allowed.masked_fill(allowed < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = allowed.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
            allowed = allowed.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        tokens = torch.multinomial(allowed.softmax(dim=-1), 1, generator=generator).squeeze(-1)
    top = logp.topk(min(params.num_logprobs, logp.shape[-1]), dim=-1)
    return StepSample(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values)
