"""GRPO with TRL's GRPOTrainer whose vLLM rollouts decode with Sparrow's block-sparse attention (CPU, colocated).

TRL builds `LLM(...)` itself, so Sparrow's vLLM plugin is configured by environment variables only: this script sets
SPARROW_VLLM_SCHEDULE (from --schedule) and vLLM's CPU variables before vLLM or TRL is imported. The rollouts are
then sparse, the policy's log-probs dense (TRL recomputes them with the training model), and TRL's own importance
sampling correction (`vllm_importance_sampling_correction`, token-level truncation at --tis-cap, Sparrow's TIS)
corrects for the mismatch. The task is Sparrow's passkey task, one prompt a step, scored by --reward (default
`first_number`; any `sparrow train --reward` spec that scores text, e.g. examples/toy_reward.py:byte_mean).

Two adaptations of TRL's colocated vLLM to vLLM's CPU backend (`adapt_trl_to_vllm_cpu`): the engine runs in
float32 and eager mode (vLLM downcasts float32 models to bfloat16 on CPU, and Sparrow's fast CPU kernel is float32),
and the weight sync goes through vLLM's `reload_weights` (on CPU vLLM repacks linear weights, so TRL's in-place
`load_weights` fails).

    .venv/bin/python examples/trl_grpo_sparse.py --steps 2                  # SmolLM2-135M, calibrated schedule
    .venv/bin/python examples/trl_grpo_sparse.py --model DIR --schedule const:64 --prompt-tokens 256

It prints the plugin's configuration, the number of sparse decode calls (one per sparse layer and decode step
batch) and TRL's logged metrics, one JSON object per line after "SPARROW_TRL".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sparrow.errors import SparrowError

CALIBRATED_SMOLLM2 = "0:512,3584:1024"  # examples/smollm2-passkey.yaml, BENCHMARKS.md


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="a local Hugging Face model directory (default: SmolLM2-135M's converted directory)")
    parser.add_argument("--schedule", default=CALIBRATED_SMOLLM2, help="Sparrow schedule spec for the rollouts")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps")
    parser.add_argument("--output-dir", default="runs/trl-grpo-sparse")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="minimum passkey prompt length in tokens")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (one prompt a step)")
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--reward", default="first_number", help="a reward spec as `sparrow train --reward` takes")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--tis-cap", type=float, default=2.0, help="upper bound of TRL's per-token IS ratio")
    return parser.parse_args(argv)


def configure_environment(schedule: str) -> None:
    """Sparrow's plugin and vLLM on CPU in this process; must run before vLLM is imported."""
    os.environ["SPARROW_VLLM_SCHEDULE"] = schedule
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, where we count calls
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # RANK, WORLD_SIZE, MASTER_ADDR/PORT for vLLM's external launcher: TRL's colocate mode sets them itself


def count_sparse_decodes() -> dict:
    """Counts calls of the plugin's sparse decode (each: the sparse requests of one layer in one decode step)."""
    from sparrow.vllm.cpu_attention import SparrowCPUAttentionImpl

    counts = {"calls": 0, "requests": 0}
    original = SparrowCPUAttentionImpl._sparse_decode

    def counted(self, queries, kv_cache, plan, sparse):
        counts["calls"] += 1
        counts["requests"] += int(plan.tokens.numel())
        return original(self, queries, kv_cache, plan, sparse)

    SparrowCPUAttentionImpl._sparse_decode = counted
    return counts


def adapt_trl_to_vllm_cpu() -> None:
    """Make TRL's colocated vLLM engine run on vLLM's CPU backend (see the module docstring)."""
    import functools

    import vllm
    from trl.generation import vllm_generation

    vllm_generation.LLM = functools.partial(vllm.LLM, dtype="float32", enforce_eager=True)

    def sync_weights(self) -> None:
        weights = ((name, param.float()) for name, param in self._iter_named_params())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def completion_texts(completions) -> list[str]:
    """TRL passes conversational completions as message lists; Sparrow's rewards take text."""
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def text_reward(spec: str):
    """Sparrow's reward `spec` (TRL's contract already) called with the completions' text."""
    import functools

    from sparrow.rewards import load_reward

    reward = load_reward(spec)

    @functools.wraps(reward)
    def on_text(prompts, completions, **columns):
        return reward(prompts, completion_texts(completions), **columns)

    return on_text


def report(tag: str, value) -> None:
    print(f"SPARROW_TRL {json.dumps({tag: value})}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_environment(args.schedule)
    try:
        run(args)
    except SparrowError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    from sparrow.vllm import config as plugin_config

    plugin_config.from_environment()  # a bad SPARROW_VLLM_* value stops here with one message, before vLLM starts
    if args.steps < 1:
        raise SparrowError(f"--steps {args.steps}: expected at least 1")

    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from sparrow.rollout.vllm_backend import model_directory
    from sparrow.tasks.fitting import prompt_length
    from sparrow.tasks.passkey import make_prompts

    model_dir = str(model_directory(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = make_prompts(args.steps, args.prompt_tokens, seed=0, tokenizer=tokenizer)
    longest = max(prompt_length(tokenizer, row["prompt"]) for row in rows)
    counts = count_sparse_decodes()
    adapt_trl_to_vllm_cpu()

    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.learning_rate, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=args.num_generations, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=1.0,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=longest + args.max_completion_length,
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=args.tis_cap)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=text_reward(args.reward), args=config,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    active = plugin_config.active()
    report("plugin", None if active is None else {"schedule": args.schedule, "bins": list(zip(
        active.schedule.starts, active.schedule.budgets)), "landmark": active.sparse.landmark,
        "dense_layers": list(active.sparse.dense_layers), "page_size": active.sparse.page_size})
    report("prompt_tokens", {"min": args.prompt_tokens, "longest": longest})
    trainer.train()
    for row in trainer.state.log_history:
        report("log", row)
    report("sparse_decode", counts)


if __name__ == "__main__":
    main()
