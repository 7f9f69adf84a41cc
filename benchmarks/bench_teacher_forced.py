"""The monitor's teacher-forced sparse forward on SmolLM2 (`sparse_completion_logits`: a shared prompt, then every
completion position attending as it was decoded), through the compiled kernel and through masked SDPA, alternated.

    .venv/bin/python benchmarks/bench_teacher_forced.py --prompt 3400 --tokens 1300 --rows 8 --schedule 0:2048

The default shape is the long-answer monitor's (8 samples of ~1.3K tokens after a 3.4K-token prompt). Prints one
JSON line per forward (seconds, of which attention) and the largest difference between the two paths' log-probs,
with the CPU's vector extensions; random token ids (the cost does not depend on the text).
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
    args = parser.parse_args()

    import torch

    import sparrow.attention.interface as interface
    from sparrow.attention import cpu_kernel
    from sparrow.attention.teacher_forced import sparse_completion_logits
    from sparrow.bench import cpu_flags, machine_info
    from sparrow.models import load_model
    from sparrow.schedules import parse_schedule

    if cpu_kernel.load() is None:
        raise SystemExit("the CPU kernel cannot be built here: nothing to compare")
    model, _ = load_model("smollm2-135m")
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (args.rows, args.prompt + args.tokens))
    ids[:, : args.prompt] = ids[0, : args.prompt]
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


if __name__ == "__main__":
    main()
