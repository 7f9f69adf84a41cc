"""The vLLM section of the device check (scripts/device_check.py): the vLLM plugin's GPU path on a CUDA machine.

(a) the Triton kernel (sparrow/vllm/triton_decode.py) against its PyTorch reference (tests/reference.py), float32
    and bfloat16, and the whole sparse step against paged.reference_decode, plus one timing of kernel vs reference;
(b) the fixed-shape decode path (graph_decode.py) captured in a CUDA graph, replayed on new inputs, against the
    eager path;
(c) the step plan's time (plan.py) at batch 256 / 32K cached tokens on CUDA tensors;
(d) if vLLM with CUDA imports: a tiny random Llama (head_dim 64, float32: vLLM picks Triton, wrapped) through vLLM
    with Sparrow under const:64, against our teacher-forced sparse forward (`sparse_completion_logits`), greedy
    and sampled; and which wrapper vLLM picks for float32 and bfloat16 (FlashAttention or FlashInfer);
(e) decode tokens/s of a small random Llama at 8K cached / batch 8 with the plugin dense and sparse, with and
    without CUDA graphs (benchmarks/vllm_decode_throughput.py, one process each).
With --dry-run, on CPU: (a), (b) uncaptured and (c) under Triton's interpreter, on small shapes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from device_record import past_deadline, seconds_left  # scripts/, beside this file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.reference
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_plan

DEVICE = "cuda"  # "cpu" with --dry-run (Triton's interpreter)
GRID = {"dtypes": ("float32", "bfloat16"), "groups": (1, 4, 8), "dims": (64, 128), "blocks": (16, 32)}
DRY_GRID = {"dtypes": ("float32",), "groups": (4,), "dims": (64,), "blocks": (32,)}


def batch(lengths, kv_heads, group, dim, block, dtype, landmark="centroid", seed=0):
    """Random requests written into scattered blocks of a vLLM CUDA cache (NHD), landmarks of the full pages."""
    import torch

    from sparrow.attention import SparseConfig
    from sparrow.vllm.paged import PageLandmarks, filled_pages, physical_pages
    from sparrow.vllm.triton_decode import page_reader

    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in lengths]
    num_blocks = sum(need) + 4
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    slots = []
    for r, n in enumerate(lengths):
        table[r, : need[r]] = order[sum(need[:r]):sum(need[: r + 1])]
        tokens = torch.arange(n)
        slots.append(table[r, tokens // block].long() * block + tokens % block)
    slots = torch.cat(slots).to(DEVICE)
    kv = torch.full((num_blocks, block, kv_heads, 2 * dim), 50.0, dtype=dtype, device=DEVICE).transpose(1, 2)
    key_cache, value_cache = kv.transpose(1, 2).split(dim, dim=-1)
    key_cache[slots // block, slots % block] = torch.randn(slots.numel(), kv_heads, dim, device=DEVICE).to(dtype)
    value_cache[slots // block, slots % block] = torch.randn(slots.numel(), kv_heads, dim, device=DEVICE).to(dtype)
    sparse = SparseConfig(landmark=landmark)
    marks = PageLandmarks(sparse, num_blocks * block // 16, kv_heads, dim, dtype, DEVICE)
    pages = filled_pages(slots, 16)
    marks.update(pages, page_reader(key_cache, value_cache, 16)(pages)[0])
    seq = torch.tensor(lengths, device=DEVICE)
    page_table = physical_pages(table.to(DEVICE), int(max(need) * block // 16), block, 16)
    queries = torch.randn(len(lengths), kv_heads, group, dim, device=DEVICE).to(dtype)
    return {"queries": queries, "key_cache": key_cache, "value_cache": value_cache, "page_table": page_table,
            "landmarks": marks, "seq_lens": seq, "sparse": sparse, "scale": dim ** -0.5}


def kernel_vs_reference():
    """Worst |kernel - reference| over G, head sizes, block sizes, landmarks and dtypes; budgets of 6 pages. The
    reference attends the kernel's pages in float32; in float32 the whole step is also held to paged.reference_decode
    (in bfloat16 a near tie may select other pages than float32 scores would)."""
    import torch

    from sparrow.vllm.paged import reference_decode
    from sparrow.vllm.triton_decode import page_reader, paged_sparse_attention, sparse_decode
    from tests.reference import reference_paged_attention

    limits = {getattr(torch, d): {"float32": 1e-5, "bfloat16": 2e-2}[d] for d in GRID["dtypes"]}
    worst, seen = {}, []

    def attend(*args):
        seen.append(args)
        return paged_sparse_attention(*args)

    for dtype in limits:
        for group in GRID["groups"]:
            for dim in GRID["dims"]:
                for block in GRID["blocks"]:
                    for landmark in ("centroid", "quest"):
                        b = batch([1000, 37, 2500, 301], 2, group, dim, block, dtype, landmark, seed=group + dim)
                        budget = torch.tensor([6, 6, 64, 6], device=DEVICE)
                        out = sparse_decode(b["queries"], b["key_cache"], b["value_cache"], b["page_table"],
                                            b["landmarks"], b["seq_lens"], budget, b["sparse"], b["scale"],
                                            attend=attend).float()
                        q, k, v, table, pages, seq, ps, scale = seen[-1]
                        diff = (out - reference_paged_attention(q.float(), k.float(), v.float(), table, pages, seq,
                                                                ps, scale)).abs().max()
                        if dtype == torch.float32:
                            paged = reference_decode(q, page_reader(k, v, ps), table, b["landmarks"], seq, budget,
                                                     b["sparse"], scale)
                            diff = max(diff, (out - paged).abs().max())
                        key = str(dtype).removeprefix("torch.")
                        worst[key] = max(worst.get(key, 0.0), float(diff))
    limits = {str(d).removeprefix("torch."): v for d, v in limits.items()}
    if any(worst[name] > limit for name, limit in limits.items()):
        raise AssertionError(f"kernel differs from the references: {worst} (limits {limits})")
    return {"max_abs_diff": worst, "limits": limits}


def kernel_timing():
    """One decode step's attention: 16 requests at 32K tokens, 8 KV heads x 4, head 128, bf16, 64 pages kept."""
    import torch

    from sparrow.vllm.triton_decode import paged_sparse_attention
    from tests.reference import reference_paged_attention

    b = batch([32768] * 16, 8, 4, 128, 16, torch.bfloat16)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    pages = torch.rand(16, 8, 2048, generator=gen, device=DEVICE).topk(64, dim=-1).indices
    args = (b["queries"], b["key_cache"], b["value_cache"], b["page_table"], pages, b["seq_lens"], 16, b["scale"])

    def ms(fn):
        for _ in range(3):
            fn(*args)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn(*args)
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 20

    return {"kernel_ms": round(ms(paged_sparse_attention), 4), "reference_ms": round(ms(reference_paged_attention), 4)}


