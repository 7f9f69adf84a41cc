"""Exact mode inside stock vLLM: the policy under Sparrow's sparse attention drafts, the dense policy verifies.

vLLM's speculative decoding with `method="draft_model"` and the policy itself as the draft model
(`speculative_config(...)`) runs a second copy of the model, with its own paged cache, as the drafter. The plugin
tells the two apart by who builds the attention metadata: the target's steps (`build`) are dense, every token;
the drafter's (`build_for_drafting`) decode sparsely at the schedule, both the token its first pass samples from
and each further draft step's (plan.py, `drafting`). The first pass also rewrites the verified tokens in the
drafter's cache densely, so the drafter drafts from the dense keys and values of every committed token, as our
engine's drafts do after each verification. vLLM's scheduler, batching, paged caches and rejection sampler do the
rest: the committed tokens are samples of the dense policy (the standard rule; greedy: the dense argmax).
"""

from __future__ import annotations

from typing import Any

from sparrow.errors import SparrowError

DRAFT_METHOD = "draft_model"
MAX_DRAFT_TOKENS = 64


def speculative_config(model: str, draft_tokens: int) -> dict[str, Any]:
    """The `speculative_config` of `vllm.LLM(...)` for exact mode on `model` with `draft_tokens` drafts a round: the
    same model as the draft, drafts sampled from the drafter's distribution (so a draft is kept with the
    probability min(1, p/q), whose mean is the acceptance alpha)."""
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise SparrowError(f"exact mode in vLLM drafts a fixed number of tokens a round: expected an integer from 1 "
                           f"to {MAX_DRAFT_TOKENS}, got {draft_tokens!r} (vLLM has no per-round choice, 'auto')")
    return {"method": DRAFT_METHOD, "model": str(model), "num_speculative_tokens": draft_tokens,
            "draft_sample_method": "probabilistic"}


def is_exact(vllm_config) -> bool:
    """Whether this engine runs Sparrow's exact mode: speculative decoding whose draft model is the target model.
    Any other speculative decoding is refused (the plugin would decode the target's steps sparsely)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    draft = getattr(spec, "draft_model_config", None)
    target = vllm_config.model_config
    if spec.method != DRAFT_METHOD or draft is None or str(draft.model) != str(target.model):
        raise SparrowError(
            f"Sparrow's vLLM plugin runs speculative decoding only as exact mode: method {DRAFT_METHOD!r} with the "
            f"served model itself as the draft model (got method {spec.method!r}, draft "
            f"{getattr(draft, 'model', None)!r}, served {target.model!r}); unset SPARROW_VLLM_SCHEDULE to run stock "
            "vLLM")
    return True


def draft_record(per_step_accepted: list[int] | None, num_tokens: int) -> tuple[int, list[bool]]:
    """(verifications, drafted per committed token) of one request from the drafts vLLM accepted at each of its
    verifications (per-request speculative decoding metrics, "detailed"): the first token comes from the prefill,
    then each verification commits its accepted drafts and one token of the dense policy's own."""
    drafted = [False]
    for accepted in per_step_accepted or []:
        drafted += [True] * accepted + [False]
    return len(per_step_accepted or []), (drafted + [False] * num_tokens)[:num_tokens]
