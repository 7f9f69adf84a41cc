"""One generated completion and the per-token records a trainer needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .sampling import SamplingParams


@dataclass
class Completion:
    """A sampled completion. Per generated token: id, rollout log-prob, top-K log-probs, KV budget in force.

    kv_budget is the number of KV tokens the sparse layers were allowed to attend for that token: the schedule's
    budget on sparse decode steps, the cached length where attention was dense (prefill, dense schedule).
    finish_reason: "stop" (EOS or a stop string) or "length" (max_new_tokens).
    prompt_index is the prompt's index within the call that generated it; prompt_key the key its random streams
    were derived from (`RolloutEngine.generate(prompt_keys=...)`; the index unless the caller gave keys).
    sampling: the settings it was drawn with (its log-probs are at `sampling.logprob_temperature`).
    Exact mode (`engine.exact`) also records the dense verifications run for this sequence (`verifies`), how many
    of them rejected a draft (`rejections`) and, per
    token, whether it was a draft the dense policy accepted (`drafted`) and the exact acceptance of the draft's
    distribution against the dense one there (`draft_acceptance`; None where no draft was made on this prefix).
    Its log-probs and top log-probs are the dense policy's, and `kv_budget` the cached length (dense attention).
    """

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    prompt_key: int | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    kv_budget: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    sampling: SamplingParams | None = None
    verifies: int = 0
    rejections: int = 0
    drafted: list[bool] = field(default_factory=list)
    draft_acceptance: list[float | None] = field(default_factory=list)

    def __post_init__(self):
        if self.prompt_key is None:
            self.prompt_key = self.prompt_index

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_json(self) -> dict:
        record = asdict(self)
        record.pop("prompt_token_ids")
        record["prompt_length"] = len(self.prompt_token_ids)
        if not self.verifies:  # not exact mode
            for key in ("verifies", "rejections", "drafted", "draft_acceptance"):
                record.pop(key)
        return record


def cached_lengths(live: list[Completion]) -> np.ndarray:
    """Each row's cached length once its last generated token is fed (the prompt's before any), as the host
    knows it."""
    return np.array([len(seq.prompt_token_ids) + len(seq.token_ids) for seq in live], dtype=np.int64)
