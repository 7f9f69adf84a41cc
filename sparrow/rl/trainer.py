"""The GRPO training loop around `grpo_step`: data order, optimizer, metrics (JSONL + TensorBoard), checkpoints.

Everything that varies between steps is a function of (seed, step): the prompts of step k come from the
seeded sampler, and the rollout seed is derived from the step, so a run resumed from checkpoint-k draws the
same data and samples as an uninterrupted one and ends with the same parameters. The one piece of state that is
not, DistillSparse's schedule switch, is saved in the checkpoint's trainer state.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.attention import SparseConfig
from sparrow.datasets import DataSpec, PromptSampler, load_examples
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.errors import SparrowError
from sparrow.evaluation import evaluate
from sparrow.models import load_model, resolve_device, resolve_dtype
from sparrow.rewards import load_reward
from sparrow.schedules import parse_schedule

from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .distill import DistillConfig, Distiller, SwitchState, attach_adapter, base_parameters, observe_probe, probe
from .report import write_report
from .step import StepSettings, grpo_step

_EVAL_SEED = 2**41  # held-out evaluation samples: one fixed seed, apart from rollouts and probes
_PROBE_SEED = 2**40  # probe sampling seeds stay apart from the rollout seeds (seed * 1_000_003 + step)


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
    num_logprobs: int = 20
    distill: bool = False
    distill_lr: float = 1e-4
    distill_rank: int = 8
    distill_alpha: float = 16.0
    distill_targets: str = "all-linear"
    distill_dropout: float = 0.0
    distill_lambda: float = 0.001
    distill_kl: str = "k3"
    switch_schedule: str | None = None
    probe_every: int = 10
    probe_prompts: int = 4
    probe_patience: int = 2
    probe_data: str | None = None
    eval_data: str | None = None
    eval_every: int = 10
    eval_generations: int = 4
    eval_schedule: str = "dense"
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
        self.distill_config()
        for name in ("probe_every", "probe_prompts", "probe_patience"):
            if getattr(self, name) < 1:
                raise SparrowError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.switch_schedule is not None:
            parse_schedule(self.switch_schedule, sparse.page_size, sparse.always_kept_pages)
            if self.switch_schedule == self.schedule:
                raise SparrowError(f"switch_schedule {self.switch_schedule!r} is the rollout schedule itself; "
                                   "expected a more aggressive candidate")
        if self.probe_data is not None and self.switch_schedule is None:
            raise SparrowError("probe_data is only used by the switch probes; give switch_schedule as well")
        if self.eval_data is not None and not Path(self.eval_data).is_file():
            raise SparrowError(f"eval_data file {self.eval_data!r} does not exist")
        for name in ("eval_every", "eval_generations"):
            if getattr(self, name) < 1:
                raise SparrowError(f"{name} must be >= 1, got {getattr(self, name)}")
        parse_schedule(self.eval_schedule, sparse.page_size, sparse.always_kept_pages)
        if self.probe_data is not None and not Path(self.probe_data).is_file():
            raise SparrowError(f"probe_data file {self.probe_data!r} does not exist")

    def distill_config(self) -> DistillConfig:
        return DistillConfig(lr=self.distill_lr, rank=self.distill_rank, alpha=self.distill_alpha,
                             targets=self.distill_targets, dropout=self.distill_dropout,
                             kl_lambda=self.distill_lambda, kl=self.distill_kl)

    def sparse_config(self) -> SparseConfig:
        return SparseConfig.from_options(self.page_size, self.landmark, self.dense_layers)

    def reward_functions(self) -> list:
        names = self.reward or ["math"]
        weights = self.reward_weights or [1.0] * len(names)
        if len(weights) != len(names):
            raise SparrowError(f"{len(names)} reward(s) but {len(weights)} reward_weights; give one weight each")
        return [(name, load_reward(name), float(w)) for name, w in zip(names, weights)]

    def settings(self) -> StepSettings:
        """The per-step settings: every StepSettings field comes from the option of the same name."""
        return StepSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StepSettings)})


def _print(message: str) -> None:
    print(message, flush=True)  # progress must show up at once also when stdout is a file


def train(config: TrainConfig, log=_print) -> list[dict]:
    """Run (or resume) the configured steps; returns this invocation's per-step metrics."""
    config.validate()
    out = Path(config.output_dir)
    examples, probes = _probe_split(config, load_examples(DataSpec(config.data, config.prompt_field,
                                                                   config.answer_field)))
    sampler = PromptSampler(len(examples), config.prompts_per_step, config.seed)
    model, tokenizer = load_model(config.model, resolve_dtype(config.dtype), resolve_device(config.device))
    sparse = config.sparse_config()
    reference = None
    if config.kl_coef > 0:
        reference = copy.deepcopy(model).requires_grad_(False)  # the initial policy, also on resume
    distiller = None
    if config.distill:
        model = attach_adapter(model, config.distill_config(), seed=config.seed)
        distiller = Distiller(model, config.distill_config(), sparse)
    engine = RolloutEngine(model, tokenizer, sparse, reference_context=distiller.dense if distiller else None)
    schedule = parse_schedule(config.schedule, sparse.page_size, sparse.always_kept_pages)
    candidate = (parse_schedule(config.switch_schedule, sparse.page_size, sparse.always_kept_pages)
                 if config.switch_schedule is not None else None)
    optimizer = torch.optim.AdamW(base_parameters(model), lr=config.learning_rate, weight_decay=config.weight_decay)
    adapter_optimizer = distiller.optimizer if distiller else None
    start, switch = 0, SwitchState()
    if config.resume and (found := list_checkpoints(out)):
        step, path = found[-1]
        state = load_checkpoint(path, model, optimizer, adapter_optimizer)
        start, switch = state["step"], SwitchState.from_json(state.get("switch"))
        log(f"resumed from {path} at step {start}")
    elif (out / "metrics.jsonl").exists() and not config.resume:
        raise SparrowError(f"{out} already holds a run; pass --resume to continue it or choose another --output-dir")
    out.mkdir(parents=True, exist_ok=True)
    from torch.utils.tensorboard import SummaryWriter

    board = SummaryWriter(str(out / "tensorboard"))
    rewards, settings, history = config.reward_functions(), config.settings(), []
    held_out = (load_examples(DataSpec(config.eval_data, config.prompt_field, config.answer_field))
                if config.eval_data is not None else None)
    if held_out is not None and start == 0:
        _evaluate(config, engine, distiller, held_out, rewards, 0, out, board, log)
    for step in range(start, config.steps):
        began = time.perf_counter()
        batch = [examples[i] for i in sampler.batch(step)]
        metrics = grpo_step(model, engine, optimizer, batch, rewards, candidate if switch.switched else schedule,
                            settings, seed=config.seed * 1_000_003 + step, reference=reference, distill=distiller)
        if candidate is not None:
            switch, probed = _probe_step(config, engine, probes, candidate, switch, step + 1, log)
            metrics.update(probed)
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
        distilled = f"  distill {metrics['distill/loss']:.4f}" if distiller else ""
        log(f"step {step + 1}/{config.steps}  reward {metrics['reward/mean']:.3f}  loss {metrics['loss']:.4f}  "
            f"len {metrics['completions/mean_length']:.0f}{distilled}  {metrics['time/step_s']:.1f}s")
        if held_out is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
            _evaluate(config, engine, distiller, held_out, rewards, step + 1, out, board, log)
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            save_checkpoint(out, step + 1, model, tokenizer, optimizer,
                            {"config": dataclasses.asdict(config), "switch": switch.to_json()}, config.keep_last,
                            adapter_optimizer)
    board.close()
    write_report([out], out)
    log(f"wrote {out / 'metrics.jsonl'} and {out / 'report.md'}")
    return history


