"""Time the vLLM plugin's per-step plan (sparrow/vllm/plan.py) on CPU, without a vLLM engine.

The plan is built from synthetic step metadata as vLLM's runner gives it (host copies of query starts, cached
lengths and `is_prefilling`; a block table): `batch` decoding requests around `cached` tokens plus one prefill chunk,
so the stock sub-batch is built too. Two columns: the CUDA backend's host side (vLLM's CUDA block of 16; the
device tensors on PyTorch's meta device, so the page-table gather and the one host-to-device copy cost only their
dispatch, as queued CUDA work costs the host its launch), and the CPU backend's whole plan (block 16, one page per
block as the plugin asks vLLM for on CPU, the page table built on the CPU).

    python benchmarks/bench_plan.py [--repeats 200]

Prints a markdown table (median ms per step) and the CPU's flags.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from sparrow.bench import machine_info
from sparrow.schedules import parse_schedule
from sparrow.vllm.plan import plan_step

BATCHES = (8, 64, 256)
CACHED = (1024, 8192, 32768)
DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
SCHEDULE = "0:256,4096:1024,16384:2048"  # sparse at every shape timed
PAGE = 16
CHUNK = 512  # tokens of the one prefill chunk in the step
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")


def step_metadata(batch: int, cached: int, block: int, seed: int = 0) -> SimpleNamespace:
    """A step of `batch` one-token decodes of about `cached` tokens and one prefill chunk, as vLLM's runner makes
    it (the fields the plan reads)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(cached - cached // 8, cached + 1, (batch + 1,), generator=gen, dtype=torch.int32)
    query_lens = torch.ones(batch + 1, dtype=torch.int32)
    query_lens[-1] = CHUNK
    starts = torch.zeros(batch + 2, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=starts[1:])
    width = cached // block + 1
    table = torch.randperm((batch + 1) * width, generator=gen).to(torch.int32).view(batch + 1, width)
    prefilling = torch.zeros(batch + 1, dtype=torch.bool)
    prefilling[-1] = True
    return SimpleNamespace(num_reqs=batch + 1, query_start_loc=starts, query_start_loc_cpu=starts.clone(),
                           seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_lens.clone(), is_prefilling=prefilling,
                           block_table_tensor=table, num_actual_tokens=int(starts[-1]), max_query_len=CHUNK,
                           max_seq_len=int(seq_lens.max()), slot_mapping=torch.arange(int(starts[-1])))


def time_plan(plan, cm: SimpleNamespace, block: int, repeats: int) -> float:
    """Median milliseconds of `plan(cm, block)` over `repeats` calls (after 5 warm-up calls)."""
    for _ in range(5):
        plan(cm, block)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan(cm, block)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def on_meta(cm: SimpleNamespace) -> SimpleNamespace:
    """`cm` with its device tensors on the meta device: device work costs only its dispatch, as queued CUDA work
    costs the host only its launch."""
    meta = {name: getattr(cm, name).to("meta") for name in DEVICE_FIELDS}
    return SimpleNamespace(**{**vars(cm), **meta})


def table(plan, repeats: int) -> list[str]:
    """The markdown table of `plan`: the CUDA backend's host side (block 16, device tensors on meta) and the CPU
    backend's whole plan (block 16, all on the CPU)."""
    lines = ["| batch | cached tokens | CUDA: host side, block 16 (ms) | CPU: whole plan, block 16 (ms) |",
             "|---:|---:|---:|---:|"]
    for batch in BATCHES:
        for cached in CACHED:
            cuda = time_plan(plan, on_meta(step_metadata(batch, cached, 16)), 16, repeats)
            cpu = time_plan(plan, step_metadata(batch, cached, 16), 16, repeats)
            lines.append(f"| {batch} | {cached} | {cuda:.3f} | {cpu:.3f} |")
    return lines


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    line = next((row for row in text.splitlines() if row.startswith(("flags", "Features"))), "")
    present = set(line.split(":", 1)[-1].split())
    return " ".join(f for f in FLAGS if f in present) or "none of " + " ".join(FLAGS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    schedule = parse_schedule(SCHEDULE)

    def plan(cm, block):
        return plan_step(cm, schedule, PAGE, block)

    print(f"plan_step, schedule {SCHEDULE}, median of {args.repeats} steps; each step: batch decodes + one "
          f"{CHUNK}-token prefill chunk")
    print("\n".join(table(plan, args.repeats)))
    print(f"\nmachine: {machine_info(torch.device('cpu'))}; CPU flags: {cpu_flags()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
