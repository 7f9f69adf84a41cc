"""Exact mode in TRL's colocated vLLM engine (`SparrowConfig(rollout_mode="exact")`).

TRL builds `LLM(model=...)` itself; `exact_llm` has it built with Sparrow's speculative configuration (the policy
as its own draft model, sparrow/vllm/exact_mode.py) and vLLM's statistics on, which `DraftCounters` reads: vLLM
keeps the drafts' distributions inside, so what the verifications kept is the monitor. TRL's weight sync loads
the target model only, so the drafter's copy would keep the old weights: the sync goes through vLLM's
`reload_weights` for both (`trl_cpu.reload_sync`, on every platform). Both only for the trainer's own engine
(trl.py's `colocated_engine`).
"""

from __future__ import annotations

import functools

from sparrow.vllm.exact_mode import speculative_config


def exact_llm(build, draft_tokens: int):
    """TRL's `LLM` (`build`) building its engine in exact mode, drafting `draft_tokens`."""

    @functools.wraps(build)
    def llm(*args, model, **kwargs):
        return build(*args, model=model, speculative_config=speculative_config(str(model), draft_tokens),
                     disable_log_stats=False, **kwargs)

    return llm


class DraftCounters:
    """What the verifications of an engine kept since the last read, from vLLM's speculative decoding counters."""

    def __init__(self, draft_tokens: int):
        self.draft_tokens = draft_tokens
        self.last = (0, 0, [0] * draft_tokens)

    def read(self, llm) -> dict[str, float]:
        """`rollout/tokens_per_verify` (the mean accepted length) and `rollout/kept_first_<i>` (the share of rounds
        that kept their first i drafts) over the rounds since the last read; nothing if there were none."""
        drafts, accepted, per_position = 0, 0, [0] * self.draft_tokens
        for metric in llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                drafts += int(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                accepted += int(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_position = [a + int(v) for a, v in zip(per_position, metric.values)]
        then = self.last
        self.last = (drafts, accepted, per_position)
        rounds = drafts - then[0]
        if rounds <= 0:
            return {}
        kept = {f"rollout/kept_first_{i + 1}": (now - old) / rounds
                for i, (now, old) in enumerate(zip(per_position, then[2]))}
        return {"rollout/tokens_per_verify": 1 + (accepted - then[1]) / rounds, "rollout/verifications": rounds,
                **kept}
