"""Decode tokens/s of one vLLM engine on a GPU, with or without Sparrow's plugin and CUDA graphs; one configuration per
process, since the plugin is configured per process (scripts/device_check.py's vllm section runs the four it compares).

    python benchmarks/vllm_decode_throughput.py MODEL_DIR --schedule const:1024|dense [--eager] [--context 8000]

The plugin is loaded with SPARROW_VLLM_SCHEDULE set to --schedule (`dense`: the plugin's dense path). `batch`
random prompts of `context` tokens are prefilled once (then served from the prefix cache); the rate is
batch * (steps - 1) over the time of a `steps`-token call beyond a 1-token call. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no CUDA graphs")
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    os.environ["SPARROW_VLLM_SCHEDULE"] = args.schedule
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=args.eager, max_model_len=args.context + 256,
              gpu_memory_utilization=0.5, max_num_seqs=max(args.batch, 8), seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (args.context,), generator=gen).tolist()}
               for _ in range(args.batch)]

    def timed(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(1)  # prefill into the prefix cache
    one, many = min(timed(1) for _ in range(2)), min(timed(args.steps) for _ in range(2))
    rate = args.batch * (args.steps - 1) / max(many - one, 1e-9)
    print(json.dumps({"schedule": args.schedule, "cuda_graphs": not args.eager, "context": args.context,
                      "batch": args.batch, "decode_tokens_per_s": round(rate, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
