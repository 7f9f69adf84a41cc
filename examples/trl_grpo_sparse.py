"""GRPO with TRL on SmolLM2: sparse vLLM rollouts under Sparrow's adaptive schedule, with its exact tail monitor.

`SparrowGRPOTrainer` (sparrow/integrations/trl.py, docs/trl.md) is TRL's GRPOTrainer with Sparrow switched on: the
rollouts decode with block-sparse attention inside vLLM (colocated, CPU here), TRL's own importance sampling
correction stays on (token-level truncation at --tis-cap), and every step logs the exact acceptance tail per
length bin with `sparrow train`'s warnings. With `--schedule adaptive` (the default) each bin's budget moves to the
cheapest rung whose 5th percentile holds --tau; the plugin follows the schedule file the trainer rewrites, from the
next engine step. The task is Sparrow's passkey task, one prompt a step, scored by --reward (default
`first_number`; any `sparrow train --reward` spec that scores text).

    .venv/bin/python examples/trl_grpo_sparse.py          # quick: 2 steps, 4 completions of 640-token prompts,
                                                          # adaptive from the calibrated schedule (sparse at once)
    .venv/bin/python examples/trl_grpo_sparse.py --full   # 10 steps, 8 completions, adaptive from dense
    .venv/bin/python examples/trl_grpo_sparse.py --schedule 0:512,3584:1024   # the calibrated schedule, fixed
    .venv/bin/python examples/trl_grpo_sparse.py --steps 1 --schedule const:48 --is-mode sequence_mask
                                                          # TRL's default correction, to compare its IS weights

Any option given overrides the preset's value. It prints one line per step as it ends (reward, loss, the exact
p5, the schedule in force, the sparse decode calls, the step's time and the monitor's share of it), then TRL's
logged metrics, Sparrow's warnings and the number of sparse decode calls (one per sparse layer and decode step
batch), one JSON object per line after "SPARROW_TRL".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sparrow.errors import SparrowError


# The presets' values of the options they set; an option given on the command line wins.
QUICK = {"steps": 2, "num_generations": 4, "prompt_tokens": 640, "max_completion_length": 24,
         "adaptive_start": "0:512,3584:1024"}
FULL = {"steps": 10, "num_generations": 8, "prompt_tokens": 1024, "max_completion_length": 48,
        "adaptive_start": "dense"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help=f"the full run {FULL} instead of the quick default {QUICK}")
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m or a local Hugging Face model directory (default: smollm2-135m, whose "
                             "converted directory sparrow.rollout.vllm_backend.model_directory gives)")
    parser.add_argument("--schedule", default="adaptive", help="Sparrow schedule spec, or `adaptive`")
    parser.add_argument("--tau", type=float, default=0.86, help="threshold of each length bin's p5 of acceptance")
    parser.add_argument("--bin-size", type=int, default=2000, help="length bins of the monitor, in tokens")
    parser.add_argument("--adaptive-start", help="the adaptive schedule's first budgets (preset: quick "
                                                 f"{QUICK['adaptive_start']}, full {FULL['adaptive_start']})")
    parser.add_argument("--adaptive-min-tokens", type=int, default=200, help="tokens a bin needs to move")
    parser.add_argument("--adaptive-patience", type=int, default=2, help="steps of evidence before a move down")
    parser.add_argument("--steps", type=int, help=f"GRPO steps (preset: quick {QUICK['steps']}, full {FULL['steps']})")
    parser.add_argument("--output-dir", default="runs/trl-grpo-sparse")
    parser.add_argument("--prompt-tokens", type=int, help="minimum passkey prompt length in tokens (preset: quick "
                        f"{QUICK['prompt_tokens']}, full {FULL['prompt_tokens']})")
    parser.add_argument("--num-generations", type=int,
                        help="completions per prompt, one prompt a step (preset: quick "
                             f"{QUICK['num_generations']}, full {FULL['num_generations']})")
    parser.add_argument("--max-completion-length", type=int, help="preset: quick "
                        f"{QUICK['max_completion_length']}, full {FULL['max_completion_length']}")
    parser.add_argument("--reward", default="first_number", help="a reward spec as `sparrow train --reward` takes")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--tis-cap", type=float, default=2.0, help="upper bound of TRL's per-token IS ratio")
    parser.add_argument("--is-mode", default="token_truncate",
                        help="TRL's vllm_importance_sampling_mode (token_truncate: Sparrow's TIS; sequence_mask: TRL's "
                             "default, to compare)")
    args = parser.parse_args(argv)
    for name, value in (FULL if args.full else QUICK).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def configure_vllm_cpu() -> None:
    """vLLM's CPU engine in this process; must run before vLLM is imported (Sparrow's own variables are set by
    the trainer)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, where we count calls
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))  # the cores this process may use, not all
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def count_sparse_decodes() -> dict:
    """Counts calls of the plugin's sparse decode (each: the sparse requests of one layer in one decode step) and
    the requests they decode, in total and per training step (`per_step`, filled by `StepCounts`)."""
    from sparrow.vllm.cpu_attention import SparrowCPUAttentionImpl

    counts = {"calls": 0, "requests": 0, "per_step": []}
    original = SparrowCPUAttentionImpl._sparse_decode

    def counted(self, queries, *args, **kwargs):
        counts["calls"] += 1
        counts["requests"] += int(queries.shape[0])
        return original(self, queries, *args, **kwargs)

    SparrowCPUAttentionImpl._sparse_decode = counted
    return counts


