"""The GRPO training loop around `run_step`: data order, optimizer, metrics (JSONL + TensorBoard), checkpoints.

Everything that varies between steps is a function of (seed, step): the prompts of step k come from the
seeded sampler, and the rollout seed is derived from the step, so a run resumed from checkpoint-k draws the
same data and samples as an uninterrupted one and ends with the same parameters. The schedule controller's state
(the adaptive budgets, DistillSparse's switch; sparrow/schedules/controllers.py) is saved in the checkpoint's
trainer state.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from sparrow.datasets import DataSpec, PromptSampler, load_examples
from sparrow.engine import encode_prompt
from sparrow.errors import SparrowError
from sparrow.evaluation import evaluate, interval_text
from sparrow.io import append_jsonl
from sparrow.lora import attach_adapter, base_parameters
from sparrow.report import write_report
from sparrow.rewards.scoring import check_reward_functions
from sparrow.schedules.adaptive import start_state
from sparrow.schedules.controllers import AdaptiveSchedule, FixedSchedule
from sparrow.typed_config import to_nested

from .checkpoint import latest_valid_checkpoint, load_checkpoint, read_trainer_state, save_checkpoint
from .config import TrainConfig
from .distill import Distiller
from .probes import switch_schedule
from .run_dir import RunLock, check_resume_config, check_resume_data, data_fingerprint, repair_metrics
from .step import Policy, run_step
from .step_metrics import step_metrics

_EVAL_SEED = 2**41  # held-out evaluation samples: one fixed seed, apart from rollouts and probes


def _print(message: str) -> None:
    print(message, flush=True)  # progress must show up at once also when stdout is a file


def _policy_and_backend(config: TrainConfig, log) -> tuple[Policy, object, object]:
    """Load the model, wrap it for DistillSparse if asked, and build its optimizer and the rollout backend."""
    model, tokenizer = config.model.load()
    reference = copy.deepcopy(model).requires_grad_(False) if config.grpo.kl_coef > 0 else None  # initial policy
    distiller = None
    if config.distill.enabled:
        model = attach_adapter(model, config.distill.lora(), seed=config.run.seed)
        distiller = Distiller(model, config.distill, config.sparse.config())
    optimizer = torch.optim.AdamW(base_parameters(model), lr=config.grpo.learning_rate,
                                  weight_decay=config.grpo.weight_decay)
    policy = Policy(model, optimizer, tokenizer.pad_token_id or 0, reference, distiller)
    lora = config.distill.lora() if config.distill.enabled else None
    backend = config.rollout.make_backend(config.model, config.sparse, model, tokenizer, log=log, lora=lora,
                                          wire_dtype=config.rollout.wire_dtype)
    return policy, backend, tokenizer


def train(config: TrainConfig, log=_print) -> list[dict]:
    """Run (or resume) the configured steps; returns this invocation's per-step metrics. The output directory is
    locked for the run: a second run on it stops at once."""
    if config.parsed is None:
        config.validate()
    with RunLock(config.run.output_dir, log=log):
        return _train(config, log)


def _resume_point(config: TrainConfig, out: Path, data: dict, log) -> tuple[int, Path] | None:
    """The checkpoint to resume from (damaged newer ones skipped), after checking that the run's options and its
    `data` fingerprint are the saved ones (or changed only where --allow-changes permits; `steps` may always grow);
    metrics logs are cut back to its step."""
    if not config.run.resume:
        if (out / "metrics.jsonl").exists():
            raise SparrowError(f"{out} already holds a run; pass --resume to continue it or choose another "
                               "--output-dir")
        return None
    found = latest_valid_checkpoint(out, log)
    if found is None:  # killed before its first checkpoint: the run starts over, its logs too
        what = "a run killed before its first checkpoint" if (out / "metrics.jsonl").exists() else "no run"
        log(f"--resume: {out} holds {what}; starting at step 0")
        repair_metrics(out / "metrics.jsonl", 0, log)
        repair_metrics(out / "eval.jsonl", -1, log)
        return None
    step, path = found
    state = read_trainer_state(path)
    saved = state.get("config", {})
    if isinstance(saved.get("grpo"), dict):  # a run resumed to go further is the same run
        saved["grpo"]["steps"] = config.grpo.steps
    changes = check_resume_config(saved, to_nested(config), config.run.allow_changes, str(path))
    changes += check_resume_data(state.get("data"), data, config.run.allow_changes, str(path))
    for change in changes:
        log(f"resuming with a changed option: {change}")
    for name in ("metrics.jsonl", "eval.jsonl"):
        repair_metrics(out / name, step, log)
    return found


def _held_out(config: TrainConfig, rows: list, tokenizer, policy: Policy) -> list | None:
    """The held-out examples (None without eval_data), after checking that the training and held-out prompts fit
    the model's positions with max_new_tokens."""
    held_out = (load_examples(DataSpec(config.eval.data, config.data.prompt_field, config.data.answer_field))
                if config.eval.data is not None else None)
    positions = getattr(policy.model.config, "max_position_embeddings", None)
    for name, path, checked in (("data", config.data.path, rows), ("eval_data", config.eval.data, held_out or [])):
        _check_lengths(checked, tokenizer, config.sampling.max_new_tokens, positions, name, path)
    return held_out


