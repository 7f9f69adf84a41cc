"""Decode step time of the native engine's code paths, measured alternately in one process: dense attention through
PyTorch's SDPA or the compiled kernel (SPARROW_CPU_KERNEL), linear layers through MKL or oneDNN-packed weights
(SPARROW_PACKED_LINEAR), decoder layers as transformers' or fused (SPARROW_FUSED_LAYERS), for a dense and a sparse
schedule, at one or more (cached tokens, batch) shapes. The prefill and the alternated decode timing are
`sparrow bench`'s (sparrow/bench.py: `prefilled`, `time_alternated`); what this script adds is switching the code
paths between the timed runs, which `sparrow bench` (one configuration of paths per process) does not.

    .venv/bin/python benchmarks/bench_decode_paths.py --shapes 1100x16,4700x8,8000x8 --schedule "0:512, 3584:1024"

Prints one JSON line per (shape, configuration) with the median ms per step, and the sparse/dense ratio of the
old paths (SDPA dense, MKL), of the kernel with packed weights, and of those with fused layers per shape; then the
prompt's prefill with MKL and with packed weights, alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# (name, schedule kind, SPARROW_CPU_KERNEL, SPARROW_PACKED_LINEAR, SPARROW_FUSED_LAYERS); the sparse schedule always
# takes the kernel, and layers fuse only with packed weights
CONFIGS = [("dense sdpa+mkl", "dense", "0", "0", "0"), ("dense kernel+mkl", "dense", "1", "0", "0"),
           ("dense kernel+packed", "dense", "1", "1", "0"), ("dense kernel+packed+fused", "dense", "1", "1", "1"),
           ("sparse mkl", "sparse", "1", "0", "0"), ("sparse packed", "sparse", "1", "1", "0"),
           ("sparse packed+fused", "sparse", "1", "1", "1")]
WARMUP = 2  # untimed decode steps before every timed one: the paths switch between them


def use_paths(name: str) -> None:
    """The code paths of configuration `name`, for the engine's next decode step."""
    _, _, kernel, packed, fused = next(config for config in CONFIGS if config[0] == name)
    os.environ["SPARROW_CPU_KERNEL"], os.environ["SPARROW_PACKED_LINEAR"] = kernel, packed
    os.environ["SPARROW_FUSED_LAYERS"] = fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shapes", default="1100x16,4700x8,8000x8", help="comma-separated CONTEXTxBATCH")
    parser.add_argument("--schedule", default="const:1024")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from sparrow.bench import cache_tokens, machine_info, prefilled, time_alternated
    from sparrow.engine import RolloutEngine
    from sparrow.models import load_model
    from sparrow.schedules import DENSE, parse_schedule

    model, tok = load_model(args.model)
    engine = RolloutEngine(model, tok, max_batch_size=256)
    schedules = {"dense": DENSE, "sparse": parse_schedule(args.schedule)}
    print(json.dumps({"machine": machine_info(engine.device), "schedule": args.schedule}), flush=True)
    for shape in args.shapes.split(","):
        context, batch = (int(x) for x in shape.split("x"))
        prompt = torch.randint(0, 49000, (1, context), generator=torch.Generator().manual_seed(0))
        tokens = cache_tokens(context, WARMUP, args.steps)
        cache, logits, _ = prefilled(engine, prompt, batch, tokens, log=lambda _: None)
        times = time_alternated(engine, cache, logits, {name: schedules[kind] for name, kind, *_ in CONFIGS},
                                args.steps, WARMUP, args.repeats, rewarm=WARMUP, setup=use_paths)
        ms = {name: 1000 * statistics.median(t) / args.steps for name, t in times.items()}
        for name, value in ms.items():
            print(json.dumps({"context": context, "batch": batch, "config": name, "ms_per_step": round(value, 1)}),
                  flush=True)
        print(json.dumps({"context": context, "batch": batch,
                          "sparse_over_dense_old": round(ms["dense sdpa+mkl"] / ms["sparse mkl"], 3),
                          "sparse_over_dense_new": round(ms["dense kernel+packed"] / ms["sparse packed"], 3),
                          "sparse_over_dense_fused": round(ms["dense kernel+packed+fused"] / ms["sparse packed+fused"],
                                                           3),
                          "fused_dense_speedup": round(ms["dense kernel+packed"] / ms["dense kernel+packed+fused"], 3),
                          "fused_sparse_speedup": round(ms["sparse packed"] / ms["sparse packed+fused"], 3),
                          "dense_speedup": round(ms["dense sdpa+mkl"] / ms["dense kernel+packed"], 3),
                          "sparse_speedup": round(ms["sparse mkl"] / ms["sparse packed"], 3)}), flush=True)
        prefill = {"mkl": [], "packed": []}
        for _ in range(args.repeats):
            for name in prefill:
                os.environ["SPARROW_PACKED_LINEAR"] = "0" if name == "mkl" else "1"
                with engine.frozen_weights():
                    engine.prefill(cache, prompt[0, :64].tolist(), torch.arange(batch))  # untimed: makes the packs
                    began = time.perf_counter()
                    engine.prefill(cache, prompt[0].tolist(), torch.arange(batch))
                    prefill[name].append(time.perf_counter() - began)
        print(json.dumps({"context": context, **{f"prefill_s_{name}": round(statistics.median(t), 2)
                                                  for name, t in prefill.items()}}), flush=True)


if __name__ == "__main__":
    main()
