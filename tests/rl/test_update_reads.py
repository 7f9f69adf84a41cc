"""Host reads in the update's micro-batches, counted on the CPU as tests/engine/test_host_syncs.py counts decode's:
the loss, KL, accumulation and backward of a micro-batch read nothing from the device (the mask is checked once
per update, the clip statistics, KL values and losses are read once per mini-batch or update). The forwards that
feed them (dense.py: pi_old, bounds, monitor) are not counted here. A bad mask is still refused, before any
micro-batch runs."""

import pytest
import torch

import sparrow.rl.step as step_module
from sparrow.datasets import Example
from sparrow.errors import SparrowError
from sparrow.models import load_model
from sparrow.rl.step import Policy, StepBatch, StepConfig, advantages, recompute, rollout, score, update
from sparrow.rollout import NativeBackend
from sparrow.schedules import const
from sparrow.typed_config import build
from tests.engine.test_host_syncs import counted_reads


def byte_mean(prompts, completions, **_):
    return [sum(c.encode()) / (255 * max(1, len(c.encode()))) for c in completions]


EXAMPLES = [Example(0, "the cat sat on the mat " * 12, "1", {}), Example(1, "a b c d e f g " * 20, "2", {})]


def _recomputed(options: dict, reference: bool = False) -> tuple[Policy, StepBatch, StepConfig]:
    """A policy and a step whose rollouts are scored and recomputed: what `update` takes."""
    cfg = build(StepConfig, {"num_generations": 4, "max_new_tokens": 12, "micro_batch_size": 2, **options})
    model, tok = load_model("tiny-qwen3")
    policy = Policy(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0), tok.pad_token_id or 0)
    if reference:
        policy.reference = load_model("tiny-qwen3")[0]
    step = StepBatch(EXAMPLES, const(64))
    rollout(NativeBackend(model, tok), step, cfg, seed=0)
    score(step, [("bytes", byte_mean, 1.0)])
    advantages(step, cfg)
    recompute(policy, step, cfg)
    return policy, step, cfg


@pytest.mark.parametrize("options, reference", [
    ({"mini_batches": 2}, False),
    ({"mini_batches": 1, "policy_loss": "gspo", "loss_aggregation": "seq-mean-token-mean", "kl_coef": 0.1}, True),
], ids=["ppo_clip", "gspo_kl_fused"])
def test_a_micro_batchs_loss_reads_nothing_from_the_device(monkeypatch, options, reference):
    policy, step, cfg = _recomputed(options, reference)
    forwards, reads, micro_batches = step_module.update_forwards, [], []

    def counted_bodies(*args, **kwargs):
        """The real forwards, uncounted; the caller's loop body over each micro-batch, counted."""
        for item in forwards(*args, **kwargs):
            micro_batches.append(len(item[0]))
            with counted_reads() as calls:
                yield item
            reads.extend(calls)

    monkeypatch.setattr(step_module, "update_forwards", counted_bodies)
    update(policy, step, cfg)
    assert len(micro_batches) >= 4, micro_batches
    assert reads == [], sorted(set(reads))
    assert step.update["loss"] == step.update["loss"] and step.update["clip_ratio"] >= 0
    assert ("kl" in step.update) == reference


@pytest.mark.parametrize("bad, message", [
    (lambda mask: mask.zero_(), r"mask of shape \(8, \d+\) marks no valid token"),
    (lambda mask: mask.masked_fill_(mask == 1, 0.5), r"mask holds 0.5: expected only 0/1"),
])
def test_a_bad_mask_is_refused_before_any_micro_batch(bad, message):
    policy, step, cfg = _recomputed({"mini_batches": 2})
    before = [p.detach().clone() for p in policy.model.parameters()]
    bad(step.batch.mask)
    with pytest.raises(SparrowError, match=message):
        update(policy, step, cfg)
    assert all(torch.equal(b, p) for b, p in zip(before, policy.model.parameters()))
