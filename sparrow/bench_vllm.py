"""Decode benchmarks inside vLLM: stock dense, the plugin's dense and sparse decode, and exact mode (the policy
drafting under the plugin, verified densely), each timed the same way and alternated in one run."""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass

import torch

from sparrow.engine import SamplingParams
from sparrow.schedules import DENSE, Schedule

from .bench import task_prompt


@dataclass
class VLLMBenchResult:
    """Decode tokens/s of one vLLM engine: dense and, with the plugin, under the schedule."""

    dense_tokens_per_s: float
    sparse_tokens_per_s: float | None
    prefill_s: float
    prefill_copied: bool


@dataclass
class VLLMExactBenchResult:
    """Decode tokens/s in vLLM of the plugin's dense and sparse decode and of exact mode, on real text (greedy), with
    what exact mode's verifications did and the memory its second copy of the model costs."""

    dense_tokens_per_s: float
    sparse_tokens_per_s: float
    exact_tokens_per_s: float
    exact_over_dense: float
    sparse_over_dense: float
    tokens_per_verify: float
    drafted_share: float
    identical_sequences: int
    sequences: int
    prefill_s: float
    exact_prefill_s: float
    exact_kv_cache_gib: float
    dense_kv_cache_gib: float
    max_rss_gib: float


ONE_TOKEN = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, num_logprobs=0)


