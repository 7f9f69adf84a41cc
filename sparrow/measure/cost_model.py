"""Cost of dense vs sparse rollouts in "equivalent FLOPs" (SPEC section 6), derived per decode step.

A decode step costs `flops + I * bytes`, with I = peak FLOP/s / memory bandwidth, so a byte moved counts as the
FLOPs the chip could have done in the time it takes to move it, plus the host time every forward pass pays besides
(`Hardware.step_overhead`, 0 for the presets), at peak FLOP/s; cost / peak FLOP/s is a predicted time. Per step we
count the weight reads (once for the whole batch), the K/V reads of the attended tokens and the landmark reads of
sparse layers (per sequence), the projection FLOPs and the attention and page-scoring FLOPs. A trajectory sums the
decode steps of `samples` sequences that share one prompt, plus one dense prefill of that prompt; `training_step`
adds the update and the monitor of a whole GRPO step (training_cost.py), and exact mode's drafts and verifications
are priced in exact_cost.py. What prices a trajectory besides the model, the hardware and the lengths (page size,
dense layers, landmark, byte sizes) is one `Pricing`, which each pricing function takes as `pricing=`. `paper_cost`
is the paper's printed approximation, kept for comparison; docs/cost-model.md derives both and lists where they
differ.

Everything here is pure arithmetic: no I/O, no printing. FLOP and byte counts are exact Python integers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np

from sparrow.attention.config import SparseConfig
from sparrow.attention.landmarks import get_landmark
from sparrow.errors import SparrowError
from sparrow.model_shapes import ModelDims
from sparrow.schedules import DENSE, Schedule, const
from sparrow.typed_config import check_int


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense bf16 peak FLOP/s, memory bandwidth in bytes/s, and step_overhead: seconds of host
    time per forward pass (Python, kernel launches, sampling) that neither FLOPs nor bytes account for. The presets
    take 0 (CUDA graphs); on a CPU it is tens of milliseconds, fitted from `sparrow bench` (docs/cost-model.md)."""

    name: str
    peak_flops: float
    bandwidth: float
    step_overhead: float = 0.0

    @property
    def overhead_flops(self) -> float:
        """The step overhead in equivalent FLOPs: what the chip could compute at peak in that time."""
        return self.step_overhead * self.peak_flops

    @property
    def intensity(self) -> float:
        """I of SPEC 6: FLOPs per byte at which compute and memory time are equal (peak_flops / bandwidth)."""
        return self.peak_flops / self.bandwidth


HARDWARE = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity (989 dense), 3.35 TB/s HBM3.
    "h100": Hardware("h100", 989e12, 3.35e12),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity (989 dense), 4.8 TB/s HBM3e.
    "h200": Hardware("h200", 989e12, 4.8e12),
    # NVIDIA DGX B200 / HGX B200 datasheet, per GPU: FP16/BF16 4.5 PFLOPS with sparsity (2.25 dense), 8 TB/s HBM3e.
    "b200": Hardware("b200", 2.25e15, 8.0e12),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 312 TFLOPS dense, 2,039 GB/s HBM2e.
    "a100": Hardware("a100", 312e12, 2.039e12),
}
"""Published peaks. `cpu` has no preset: its numbers depend on the machine and must be given."""


def hardware(name: str, peak_flops: float | None = None, bandwidth: float | None = None,
             step_overhead: float = 0.0) -> Hardware:
    """A preset by name, with either number overridable; `cpu` needs both numbers. `step_overhead` (seconds per
    forward pass, >= 0) applies to any of them."""
    key = str(name).strip().lower()
    for what, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise SparrowError(f"{what} must be a positive finite number, got {value!r}")
    if isinstance(step_overhead, bool) or not isinstance(step_overhead, numbers.Real) or not (
            0 <= step_overhead < 3600):
        raise SparrowError(f"step_overhead must be seconds per forward pass from 0 to 3600, got {step_overhead!r}")
    step_overhead = float(step_overhead)
    if key == "cpu":
        missing = [flag for flag, value in (("--peak-flops", peak_flops), ("--bandwidth", bandwidth)) if value is None]
        if missing:
            raise SparrowError(f"hardware 'cpu' has no published numbers: give {' and '.join(missing)} "
                               "(FLOP/s and bytes/s of this machine)")
        return Hardware("cpu", float(peak_flops), float(bandwidth), step_overhead)
    if key not in HARDWARE:
        raise SparrowError(f"unknown hardware {name!r}: expected one of {', '.join(HARDWARE)} or cpu "
                           "(with --peak-flops and --bandwidth)")
    preset = HARDWARE[key]
    return Hardware(key, float(peak_flops) if peak_flops is not None else preset.peak_flops,
                    float(bandwidth) if bandwidth is not None else preset.bandwidth, step_overhead)


