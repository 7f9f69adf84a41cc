"""The compiled CPU attention kernel alone, at SmolLM2's attention shape (3 KV heads of dim 64, 3 query heads each,
30 layers): one dense decode step, one sparse step at a budget (its kept pages where random landmarks put them,
and the same number of pages kept contiguous), and exact mode's dense verification of S tokens (`span_decode`), on
random keys and values of `--context` cached tokens per row.

    .venv/bin/python benchmarks/bench_attention_kernel.py --context 8100 --batch 8 --budget 1024 --spans 2,5,9

Every layer has a cache of its own (in huge pages, as the engine's), so a step reads from memory as a real one does:
one cache called 30 times stays in the last-level cache once the budget is small. The calls alternate, one whole
step each, repeat after repeat. Prints one JSON line per call kind with the median milliseconds of a step (28 sparse
layers and 2 dense ones for the sparse steps) and the CPU's vector extensions. The kernel is built for this CPU on
first use; compare configurations measured in one run on an idle machine.
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

    from sparrow.attention import SparseConfig
    from sparrow.bench import cpu_flags, machine_info
    from sparrow.cpu import kernel as cpu_kernel
    from sparrow.cpu.huge_pages import zeros

    if cpu_kernel.load() is None:
        raise SystemExit("the compiled CPU kernel cannot be built here")
    heads, group, dim, layers, dense_layers = 3, 3, 64, 30, 2
    sparse = SparseConfig()
    page = sparse.page_size
    pages = -(-(args.context + 16) // page)
    budget_pages = args.budget // page
    torch.manual_seed(0)
    shape = (args.batch, heads, pages, page, dim)
    caches = [tuple(zeros(shape, torch.float32, torch.device("cpu")).normal_() for _ in range(2))
              for _ in range(layers)]
    marks = [sparse.page_landmark.build(keys) for keys, _ in caches]
    one = torch.randn(args.batch, heads, group, dim)
    # landmarks that rank the pages by position: the kept ones are the first budget_pages, one contiguous run
    ahead = torch.where(torch.arange(pages) < budget_pages, 1.0, -1.0).view(1, 1, pages, 1)
    first = [one.mean(2, keepdim=True).expand(args.batch, heads, pages, dim) * ahead]
    n_pages = torch.full((args.batch,), pages, dtype=torch.int64)
    total = torch.full((args.batch,), args.context + 16, dtype=torch.int64)
    budget = torch.full((args.batch,), budget_pages, dtype=torch.int64)
    scale = dim**-0.5

    def step(queries, kept, landmarks=None):
        """One decode step over every layer's cache: `kept` pages per row in the sparse layers."""
        for layer, (keys, values) in enumerate(caches):
            chosen = n_pages if layer < dense_layers else kept
            cpu_kernel.sparse_decode(queries, keys, values, landmarks or marks[layer], n_pages, chosen, total,
                                     sparse, scale)

    spans = [int(s) for s in args.spans.split(",")]
    span_queries = {span: torch.randn(args.batch, heads, group * span, dim) for span in spans}
    calls = {"dense decode": (lambda: step(one, n_pages), 1),  # name: (one step, new tokens per row)
             f"sparse decode at {args.budget}": (lambda: step(one, budget), 1),
             f"sparse decode at {args.budget}, kept pages contiguous": (lambda: step(one, budget, first), 1)}
    for span in spans:
        calls[f"dense span of {span}"] = (lambda span=span: [
            cpu_kernel.span_decode(span_queries[span], keys, values, marks[layer], n_pages, total, span, sparse,
                                   scale) for layer, (keys, values) in enumerate(caches)], span)
    times = {name: [] for name in calls}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, (call, _) in calls.items():
            start = time.perf_counter()
            call()
            if repeat:
                times[name].append(time.perf_counter() - start)
    common = {"context": args.context, "batch": args.batch, "cpu_flags": cpu_flags(("avx2", "avx512f", "amx")),
              "machine": machine_info(torch.device("cpu"))}
    for name, values in times.items():
        ms, span = 1000 * statistics.median(values), calls[name][1]
        print(json.dumps({"call": name, "step_ms": round(ms, 1),
                          **({"per_token_ms": round(ms / span, 1)} if span > 1 else {}), **common}))


if __name__ == "__main__":
    main()
