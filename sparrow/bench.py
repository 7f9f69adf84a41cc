"""Decode-throughput benchmark: our dense and sparse decode, and transformers' `generate`, in one run.

All three start from the same shared prefill of a `context`-token prompt copied into `batch` rows, so they
decode at the same cached length; each is warmed up, then timed over several repeats (the median is reported).
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.attention.interface import base_model
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.engine.sampling import sample
from sparrow.errors import SparrowError
from sparrow.measure.cost_model import Pricing, compare
from sparrow.measure.exact_cost import best_draft_tokens, exact_decode
from sparrow.schedules import DENSE, Schedule

GREEDY = SamplingParams(max_new_tokens=1, temperature=0.0, num_logprobs=20)


@dataclass
class BenchResult:
    dense_tokens_per_s: float
    sparse_tokens_per_s: float
    hf_tokens_per_s: float | None
    sparse_over_dense: float
    dense_over_hf: float | None
    prefill_s: float
    kv_bytes_per_step: dict


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_step(engine: RolloutEngine, schedule: Schedule, cached: int, batch: int) -> dict:
    """Bytes of keys/values (and landmarks) one decode step reads, dense vs sparse, plus the weights' bytes."""
    element = torch.finfo(engine.dtype).bits // 8
    width = 2 * engine.kv_heads * engine.head_dim * element  # K and V per token
    dense = engine.num_layers * cached * width * batch
    sparse_layers = engine.num_layers - len(engine.sparse.dense_layers)
    attended = min(schedule.budget_at(cached), cached) if not schedule.is_dense else cached
    page = engine.sparse.page_landmark.bytes_per_page(engine.kv_heads, engine.head_dim, element)
    landmarks = (cached // engine.sparse.page_size) * page
    sparse = (len(engine.sparse.dense_layers) * cached * width + sparse_layers * (attended * width + landmarks)) * batch
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {"weights": weights, "dense_kv": dense, "sparse_kv": sparse}


def cache_tokens(context: int, warmup: int, steps: int) -> int:
    """Tokens per row of the benchmark's KV cache: the prompt and every decode step, warm-up included."""
    return context + warmup + steps + 1


def check_kv_cache_fits(config, dtype: torch.dtype, device: torch.device, batch: int, tokens: int) -> None:
    """Refuse a KV cache of `batch` rows of `tokens` tokens, for the model of Hugging Face `config`, that does not
    fit twice (the prefilled cache and the copy each repeat decodes) in the total memory of `device`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8
    need = 2 * batch * tokens * per_token
    total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
             else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if need > total:
        raise SparrowError(f"batch {batch} x {tokens} cached tokens need {need / 2**30:,.1f} GiB of KV cache (held "
                           f"twice), more than the {total / 2**30:,.1f} GiB of memory on device {device}; expected a "
                           "smaller --batch or --context")


def time_decode(engine: RolloutEngine, cache, logits, schedule: Schedule, steps: int, warmup: int) -> float:
    """Seconds of `steps` greedy decode steps from `logits` after `warmup` untimed ones (packing happens there)."""
    with engine.frozen_weights():  # as in generate
        tokens = sample(logits, GREEDY, None).tokens
        for _ in range(warmup):
            logits, _ = engine.decode_step(cache, tokens, schedule)
            tokens = sample(logits, GREEDY, None).tokens
        _sync(engine.device)
        start = time.perf_counter()
        for _ in range(steps):
            logits, _ = engine.decode_step(cache, tokens, schedule)
            tokens = sample(logits, GREEDY, None).tokens
        _sync(engine.device)
        return time.perf_counter() - start


@torch.no_grad()
def _time_hf(model, prompt: torch.Tensor, batch: int, steps: int, repeats: int) -> list[float]:
    """transformers `generate` (its default SDPA attention, dense) continuing from a shared prefilled cache."""
    inner = base_model(model)
    previous = inner.config._attn_implementation
    inner.set_attn_implementation("sdpa")
    try:
        out = model(input_ids=prompt[:, :-1], use_cache=True)
        prefilled = out.past_key_values
        prefilled.batch_repeat_interleave(batch)
        ids = prompt.expand(batch, -1)
        kwargs = {"do_sample": False, "min_new_tokens": steps, "max_new_tokens": steps, "pad_token_id": 0}
        model.generate(ids, past_key_values=copy.deepcopy(prefilled), **{**kwargs, "min_new_tokens": 2,
                                                                          "max_new_tokens": 2})
        times = []
        for _ in range(repeats):
            cache = copy.deepcopy(prefilled)
            _sync(prompt.device)
            start = time.perf_counter()
            model.generate(ids, past_key_values=cache, **kwargs)
            _sync(prompt.device)
            times.append(time.perf_counter() - start)
        return times
    finally:
        inner.set_attn_implementation(previous)


def random_prompt(engine: RolloutEngine, context: int, seed: int = 0) -> torch.Tensor:
    """[1, context] random token ids of the model's vocabulary, on the engine's device."""
    vocab = base_model(engine.model).config.vocab_size
    return torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(engine.device)


def prefilled(engine: RolloutEngine, prompt: torch.Tensor, batch: int, tokens: int, log=print):
    """(cache, logits [batch, V], seconds): `prompt` [1, context] prefilled once for `batch` rows of a cache of
    `tokens` tokens per row (refused where it does not fit the device)."""
    context = prompt.shape[1]
    check_kv_cache_fits(base_model(engine.model).config, engine.dtype, engine.device, batch, tokens)
    cache = engine.new_cache(batch, tokens)
    log(f"prefill: {context} tokens shared by {batch} rows")
    start = time.perf_counter()
    logits = engine.prefill(cache, prompt[0].tolist(), torch.arange(batch, device=engine.device))
    _sync(engine.device)
    return cache, logits.expand(batch, -1), time.perf_counter() - start


def time_alternated(engine: RolloutEngine, cache, logits, schedules: dict[str, Schedule], steps: int, warmup: int,
                    repeats: int, rewarm: int = 1, setup=None, log=None) -> dict[str, list[float]]:
    """Seconds of `steps` decode steps per repeat of each named schedule, from a copy of the prefilled `cache`,
    alternated, so that a machine slowing down mid-run slows all alike: `warmup` untimed steps before each one's
    first repeat, `rewarm` before later ones. `setup(name)` runs before each (bench_decode_paths.py switches the
    engine's code paths there); `log` gets one line per repeat."""
    times = {name: [] for name in schedules}
    for r in range(repeats):
        for name, schedule in schedules.items():
            if setup is not None:
                setup(name)
            warm = warmup if r == 0 else rewarm
            times[name].append(time_decode(engine, cache.clone(), logits, schedule, steps, warm))
        if log is not None:
            log(f"repeat {r + 1}/{repeats}: {steps} decode steps x {cache.rows} rows, "
                + ", ".join(f"{name} {t[-1]:.1f}s" for name, t in times.items()))
    return times


def run_benchmark(engine: RolloutEngine, schedule: Schedule, context: int, batch: int, steps: int = 32,
                  warmup: int = 4, repeats: int = 3, hf: bool = True, seed: int = 0, log=print) -> BenchResult:
    """Tokens/s of dense and sparse decode (and transformers' generate) at `context` cached tokens."""
    prompt = random_prompt(engine, context, seed)
    cache, logits, prefill_s = prefilled(engine, prompt, batch, cache_tokens(context, warmup, steps), log)
    times = time_alternated(engine, cache, logits, {"dense": DENSE, "sparse": schedule}, steps, warmup, repeats,
                            log=log)
    rates = {name: batch * steps / statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        log(f"{name:>6}: {rates[name]:8.1f} tokens/s  ({1000 * statistics.median(t) / steps:.1f} ms/step)")
    hf_rate = None
    if hf:
        del cache
        log(f"transformers generate: {repeats} repeats of {steps} steps x {batch} rows")
        times = _time_hf(engine.model, prompt, batch, steps, repeats)
        hf_rate = batch * steps / statistics.median(times)
        log(f"{'hf':>6}: {hf_rate:8.1f} tokens/s  (transformers generate)")
    return BenchResult(
        dense_tokens_per_s=rates["dense"], sparse_tokens_per_s=rates["sparse"], hf_tokens_per_s=hf_rate,
        sparse_over_dense=rates["sparse"] / rates["dense"],
        dense_over_hf=rates["dense"] / hf_rate if hf_rate else None, prefill_s=prefill_s,
        kv_bytes_per_step=kv_bytes_per_step(engine, schedule, context, batch),
    )


def cpu_flags(prefixes: tuple[str, ...]) -> list[str]:
    """This CPU's feature flags that start with one of `prefixes` (e.g. ("avx", "amx")), sorted: the first CPU's
    `flags` line of /proc/cpuinfo; empty where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    line = next((row for row in lines if row.startswith("flags")), "")
    return sorted({flag for flag in line.partition(":")[2].split() if flag.startswith(prefixes)})


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu_flags"] = cpu_flags(("avx", "amx", "fma"))  # which kernels ran: AVX2 and AVX-512 CPUs differ
        info["torch_cpu_kernels"] = torch.backends.cpu.get_cpu_capability()  # ATEN_CPU_CAPABILITY may lower it
    return info


@dataclass
class ExactBenchResult:
    """Decode tokens/s of dense, sparse and exact mode on real text, and what exact mode's verification did."""

    dense_tokens_per_s: float
    sparse_tokens_per_s: float
    exact_tokens_per_s: float
    sparse_over_dense: float
    exact_over_dense: float
    tokens_per_verify: float
    coupled_acceptance: float
    mean_alpha: float
    identical_sequences: int
    sequences: int
    prompt_tokens: int
    prefill_s: float


def task_prompt(tokenizer, context: int, seed: int) -> list[int]:
    """Real text of `context` tokens for decoding: a manifest-task prompt with 64 codes (its answers are long),
    fitted to at least that length and cut to its last `context` tokens (the instruction and the answer's start
    stay)."""
    from sparrow.engine import encode_prompt
    from sparrow.tasks.manifest import make_prompts

    example = make_prompts(1, max(64, context), seed, tokenizer, codes=64)[0]
    ids = encode_prompt(tokenizer, example["prompt"])
    if len(ids) < context:
        raise SparrowError(f"the manifest prompt came out at {len(ids)} tokens, below --context {context}")
    return ids[-context:]


def _time_wave(engine: RolloutEngine, cache, logits, prompt: list[int], sampling: SamplingParams,
               schedule: Schedule, draft_tokens: int | None) -> tuple[float, list]:
    """Seconds to decode `cache.rows` samples of `prompt` from a prefilled cache, and the completions. The cache's
    copy (gigabytes at 8K) and the weights' packing (`run_exact_benchmark` holds one scope) are not timed: both
    would add the same seconds to every configuration and pull their ratios toward 1."""
    from tqdm.auto import tqdm

    from sparrow.engine import Completion

    seqs = [Completion(0, s, prompt, 0, sampling=sampling) for s in range(cache.rows)]
    keys = engine.row_keys(sampling.seed, seqs)
    copy = cache.clone()
    with engine.frozen_weights(), tqdm(disable=True) as bar:
        _sync(engine.device)
        start = time.perf_counter()
        engine.decode_wave(copy, seqs, keys, logits, sampling, schedule, bar, draft_tokens)
        _sync(engine.device)
        return time.perf_counter() - start, seqs


def run_exact_benchmark(engine: RolloutEngine, schedule: Schedule, draft_tokens: int, context: int, batch: int,
                        steps: int = 32, repeats: int = 3, seed: int = 0, temperature: float = 1.0,
                        log=print, exact_rule: str = "coupled") -> ExactBenchResult:
    """Decode tokens/s of dense, sparse (`schedule`) and exact mode (`schedule` drafting `draft_tokens`), alternated,
    each sampling `steps` tokens per row at `temperature` from one real-text prompt of `context` tokens shared by
    `batch` rows (a seed per repeat: the same tokens for dense and exact). Exact mode's speed depends on how often
    the dense policy accepts the drafts, so the text is real, not random ids. `exact_rule` as
    `SamplingParams.exact_rule` (with "residual" the sequences are the dense distribution's, not dense's tokens)."""
    from sparrow.engine.exact import exact_summary, max_draft

    prompt = task_prompt(engine.tokenizer, context, seed)
    check_kv_cache_fits(base_model(engine.model).config, engine.dtype, engine.device, batch,
                        context + steps + max_draft(draft_tokens))
    cache = engine.new_cache(batch, context + steps, slack=max_draft(draft_tokens))
    log(f"prefill: a {context}-token manifest prompt shared by {batch} rows")
    start = time.perf_counter()
    logits = engine.prefill(cache, prompt, torch.arange(batch, device=engine.device)).expand(batch, -1)
    _sync(engine.device)
    prefill_s = time.perf_counter() - start
    configs = {"dense": (DENSE, None), "sparse": (schedule, None), "exact": (schedule, draft_tokens)}
    with engine.frozen_weights():  # one packing for every timed wave, made in the warm-up
        warm = SamplingParams(max_new_tokens=4, temperature=temperature, seed=seed, ignore_eos=True,
                              exact_rule=exact_rule)
        log(f"warm-up: {warm.max_new_tokens} tokens x {batch} rows, dense, sparse and exact")
        for sched, k in configs.values():
            _time_wave(engine, cache, logits, prompt, warm, sched, k)
        times = {name: [] for name in configs}
        identical, summaries = 0, []
        for r in range(repeats):  # alternated, so that a machine slowing down mid-run slows all alike
            sampling = SamplingParams(max_new_tokens=steps, temperature=temperature, seed=seed + r, ignore_eos=True,
                                      exact_rule=exact_rule)
            outs = {}
            for name, (sched, k) in configs.items():
                seconds, outs[name] = _time_wave(engine, cache, logits, prompt, sampling, sched, k)
                times[name].append(seconds)
            same = sum(e.token_ids == d.token_ids for e, d in zip(outs["exact"], outs["dense"]))
            identical += same
            summaries.append(exact_summary(outs["exact"]))
            log(f"repeat {r + 1}/{repeats}: {steps} tokens x {batch} rows, "
                + ", ".join(f"{name} {t[-1]:.1f}s" for name, t in times.items())
                + f"; {same} of {batch} exact sequences identical to dense")
    rates = {name: batch * steps / statistics.median(t) for name, t in times.items()}
    mean = {key: statistics.fmean(s[key] for s in summaries) for key in summaries[0]}
    for name in configs:
        log(f"{name:>6}: {rates[name]:8.1f} tokens/s  ({1000 * statistics.median(times[name]) / steps:.1f} ms/token "
            "per row batch)")
    log(f"exact: {mean['tokens_per_verify']:.2f} tokens per verification, {exact_rule} acceptance "
        f"{mean['coupled_acceptance']:.3f} (mean alpha {mean['mean_alpha']:.3f}), {identical} of {batch * repeats} "
        "sequences identical to dense")
    return ExactBenchResult(
        dense_tokens_per_s=rates["dense"], sparse_tokens_per_s=rates["sparse"], exact_tokens_per_s=rates["exact"],
        sparse_over_dense=rates["sparse"] / rates["dense"], exact_over_dense=rates["exact"] / rates["dense"],
        tokens_per_verify=mean["tokens_per_verify"], coupled_acceptance=mean["coupled_acceptance"],
        mean_alpha=mean["mean_alpha"], identical_sequences=identical, sequences=batch * repeats,
        prompt_tokens=len(prompt), prefill_s=prefill_s)


def predicted_steps(dims, hw, schedule: Schedule, context: int, steps: int, batch: int, measured: dict[str, float],
                    exact: tuple[float, int] | None = None, *,
                    pricing: Pricing = Pricing()) -> dict[str, dict[str, float]]:
    """The cost model's mean decode step beside the measured one (milliseconds, all rows) for each configuration
    in `measured` (name -> measured seconds per step: dense, sparse, and exact with `exact` = (coupled acceptance,
    draft tokens, 0 for the model's best)) over the timed trajectory: `steps` steps from `context` cached tokens,
    `batch` rows. Measured minus predicted is the host time per step the model leaves out (`--step-overhead`)."""
    trajectory = (dims, hw, schedule, context, steps, batch)
    result = compare(*trajectory, pricing=pricing)
    predicted = {"dense": result["dense_step_s"], "sparse": result["sparse_step_s"]}
    if exact is not None:
        acceptance, draft_tokens = exact
        run = (exact_decode(*trajectory, acceptance, draft_tokens, pricing=pricing) if draft_tokens
               else best_draft_tokens(*trajectory, acceptance=acceptance, pricing=pricing))
        predicted["exact"] = predicted["dense"] / run["exact_over_dense"]
    return {name: {"predicted_ms": 1e3 * predicted[name], "measured_ms": 1e3 * seconds,
                   "residual_ms": 1e3 * (seconds - predicted[name])} for name, seconds in measured.items()}
