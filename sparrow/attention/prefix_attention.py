"""Dense causal attention of queries that follow a cached prefix (a shared prompt), without a mask.

The completions of a group are teacher-forced after their prompt's cache: queries are the last Tq of Tk positions,
so the causal mask is aligned to the bottom right and SDPA needs it as an explicit [Tq, Tk] mask, which PyTorch's
CPU flash kernel converts, reads block by block and cannot skip. Split at the prefix instead: every query sees
all prefix keys (no mask) and the completion's keys causally (a square, `is_causal`), and the two halves are
merged by their log-sum-exps. The backward runs the flash backward of each half against the merged output and
log-sum-exp, which is the full attention's gradient (the softmax normaliser is the merged one). CPU flash only
(float32, bfloat16): `usable` says when; other devices keep SDPA with the mask.
"""

from __future__ import annotations

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def usable(query: torch.Tensor) -> bool:
    """Whether `prefix_causal_attention` can run on `query`'s device and dtype."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)


def prefix_causal_attention(query, key, value, scale: float) -> torch.Tensor:
    """Causal attention of query [B, H, Tq, D] against key/value [B, Hkv, Tk, D] whose first Tk - Tq > 0
    positions are a prefix every query sees; returns [B, H, Tq, D] like SDPA."""
    offset = key.shape[2] - query.shape[2]
    if offset <= 0 or not usable(query):
        raise ValueError(f"prefix_causal_attention needs CPU float32/bfloat16 queries after a prefix, got "
                         f"{query.device.type} {query.dtype}, {query.shape[2]} queries over {key.shape[2]} keys")
    return _SplitAtPrefix.apply(query, key, value, offset, scale)


def _merge(halves):
    """Outputs [B, H, T, D] and log-sum-exps [B, H, T] of attention over disjoint key sets -> those of the union."""
    (o1, l1), (o2, l2) = halves
    lse = torch.logaddexp(l1, l2)
    return o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1), lse


class _SplitAtPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, offset: int, scale: float):
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        out, lse = _merge([_FLASH(query, keys[:, :, :offset], values[:, :, :offset], scale=scale)[:2],
                           _FLASH(query, keys[:, :, offset:], values[:, :, offset:], is_causal=True, scale=scale)[:2]])
        out = out.to(query.dtype)
        ctx.save_for_backward(query, keys, values, out, lse)
        ctx.offset, ctx.scale, ctx.group = offset, scale, group
        return out

    @staticmethod
    def backward(ctx, grad):
        query, keys, values, out, lse = ctx.saved_tensors
        offset, grad = ctx.offset, grad.contiguous()
        dq1, dk1, dv1 = _FLASH_BACKWARD(grad, query, keys[:, :, :offset], values[:, :, :offset], out, lse, 0.0, False,
                                        scale=ctx.scale)
        dq2, dk2, dv2 = _FLASH_BACKWARD(grad, query, keys[:, :, offset:], values[:, :, offset:], out, lse, 0.0, True,
                                        scale=ctx.scale)
        batch, heads, length, dim = keys.shape

        def per_kv_head(d1, d2):
            return torch.cat([d1, d2], dim=2).view(batch, heads // ctx.group, ctx.group, length, dim).sum(2)

        return dq1 + dq2, per_kv_head(dk1, dk2), per_kv_head(dv1, dv2), None, None
