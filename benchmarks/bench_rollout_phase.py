"""Rollout-phase throughput (prefill + decode + sampling, tokens/s) of dense and sparse actors on real prompts,
measured alternately in one process so that every configuration sees the same machine state.

Each prompt is rolled out `--samples` times per configuration, the configurations one after another per prompt
(the training rollout: one group per call, `NativeBackend.generate`). A configuration is a schedule, with `+adapter`
for the sparse actor with the LoRA adapter of `--adapter` on (DistillSparse; without it the adapter is off) and
`+exactK` for exact mode drafting K tokens per verification (the tokens are then dense's: `identical` counts them),
`+pageN` for KV pages of N tokens instead of 16 (an engine of its own).

    .venv/bin/python benchmarks/bench_rollout_phase.py --prompts runs/bench/promise/train.jsonl --count 4 \
        --model CKPT --adapter CKPT/adapter --configs dense,0:1024+adapter,0:1024
"""

from __future__ import annotations

import argparse
import json
import re
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", default=None, help="peft adapter directory (for +adapter configurations)")
    parser.add_argument("--prompts", required=True, help="JSONL prompt file (sparrow prompts)")
    parser.add_argument("--count", type=int, default=4, help="prompts, the file's first")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--num-logprobs", type=int, default=64)
    parser.add_argument("--configs", default="dense,0:1024", help="comma-separated schedules, each +adapter or not")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward", default=None, help="also score each configuration's completions with this "
                        "reward (a built-in name or module:function), as training does")
    args = parser.parse_args()

    import torch

    from sparrow.attention import SparseConfig
    from sparrow.datasets import DataSpec, load_examples
    from sparrow.engine import SamplingParams
    from sparrow.errors import SparrowError
    from sparrow.lora import load_adapter
    from sparrow.rewards import load_reward
    from sparrow.rewards.scoring import score_examples
    from sparrow.models import load_model
    from sparrow.rollout import NativeBackend
    from sparrow.schedules import DENSE, parse_schedule

    def parse(config: str) -> tuple[str, bool, int | None, int]:
        spec, *flags = config.split("+")
        unknown = [f for f in flags if f != "adapter" and not re.fullmatch(r"(exact|page)\d+", f)]
        if unknown:
            raise SparrowError(f"configuration {config!r}: unknown flag(s) {unknown}; expected adapter, exactK, pageN")
        exact = [int(f.removeprefix("exact")) for f in flags if f.startswith("exact")]
        page = [int(f.removeprefix("page")) for f in flags if f.startswith("page")]
        return spec, "adapter" in flags, exact[0] if exact else None, page[0] if page else SparseConfig().page_size

    configs = [parse(c) for c in args.configs.split(",")]
    if any(on for _, on, _, _ in configs) and not args.adapter:
        raise SparrowError("a +adapter configuration needs --adapter DIR")
    sparse_of = {page: SparseConfig(page_size=page) for *_, page in configs}
    schedules = {(spec, page): parse_schedule(spec, page, sparse_of[page].always_kept_pages)
                 for spec, _, _, page in configs}
    reward_fns = [(args.reward, load_reward(args.reward), 1.0)] if args.reward else None
    model, tok = load_model(args.model)
    if args.adapter:
        model = load_adapter(model, args.adapter)
    backends = {page: NativeBackend(model, tok, sparse) for page, sparse in sparse_of.items()}
    examples = load_examples(DataSpec(args.prompts))[: args.count]
    totals = {c: {"tokens": 0, "seconds": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "verify_s": 0.0, "rewards": []}
              for c in args.configs.split(",")}
    with torch.no_grad():  # untimed: first-use costs (weight packing, allocations)
        for backend in backends.values():
            backend.generate([examples[0].prompt], SamplingParams(max_new_tokens=2, top_p=args.top_p), DENSE, 1)
    for i, ex in enumerate(examples):
        dense_tokens = None
        for name, (spec, adapter, draft, page) in zip(totals, configs, strict=True):
            backend = backends[page]
            sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, seed=args.seed + i, num_logprobs=args.num_logprobs)
            began = time.perf_counter()
            with torch.no_grad():
                out = backend.generate([ex.prompt], sampling, schedules[spec, page], args.samples, adapter=adapter,
                                       draft_tokens=draft)
            seconds = time.perf_counter() - began
            tokens = sum(len(c.token_ids) for c in out)
            t = totals[name]
            t["tokens"] += tokens
            t["seconds"] += seconds
            for phase in ("prefill", "decode", "verify"):
                t[f"{phase}_s"] += backend.timing.get(phase, 0.0)
            row = {"prompt": i, "config": name, "tokens": tokens, "seconds": round(seconds, 2),
                   "tokens_per_s": round(tokens / seconds, 2)}
            if spec == "dense" and not adapter and draft is None and dense_tokens is None:
                dense_tokens = [c.token_ids for c in out]
            if draft is not None and dense_tokens is not None:
                row["identical"] = sum(c.token_ids == d for c, d in zip(out, dense_tokens))
            if reward_fns:
                rewards = score_examples(reward_fns, [ex], out).totals
                t["rewards"] += rewards
                row["mean_reward"] = round(sum(rewards) / len(rewards), 4)
            print(json.dumps(row), flush=True)
    first = next(iter(totals.values()))
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        print(json.dumps({"config": name, "tokens": t["tokens"], "seconds": round(t["seconds"], 1),
                          "prefill_s": round(t["prefill_s"], 1), "decode_s": round(t["decode_s"], 1),
                          "verify_s": round(t["verify_s"], 1),
                          "tokens_per_s": round(rate, 2),
                          "speedup": round(rate / (first["tokens"] / first["seconds"]), 3),
                          **({"mean_reward": round(sum(t["rewards"]) / len(t["rewards"]), 4)} if reward_fns else {})}))


if __name__ == "__main__":
    main()