def tiny_llama(path: str, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
               positions: int = 4096) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparrow.models import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                         intermediate_size=2 * hidden, max_position_embeddings=positions, tie_word_embeddings=False,
                         initializer_range=0.1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def graph_capture_vs_eager():
    """graph_decode.graph_sparse_decode captured once in a CUDA graph (on CPU: run, not captured), then replayed
    after new queries and budgets are written into its inputs: equal to the eager sparse_decode on every request of
    budget > 0 (float32, centroid and quest)."""
    import torch

    from sparrow.vllm.graph_decode import graph_sparse_decode
    from sparrow.vllm.triton_decode import sparse_decode

    worst = 0.0
    for landmark in ("centroid", "quest"):
        b = batch([1000, 37, 2500, 301], 2, 4, 64, 32, torch.float32, landmark)
        table = b["page_table"][:, ::2].div(2, rounding_mode="floor").to(torch.int32)  # the block table
        budget = torch.tensor([6, 0, 8, 6], device=DEVICE, dtype=torch.int32)
        args = (b["queries"], b["key_cache"], b["value_cache"], table, b["landmarks"], b["seq_lens"], budget,
                b["sparse"], b["scale"], 8)

        def run(args=args):
            return graph_sparse_decode(*args)

        if DEVICE == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run()
            b["queries"].copy_(torch.randn_like(b["queries"]))
            budget.copy_(torch.tensor([8, 5, 0, 4], dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
        else:
            out = run()
        eager = sparse_decode(b["queries"], b["key_cache"], b["value_cache"], b["page_table"], b["landmarks"],
                              b["seq_lens"], budget.clamp(min=1), b["sparse"], b["scale"])
        rows = budget > 0
        worst = max(worst, float((out[rows] - eager[rows]).abs().max()))
    if worst > 1e-5:
        raise AssertionError(f"the replayed graph path differs from the eager path by {worst}")
    return {"max_abs_diff": worst, "captured": DEVICE == "cuda"}


def plan_time():
    """plan.plan_step at batch 256 (+ one prefill chunk) / 32K cached tokens, block 16, the device tensors on
    DEVICE: median host milliseconds per step (the device work is queued, not waited for)."""
    import statistics

    import torch
    from bench_plan import SCHEDULE, step_metadata

    from sparrow.schedules import parse_schedule
    from sparrow.vllm.plan import plan_step

    schedule = parse_schedule(SCHEDULE)
    cm = step_metadata(256, 32768, 16)
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        setattr(cm, name, getattr(cm, name).to(DEVICE))
    times = []
    for _ in range(50):
        start = time.perf_counter()
        plan_step(cm, schedule, 16, 16)
        times.append(time.perf_counter() - start)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return {"median_ms": round(statistics.median(times[5:]) * 1e3, 4)}


def decode_throughput():
    """Decode tokens/s at 8K cached / batch 8 on a small random Llama (8 layers, 16 heads, 8 KV heads of 64), the
    plugin dense and at const:1024, each with CUDA graphs and then without, one process each (until the
    deadline)."""
    import subprocess

    path = tiny_llama(tempfile.mkdtemp(prefix="sparrow-throughput-"), hidden=1024, layers=8, heads=16, kv_heads=8,
                      positions=9000)
    script = ROOT / "benchmarks" / "vllm_decode_throughput.py"
    rates = {}
    for eager in (False, True):
        for schedule in ("dense", "const:1024"):
            key = f"{schedule}/{'eager' if eager else 'cuda_graphs'}"
            if past_deadline():
                rates[key] = "skipped: past --deadline"
                continue
            try:
                run = subprocess.run([sys.executable, str(script), path, "--schedule", schedule]
                                     + (["--eager"] if eager else []), capture_output=True, text=True,
                                     timeout=seconds_left(150), check=False)
            except subprocess.TimeoutExpired as err:
                rates[key] = f"failed: timed out after {err.timeout:g} s"
                continue
            if run.returncode:
                rates[key] = "failed: " + run.stderr[-1500:]
                continue
            rates[key] = json.loads(run.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]
    numbers = {k: v for k, v in rates.items() if isinstance(v, float)}
    for mode in ("eager", "cuda_graphs"):
        if f"dense/{mode}" in numbers and f"const:1024/{mode}" in numbers:
            rates[f"sparse_over_dense/{mode}"] = round(numbers[f"const:1024/{mode}"] / numbers[f"dense/{mode}"], 3)
    if any(isinstance(v, str) and v.startswith("failed") for v in rates.values()):
        raise RuntimeError(f"some configurations failed: {rates}")
    return rates


def vllm_vs_teacher_forced():
    """vLLM's log-probs of its own tokens against our teacher-forced sparse forward under const:64."""
    import torch

    from sparrow.errors import SparrowError
    from sparrow.vllm import env as plugin_env
    from sparrow.vllm import state as plugin_state

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, where we register
    import vllm
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cuda():
        raise RuntimeError(f"vLLM's platform here is {current_platform.device_name!r}, not CUDA")
    from sparrow.vllm import plugin, wrapped

    schedule_env = {plugin_env.ENV_SCHEDULE: "const:64"}
    os.environ.update(schedule_env)
    try:
        plugin.register()
        wiring = "plugin.register registered the CUDA backend"
    except SparrowError as err:
        os.environ.pop(plugin_env.ENV_SCHEDULE)
        load_general_plugins()  # once per process, with the schedule unset: a later call changes nothing
        plugin_state.activate(plugin_env.from_environment(schedule_env))
        for member in wrapped.WRAPPED:
            register_backend(AttentionBackendEnum[member], wrapped.wrapper_path(member))
        wiring = f"wrappers registered by this script (plugin.register: {err})"
    calls = {"sparse": 0}
    kernel = wrapped.sparse_decode

    def counted(*args, **kwargs):
        calls["sparse"] += 1
        return kernel(*args, **kwargs)

    wrapped.sparse_decode = counted
    from sparrow.attention import SparseConfig
    from sparrow.attention.teacher_forced import sparse_completion_logits
    from sparrow.models import load_model
    from sparrow.schedules import const

    path = tiny_llama(tempfile.mkdtemp(prefix="sparrow-device-"))
    llm = vllm.LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=2048, gpu_memory_utilization=0.3,
                   logprobs_mode="processed_logprobs", seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (300, 517, 64, 700)]
    model, _ = load_model(path, device=DEVICE)
    from vllm.v1.attention.selector import AttentionSelectorConfig

    result = {"wiring": wiring, "picked": {  # the wrapper vLLM picks here (float32: Triton; 16-bit: FA or FlashInfer)
        str(dtype): current_platform.get_attn_backend_cls(None, AttentionSelectorConfig(
            head_size=64, dtype=dtype, kv_cache_dtype="auto", block_size=None)) for dtype in (torch.float32,
                                                                                             torch.bfloat16)}}
    for name, params in (("greedy", vllm.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)),
                         ("sampled", vllm.SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=1,
                                                         n=2, seed=5))):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        diffs, dense_diffs = [], []
        for prompt, out in zip(prompts, outs):
            for completion in out.outputs:
                ids = torch.tensor([prompt + list(completion.token_ids)], device=DEVICE)
                theirs = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
                with torch.no_grad():
                    sparse = sparse_completion_logits(model, ids, len(prompt), const(64), SparseConfig())[0]
                    dense = model(input_ids=ids).logits[0, len(prompt) - 1: -1]
                target = torch.tensor(completion.token_ids, device=DEVICE)[:, None]
                for logits, into in ((sparse, diffs), (dense, dense_diffs)):
                    ours = torch.log_softmax(logits.float(), -1).gather(-1, target)[:, 0].cpu()
                    into.append((ours - theirs).abs())
        diffs, dense_diffs = torch.cat(diffs), torch.cat(dense_diffs)
        result[name] = {"max_abs_diff": float(diffs.max()), "share_below_1e-3": float((diffs < 1e-3).float().mean()),
                        "max_abs_diff_vs_dense": float(dense_diffs.max())}
    result["sparse_kernel_calls"] = calls["sparse"]
    ok = (calls["sparse"] > 0 and all(result[n]["share_below_1e-3"] >= 0.99 for n in ("greedy", "sampled"))
          and result["greedy"]["max_abs_diff_vs_dense"] > 1e-3)
    if not ok:
        raise AssertionError(f"vLLM's sparse rollouts disagree with the teacher-forced forward: {result}")
    return result


def steps(dry_run: bool) -> tuple[list, list]:
    """(checks, timings) of this section, as (name, function) pairs; with `dry_run` on CPU under Triton's
    interpreter (TRITON_INTERPRET=1 set before triton.language is first imported: device_check.py does it), the
    kernel, graph-path and plan checks on small shapes; no vLLM engine, no timing."""
    global DEVICE, GRID
    checks = [("kernel_vs_reference", kernel_vs_reference), ("graph_capture_vs_eager", graph_capture_vs_eager),
              ("plan_time", plan_time)]
    if dry_run:
        DEVICE, GRID = "cpu", DRY_GRID
        return checks, []
    return checks + [("vllm_vs_teacher_forced", vllm_vs_teacher_forced)], [("kernel_timing", kernel_timing),
                                                                          ("decode_throughput", decode_throughput)]