def _evaluate(config: TrainConfig, engine: RolloutEngine, distiller, examples: list, rewards: list, step: int,
              out: Path, board, log) -> None:
    """Held-out mean@k / pass@k of the dense policy (adapter off) under `eval_schedule`, appended to eval.jsonl.

    The sampling seed is the same at every evaluation, so successive rows differ by the policy, not the draw.
    """
    clock = time.perf_counter()
    sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              top_p=config.top_p, seed=_EVAL_SEED + config.seed)
    schedule = parse_schedule(config.eval_schedule, engine.sparse.page_size, engine.sparse.always_kept_pages)
    with distiller.dense() if distiller is not None else contextlib.nullcontext():
        result = evaluate(engine, examples, rewards, schedule, sampling, config.eval_generations)
    row = {"step": step, **{f"eval/{k}": v for k, v in result.items()}, "time/eval_s": time.perf_counter() - clock}
    with open(out / "eval.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
    for name, value in row.items():
        if name != "step" and isinstance(value, (int, float)):
            board.add_scalar(name, value, step)
    board.flush()
    k = config.eval_generations
    log(f"eval at step {step}: held-out mean@{k} {result[f'mean@{k}']:.3f}  pass@{k} {result[f'pass@{k}']:.3f}  "
        f"({len(examples)} prompts, {row['time/eval_s']:.0f}s)")


def _probe_split(config: TrainConfig, examples: list) -> tuple[list, list]:
    """(training examples, probe examples). The probes use the first `probe_prompts` rows of `probe_data` when
    given, else the last `probe_prompts` rows of `data`, which are then held out of training."""
    if config.switch_schedule is None:
        return examples, []
    n = config.probe_prompts
    if config.probe_data is not None:
        return examples, load_examples(DataSpec(config.probe_data, config.prompt_field, config.answer_field))[:n]
    if len(examples) <= n:
        raise SparrowError(f"{config.data} has {len(examples)} rows: holding out probe_prompts={n} of them for the "
                           "switch probes leaves none to train on; lower probe_prompts or give a probe_data file")
    return examples[:-n], examples[-n:]


def _probe_step(config: TrainConfig, engine: RolloutEngine, probes: list, candidate, switch: SwitchState,
                step: int, log) -> tuple[SwitchState, dict]:
    """After completed step `step`, every `probe_every` steps until the switch: measure the candidate schedule's
    exact acceptance on the probe prompts and advance the switch state; returns it and `probe/...` metrics."""
    metrics: dict = {}
    if not switch.switched and step % config.probe_every == 0:
        clock = time.perf_counter()
        sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                  top_p=config.top_p, seed=_PROBE_SEED + config.seed * 1_000_003 + step)
        bins, metrics = probe(engine, [ex.prompt for ex in probes], candidate, sampling, config.num_generations,
                              config.bin_size)
        switch = observe_probe(switch, bins, config.tau, config.probe_patience, step)
        metrics.update({"probe/streak": switch.streak, "time/probe_s": time.perf_counter() - clock})
        if switch.switched:
            log(f"step {step}: every length bin's 5th percentile of acceptance under {config.switch_schedule} reached "
                f"tau {config.tau} on {config.probe_patience} consecutive probes; rollouts switch to it")
    metrics["distill/switched"] = float(switch.switched)
    return switch, metrics
