"""DistillSparse (SPEC section 8): a LoRA adapter that is active only when the model acts as the sparse actor.

The adapter is on for sparse rollouts (the RolloutEngine) and for the teacher-forced sparse forward of its own
update. It is off (`Distiller.dense()`, peft's `disable_adapter`) for the dense recompute of pi_old, the dense
policy update, the dense targets of the exact KL modes and the dense reference of the probes, so the dense policy
is exactly what it would be without DistillSparse. After each dense policy step the base weights are frozen and
the adapter takes one AdamW step on

    L_LoRA = L_PPO_sparse + lambda * L_KL

(see `Distiller.step`). When rollouts may move to a more aggressive schedule is the switch controller's
(`sparrow.schedules.controllers.SwitchSchedule`: its state and decision), on the probes of rl/probes.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass

import torch

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import sparse_completion_logits
from sparrow.errors import SparrowError
from sparrow.lora import LoraSpec, adapter_parameters, base_parameters, without_adapter
from sparrow.measure.batch import RolloutBatch, piece_logits, piece_logprobs, shared_prompt_pieces
from sparrow.schedules import Schedule
from sparrow.typed_config import check_int, option

from .activation_checkpointing import checkpointed_layers
from .losses import FULL_KL_DIRECTIONS, accumulation_share, check_mask, full_kl, kl_penalty, policy_loss, read_floats

DISTILL_KL_MODES = ("k3", *FULL_KL_DIRECTIONS)


def _check_number(option: str, value, ok, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise SparrowError(f"{option} must be a number {expected}, got {value!r}")


@dataclass(frozen=True)
class DistillConfig:
    """The `distill` section of the train config: the adapter, its optimizer and schedule switching.

    enabled: DistillSparse on (`--distill`). lr: AdamW learning rate of the adapter (no weight decay); 1e-4 is a
    usual LoRA rate: a zero-initialized low-rank update needs a far larger rate than full fine-tuning (1e-6 would
    leave it near zero). rank, alpha: LoRA rank and scaling numerator (the release: alpha 16). targets:
    "all-linear" (every linear layer but the output head, the release's choice) or comma-separated module names
    such as "q_proj,v_proj". dropout: LoRA dropout. kl_lambda: weight of L_KL (the release: 0.001). kl: "k3" (the
    release's sampled-token estimator of KL(sparse || dense)), "forward" (exact KL(dense || sparse)) or "reverse"
    (exact KL(sparse || dense)). switch_schedule: a more aggressive schedule that rollouts switch to after
    `probe_patience` consecutive probes (every `probe_every` steps, on `probe_prompts` held-out prompts of
    `probe_data` or the last rows of the data) hold every length bin's acceptance p5 at tau.
    """

    enabled: bool = option(False, "DistillSparse: a LoRA adapter active only in the sparse actor, trained toward "
                           "the dense policy", flag="distill")
    lr: float = option(1e-4, "AdamW learning rate of the adapter", flag="distill_lr")
    rank: int = option(8, "LoRA rank of the adapter", flag="distill_rank")
    alpha: float = option(16.0, "LoRA scaling numerator of the adapter", flag="distill_alpha")
    targets: str = option("all-linear", "all-linear or comma-separated module names for the adapter",
                          flag="distill_targets")
    dropout: float = option(0.0, "LoRA dropout of the adapter", flag="distill_dropout")
    kl_lambda: float = option(0.001, "weight of the adapter's KL term", flag="distill_lambda")
    kl: str = option("k3", "k3 (sampled-token estimate of KL(sparse||dense)), forward (exact KL(dense||sparse)) or "
                     "reverse", flag="distill_kl")
    switch_schedule: str | None = option(None, "a more aggressive schedule rollouts switch to once probes show its "
                                         "tail acceptance >= tau")
    probe_every: int = option(10, "a switch probe every N-th step")
    probe_prompts: int = option(4, "held-out prompts per switch probe")
    probe_patience: int = option(2, "consecutive passing probes before rollouts switch")
    probe_data: str | None = option(None, "prompts for the switch probes (default: the last probe_prompts rows of "
                                    "--data, held out)")

    def __post_init__(self):
        check_int("distill_rank", self.rank, 1)
        _check_number("distill_lr", self.lr, lambda v: v > 0, "> 0")
        _check_number("distill_alpha", self.alpha, lambda v: v > 0, "> 0")
        _check_number("distill_lambda", self.kl_lambda, lambda v: v >= 0, ">= 0")
        _check_number("distill_dropout", self.dropout, lambda v: 0 <= v < 1, "in [0, 1)")
        if self.kl not in DISTILL_KL_MODES:
            raise SparrowError(f"unknown distill_kl {self.kl!r}: expected one of {', '.join(DISTILL_KL_MODES)}")
        if not isinstance(self.targets, str) or not self.target_modules():
            raise SparrowError(f"distill_targets must be 'all-linear' or comma-separated module names such as "
                               f"'q_proj,v_proj', got {self.targets!r}")
        for name in ("probe_every", "probe_prompts", "probe_patience"):
            check_int(name, getattr(self, name), 1)

    def target_modules(self) -> str | list[str]:
        return self.lora().target_modules()

    def lora(self) -> LoraSpec:
        """The adapter's shape, as `sparrow.lora.attach_adapter` and the rollout workers' model spec take it."""
        return LoraSpec(self.rank, self.alpha, self.targets, self.dropout)


@contextlib.contextmanager
def _frozen(params: list[torch.nn.Parameter]):
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


class Distiller:
    """The adapter's optimizer and update, for a model returned by `attach_adapter` (or a loaded PeftModel)."""

    def __init__(self, model, cfg: DistillConfig, sparse: SparseConfig | None = None):
        self.model, self.cfg, self.sparse = model, cfg, sparse or SparseConfig()
        self.params = adapter_parameters(model)
        if not self.params or not hasattr(model, "disable_adapter"):
            raise SparrowError("DistillSparse needs a model with a LoRA adapter: wrap it with attach_adapter first")
        self.base = base_parameters(model)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)

    def dense(self):
        """Context in which the model is the dense policy alone (adapter disabled)."""
        return without_adapter(self.model)

    def step(self, batch: RolloutBatch, logp_old: torch.Tensor, advantages: torch.Tensor, schedule: Schedule,
             cfg) -> dict:
        """One adapter update on the step's rollouts, base weights frozen; returns `distill/...` metrics.

        L_PPO_sparse is the run's policy loss (`--policy-loss`, clipped PPO by default) with pi_theta = the
        teacher-forced sparse log-probs (adapter on, the rollout `schedule`), pi_old = the rollout log-probs and
        the GRPO advantages. No TIS weight: the rollouts
        were sampled by this very actor (before its update), so the old policy is the behaviour policy and the
        PPO ratio already is the full importance ratio. L_KL (token mean) pulls the sparse actor toward the
        dense policy: "k3" uses the dense `logp_old` of the recompute (pi_old, before this step's dense update)
        and costs nothing extra; "forward"/"reverse" need full-vocabulary dense logits, so they run one extra
        no-grad dense forward per piece (adapter off, after this step's dense update; the shared-prompt forward
        of the recompute, logits at completion positions only). Rows run in the recompute's shared-prompt pieces,
        the sparse forward too (`sparse_completion_logits`: each prompt's dense prefill once per piece);
        accumulation and `max_grad_norm` as for the policy.
        """
        clock = time.perf_counter()
        grpo, temperature = cfg.grpo, batch.temperature
        clip = {"clip_low": grpo.clip_low, "clip_high": grpo.clip_high, "dual_clip": grpo.dual_clip,
                "aggregation": grpo.loss_aggregation}
        rows = torch.arange(batch.input_ids.shape[0])
        actor = functools.partial(sparse_completion_logits, schedule=schedule, sparse=self.sparse)
        check_mask(batch.mask)  # once: the pieces' losses read nothing from the device
        tokens = batch.mask.sum()
        parts, diffs = [], []  # (metric, value * share) of each piece, read once after the last
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with _frozen(self.base), checkpointed_layers(self.model, grpo.gradient_checkpointing):
            for piece in shared_prompt_pieces(batch, rows, grpo.micro_batch_size):
                mask = batch.mask[piece]
                valid = mask.bool()
                logits, span = piece_logits(self.model, batch, piece, actor)
                logp = piece_logprobs(logits, batch, piece, span, temperature)
                ppo, _ = policy_loss(grpo.policy_loss, logp, batch.rollout_logprobs[piece], advantages[piece], mask,
                                     **clip)
                kl = self._kl(batch, piece, span, logits, logp, logp_old[piece])
                loss = ppo + self.cfg.kl_lambda * kl
                share = accumulation_share(mask, tokens, len(piece), len(rows), grpo.loss_aggregation)
                (loss * share).backward()
                parts += [(name, value.detach() * share) for name, value in (("loss", loss), ("ppo_loss", ppo),
                                                                             ("kl", kl))]
                diffs.append((logp.detach() - logp_old[piece])[valid].abs())
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, grpo.max_grad_norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # stale adapter grads must not reach the policy's grad clip
        self.model.eval()
        totals = {"loss": 0.0, "ppo_loss": 0.0, "kl": 0.0}
        for (name, _), value in zip(parts, read_floats([part for _, part in parts])):
            totals[name] += value
        return {**{f"distill/{name}": value for name, value in totals.items()},
                "distill/grad_norm": grad_norm,
                "distill/logp_difference_mean": float(torch.cat(diffs).mean()),
                "time/distill_s": time.perf_counter() - clock}

    def _kl(self, batch: RolloutBatch, piece: torch.Tensor, span: slice, logits: torch.Tensor, logp: torch.Tensor,
            logp_old: torch.Tensor) -> torch.Tensor:
        """L_KL of a piece (token mean): k3 against the recompute's dense `logp_old`, or the exact KL against the
        dense logits of a no-grad forward with the adapter off."""
        if self.cfg.kl == "k3":
            return kl_penalty(logp, logp_old, "k3")[batch.mask[piece].bool()].mean()
        with torch.no_grad(), self.dense():
            dense_logits, _ = piece_logits(self.model, batch, piece)
        inside = batch.mask[piece, span].bool()
        return full_kl(logits[inside], dense_logits[inside], self.cfg.kl, batch.temperature).mean()
