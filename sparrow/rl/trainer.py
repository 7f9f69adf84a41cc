"""The GRPO training loop around `grpo_step`: data order, optimizer, metrics (JSONL + TensorBoard), checkpoints.

Everything that varies between steps is a function of (seed, step): the prompts of step k come from the
seeded sampler, and the rollout seed is derived from the step, so a run resumed from checkpoint-k draws the
same data and samples as an uninterrupted one and ends with the same parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.attention import SparseConfig
from sparrow.datasets import DataSpec, PromptSampler, load_examples
from sparrow.engine import RolloutEngine
from sparrow.errors import SparrowError
from sparrow.models import load_model, resolve_device, resolve_dtype
from sparrow.rewards import load_reward
from sparrow.schedules import parse_schedule

from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .report import write_report
from .step import StepSettings, grpo_step


@dataclass
class TrainConfig:
    """One GRPO run. Names follow TRL where they mean the same thing (num_generations, learning_rate, ...)."""

    model: str = "tiny-qwen3"
    dtype: str = "float32"
    device: str = "auto"
    data: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    reward: list[str] | None = None
    reward_weights: list[float] | None = None
    schedule: str = "dense"
    page_size: int = 16
    landmark: str = "centroid"
    dense_layers: str = "0,1"
    steps: int = 2
    prompts_per_step: int = 2
    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    tis_mode: str = "truncate"
    tis_cap: float = 2.0
    tau: float = 0.86
    bin_size: int = 2000
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_aggregation: str = "token-mean"
    mini_batches: int = 1
    micro_batch_size: int = 4
    seed: int = 0
    output_dir: str = "runs/train"
    save_every: int = 1
    keep_last: int = 2
    resume: bool = False

    def validate(self) -> None:
        if self.data is None:
            raise SparrowError("give the prompt data: --data FILE.jsonl|.parquet")
        if not Path(self.data).is_file():
            raise SparrowError(f"data file {self.data!r} does not exist")
        for name in ("steps", "prompts_per_step", "save_every", "keep_last"):
            if getattr(self, name) < 1:
                raise SparrowError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise SparrowError(f"learning_rate must be > 0, got {self.learning_rate}")
        self.reward_functions()
        self.settings()
        resolve_dtype(self.dtype)
        resolve_device(self.device)
        sparse = self.sparse_config()
        parse_schedule(self.schedule, sparse.page_size, sparse.always_kept_pages)

    def sparse_config(self) -> SparseConfig:
        return SparseConfig.from_options(self.page_size, self.landmark, self.dense_layers)

    def reward_functions(self) -> list:
        names = self.reward or ["math"]
        weights = self.reward_weights or [1.0] * len(names)
        if len(weights) != len(names):
            raise SparrowError(f"{len(names)} reward(s) but {len(weights)} reward_weights; give one weight each")
        return [(name, load_reward(name), float(w)) for name, w in zip(names, weights)]

    def settings(self) -> StepSettings:
        return StepSettings(num_generations=self.num_generations, max_new_tokens=self.max_new_tokens,
                            temperature=self.temperature, top_p=self.top_p, clip_low=self.clip_low,
                            clip_high=self.clip_high, dual_clip=self.dual_clip, tis_mode=self.tis_mode,
                            tis_cap=self.tis_cap, loss_aggregation=self.loss_aggregation,
                            mini_batches=self.mini_batches, micro_batch_size=self.micro_batch_size,
                            max_grad_norm=self.max_grad_norm, tau=self.tau, bin_size=self.bin_size,
                            kl_coef=self.kl_coef, kl_estimator=self.kl_estimator)


def train(config: TrainConfig, log=print) -> list[dict]:
    """Run (or resume) the configured steps; returns this invocation's per-step metrics."""
    config.validate()
    out = Path(config.output_dir)
    examples = load_examples(DataSpec(config.data, config.prompt_field, config.answer_field))
    sampler = PromptSampler(len(examples), config.prompts_per_step, config.seed)
    model, tokenizer = load_model(config.model, resolve_dtype(config.dtype), resolve_device(config.device))
    sparse = config.sparse_config()
    engine = RolloutEngine(model, tokenizer, sparse)
    schedule = parse_schedule(config.schedule, sparse.page_size, sparse.always_kept_pages)
    reference = None
    if config.kl_coef > 0:
        reference = copy.deepcopy(model).requires_grad_(False)  # the initial policy, also on resume
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    start = 0
    if config.resume and (found := list_checkpoints(out)):
        step, path = found[-1]
        state = load_checkpoint(path, model, optimizer)
        start = state["step"]
        log(f"resumed from {path} at step {start}")
    elif (out / "metrics.jsonl").exists() and not config.resume:
        raise SparrowError(f"{out} already holds a run; pass --resume to continue it or choose another --output-dir")
    out.mkdir(parents=True, exist_ok=True)
    from torch.utils.tensorboard import SummaryWriter

    board = SummaryWriter(str(out / "tensorboard"))
    rewards, settings, history = config.reward_functions(), config.settings(), []
    for step in range(start, config.steps):
        began = time.perf_counter()
        batch = [examples[i] for i in sampler.batch(step)]
        metrics = grpo_step(model, engine, optimizer, batch, rewards, schedule, settings,
                            seed=config.seed * 1_000_003 + step, reference=reference)
        metrics = {"step": step + 1, **metrics, "time/step_s": time.perf_counter() - began}
        with open(out / "metrics.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(metrics) + "\n")
        history.append(metrics)
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and name != "step":
                board.add_scalar(name, value, step + 1)
        board.flush()
        for warning in metrics["mismatch/warnings"]:
            log(f"warning: step {step + 1}: {warning}")
        log(f"step {step + 1}/{config.steps}  reward {metrics['reward/mean']:.3f}  loss {metrics['loss']:.4f}  "
            f"len {metrics['completions/mean_length']:.0f}  {metrics['time/step_s']:.1f}s")
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            save_checkpoint(out, step + 1, model, tokenizer, optimizer,
                            {"config": dataclasses.asdict(config)}, config.keep_last)
    board.close()
    write_report([out], out)
    log(f"wrote {out / 'metrics.jsonl'} and {out / 'report.md'}")
    sys.stdout.flush()
    return history
