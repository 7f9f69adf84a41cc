"""Before/after of the compiled CPU kernel: another checkout's kernel sources (`sparrow/cpu/csrc`, or
`sparrow/attention/csrc` in checkouts before they moved) built under a name of its own
(with this checkout's compiler flags) against this checkout's, alternated call by call in one process, each result
compared bit for bit.

    git worktree add /tmp/old <commit>
    .venv/bin/python benchmarks/bench_kernel_ab.py /tmp/old --rows 8,24,40 --contexts 1000,8100 --spans 1,2,5

Prints one JSON line per case with the median ms of each (30 layers: a whole step's share at SmolLM2's shape)
and whether the outputs are equal: `small_linear` over SmolLM2's linear layers (30 layers of distinct weights, so
they stream from memory, and the LM head) at each row count; the attention kernel's dense decode (span 1) and span
steps on random keys/values of 8 rows, 3 KV heads x 3 query heads of dim 64. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): q/k/v, o, gate/up, down of SmolLM2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="a checkout (e.g. a git worktree) holding the kernel before")
    parser.add_argument("--rows", default="8,24,40", help="small_linear row counts")
    parser.add_argument("--contexts", default="1000,8100", help="cached tokens per row for the attention kernel")
    parser.add_argument("--spans", default="1,2,5", help="tokens per row attended at once (1: a decode step)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch
    from torch.utils.cpp_extension import load

    from sparrow.attention import SparseConfig
    from sparrow.cpu import kernel as cpu_kernel

    places = [args.baseline / "sparrow" / package / "csrc" for package in ("cpu", "attention")]
    csrc = next((place for place in places if (place / "sparse_decode.cpp").is_file()), None)
    if csrc is None:
        raise SystemExit(f"{args.baseline} holds no kernel sources (expected {places[0]}/sparse_decode.cpp)")
    new = cpu_kernel.load()
    if new is None:
        raise SystemExit("this checkout's CPU kernel cannot be built here")
    old = load(name="sparrow_kernel_baseline", sources=[str(csrc / name) for name in ("sparse_decode.cpp",
                                                                                    "small_linear.cpp")],
               extra_cflags=cpu_kernel.CFLAGS, extra_ldflags=cpu_kernel.LDFLAGS, verbose=False)

    def compare(case: dict, call) -> None:
        """Alternate call(old) and call(new), then print their medians and whether their outputs are equal."""
        same = torch.equal(call(old), call(new))
        times = {"before": [], "after": []}
        for _ in range(args.repeats):
            for name, module in (("before", old), ("after", new)):
                start = time.perf_counter()
                call(module)
                times[name].append(time.perf_counter() - start)
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        print(json.dumps({**case, "before_ms": round(ms["before"], 1), "after_ms": round(ms["after"], 1),
                          "speedup": round(ms["before"] / ms["after"], 2), "bit_equal": same}), flush=True)

    torch.manual_seed(0)
    layers = [[torch.randn(n, k) * 0.02 for n, k in LINEARS] for _ in range(30)]
    head = torch.randn(49152, 576) * 0.02
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k) for k in (576, 1536)}

        def linears(module, x=x):
            outs = [module.small_linear(x[w.shape[1]], w, None) for layer in layers for w in layer]
            return torch.cat([o.flatten() for o in outs] + [module.small_linear(x[576], head, None).flatten()])
        compare({"call": "small_linear, SmolLM2's layers", "rows": rows}, linears)

    sparse, page, heads, group, dim, batch = SparseConfig(), 16, 3, 3, 64, 8
    for context in (int(c) for c in args.contexts.split(",")):
        pages = -(-(context + page) // page)
        keys, values = torch.randn(batch, heads, pages, page, dim), torch.randn(batch, heads, pages, page, dim)
        marks = sparse.page_landmark.build(keys)
        n_pages = torch.full((batch,), pages, dtype=torch.int64)
        total = torch.full((batch,), context + page, dtype=torch.int64)
        for span in (int(s) for s in args.spans.split(",")):
            q = torch.randn(batch, heads, group * span, dim)

            def attention(module, q=q, span=span, keys=keys, values=values, marks=marks, n_pages=n_pages,
                          total=total):
                common = (keys, values, marks, n_pages, n_pages, total, sparse.sink_pages, sparse.recent_pages,
                          dim**-0.5)
                if span == 1:
                    return module.sparse_decode(q, *common)
                return module.span_decode(q, *common, span)
            compare({"call": "attention, dense" if span == 1 else "attention, span", "context": context,
                     "span": span, "layers": 30}, lambda m, f=attention: torch.stack([f(m) for _ in range(30)]))


if __name__ == "__main__":
    main()