@dataclass(frozen=True)
class StepCost:
    """FLOPs, bytes and equivalent FLOPs (`cost = flops + I * bytes + forwards * overhead`) of one decode step or
    a sum of them.

    flops = proj_flops + attn_flops + score_flops; bytes = weight_bytes + kv_bytes + landmark_bytes; forwards: the
    forward passes, each paying the hardware's step overhead. attention_share is the part of `cost` due to
    attention: K/V and landmark bytes, attention and scoring FLOPs.
    """

    flops: int
    bytes: int
    cost: float
    attention_share: float
    weight_bytes: int
    kv_bytes: int
    landmark_bytes: int
    proj_flops: int
    attn_flops: int
    score_flops: int
    forwards: int


@dataclass(frozen=True)
class TrajectoryCost(StepCost):
    """The totals of a trajectory (fields of StepCost) and its two phases: one prefill, `steps` decode steps."""

    prefill: StepCost
    decode: StepCost
    steps: int
    samples: int


def _cost(hw: Hardware, *, weight_bytes: int, kv_bytes: int, landmark_bytes: int, proj_flops: int,
          attn_flops: int, score_flops: int, forwards: int) -> StepCost:
    """Assemble a StepCost from its parts."""
    flops = proj_flops + attn_flops + score_flops
    nbytes = weight_bytes + kv_bytes + landmark_bytes
    cost = flops + hw.intensity * nbytes + forwards * hw.overhead_flops
    attention = attn_flops + score_flops + hw.intensity * (kv_bytes + landmark_bytes)
    return StepCost(flops, nbytes, cost, attention / cost if cost else 0.0, weight_bytes, kv_bytes, landmark_bytes,
                    proj_flops, attn_flops, score_flops, forwards)


def _add(hw: Hardware, a: StepCost, b: StepCost) -> StepCost:
    names = ("weight_bytes", "kv_bytes", "landmark_bytes", "proj_flops", "attn_flops", "score_flops", "forwards")
    return _cost(hw, **{n: getattr(a, n) + getattr(b, n) for n in names})


def seconds(cost: StepCost, hw: Hardware) -> float:
    """The predicted time of `cost` on `hw`: equivalent FLOPs at peak FLOP/s."""
    return cost.cost / hw.peak_flops


MAX_LENGTH = 10**7
"""The longest prompt_len or gen_len priced: beyond any model's context, and a trajectory's per-step arrays stay
near 1 GB at this length."""


