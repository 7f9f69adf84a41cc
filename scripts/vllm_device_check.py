"""The vLLM plugin's GPU path on a lent CUDA machine, in one run of under three minutes; installs nothing.

(a) the Triton kernel (sparrow/vllm/triton_decode.py) on CUDA against its PyTorch reference, float32 and bfloat16,
    and the whole sparse step against paged.reference_decode, plus one timing of kernel vs reference;
(b) if vLLM with CUDA imports: a tiny random Llama (head_dim 64) through vLLM with Sparrow's CUDA backend under
    const:64, against our teacher-forced sparse forward (`sparse_completion_logits`), greedy and sampled.
Each step is guarded: a failure is recorded with its traceback and the rest still runs. Prints one JSON summary
and writes it to $OUT/device_check.json (or --out). Exit status 1 if any check fails or errors. Run from the
repository root with whatever python has torch:

    python scripts/vllm_device_check.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SUMMARY: dict = {"environment": {}, "steps": {}}


def run_step(name: str, fn) -> None:
    """Run one check, recording its result or its error under `name`."""
    start = time.perf_counter()
    try:
        SUMMARY["steps"][name] = {"ok": True, **(fn() or {})}
    except Exception as err:  # noqa: BLE001 - every failure is reported, the next step still runs
        SUMMARY["steps"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000],
                                  "traceback": traceback.format_exc()[-3000:]}
    SUMMARY["steps"][name]["seconds"] = round(time.perf_counter() - start, 2)
    print(f"{'PASS' if SUMMARY['steps'][name]['ok'] else 'FAIL'}  {name}", file=sys.stderr, flush=True)


def versions() -> None:
    env = SUMMARY["environment"]
    for name in ("torch", "triton", "vllm", "transformers"):
        try:
            env[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as err:  # noqa: BLE001
            env[name] = f"not importable: {type(err).__name__}: {err}"[:300]
    try:
        import torch

        env["cuda"] = torch.cuda.is_available()
        env["device"] = torch.cuda.get_device_name() if env["cuda"] else None
    except Exception as err:  # noqa: BLE001
        env["cuda"] = f"{type(err).__name__}: {err}"


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
    slots = torch.cat(slots).cuda()
    kv = torch.full((num_blocks, block, kv_heads, 2 * dim), 50.0, dtype=dtype, device="cuda").transpose(1, 2)
    key_cache, value_cache = kv.transpose(1, 2).split(dim, dim=-1)
    key_cache[slots // block, slots % block] = torch.randn(slots.numel(), kv_heads, dim, device="cuda").to(dtype)
    value_cache[slots // block, slots % block] = torch.randn(slots.numel(), kv_heads, dim, device="cuda").to(dtype)
    sparse = SparseConfig(landmark=landmark)
    marks = PageLandmarks(sparse, num_blocks * block // 16, kv_heads, dim, dtype, "cuda")
    pages = filled_pages(slots, 16)
    marks.update(pages, page_reader(key_cache, value_cache, 16)(pages)[0])
    seq = torch.tensor(lengths, device="cuda")
    page_table = physical_pages(table.cuda(), int(max(need) * block // 16), block, 16)
    queries = torch.randn(len(lengths), kv_heads, group, dim, device="cuda").to(dtype)
    return {"queries": queries, "key_cache": key_cache, "value_cache": value_cache, "page_table": page_table,
            "landmarks": marks, "seq_lens": seq, "sparse": sparse, "scale": dim ** -0.5}


def kernel_vs_reference():
    """Worst |kernel - reference| over G, head sizes, block sizes, landmarks and dtypes; budgets of 6 pages. The
    reference attends the kernel's pages in float32; in float32 the whole step is also held to paged.reference_decode
    (in bfloat16 a near tie may select other pages than float32 scores would)."""
    import torch

    from sparrow.vllm.paged import reference_decode
    from sparrow.vllm.triton_decode import page_reader, paged_sparse_attention, reference_paged_attention, sparse_decode

    limits = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
    worst, seen = {}, []

    def attend(*args):
        seen.append(args)
        return paged_sparse_attention(*args)

    for dtype in limits:
        for group in (1, 4, 8):
            for dim in (64, 128):
                for block in (16, 32):
                    for landmark in ("centroid", "quest"):
                        b = batch([1000, 37, 2500, 301], 2, group, dim, block, dtype, landmark, seed=group + dim)
                        budget = torch.tensor([6, 6, 64, 6], device="cuda")
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

    from sparrow.vllm.triton_decode import paged_sparse_attention, reference_paged_attention

    b = batch([32768] * 16, 8, 4, 128, 16, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = torch.rand(16, 8, 2048, generator=gen, device="cuda").topk(64, dim=-1).indices
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


def tiny_llama(path: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparrow.models import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=512, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.1, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def vllm_vs_teacher_forced():
    """vLLM's log-probs of its own tokens against our teacher-forced sparse forward under const:64."""
    import torch

    from sparrow.errors import SparrowError
    from sparrow.vllm import config as plugin_config

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, where we register
    import vllm
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cuda():
        raise RuntimeError(f"vLLM's platform here is {current_platform.device_name!r}, not CUDA")
    from sparrow.vllm import cuda_attention, plugin

    schedule_env = {plugin_config.ENV_SCHEDULE: "const:64"}
    os.environ.update(schedule_env)
    try:
        plugin.register()
        wiring = "plugin.register registered the CUDA backend"
    except SparrowError as err:
        os.environ.pop(plugin_config.ENV_SCHEDULE)
        load_general_plugins()  # once per process, with the schedule unset: a later call changes nothing
        plugin_config.activate(plugin_config.from_environment(schedule_env))
        for member in (AttentionBackendEnum.FLASH_ATTN, AttentionBackendEnum.TRITON_ATTN):
            register_backend(member, "sparrow.vllm.cuda_attention.SparrowTritonAttentionBackend")
        wiring = f"registered by this script over FLASH_ATTN and TRITON_ATTN (plugin.register: {err})"
    calls = {"sparse": 0}
    kernel = cuda_attention.sparse_decode

    def counted(*args, **kwargs):
        calls["sparse"] += 1
        return kernel(*args, **kwargs)

    cuda_attention.sparse_decode = counted
    from sparrow.attention import SparseConfig
    from sparrow.attention.teacher_forced import sparse_completion_logits
    from sparrow.models import load_model
    from sparrow.schedules import const

    path = tiny_llama(tempfile.mkdtemp(prefix="sparrow-device-"))
    llm = vllm.LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=2048, gpu_memory_utilization=0.3,
                   logprobs_mode="processed_logprobs", seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (300, 517, 64, 700)]
    model, _ = load_model(path, device="cuda")
    result = {"wiring": wiring}
    for name, params in (("greedy", vllm.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)),
                         ("sampled", vllm.SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=1,
                                                         n=2, seed=5))):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        diffs, dense_diffs = [], []
        for prompt, out in zip(prompts, outs):
            for completion in out.outputs:
                ids = torch.tensor([prompt + list(completion.token_ids)], device="cuda")
                theirs = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
                with torch.no_grad():
                    sparse = sparse_completion_logits(model, ids, len(prompt), const(64), SparseConfig())[0]
                    dense = model(input_ids=ids).logits[0, len(prompt) - 1: -1]
                target = torch.tensor(completion.token_ids, device="cuda")[:, None]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for device_check.json")
    args = parser.parse_args()
    versions()
    for name, fn in (("kernel_vs_reference", kernel_vs_reference), ("kernel_timing", kernel_timing),
                     ("vllm_vs_teacher_forced", vllm_vs_teacher_forced)):
        run_step(name, fn)
    SUMMARY["ok"] = all(s["ok"] for s in SUMMARY["steps"].values())
    text = json.dumps(SUMMARY, indent=1)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "device_check.json").write_text(text)
    return 0 if SUMMARY["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