def _restore(resume_from, policy: Policy, backend, controller, adapter_optimizer, log) -> int:
    """The step the run starts from: 0, or on resume the checkpoint's, with the policy, its optimizers and the
    controller restored and the backend given the weights."""
    if resume_from is None:
        return 0
    state = load_checkpoint(resume_from[1], policy.model, policy.optimizer, adapter_optimizer)
    controller.restore(state)
    backend.sync_weights(policy.model)
    log(f"resumed from {resume_from[1]} at step {state['step']}")
    return state["step"]


def _train(config: TrainConfig, log) -> list[dict]:
    run, grpo = config.run, config.grpo
    out = Path(run.output_dir)
    rows = load_examples(DataSpec(config.data.path, config.data.prompt_field, config.data.answer_field))
    data = data_fingerprint(config.data.path, rows)
    resume_from = _resume_point(config, out, data, log)
    examples, probes = _probe_split(config, rows)
    if grpo.prompts_per_step > len(examples):
        raise SparrowError(f"prompts_per_step {grpo.prompts_per_step} exceeds the {len(examples)} training rows of "
                           f"{config.data.path!r}: every step would repeat prompts; expected at most {len(examples)} "
                           "(num_generations samples each prompt more often)")
    sampler = PromptSampler(len(examples), grpo.prompts_per_step, run.seed)
    check_reward_functions(config.data.parsed, examples)
    policy, backend, tokenizer = _policy_and_backend(config, log)
    if config.sparse.exact:
        drafts = config.sparse.draft_tokens or "an automatically chosen number of"
        log(f"exact mode: {config.sparse.schedule} drafts {drafts} tokens per dense verification; "
            f"rollouts are the dense policy's own samples, so the TIS weights ({config.grpo.tis_mode}) are 1 and "
            "the reward check is off; the monitor reads each drafted token's acceptance (no teacher-forced pass)")
    try:
        held_out = _held_out(config, rows, tokenizer, policy)
        controller = _controller(config, policy, backend, examples, probes, tokenizer)
        adapter_optimizer = policy.distiller.optimizer if policy.distiller else None
        start = _restore(resume_from, policy, backend, controller, adapter_optimizer, log)
        from torch.utils.tensorboard import SummaryWriter

        board = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)
        rewards, step_cfg, history = config.data.parsed, config.step_config(), []
        if held_out is not None and start == 0 and config.eval.at_start:
            _evaluate(config, backend, held_out, rewards, 0, out, board, log)
        for step in range(start, grpo.steps):
            began = time.perf_counter()
            batch = [examples[i] for i in sampler.batch(step)]
            cfg = config.step_config(exact=True) if controller.exact() else step_cfg  # an adaptive bin fell back
            done = run_step(policy, backend, batch, rewards, controller.schedule(), cfg,
                            seed=run.seed * 1_000_003 + step, number=step + 1, measure=controller.measure())
            metrics = {**step_metrics(done, cfg), **getattr(backend, "stats", {})}
            for event in controller.after_step(step + 1, done, metrics):
                log(event)
            metrics = {"step": step + 1, **metrics, "time/step_s": time.perf_counter() - began}
            history.append(metrics)
            _log_step(metrics, grpo.steps, out, board, log, distilled=policy.distiller is not None)
            if held_out is not None and ((step + 1) % config.eval.every == 0 or step + 1 == grpo.steps):
                _evaluate(config, backend, held_out, rewards, step + 1, out, board, log)
            if (step + 1) % run.save_every == 0 or step + 1 == grpo.steps:
                save_checkpoint(out, step + 1, policy.model, tokenizer, policy.optimizer,
                                {"config": to_nested(config), "data": data, **controller.state()}, run.keep_last,
                                adapter_optimizer)
        board.close()
        write_report([out], out)
        log(f"wrote {out / 'metrics.jsonl'} and {out / 'report.md'}")
        return history
    finally:
        backend.close()  # a local Ray stops with the run, also when it fails


def _worker_line(metrics: dict) -> str:
    """Ray workers' share of the step for the progress line: sync and gather seconds, tokens/s per worker."""
    if "rollout/sync_s" not in metrics:
        return ""
    rates = [f"{v:.0f}" for k, v in sorted(metrics.items()) if k.startswith("rollout/worker_")]
    return (f"  (workers: sync {metrics['rollout/sync_s']:.1f}s, gather {metrics.get('rollout/gather_s', 0):.2f}s, "
            f"tokens/s {' '.join(rates)})")


