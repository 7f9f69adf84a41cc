"""The compiled CPU attention kernel alone, at SmolLM2's attention shape (3 KV heads of dim 64, 3 query heads each,
30 layers): one dense decode step, one sparse step at a budget, and exact mode's dense verification of S tokens
(`span_decode`), on random keys and values of `--context` cached tokens per row.

    .venv/bin/python benchmarks/bench_attention_kernel.py --context 8100 --batch 8 --spans 2,5,9

Prints one JSON line per call kind with the median milliseconds of the call times the layer count (a whole step's
attention: 28 sparse layers and 2 dense ones for the sparse step), and the CPU's vector extensions. The kernel is
built for this CPU on first use; compare configurations measured in one run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024, help="the sparse step's budget in tokens")
    parser.add_argument("--spans", default="2,5,9", help="comma-separated verification spans (K + 1)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch

    from sparrow.attention import SparseConfig, cpu_kernel
    from sparrow.bench import cpu_flags, machine_info

    if cpu_kernel.load() is None:
        raise SystemExit("the compiled CPU kernel cannot be built here")
    heads, group, dim, layers, dense_layers = 3, 3, 64, 30, 2
    sparse = SparseConfig()
    page = sparse.page_size
    pages = -(-(args.context + 16) // page)
    torch.manual_seed(0)
    keys = torch.randn(args.batch, heads, pages, page, dim)
    values = torch.randn(args.batch, heads, pages, page, dim)
    marks = sparse.page_landmark.build(keys)
    n_pages = torch.full((args.batch,), pages, dtype=torch.int64)
    total = torch.full((args.batch,), args.context + 16, dtype=torch.int64)
    budget = torch.full((args.batch,), args.budget // page, dtype=torch.int64)
    scale = dim**-0.5

    def median_ms(call) -> float:
        call()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    one = torch.randn(args.batch, heads, group, dim)
    dense_ms = median_ms(lambda: cpu_kernel.sparse_decode(one, keys, values, marks, n_pages, n_pages, total, sparse,
                                                          scale))
    sparse_ms = median_ms(lambda: cpu_kernel.sparse_decode(one, keys, values, marks, n_pages, budget, total, sparse,
                                                           scale))
    common = {"context": args.context, "batch": args.batch, "cpu_flags": cpu_flags(("avx2", "avx512f", "amx")),
              "machine": machine_info(torch.device("cpu"))}
    print(json.dumps({"call": "dense decode", "step_ms": round(layers * dense_ms, 1), **common}))
    print(json.dumps({"call": f"sparse decode at {args.budget}",
                      "step_ms": round((layers - dense_layers) * sparse_ms + dense_layers * dense_ms, 1), **common}))
    for span in (int(s) for s in args.spans.split(",")):
        queries = torch.randn(args.batch, heads, group * span, dim)
        span_ms = median_ms(lambda: cpu_kernel.span_decode(queries, keys, values, marks, n_pages, total, span, sparse,
                                                           scale))
        print(json.dumps({"call": f"dense span of {span}", "step_ms": round(layers * span_ms, 1),
                          "per_token_ms": round(layers * span_ms / span, 1), **common}))


if __name__ == "__main__":
    main()
