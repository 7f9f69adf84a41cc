"""A whole GRPO step priced with the cost model (cost_model.py): the rollout, the update both arms pay and the exact
monitor sparse rollouts pay. Pure arithmetic, as cost_model.py."""

from __future__ import annotations

import dataclasses

from sparrow.attention.landmarks import get_landmark
from sparrow.errors import SparrowError
from sparrow.measure.acceptance import monitored_rows
from sparrow.model_shapes import ModelDims
from sparrow.schedules import DENSE, Schedule
from sparrow.typed_config import check_int

from .cost_model import Hardware, Pricing, _cost, _trajectory_sums, trajectory_cost


def training_step(dims: ModelDims, hw: Hardware, schedule: Schedule, prompt_len: int, gen_len: int, samples: int,
                  monitor_every: int = 1, monitor_share: float = 1.0, *, pricing: Pricing = Pricing()) -> dict:
    """A whole GRPO step of one group (`samples` completions of one prompt), dense rollouts against `schedule`'s:
    the rollout (`trajectory_cost`), the update both pay, and the exact monitor only sparse rollouts pay.

    The update runs the dense policy forward and backward over the group, the prompt once (its K/V shared by the
    samples, no logits) and every completion against it (each token attending the tokens before it): three times
    the forward's FLOPs, a backward costing two forwards. Thousands of tokens share each weight read, so it is
    bound by arithmetic; its bytes are the weights read three times. The monitor teacher-forces the first
    ceil(monitor_share * samples) completions through the sparse actor every `monitor_every`-th step, reusing the
    update's prompt and dense logits: each completion token's forward, attending what it attended while
    decoding and scoring the same landmarks (the acceptance itself, a few FLOPs per vocabulary entry, is left
    out). `step_speedup` is the dense step's cost over the sparse step's (the monitor spread over its steps);
    `step_speedup_limit` is what a free rollout and monitor would give: the update alone bounds the step."""
    check_int("monitor_every", monitor_every, 1)
    if not 0 < monitor_share <= 1:
        raise SparrowError(f"monitor_share must be in (0, 1], got {monitor_share!r}")
    dense = trajectory_cost(dims, hw, DENSE, prompt_len, gen_len, samples, pricing=pricing)
    sparse = trajectory_cost(dims, hw, schedule, prompt_len, gen_len, samples, pricing=pricing)
    sum_cached, sum_sparse, sum_scored = _trajectory_sums(schedule, prompt_len, gen_len, pricing.page_size)
    attn_per_pair = 4 * dims.heads * dims.head_dim
    prompt_pairs = prompt_len * (prompt_len + 1) // 2
    forward_proj = 2 * (dims.step_params - dims.vocab * dims.hidden) * prompt_len + 2 * dims.step_params * (
        samples * gen_len)
    forward_attn = attn_per_pair * dims.layers * (prompt_pairs + samples * sum_cached)
    update = _cost(hw, weight_bytes=3 * dims.step_params * pricing.bytes_per_param, kv_bytes=0, landmark_bytes=0,
                   proj_flops=3 * forward_proj, attn_flops=3 * forward_attn, score_flops=0, forwards=0)
    rows = monitored_rows(samples, monitor_share)
    sparse_layers = dims.layers - pricing.dense_layers
    lm = get_landmark(pricing.landmark)
    monitor = _cost(hw, weight_bytes=dims.step_params * pricing.bytes_per_param, kv_bytes=0, landmark_bytes=0,
                    proj_flops=2 * dims.step_params * rows * gen_len,
                    attn_flops=rows * attn_per_pair * (pricing.dense_layers * sum_cached
                                                       + sparse_layers * sum_sparse),
                    score_flops=rows * lm.score_flops_per_page(dims.heads, dims.kv_heads, dims.head_dim)
                    * sparse_layers * sum_scored, forwards=0)
    dense_step = dense.cost + update.cost
    sparse_step = sparse.cost + update.cost + monitor.cost / monitor_every
    return {"rollout_speedup": dense.cost / sparse.cost, "update_cost": update.cost, "monitor_cost": monitor.cost,
            "monitor_every": monitor_every, "monitor_rows": rows, "dense_step_cost": dense_step,
            "sparse_step_cost": sparse_step, "dense_step_s": dense_step / hw.peak_flops,
            "sparse_step_s": sparse_step / hw.peak_flops, "update_share": update.cost / dense_step,
            "step_speedup": dense_step / sparse_step, "step_speedup_limit": dense_step / update.cost,
            "update": dataclasses.asdict(update), "monitor": dataclasses.asdict(monitor)}