def check_trajectory(prompt_len, gen_len, samples) -> None:
    """Refuse lengths that are not integers from 1 to MAX_LENGTH, and samples that is not an integer >= 1."""
    for what, value in (("prompt_len", prompt_len), ("gen_len", gen_len)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_LENGTH:
            raise SparrowError(f"{what} must be an integer from 1 to {MAX_LENGTH:,} tokens, got {value!r}")
    check_int("samples", samples, 1)


@dataclass(frozen=True)
class Pricing:
    """What prices a trajectory besides the model, the hardware and the lengths: the KV page size, how many
    layers stay dense, the landmark the sparse ones score, and the bytes of a weight and of a cached K/V element.
    One value that every pricing function takes (`pricing=`), built once by each caller from its options.
    `check(dims)` refuses what the model cannot price; the pricing functions call it."""

    page_size: int = 16
    dense_layers: int = 2
    landmark: str = "centroid"
    bytes_per_param: float = 2
    bytes_per_kv: float = 2

    def check(self, dims: ModelDims) -> None:
        """Raise SparrowError for settings the model cannot price."""
        if self.page_size < 1:
            raise SparrowError(f"page size must be a positive integer, got {self.page_size}")
        if not 0 <= self.dense_layers <= dims.layers:
            raise SparrowError(f"dense_layers must be between 0 and the model's {dims.layers} layers, got "
                               f"{self.dense_layers}")
        get_landmark(self.landmark)
        for what, value in (("bytes_per_param", self.bytes_per_param), ("bytes_per_kv", self.bytes_per_kv)):
            if not (value > 0 and math.isfinite(value)):
                raise SparrowError(f"{what} must be a positive finite number, got {value!r}")


def _budget_pages(budget: np.ndarray, page_size: int) -> np.ndarray:
    """Whole pages of each token budget; a budget below the always-kept pages (sink + recent, SparseConfig's
    defaults) cannot be honoured."""
    pages = budget // page_size
    kept = SparseConfig().always_kept_pages
    if pages.size and int(pages.min()) < kept:
        low = int(budget[int(np.argmin(pages))])
        raise SparrowError(f"KV budget {low} is below the {kept} always-kept pages of {page_size} "
                           f"tokens ({kept * page_size} tokens)")
    return pages


def _sparse_counts(cached: np.ndarray, budget: np.ndarray | None, page_size: int) -> tuple[int, int]:
    """(tokens attended, landmarks scored) by one sequence in one sparse layer, summed over the given steps.

    With P = ceil(n / ps) pages and k budget pages: if P <= k the step is dense (n tokens, no scoring); else k
    pages are attended, the last of them the current page, so k * ps tokens minus that page's P * ps - n empty
    slots, and the landmarks of all n // ps full pages are read.
    """
    if budget is None:
        return int(cached.sum()), 0
    pages = -(-cached // page_size)
    k = _budget_pages(budget, page_size)
    selecting = pages > k
    attended = np.where(selecting, k * page_size - (pages * page_size - cached), cached)
    scored = np.where(selecting, cached // page_size, 0)
    return int(attended.sum()), int(scored.sum())


def _decode(dims: ModelDims, hw: Hardware, batch: int, steps: int, sum_cached: int, sum_sparse: int,
            sum_scored: int, pricing: Pricing) -> StepCost:
    """Cost of `steps` decode steps of `batch` sequences from token and landmark counts summed over the steps.

    Weights are read once for the batch (2 FLOPs per weight per sequence). Each sequence, per layer, reads K and V
    of the tokens it attends (4 * heads * head_dim FLOPs per token for QK and PV) and writes the new token's K
    and V; in a sparse layer that selects, it also reads and scores the landmarks of its full pages, at the bytes
    and FLOPs per page of the landmark's registry entry (attention/landmarks.py; centroid: one vector per KV head
    scored with the group-mean query; quest: min and max, scored per query head).
    """
    sparse_layers = dims.layers - pricing.dense_layers
    per_kv_head = dims.kv_heads * dims.head_dim
    tokens_read = pricing.dense_layers * sum_cached + sparse_layers * sum_sparse
    lm = get_landmark(pricing.landmark)
    page_bytes = lm.bytes_per_page(dims.kv_heads, dims.head_dim, pricing.bytes_per_kv)
    page_flops = lm.score_flops_per_page(dims.heads, dims.kv_heads, dims.head_dim)
    return _cost(
        hw,
        weight_bytes=steps * dims.step_params * pricing.bytes_per_param,
        kv_bytes=batch * 2 * per_kv_head * pricing.bytes_per_kv * (tokens_read + steps * dims.layers),
        landmark_bytes=batch * page_bytes * sparse_layers * sum_scored,
        proj_flops=2 * dims.step_params * batch * steps,
        attn_flops=batch * 4 * dims.heads * dims.head_dim * tokens_read,
        score_flops=batch * page_flops * sparse_layers * sum_scored,
        forwards=steps,
    )


def prefill_cost(dims: ModelDims, hw: Hardware, prompt_len: int, *, pricing: Pricing = Pricing()) -> StepCost:
    """One dense causal prefill: 2 FLOPs per weight per token, token t attends t tokens, weights read once.

    Attention FLOPs: 4 * heads * head_dim per (query, key) pair, L (L + 1) / 2 pairs per layer. Bytes: the weights
    once and the prompt's K and V written once (shared by all samples), at `pricing`'s byte sizes.
    """
    pairs = prompt_len * (prompt_len + 1) // 2
    return _cost(
        hw,
        weight_bytes=dims.step_params * pricing.bytes_per_param,
        kv_bytes=2 * dims.kv_width * prompt_len * pricing.bytes_per_kv,
        landmark_bytes=0,
        proj_flops=2 * dims.step_params * prompt_len,
        attn_flops=4 * dims.heads * dims.head_dim * dims.layers * pairs,
        score_flops=0,
        forwards=1,
    )


def _trajectory_sums(schedule: Schedule, prompt_len: int, gen_len: int, page_size: int) -> tuple[int, int, int]:
    """Over the generated tokens of one sequence (token i holding prompt_len + i + 1 cached tokens): the cached
    tokens, those a sparse layer attends under `schedule`, and the landmarks it scores, each summed."""
    first, last = prompt_len + 1, prompt_len + gen_len
    sum_cached = (first + last) * gen_len // 2
    if schedule.is_dense:
        return sum_cached, sum_cached, 0
    cached = np.arange(first, last + 1, dtype=np.int64)
    return sum_cached, *_sparse_counts(cached, schedule.budget_for(cached), page_size)


def trajectory_cost(dims: ModelDims, hw: Hardware, schedule: Schedule, prompt_len: int, gen_len: int, samples: int,
                    *, pricing: Pricing = Pricing()) -> TrajectoryCost:
    """One shared dense prefill plus `gen_len` decode steps of `samples` sequences under `schedule`.

    At decode step i (0-based) each sequence holds prompt_len + i + 1 tokens, and its budget is the schedule's
    at that length. Steps are counted in closed form (dense) or with numpy over all steps at once (sparse).
    """
    pricing.check(dims)
    check_trajectory(prompt_len, gen_len, samples)
    sum_cached, sum_sparse, sum_scored = _trajectory_sums(schedule, prompt_len, gen_len, pricing.page_size)
    decode = _decode(dims, hw, samples, gen_len, sum_cached, sum_sparse, sum_scored, pricing)
    prefill = prefill_cost(dims, hw, prompt_len, pricing=pricing)
    total = _add(hw, prefill, decode)
    return TrajectoryCost(**dataclasses.asdict(total), prefill=prefill, decode=decode, steps=gen_len,
                          samples=samples)


def compare(dims: ModelDims, hw: Hardware, schedule: Schedule, prompt_len: int, gen_len: int, samples: int,
            *, pricing: Pricing = Pricing()) -> dict:
    """Dense vs `schedule` over the same trajectory: costs, predicted speedup, mean decode step times, attention
    shares, breakdowns."""
    if schedule.is_dense:
        raise SparrowError(f"schedule {schedule.name!r} is dense: nothing to compare; give a sparse schedule")
    dense = trajectory_cost(dims, hw, DENSE, prompt_len, gen_len, samples, pricing=pricing)
    sparse = trajectory_cost(dims, hw, schedule, prompt_len, gen_len, samples, pricing=pricing)
    return {
        "dense_cost": dense.cost,
        "sparse_cost": sparse.cost,
        "predicted_speedup": dense.cost / sparse.cost,
        "dense_step_s": seconds(dense.decode, hw) / gen_len,
        "sparse_step_s": seconds(sparse.decode, hw) / gen_len,
        "dense_attention_share": dense.attention_share,
        "sparse_attention_share": sparse.attention_share,
        "dense": dataclasses.asdict(dense),
        "sparse": dataclasses.asdict(sparse),
    }


def equal_cost_constant(dims: ModelDims, hw: Hardware, schedule: Schedule, prompt_lens: list[int], gen_len: int,
                        samples: int, *, pricing: Pricing = Pricing()) -> tuple[int, float]:
    """The constant budget (whole pages, from the always-kept pages up) whose predicted rollout cost, summed over
    one trajectory per prompt length in `prompt_lens`, is closest to `schedule`'s; returns (budget, its cost over
    the schedule's). The fair constant rival of a growing schedule on a mixed-length task: the same predicted
    rollout cost, spent evenly over lengths. Bisection over pages: the cost never falls as the budget grows."""
    if not prompt_lens:
        raise SparrowError("equal-cost constant budget needs at least one prompt length")
    for length in prompt_lens:
        check_trajectory(length, gen_len, samples)
    page_size = pricing.page_size

    def total(s: Schedule) -> float:
        return sum(trajectory_cost(dims, hw, s, n, gen_len, samples, pricing=pricing).cost for n in prompt_lens)

    target = total(schedule)
    low, high = SparseConfig().always_kept_pages, -(-(max(prompt_lens) + gen_len) // page_size)
    while low < high:  # the fewest pages whose cost reaches the target (high: dense everywhere)
        middle = (low + high) // 2
        if total(const(middle * page_size)) >= target:
            high = middle
        else:
            low = middle + 1
    candidates = [pages for pages in (low - 1, low) if pages >= SparseConfig().always_kept_pages]
    costs = {pages: total(const(pages * page_size)) for pages in candidates}
    best = min(candidates, key=lambda pages: abs(costs[pages] - target))
    return best * page_size, costs[best] / target


def paper_cost(dims: ModelDims, hw: Hardware, budget: int, prompt_len: int, gen_len: int, samples: int,
               page_size: int) -> dict:
    """The paper's printed formulas (SPEC section 6), verbatim: constant budget, no weight reads, all layers sparse.

    P = dims.params, N = samples, D = kv_width, r = gqa_ratio, B = budget, ps = page_size, I = hw.intensity.
    """
    P, N, D, r, B, ps, I = dims.params, samples, dims.kv_width, dims.gqa_ratio, budget, page_size, hw.intensity
    L_in, L_out = prompt_len, gen_len
    dense = (2 * P * N * L_out + r * (2 * L_in + L_out) * L_out * N * D
             + I * (2 * L_in * L_out * D + N * L_out ** 2 * D))
    without_scoring = 2 * N * P * L_out + 2 * r * N * D * B * L_out + 2 * I * N * D * B * L_out
    scoring = (2 * N * L_in * D * L_out + r * N * D * L_out ** 2 / (2 * ps)
               + 2 * I * L_in * D * L_out + I * N * D * L_out ** 2 / (2 * ps))
    sparse = without_scoring + scoring
    return {"dense": dense, "sparse": sparse, "speedup": dense / sparse}
