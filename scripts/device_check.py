"""The one check to run on a lent GPU: Sparrow's engine, its vLLM plugin and exact mode inside vLLM.

One run of at most eight minutes on one H100, writing one JSON file. Installs nothing; run from the repository root:

    .venv/bin/python scripts/device_check.py                # on the GPU machine: OUT/device_check.json
    .venv/bin/python scripts/device_check.py --dry-run      # on CPU: what runs without a GPU, no timing

Three sections (--sections picks some): engine (scripts/device_engine.py: our engine's correctness checks and two
GRPO runs on tiny-qwen3, then `sparrow bench`), vllm (scripts/device_vllm.py: the Triton kernel, the CUDA-graph
decode path, the step plan, vLLM with the plugin against our teacher-forced forward, decode throughput) and exact
(scripts/device_exact.py: exact mode in vLLM, identity with dense and tokens/s against stock vLLM). Every
section's checks run first, then the timings, each step guarded (a failure is recorded with its traceback and the
next step runs); no step starts after --deadline seconds (default 450), and a child process is stopped there, so
the run ends within eight minutes and the file says which steps were skipped (--deadline 0, or one section at a
time, runs them). The file is written after every step: a run cut short keeps what it did. Exit status 1 if any
check or step fails.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from pathlib import Path

import device_record as record  # scripts/, beside this file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SECTIONS = ("engine", "vllm", "exact")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: engine, vllm, exact")
    parser.add_argument("--dry-run", action="store_true", help="on CPU: the engine's checks (no benchmark) and the "
                        "vLLM section's kernel, graph-path and plan checks under Triton's interpreter, on small shapes")
    parser.add_argument("--device", default="cuda", help="the engine section's device (cpu with --dry-run)")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/device-check"),
                        help="the JSON file, training runs and the benchmark's model go here (default: $OUT)")
    parser.add_argument("--results", help="where the JSON file goes (default: OUT/device_check.json)")
    parser.add_argument("--deadline", type=float,
                        help="seconds after start past which no step starts and child processes stop (0: none; "
                             "default 450, none with --dry-run)")
    parser.add_argument("--no-bench", action="store_true", help="engine section: skip `sparrow bench`")
    parser.add_argument("--bench-model", default="smollm2-135m",
                        help="model of the benchmark: a `sparrow bench --model` spec, or smollm2-shape (SmolLM2-135M-"
                             "Instruct's architecture with random weights, written under --out: speeds only)")
    parser.add_argument("--bench", action="append", metavar="CONTEXT:BATCH[:DTYPE]",
                        help="one benchmark run (repeatable; dtype float32 unless given); default: "
                             "BENCH_CONTEXT:8 and BENCH_CONTEXT:32")
    parser.add_argument("--bench-context", type=int, default=8150, help="cached tokens of the default runs")
    parser.add_argument("--bench-schedule", default="const:1024", help="the sparse schedule benchmarked")
    parser.add_argument("--bench-steps", type=int, default=32, help="timed decode steps per repeat")
    parser.add_argument("--bench-repeats", type=int, default=3, help="timed repeats (median reported)")
    parser.add_argument("--bench-timeout", type=float, default=600, help="seconds allowed to one benchmark run")
    parser.add_argument("--bench-exact", type=int, default=0, metavar="K",
                        help="benchmark exact mode (K drafted tokens per verification) on real text instead")
    importlib.import_module("device_exact").add_options(parser)
    args = parser.parse_args(argv)
    args.sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections {', '.join(unknown)}: expected some of {', '.join(SECTIONS)}")
    return args


def machine(device) -> dict:
    """Versions of what the sections use, and the device."""
    info = {}
    for name in ("torch", "triton", "vllm", "transformers"):
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as err:  # noqa: BLE001 - a section that needs it fails on its own
            info[name] = f"not importable: {type(err).__name__}: {err}"[:300]
    import torch

    info["device"] = str(device)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# the timings in the order they run after the checks: the shortest first, then exact mode in vLLM (never measured
# on a GPU before this script), our engine's benchmark, and the plugin's throughput with and without CUDA graphs
TIMINGS = ("vllm/kernel_timing", "exact/throughput", "engine/bench", "vllm/decode_throughput")


def plan(args, device, out: Path) -> list[tuple[str, object]]:
    """(name, step) of every section chosen: all their checks, then all their timings (in the order of TIMINGS)."""
    checks, timings = [], {}
    if "engine" in args.sections:
        engine = importlib.import_module("device_engine")
        checks += [("engine/attention_checks", lambda: engine.attention_checks(device)),
                   ("engine/exact_checks", lambda: engine.exact_checks(device)),
                   ("engine/training_checks", lambda: engine.training_checks(device, out))]
        if not (args.no_bench or args.dry_run):
            timings["engine/bench"] = lambda: engine.bench_runs(args, device, out)
    if "vllm" in args.sections:
        vllm_checks, vllm_timings = importlib.import_module("device_vllm").steps(args.dry_run)
        checks += [(f"vllm/{name}", fn) for name, fn in vllm_checks]
        timings.update((f"vllm/{name}", fn) for name, fn in vllm_timings)
    if "exact" in args.sections and not args.dry_run:
        exact = importlib.import_module("device_exact")
        checks.append(("exact/identity", lambda: exact.identity(args)))
        timings["exact/throughput"] = lambda: exact.throughput(args)
    return checks + [(name, timings[name]) for name in TIMINGS if name in timings]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton.language is first imported
        args.device = "cpu"
    import torch
    from transformers.utils.logging import disable_progress_bar

    from sparrow.models import resolve_device

    out = Path(args.out)
    record.PATH = Path(args.results) if args.results else out / "device_check.json"
    record.DEADLINE = args.deadline if args.deadline is not None else 0 if args.dry_run else 450
    device = resolve_device(args.device)
    disable_progress_bar()
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    record.SUMMARY["machine"] = machine(device)
    record.SUMMARY["sections"], record.SUMMARY["dry_run"] = args.sections, args.dry_run
    record.save()
    for name, step in plan(args, device, out):
        record.run_step(name, step)
        gc.collect()  # what a step held on the GPU (an in-process vLLM engine, the allocator's cache) goes back
        if device.type == "cuda":  # before a later step's child process sizes its engine to the free memory
            torch.cuda.empty_cache()
    steps = record.SUMMARY["steps"].values()
    record.SUMMARY["ok"] = all(s.get("ok", True) for s in steps) and all(c["ok"] for c in record.SUMMARY["checks"])
    record.SUMMARY["seconds"] = round(record.elapsed(), 1)
    record.save()
    skipped = [name for name, s in record.SUMMARY["steps"].items() if "skipped" in s]
    print(f"device_check: {'ok' if record.SUMMARY['ok'] else 'FAILED'} in {record.elapsed():.0f} s"
          + (f", skipped past the deadline: {', '.join(skipped)}" if skipped else "") + f"; {record.PATH}",
          flush=True)
    return 0 if record.SUMMARY["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