def step_counts(counts: dict):
    """A TrainerCallback appending each step's sparse decode calls and requests to counts["per_step"], and
    printing one line per step when TRL logs it (logging_steps=1)."""
    from transformers import TrainerCallback

    class StepCounts(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            done = [sum(step[k] for step in counts["per_step"]) for k in ("calls", "requests")]
            counts["per_step"].append({"calls": counts["calls"] - done[0], "requests": counts["requests"] - done[1]})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                from tqdm.auto import tqdm

                calls = counts["per_step"][-1]["calls"] if counts["per_step"] else 0
                tqdm.write(step_line(state.global_step, state.max_steps, logs, calls), file=sys.stdout)

    return StepCounts()


def step_line(step: int, steps: int, logs: dict, sparse_calls: int) -> str:
    """`step 1/2: reward 0.125, loss 0.0021, exact p5 0.912 over 128 tokens, schedule v1 0:512, 58 sparse decode
    calls, 41.2 s (monitor 9.8 s, 24%)`, from TRL's logged row of the step."""
    def get(name, form):
        value = logs.get(name)
        return "n/a" if value is None else format(value, form)

    budgets = sorted((int(k.split("/")[1].removeprefix("bin_")), v) for k, v in logs.items()
                     if k.startswith("adaptive/bin_") and k.endswith("/budget"))
    schedule = ",".join(f"{start}:{int(budget)}" for start, budget in budgets)
    step_time, monitor = logs.get("step_time"), logs.get("time/sparrow_monitor_s")
    share = f", {100 * monitor / step_time:.0f}%" if step_time and monitor is not None else ""
    return (f"step {step}/{steps}: reward {get('reward', '.3f')}, loss {get('loss', '.4g')}, exact p5 "
            f"{get('mismatch/exact/p5', '.3f')} over {get('mismatch/exact/tokens', '.0f')} tokens, schedule "
            f"v{get('sparrow/schedule_version', '.0f')}{' ' + schedule if schedule else ''}, {sparse_calls} sparse "
            f"decode calls, {get('step_time', '.1f')} s (monitor {get('time/sparrow_monitor_s', '.1f')} s{share})")


def text_reward(spec: str):
    """Sparrow's reward `spec` (TRL's contract already) called with the completions' text (TRL passes
    conversational completions as message lists)."""
    import functools

    from sparrow.rewards import load_reward

    reward = load_reward(spec)

    @functools.wraps(reward)
    def on_text(prompts, completions, **columns):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward(prompts, texts, **columns)

    return on_text


def report(tag: str, value) -> None:
    print(f"SPARROW_TRL {json.dumps({tag: value})}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_vllm_cpu()
    try:
        run(args)
    except SparrowError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    # Sparrow's integration before TRL: importing it filters TRL's warning that vLLM 0.32 is outside its range,
    # which TRL's modules print when imported (docs/trl.md#install)
    from sparrow.integrations.config import SparrowConfig

    sparrow = SparrowConfig(schedule=args.schedule, tau=args.tau, bin_size=args.bin_size,
                            adaptive_start=args.adaptive_start, adaptive_min_tokens=args.adaptive_min_tokens,
                            adaptive_patience=args.adaptive_patience,
                            correction="trl")  # the GRPOConfig below names the mode (--is-mode): kept as given
    if args.steps < 1:
        raise SparrowError(f"--steps {args.steps}: expected at least 1")

    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from sparrow.integrations.trl import SparrowGRPOTrainer
    from sparrow.rollout.vllm_backend import model_directory
    from sparrow.tasks.fitting import prompt_length
    from sparrow.tasks.passkey import make_prompts

    model_dir = str(model_directory(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = make_prompts(args.steps, args.prompt_tokens, seed=0, tokenizer=tokenizer)
    longest = max(prompt_length(tokenizer, row["prompt"]) for row in rows)
    counts = count_sparse_decodes()
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.learning_rate, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=args.num_generations, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=1.0,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=longest + args.max_completion_length,
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=args.is_mode,
        vllm_importance_sampling_clip_max=args.tis_cap)
    trainer = SparrowGRPOTrainer(model=model_dir, reward_funcs=text_reward(args.reward), args=config,
                                 train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                                 callbacks=[step_counts(counts)], sparrow_config=sparrow)
    report("prompt_tokens", {"min": args.prompt_tokens, "longest": longest})
    report("schedule_file", str(trainer.sparrow_schedule.path))
    report("correction", trainer.sparrow_correction)
    print(f"{args.steps} GRPO steps of {args.num_generations} completions on {longest}-token prompts, "
          f"schedule {args.schedule}" + (f" from {args.adaptive_start}" if args.schedule == "adaptive" else "")
          + ("" if args.full else " (quick; --full for the 10-step run)"), flush=True)
    trainer.train()
    for row in trainer.state.log_history:
        report("log", row)
    for step, message in trainer.sparrow_warnings:
        report("warning", {"step": step, "message": message})
    report("sparse_decode", counts)


if __name__ == "__main__":
    main()
