"""Time Sparrow's paged sparse-decode kernel against vLLM's CPU attention kernel on the same synthetic cache.

A stack of `--layers` layers, each its own vLLM CPU KV cache [blocks, kv heads, block, 2 head dim] (random keys and
values, every request's blocks scattered at random), so that, as in a real decode step, the cache does not fit in
the CPU's caches. One timed call runs every layer: vLLM's kernel attends every token (dense), ours the pages its
rule selects under `--budget` tokens, and ours with a budget covering every page. SmolLM2-135M's attention shape
(3 KV heads, 3 query heads each, head dim 64). Before timing, ours at the covering budget must equal vLLM's output.

    python benchmarks/bench_paged_kernel.py --context 1100 --batch 16 --budget 512 --block 16 128

Each kernel runs on caches in plain 4 KiB memory pages (as vLLM allocates them) and in transparent huge pages (as
the plugin backs vLLM's cache where the kernel allows, `sparrow/cpu/huge_pages.py`), all six interleaved. Prints
one markdown row per block size and kind of memory (median ms per call over `--repeats`) and the CPU's flags.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from sparrow.attention import SparseConfig
from sparrow.bench import machine_info
from sparrow.cpu import kernel as cpu_kernel
from sparrow.cpu.huge_pages import collapse
from sparrow.vllm.paged import physical_pages

KV_HEADS, GROUP, DIM, PAGE = 3, 3, 64, 16
MEMORY = ("4k", "huge")


def kernels(context: int, batch: int, budget: int, block: int, layers: int, huge: bool, seed: int = 0):
    """(name -> callable) for one block size: vLLM dense, ours sparse, ours covering; and the covering check.
    huge: the caches' memory collapsed into transparent huge pages (what the plugin does), else plain 4 KiB pages."""
    from vllm import _custom_ops as ops
    from vllm import envs

    gen = torch.Generator().manual_seed(seed)
    per_row = -(-context // block)
    blocks = batch * per_row + 4
    shape = (blocks, KV_HEADS, block, 2 * DIM)
    caches = [torch.randn(shape, generator=gen) for _ in range(layers)]
    if huge and not all(collapse(c.data_ptr(), c.nbytes) for c in caches):
        raise SystemExit("this kernel did not give the caches huge pages (MADV_COLLAPSE needs Linux 6.1+)")
    sparse = SparseConfig(page_size=PAGE)
    marks = [[torch.randn(blocks * block // PAGE, KV_HEADS, DIM, generator=gen)] for _ in range(layers)]
    table = torch.randperm(blocks, generator=gen)[: batch * per_row].view(batch, per_row).to(torch.int32)
    pages = -(-context // PAGE)
    phys = physical_pages(table, pages, block, PAGE)
    query = torch.randn(batch, KV_HEADS * GROUP, DIM, generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    n_pages = torch.full((batch,), pages, dtype=torch.int64)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    scale = DIM ** -0.5
    isa = "vec" if block % 32 == 0 else "vec16"
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=KV_HEADS * GROUP, num_kv_heads=KV_HEADS, head_dim=DIM,
        seq_lens=seq_lens.to(torch.int32), dtype=torch.float32, query_start_loc=starts, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
        kv_cache_dtype="auto")
    out = torch.empty_like(query)

    def vllm_dense():
        for cache in caches:
            key_cache, value_cache = cache.view(blocks, KV_HEADS, block * 2, -1).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
                seq_lens=seq_lens.to(torch.int32), scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=table, softcap=0.0, scheduler_metadata=scheduler, s_aux=None, dynamic_causal=None,
                k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return out

    def ours(budget_pages: int):
        budgets = torch.full((batch,), budget_pages, dtype=torch.int64)

        def call():
            for cache, mark in zip(caches, marks):
                result = cpu_kernel.paged_sparse_decode(query.view(batch, KV_HEADS, GROUP, DIM), cache, phys, mark,
                                                        n_pages, budgets, seq_lens, sparse, scale)
            return result.reshape(batch, KV_HEADS * GROUP, DIM)

        return call

    covering = ours(pages)
    error = (covering() - vllm_dense()).abs().max().item()
    if error > 1e-4:
        raise SystemExit(f"block {block}: our kernel at a covering budget differs from vLLM's by {error}")
    return {"vLLM dense": vllm_dense, f"ours {budget // PAGE} of {pages} pages": ours(budget // PAGE),
            f"ours all {pages} pages": covering}


def time_interleaved(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=512, help="tokens (whole pages of 16)")
    parser.add_argument("--block", type=int, nargs="+", default=[16, 128], help="vLLM KV block sizes to time")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--memory", nargs="+", choices=MEMORY, default=list(MEMORY),
                        help="the caches' memory pages: 4 KiB (as vLLM allocates) or transparent huge pages")
    args = parser.parse_args()
    if not cpu_kernel.usable(torch.zeros(1)):
        raise SystemExit("the compiled CPU kernel is not available here")
    print(f"{args.layers} layers, {args.batch} requests x {args.context} cached tokens, budget {args.budget}; "
          f"median ms per call of {args.repeats}")
    header = None
    for block in args.block:
        fns = {(memory, name): fn for memory in args.memory
               for name, fn in kernels(args.context, args.batch, args.budget, block, args.layers,
                                       memory == "huge").items()}
        ms = time_interleaved(fns, args.repeats)  # every kernel on both kinds of memory, interleaved
        for memory in args.memory:
            names = [name for mem, name in ms if mem == memory]
            if header is None:
                header = names
                print("| block | memory pages | " + " | ".join(header) + " | ours sparse / vLLM dense |")
                print("|---:|---|" + "---:|" * (len(header) + 1))
            values = [ms[memory, name] for name in names]
            print(f"| {block} | {memory} | " + " | ".join(f"{v:.1f}" for v in values)
                  + f" | {values[1] / values[0]:.2f} |", flush=True)
    print(f"\nmachine: {machine_info(torch.device('cpu'))}")
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    print("CPU flags: " + " ".join(f for f in flags if f.startswith(("avx", "amx", "fma"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
