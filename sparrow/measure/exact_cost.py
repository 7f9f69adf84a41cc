"""Exact mode priced with the cost model (cost_model.py): K sparse drafts and one dense span verification a round,
the tokens a round commits at a given acceptance, and the draft length that maximises the predicted speedup. Pure
arithmetic, as cost_model.py."""

from __future__ import annotations

import itertools

from sparrow.errors import SparrowError
from sparrow.model_shapes import ModelDims
from sparrow.schedules import DENSE, Schedule
from sparrow.typed_config import check_finite, check_int

from .cost_model import Hardware, Pricing, _cost, trajectory_cost


def tokens_per_verify(acceptance: float, draft_tokens: int) -> float:
    """Expected tokens one exact-mode round commits when each draft is accepted with probability `acceptance`
    independently: the accepted drafts plus the dense token the verification adds, sum_{i=0..K} a^i."""
    if not 0.0 <= acceptance <= 1.0:
        raise SparrowError(f"acceptance must be in [0, 1], got {acceptance!r}")
    check_int("draft_tokens", draft_tokens, 1)
    return float(sum(acceptance**i for i in range(draft_tokens + 1)))


def acceptance_segments(acceptance, prompt_len: int, gen_len: int) -> list[tuple[int, int, float]]:
    """The trajectory's decode steps 0..gen_len-1 (step i holds prompt_len + i + 1 tokens) as runs (first step,
    steps, acceptance). `acceptance`: one value for every length, or [(cached length, acceptance), ...] ascending,
    each in force from its length on (a profile's per-bin means); lengths below the first take the first's."""
    if not isinstance(acceptance, (list, tuple)):
        return [(0, gen_len, acceptance)]
    if not acceptance:
        raise SparrowError("per-length acceptance needs at least one (cached length, acceptance) pair")
    for start, value in acceptance:
        check_int("acceptance's cached length", start, 0)
        check_finite(f"acceptance from {start} cached tokens", value, 0, 1)
    for (before, _), (start, _) in itertools.pairwise(acceptance):
        if start <= before:
            raise SparrowError(f"per-length acceptance must ascend in cached length, got {before} then {start}")
    # the first step at each later length (clipped to the trajectory); the first value also covers what precedes it
    bounds = [0, *(min(gen_len, max(0, start - prompt_len - 1)) for start, _ in acceptance[1:]), gen_len]
    return [(first, end - first, float(value))
            for (first, end), (_, value) in zip(itertools.pairwise(bounds), acceptance, strict=True) if end > first]


DRAFTERS = ("shared", "copy")


def exact_decode(dims: ModelDims, hw: Hardware, schedule: Schedule, prompt_len: int, gen_len: int, samples: int,
                 acceptance, draft_tokens: int, *, pricing: Pricing = Pricing(), drafter: str = "shared") -> dict:
    """Predicted decode cost of exact mode against dense decode over one trajectory.

    A round drafts K tokens with `schedule` (K sparse decode steps) and verifies them with one dense span step of
    K+1 tokens per sequence: the weights and each sequence's K/V are read once, the projection and attention FLOPs
    are paid for every token. A round commits `tokens_per_verify(a, K)` tokens on average, so a stretch of n steps
    takes n / E rounds. The per-step sums of the trajectory (sparse and dense decode) price the K drafts and the
    verification at the lengths they run at. `acceptance` is the coupled acceptance a (a profile's mean alpha is
    its upper bound): one value, or per cached length as `acceptance_segments` reads it, each stretch of the
    trajectory priced at its own. `drafter`: "shared" (our engine: the drafts decode over the verified cache) or
    "copy" (vLLM's draft model, a second copy with its own cache: its first pass of a round rewrites the K+1
    verified tokens densely, priced as a second verification, and draws the first draft; K-1 sparse steps
    follow)."""
    if drafter not in DRAFTERS:
        raise SparrowError(f"drafter {drafter!r}: expected one of {', '.join(DRAFTERS)}")
    check_int("draft_tokens", draft_tokens, 1)
    dense = trajectory_cost(dims, hw, DENSE, prompt_len, gen_len, samples, pricing=pricing).decode
    sparse = trajectory_cost(dims, hw, schedule, prompt_len, gen_len, samples, pricing=pricing).decode
    exact_cost, rounds, weighted = 0.0, 0.0, 0.0
    for first, steps, value in acceptance_segments(acceptance, prompt_len, gen_len):
        part_dense = trajectory_cost(dims, hw, DENSE, prompt_len + first, steps, samples, pricing=pricing).decode
        part_sparse = trajectory_cost(dims, hw, schedule, prompt_len + first, steps, samples,
                                      pricing=pricing).decode
        verify = _cost(hw, weight_bytes=part_dense.weight_bytes, kv_bytes=part_dense.kv_bytes, landmark_bytes=0,
                       proj_flops=(draft_tokens + 1) * part_dense.proj_flops,
                       attn_flops=(draft_tokens + 1) * part_dense.attn_flops, score_flops=0,
                       forwards=part_dense.forwards)
        per_round = tokens_per_verify(value, draft_tokens)
        drafts = (draft_tokens * part_sparse.cost if drafter == "shared"
                  else verify.cost + (draft_tokens - 1) * part_sparse.cost)
        exact_cost += (drafts + verify.cost) / per_round
        rounds += steps / per_round
        weighted += steps * value
    return {"acceptance": weighted / gen_len, "dense_decode_cost": dense.cost, "sparse_decode_cost": sparse.cost,
            "exact_decode_cost": exact_cost, "tokens_per_verify": gen_len / rounds,
            "sparse_over_dense": dense.cost / sparse.cost, "exact_over_dense": dense.cost / exact_cost}


def best_draft_tokens(dims: ModelDims, hw: Hardware, schedule: Schedule, prompt_len: int, gen_len: int,
                      samples: int, acceptance, max_draft_tokens: int = 16, *, pricing: Pricing = Pricing(),
                      drafter: str = "shared") -> dict:
    """`exact_decode` at the draft length K in 1..max_draft_tokens that maximises the predicted speedup."""
    check_int("max_draft_tokens", max_draft_tokens, 1)
    runs = [{"draft_tokens": k, **exact_decode(dims, hw, schedule, prompt_len, gen_len, samples, acceptance, k,
                                               pricing=pricing, drafter=drafter)}
            for k in range(1, max_draft_tokens + 1)]
    return max(runs, key=lambda run: run["exact_over_dense"])
