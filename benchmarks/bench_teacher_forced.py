"""Teacher-forced forwards of completions after a shared prompt on SmolLM2, two paths alternated: the monitor's
sparse forward (`sparse_completion_logits`, every position attending as it was decoded) through the compiled
kernel and through masked SDPA; or, with `--dense`, the update's and the monitor's dense forward (`SharedPrompt`)
through the split at the prompt (`prefix_attention`) and through transformers' SDPA with its mask.

    .venv/bin/python benchmarks/bench_teacher_forced.py --prompt 3400 --tokens 1300 --rows 8 --schedule 0:2048
    .venv/bin/python benchmarks/bench_teacher_forced.py --dense --repeats 3
    .venv/bin/python benchmarks/bench_teacher_forced.py --dense --backward --rows 2

The default shape is the long-answer monitor's (8 samples of ~1.3K tokens after a 3.4K-token prompt). Prints one
JSON line per forward (seconds; of which attention, or with `--backward` the backward's seconds) and the largest
difference between the two paths' log-probs, with the CPU's vector extensions; random token ids (the cost does not
depend on the text). A warm-up forward runs first: the first one in a process pays for its memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=3400, help="shared prompt tokens")
    parser.add_argument("--tokens", type=int, default=1300, help="completion tokens per row")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--schedule", default="0:2048")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dense", action="store_true", help="the dense forward: split at the prompt or SDPA's mask")
    parser.add_argument("--backward", action="store_true", help="with --dense: time a backward too (gradients on)")
    args = parser.parse_args()
    if args.backward and not args.dense:
        parser.error("--backward times the dense forward's backward: add --dense")

    import torch

    import sparrow.attention.interface as interface
    from sparrow.attention.teacher_forced import sparse_completion_logits
    from sparrow.bench import cpu_flags, machine_info
    from sparrow.cpu import kernel as cpu_kernel
    from sparrow.models import load_model
    from sparrow.schedules import parse_schedule

    model, _ = load_model("smollm2-135m")
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (args.rows, args.prompt + args.tokens))
    ids[:, : args.prompt] = ids[0, : args.prompt]
    if args.dense:
        _dense(model, ids, args)
        return
    if cpu_kernel.load() is None:
        raise SystemExit("the CPU kernel cannot be built here: nothing to compare")
    schedule = parse_schedule(args.schedule)
    attention = [0.0]
    inner = interface.teacher_forced_attention

    def timed(*a, **k):
        began = time.perf_counter()
        out = inner(*a, **k)
        attention[0] += time.perf_counter() - began
        return out

    interface.teacher_forced_attention = timed
    logprobs = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for path, flag in (("kernel", "1"), ("masked SDPA", "0")):
                os.environ["SPARROW_CPU_KERNEL"] = flag
                attention[0] = 0.0
                began = time.perf_counter()
                logits = sparse_completion_logits(model, ids, args.prompt, schedule)
                seconds = time.perf_counter() - began
                logprobs[path] = torch.log_softmax(logits.float(), -1)
                print(json.dumps({"path": path, "seconds": round(seconds, 1), "attention_s": round(attention[0], 1)}),
                      flush=True)
    diff = float((logprobs["kernel"] - logprobs["masked SDPA"]).abs().max())
    print(json.dumps({"max_logprob_difference": diff, "cpu_flags": cpu_flags(("avx", "amx", "fma")),
                      "machine": machine_info(torch.device("cpu"))}))


def _dense(model, ids, args) -> None:
    """`SharedPrompt.logits` with Sparrow's dense context (the split) and with none (transformers' masked SDPA)."""
    import torch

    from sparrow.attention.interface import CONTEXT_KEY
    from sparrow.attention.teacher_forced import SharedPrompt
    from sparrow.bench import cpu_flags, machine_info

    model.train(args.backward)
    paths = {"split at the prompt": {}, "transformers SDPA": {CONTEXT_KEY: None}}
    logprobs = {}
    with torch.set_grad_enabled(args.backward):
        for repeat in range(args.repeats + 1):
            for path, kwargs in paths.items():
                model.zero_grad(set_to_none=True)
                began = time.perf_counter()
                prompt = SharedPrompt(model, ids[:1, : args.prompt])
                logits = prompt.logits(model, ids, args.prompt, **kwargs)
                seconds = time.perf_counter() - began
                line = {"path": path, "seconds": round(seconds, 1)}
                if args.backward:
                    began = time.perf_counter()
                    torch.log_softmax(logits.float(), -1)[..., 0].mean().backward()
                    prompt.backward()
                    line["backward_s"] = round(time.perf_counter() - began, 1)
                logprobs[path] = torch.log_softmax(logits.detach()[:, -64:].float(), -1)
                del logits, prompt
                if repeat:
                    print(json.dumps(line), flush=True)
    diff = float((logprobs["split at the prompt"] - logprobs["transformers SDPA"]).abs().max())
    print(json.dumps({"max_logprob_difference_last_64": diff, "cpu_flags": cpu_flags(("avx", "amx", "fma")),
                      "machine": machine_info(torch.device("cpu"))}))


if __name__ == "__main__":
    main()
