"""Rollout throughput and per-step overhead of Ray rollout workers against rollouts in this process.

Each configuration runs `--steps` GRPO-shaped rollout steps: the trainer's weight sync (`sync_weights`), then one
generate of `--prompts` prompts x `--samples` samples of exactly `--max-new-tokens` tokens (EOS ignored) under
`--schedule`. Configurations (`--configs`): `WxC` is W Ray workers with C CPUs (= torch threads) each, `native:T`
is the `NativeBackend` in this process on T threads. Per configuration it prints the median over steps of
throughput (generated tokens per second of wall time), sync seconds and bytes, gather seconds (wall time minus
the slowest worker's own: scheduling, transfer and reassembly) and the per-worker throughput, and once the round
trip of a one-token call (the fixed scheduling cost). One local Ray is started for all configurations with the
largest CPU count any of them needs; give the machine that many idle cores. Run from the repository root:

    .venv/bin/python benchmarks/bench_ray.py --model smollm2-135m --configs native:1,native:2,1x1,2x1,1x2 \
        --prompts 8 --prompt-tokens 1024 --samples 4 --max-new-tokens 64 --schedule const:256 --json bench_ray.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import ray
import torch

from sparrow.bench import machine_info
from sparrow.engine import SamplingParams
from sparrow.models import load_model, resolve_dtype
from sparrow.rollout import NativeBackend
from sparrow.rollout.factory import ModelSpec
from sparrow.rollout.ray_backend import RayRolloutBackend
from sparrow.schedules import parse_schedule


def parse_config(text: str) -> tuple[str, int, int]:
    """("native", 1, threads) or ("ray", workers, cpus each)."""
    if text.startswith("native:"):
        return "native", 1, int(text.split(":", 1)[1])
    workers, cpus = text.lower().split("x")
    return "ray", int(workers), int(cpus)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def run_config(kind, workers, cpus, model, tokenizer, spec, args, prompts, schedule) -> dict:
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=True)
    if kind == "native":
        torch.set_num_threads(cpus)
        backend = NativeBackend(model, tokenizer, spec.sparse, spec.max_batch_size)
    else:
        backend = RayRolloutBackend(model, tokenizer, spec, workers, cpus_per_worker=cpus, wire_dtype=args.wire_dtype,
                                    log=lambda m: None)
    try:
        backend.generate(prompts[:1], SamplingParams(max_new_tokens=4, seed=0), schedule)  # warm-up
        rows = []
        for _ in range(args.steps):
            began = time.perf_counter()
            backend.sync_weights(model)
            synced = time.perf_counter()
            completions = backend.generate(prompts, sampling, schedule, args.samples)
            wall = time.perf_counter() - synced
            tokens = sum(len(c.token_ids) for c in completions)
            stats = getattr(backend, "stats", {})
            rows.append({"tokens_per_s": tokens / wall, "generate_s": wall, "sync_s": synced - began,
                         "sync_bytes": stats.get("rollout/sync_bytes", 0),
                         "gather_s": stats.get("rollout/gather_s", 0.0),
                         **{k.removeprefix("rollout/"): v for k, v in stats.items()
                            if k.startswith("rollout/worker_")}})
        trips = []
        for _ in range(args.roundtrips):
            began = time.perf_counter()
            backend.generate([prompts[0][:8]], SamplingParams(max_new_tokens=1, seed=0), schedule)
            trips.append(time.perf_counter() - began)
    finally:
        backend.close()
    result = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    result["roundtrip_s"] = statistics.median(trips)
    return {"config": f"native:{cpus}" if kind == "native" else f"{workers}x{cpus}", **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", default="native:1,native:2,1x1,2x1,1x2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--schedule", default="const:256")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--roundtrips", type=int, default=10)
    parser.add_argument("--wire-dtype", default=None, help="dtype of the weights in the object store (e.g. bfloat16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    configs = [parse_config(c) for c in args.configs.split(",")]
    model, tokenizer = load_model(args.model, resolve_dtype(args.dtype))
    spec = ModelSpec(args.model, args.dtype, "cpu", max_batch_size=args.max_batch_size)
    schedule = parse_schedule(args.schedule, spec.sparse.page_size, spec.sparse.always_kept_pages)
    prompts = random_prompts(args.prompts, args.prompt_tokens, len(tokenizer), args.seed)
    ray_cpus = max([w * c for kind, w, c in configs if kind == "ray"], default=0)
    if ray_cpus:
        if ray_cpus > len(os.sched_getaffinity(0)):
            print(f"warning: {ray_cpus} CPUs asked for, {len(os.sched_getaffinity(0))} available to this process")
        ray.init(address="local", num_cpus=ray_cpus, include_dashboard=False, log_to_driver=False)
    results = []
    for kind, workers, cpus in configs:
        result = run_config(kind, workers, cpus, model, tokenizer, spec, args, prompts, schedule)
        results.append(result)
        workers_line = " ".join(f"{k}={v:.0f}" for k, v in result.items() if k.startswith("worker_"))
        print(f"{result['config']:>9}: {result['tokens_per_s']:8.1f} tok/s  generate {result['generate_s']:.2f} s  "
              f"sync {result['sync_s']:.3f} s ({result['sync_bytes'] / 1e6:.1f} MB)  gather {result['gather_s']:.3f} s"
              f"  round trip {result['roundtrip_s'] * 1e3:.1f} ms  {workers_line}", flush=True)
    if ray_cpus:
        ray.shutdown()
    if args.json:
        record = {"results": results, "args": vars(args), "machine": machine_info(torch.device("cpu")),
                  "date": datetime.date.today().isoformat()}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