def _check_lengths(examples: list, tokenizer, max_new_tokens: int, positions: int | None, name: str,
                   path: str) -> None:
    """Every row's prompt plus max_new_tokens within the model's positions, checked before the first step (a row
    past them would otherwise stop the run at the step that first draws it)."""
    if not positions:
        return
    for ex in examples:
        length = len(encode_prompt(tokenizer, ex.prompt))
        if length + max_new_tokens > positions:
            raise SparrowError(f"{name} {path!r}: row {ex.index} (counted from 0) has {length} prompt tokens; with "
                               f"max_new_tokens {max_new_tokens} that exceeds the model's {positions} positions; "
                               "shorten or drop the row, or lower --max-new-tokens")


def _controller(config: TrainConfig, policy: Policy, backend, examples: list, probes: list, tokenizer):
    """The run's schedule controller (sparrow/schedules/controllers.py). The adaptive one starts from
    `adaptive_start`'s budgets on bins of `bin_size` up to the longest prompt plus max_new_tokens."""
    if config.parsed.adaptive:
        longest = max(len(encode_prompt(tokenizer, ex.prompt)) for ex in examples) + config.sampling.max_new_tokens
        sparse = config.sparse.config()
        return AdaptiveSchedule(start_state(config.parsed.schedule, config.monitor.bin_size, longest, sparse.page_size,
                                            sparse.always_kept_pages), config.monitor.tau, config.adaptive)
    if config.parsed.switch_schedule is not None:
        return switch_schedule(config, policy, backend, probes)
    return FixedSchedule(config.parsed.schedule)


def _log_step(metrics: dict, steps: int, out: Path, board, log, distilled: bool) -> None:
    """A finished step's row in metrics.jsonl and TensorBoard, its warnings and its progress line."""
    step = metrics["step"]
    append_jsonl(out / "metrics.jsonl", metrics)
    for name, value in metrics.items():
        if isinstance(value, (int, float)) and name != "step":
            board.add_scalar(name, value, step)
    board.flush()
    for warning in metrics["mismatch/warnings"]:
        log(f"warning: step {step}: {warning}")
    distill = f"  distill {metrics['distill/loss']:.4f}" if distilled else ""
    log(f"step {step}/{steps}  reward {metrics['reward/mean']:.3f}  loss {metrics['loss']:.4f}  "
        f"len {metrics['completions/mean_length']:.0f}{distill}  {metrics['time/step_s']:.1f}s"
        f"{_worker_line(metrics)}")


def _evaluate(config: TrainConfig, backend, examples: list, rewards: list, step: int, out: Path, board,
              log) -> None:
    """Held-out mean@k / pass@k of the dense policy (adapter off) under `eval_schedule`, appended to eval.jsonl.

    The sampling seed is the same at every evaluation, so successive rows differ by the policy, not the draw.
    """
    clock = time.perf_counter()
    sampling = config.sampling.params(seed=_EVAL_SEED + config.run.seed)
    k = config.eval.generations
    log(f"eval at step {step}: sampling {len(examples)} held-out prompts x {k}")
    result = evaluate(backend, examples, rewards, config.parsed.eval_schedule, sampling, k, adapter=False,
                      progress=True)
    row = {"step": step, **{f"eval/{key}": v for key, v in result.items()}, "time/eval_s": time.perf_counter() - clock}
    append_jsonl(out / "eval.jsonl", row)
    for name, value in row.items():
        if name != "step" and isinstance(value, (int, float)):
            board.add_scalar(name, value, step)
    board.flush()
    log(f"eval at step {step}: held-out mean@{k} {result[f'mean@{k}']:.3f} ({interval_text(result)})  "
        f"pass@{k} {result[f'pass@{k}']:.3f}  ({len(examples)} prompts, {row['time/eval_s']:.0f}s)")


def _probe_split(config: TrainConfig, examples: list) -> tuple[list, list]:
    """(training examples, probe examples). The probes use the first `probe_prompts` rows of `probe_data` when
    given, else the last `probe_prompts` rows of `data`, which are then held out of training."""
    distill = config.distill
    if distill.switch_schedule is None:
        return examples, []
    n = distill.probe_prompts
    if distill.probe_data is not None:
        spec = DataSpec(distill.probe_data, config.data.prompt_field, config.data.answer_field)
        return examples, load_examples(spec)[:n]
    if len(examples) <= n:
        raise SparrowError(f"{config.data.path} has {len(examples)} rows: holding out probe_prompts={n} of them for "
                           "the switch probes leaves none to train on; lower probe_prompts or give a probe_data file")
    return examples[:-n], examples[-n:]