def time_calls(configs: dict, prompts: list[list[int]], steps: int, repeats: int, log,
               warmup: int = 4) -> tuple[dict, dict]:
    """Per config name (backend, schedule, draft tokens): decode tokens/s over `repeats` alternated calls, each
    `steps` greedy tokens per prompt, the time of a 1-token call taken off (the recompute of a prompt's partial last
    block cancels out); and each config's completions of the last repeat. `warmup` tokens per config first."""
    many = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True, num_logprobs=0)
    if warmup:
        log(f"warm-up: {warmup} tokens x {len(prompts)} requests, " + " and ".join(configs))
        first = SamplingParams(max_new_tokens=warmup, temperature=0.0, ignore_eos=True, num_logprobs=0)
        for backend, schedule, drafts in configs.values():
            backend.generate(prompts, first, schedule, draft_tokens=drafts)
    times, outs = {name: [] for name in configs}, {}
    for r in range(repeats):  # alternated, so that a machine slowing down mid-run slows all alike
        for name, (backend, schedule, drafts) in configs.items():
            if len(configs) > 1:  # untimed: a sparse call after a dense one rebuilds landmarks
                backend.generate(prompts, ONE_TOKEN, schedule, draft_tokens=drafts)
            start = time.perf_counter()
            backend.generate(prompts, ONE_TOKEN, schedule, draft_tokens=drafts)
            base = time.perf_counter() - start
            start = time.perf_counter()
            outs[name] = backend.generate(prompts, many, schedule, draft_tokens=drafts)
            times[name].append(time.perf_counter() - start - base)
        log(f"repeat {r + 1}/{repeats}: {steps} tokens x {len(prompts)} requests, "
            + ", ".join(f"{name} {t[-1]:.1f}s" for name, t in times.items()))
    rates = {name: len(prompts) * (steps - 1) / statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        log(f"{name:>6}: {rates[name]:8.1f} tokens/s  ({1000 * statistics.median(t) / (steps - 1):.1f} ms/step)")
    return rates, outs


def _prefill(backend, prompts, schedule: Schedule, drafts: int | None) -> float:
    start = time.perf_counter()
    backend.generate(prompts, ONE_TOKEN, schedule, draft_tokens=drafts)
    return time.perf_counter() - start


def run_vllm_benchmark(backend, schedule: Schedule | None, context: int, batch: int, steps: int = 32,
                       repeats: int = 3, warmup: int = 4, seed: int = 0, log=print) -> VLLMBenchResult:
    """Decode tokens/s of a `VLLMBackend` at `context` cached tokens on `batch` distinct random prompts, prefilled
    once (their blocks stay in vLLM's prefix cache). `schedule` None: dense only (stock vLLM). The first prompt is
    prefilled alone: an engine started with `copied_prefill.kv_transfer_config()` then copies its K and V into the
    others' blocks instead of prefilling them."""
    vocab = len(backend.tokenizer)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
    copied = copies_prefill(backend)
    log(f"prefill: {batch} distinct prompts of {context} tokens"
        + (" (the first computed, its K and V copied into the others' blocks)" if copied else ""))
    prefill_s = _prefill(backend, prompts[:1], DENSE, None) + _prefill(backend, prompts, DENSE, None)
    configs = {"dense": (backend, DENSE, None)}
    if schedule is not None:
        configs["sparse"] = (backend, schedule, None)
    rates, _ = time_calls(configs, prompts, steps, repeats, log, warmup)
    return VLLMBenchResult(rates["dense"], rates.get("sparse"), prefill_s, copied)


def run_vllm_exact_benchmark(plain, exact, schedule: Schedule, draft_tokens: int, context: int, batch: int,
                             steps: int = 32, repeats: int = 3, warmup: int = 4, seed: int = 0,
                             log=print) -> VLLMExactBenchResult:
    """Greedy decode tokens/s of the plugin's dense and sparse decode (`plain`, a `VLLMBackend`) and of exact mode
    (`exact`, one started drafting `draft_tokens`) at `context` cached tokens on `batch` distinct real-text prompts
    (the drafts' acceptance depends on the text), alternated; exact's tokens against dense's."""
    from sparrow.engine.exact import exact_summary

    prompts = [task_prompt(plain.tokenizer, context, seed + i) for i in range(batch)]
    log(f"prefill: {batch} real-text prompts of {context} tokens, in each engine")
    prefill_s = _prefill(plain, prompts, DENSE, None)
    exact_prefill_s = _prefill(exact, prompts, schedule, draft_tokens)
    configs = {"dense": (plain, DENSE, None), "sparse": (plain, schedule, None),
               "exact": (exact, schedule, draft_tokens)}
    rates, outs = time_calls(configs, prompts, steps, repeats, log, warmup)
    summary = exact_summary(outs["exact"])
    same = sum(e.token_ids == d.token_ids for e, d in zip(outs["exact"], outs["dense"]))
    log(f"exact: {summary['tokens_per_verify']:.2f} tokens per verification, {same} of {batch} sequences "
        "identical to dense")
    return VLLMExactBenchResult(
        dense_tokens_per_s=rates["dense"], sparse_tokens_per_s=rates["sparse"], exact_tokens_per_s=rates["exact"],
        exact_over_dense=rates["exact"] / rates["dense"], sparse_over_dense=rates["sparse"] / rates["dense"],
        tokens_per_verify=summary["tokens_per_verify"], drafted_share=summary["drafted_share"],
        identical_sequences=same, sequences=batch, prefill_s=prefill_s, exact_prefill_s=exact_prefill_s,
        exact_kv_cache_gib=kv_cache_gib(exact), dense_kv_cache_gib=kv_cache_gib(plain),
        max_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def copies_prefill(backend) -> bool:
    """Whether a `VLLMBackend`'s engine was started with the copied-prefill connector (`sparrow.vllm.copied_prefill`)."""
    from sparrow.vllm.copied_prefill import CONNECTOR

    config = backend.llm.llm_engine.vllm_config.kv_transfer_config
    return config is not None and config.kv_connector == CONNECTOR


def kv_cache_gib(backend) -> float:
    """The KV cache vLLM allocated for an engine, in GiB: its blocks over every layer (exact mode's engine holds the
    drafter's copy of the layers too)."""
    config = backend.llm.llm_engine.vllm_config
    model = config.model_config
    copies = 2 if config.speculative_config is not None else 1
    per_block = (copies * model.get_total_num_hidden_layers() * 2 * model.get_total_num_kv_heads()
                 * model.get_head_size() * model.dtype.itemsize * config.cache_config.block_size)
    return float(config.cache_config.num_gpu_blocks or 0) * per_block / 2**30
