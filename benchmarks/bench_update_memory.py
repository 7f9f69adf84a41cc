"""Peak memory and time of the update's forward and backward on one long prompt, with and without
`gradient_checkpointing`.

Each configuration runs in its own child process (peak resident set from getrusage): one group's shared prompt
forward (`SharedPrompt`, as the policy update runs it) and its completions in micro-batches, each backpropagated,
then the prompt's backward; with `--sparse B` the adapter update's path instead (a LoRA adapter, the sparse actor's
`sparse_completion_logits` at a constant budget B, one prompt forward per micro-batch).

    .venv/bin/python benchmarks/bench_update_memory.py --prompt 4600 --completion 200 --group 8 --micro 4
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _one(args) -> dict:
    import torch

    from sparrow.attention.teacher_forced import SharedPrompt, sparse_completion_logits
    from sparrow.models import load_model
    from sparrow.rl.activation_checkpointing import checkpointed_layers
    from sparrow.schedules import const

    torch.manual_seed(0)
    model, _ = load_model(args.model)
    if args.sparse:
        from sparrow.lora import attach_adapter
        from sparrow.rl.distill import DistillConfig

        model = attach_adapter(model, DistillConfig().lora())
    model.train()
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt))
    ids = torch.cat([prompt.expand(args.group, -1), torch.randint(3, vocab, (args.group, args.completion))], dim=1)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    with checkpointed_layers(model, args.checkpointing):
        shared = None if args.sparse else SharedPrompt(model, prompt)
        for rows in torch.arange(args.group).split(args.micro):
            if args.sparse:
                logits = sparse_completion_logits(model, ids[rows], args.prompt, const(args.sparse))
            else:
                logits = shared.logits(model, ids[rows], args.prompt)
            logits.float().logsumexp(-1).mean().backward()
            del logits
        if shared is not None:
            shared.backward()
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"checkpointing": args.checkpointing, "seconds": round(seconds, 1),
            "peak_gb": round(peak / 2**20, 2), "growth_gb": round((peak - base) / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=4600, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=200, help="completion tokens per row")
    parser.add_argument("--group", type=int, default=8, help="completions of the prompt")
    parser.add_argument("--micro", type=int, default=4, help="rows per forward and backward")
    parser.add_argument("--sparse", type=int, default=0, help="the adapter update's sparse path at this budget")
    parser.add_argument("--checkpointing", type=int, choices=(0, 1), default=None, help="run one setting only")
    args = parser.parse_args()
    if args.checkpointing is not None:
        print(json.dumps(_one(args)))
        return
    shape = {k: getattr(args, k) for k in ("model", "prompt", "completion", "group", "micro", "sparse")}
    for setting in (0, 1):
        child = [sys.executable, __file__, *sys.argv[1:], "--checkpointing", str(setting)]
        out = subprocess.run(child, capture_output=True, text=True)
        if out.returncode:
            print(json.dumps({**shape, "checkpointing": bool(setting), "failed": out.returncode,
                              "stderr": out.stderr[-300:]}))
            continue
        print(json.dumps({**shape, **json.loads(out.stdout.strip().splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
