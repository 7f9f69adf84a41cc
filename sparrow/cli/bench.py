"""`sparrow bench`: decode throughput of dense vs sparse attention, and of transformers' generate."""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass
from pathlib import Path

from sparrow.bench import (
    cache_tokens,
    check_kv_cache_fits,
    machine_info,
    predicted_steps,
    run_benchmark,
    run_exact_benchmark,
)
from sparrow.bench_vllm import run_vllm_benchmark, run_vllm_exact_benchmark
from sparrow.engine import RolloutEngine
from sparrow.engine.sampling import EXACT_RULES
from sparrow.errors import SparrowError
from sparrow.model_shapes import model_config, model_dims
from sparrow.models import MODEL_NAMES, resolve_dtype
from sparrow.options import AdaptedModelSection, ScheduledSparseSection, check_exact_rule_mode
from sparrow.rollout.factory import check_backend
from sparrow.typed_config import check_int, option, section, to_nested

from .config import add_config_options, load_config
from .machine import MachineSection
from .progress import phase_log


@dataclass
class BenchConfig:
    model: AdaptedModelSection = section(AdaptedModelSection)
    sparse: ScheduledSparseSection = section(ScheduledSparseSection, schedule="const:1024")
    context: int = option(8192, "cached tokens (prompt length) at which decode is timed")
    batch: int = option(8, "sequences decoded together (they share one prefill)")
    steps: int = option(32, "timed decode steps per repeat")
    warmup: int = option(4, "untimed decode steps before the first repeat")
    repeats: int = option(3, "timed repeats; the median is reported")
    hf: bool = option(True, "also time transformers' generate (dense SDPA) from the same prefill")
    seed: int = option(0, "seed of the random prompts")
    json: bool = option(False, "print one JSON object with the results")
    backend: str = option("native", "vllm: after our engine's numbers, vLLM with Sparrow's plugin, dense and sparse "
                          "(one engine), on distinct prompts")
    stock: bool = option(False, "with --backend vllm: also time stock vLLM (a child process without the plugin), for "
                         "the plugin's dense overhead")
    block_size: int = option(0, "with --backend vllm: the plugin's KV block size on CPU (0: its default, one "
                             "16-token page per block; 128: stock vLLM's)")
    machine: MachineSection = section(MachineSection, param_bytes=4, kv_bytes=4)
    predict: bool = option(False, "also print the cost model's mean decode step beside each measured one, for the "
                           "machine of --hardware (on a CPU: cpu with --peak-flops and --bandwidth; bytes per weight "
                           "and K/V element: 4 for float32); measured minus predicted is the host time per step "
                           "that --step-overhead prices")
    exact_rule: str = option("coupled", "with --rollout-mode exact: how drafts are judged (coupled: dense sampling's "
                             "own tokens; residual: speculative sampling's rejection rule)")

    def validate(self) -> None:
        self.model.validate()
        self.sparse.validate()
        for name in ("context", "batch", "steps", "repeats"):
            check_int(name, getattr(self, name), 1)
        check_int("warmup", self.warmup, 0)
        check_int("seed", self.seed, 0)
        check_backend(self.backend, 0, None)
        check_int("block_size", self.block_size, 0)
        if self.block_size and (self.backend != "vllm" or self.block_size % 16
                                or self.block_size % self.sparse.page_size):
            raise SparrowError(f"--block-size {self.block_size}: needs --backend vllm and a multiple of 16 and of the "
                               f"page size ({self.sparse.page_size})")
        longest = cache_tokens(self.context, self.warmup, self.steps)
        if self.block_size > longest + 16:
            raise SparrowError(f"--block-size {self.block_size} is longer than the benchmark's sequences "
                               f"({longest} tokens): expected at most {longest - longest % 16 + 16}; one block "
                               "would hold more than a whole sequence")
        if self.sparse.exact and self.backend == "vllm" and not self.sparse.draft_tokens:
            raise SparrowError("--backend vllm fixes the draft length when the engine starts: give --draft-tokens K "
                               "(1-64), not auto")
        if self.exact_rule not in EXACT_RULES:
            raise SparrowError(f"--exact-rule {self.exact_rule!r}: expected one of {', '.join(EXACT_RULES)}")
        check_exact_rule_mode(self.exact_rule, self.sparse.exact)
        if self.stock and self.backend != "vllm":
            raise SparrowError("--stock times stock vLLM beside the plugin: it needs --backend vllm")
        if self.backend == "vllm" and self.steps < 2:
            raise SparrowError(f"--backend vllm times decode beyond a 1-token call: steps must be >= 2, got {self.steps}")
        if self.sparse.parsed_schedule.is_dense:
            raise SparrowError("bench compares dense with a sparse schedule; give --schedule other than 'dense'")
        if self.predict:
            self._check_predict()
        model = self.model
        if model.name in MODEL_NAMES or (Path(model.name).expanduser() / "config.json").is_file():  # else at load
            check_kv_cache_fits(model_config(model.name), resolve_dtype(model.dtype), model.torch_device(),
                                self.batch, cache_tokens(self.context, self.warmup, self.steps))

    def _check_predict(self) -> None:
        self.machine.validate()
        model_dims(self.model.name)
        on_cpu = self.model.torch_device().type == "cpu"
        if on_cpu != (self.machine.hardware.strip().lower() == "cpu"):
            raise SparrowError(f"--predict prices the machine bench runs on ({'a CPU' if on_cpu else 'a GPU'}), not "
                               f"--hardware {self.machine.hardware!r}: give "
                               + ("--hardware cpu --peak-flops FLOP/S --bandwidth BYTES/S" if on_cpu
                                  else "a GPU preset (h100, h200, b200, a100)"))


def _predicted(config: BenchConfig, measured: dict[str, float], exact: tuple[float, int] | None = None) -> dict:
    """`predicted_steps` for this run's trajectory and machine; `measured`: seconds per decode step by name."""
    sparse = config.sparse.config()
    return predicted_steps(model_dims(config.model.name), config.machine.spec(), config.sparse.parsed_schedule,
                           config.context, config.steps, config.batch, measured, exact,
                           pricing=config.machine.pricing(page_size=sparse.page_size,
                                                          dense_layers=len(set(sparse.dense_layers)),
                                                          landmark=sparse.landmark))


def _print_predicted(predicted: dict, hardware: str) -> None:
    print(f"cost model ({hardware}), ms per step predicted / measured (measured - predicted): " + "; ".join(
        f"{name} {p['predicted_ms']:.1f} / {p['measured_ms']:.1f} ({p['residual_ms']:+.1f})"
        for name, p in predicted.items()))


def run(args) -> int:
    config = load_config(BenchConfig, args)
    log = phase_log("bench")  # stderr: stdout holds only the result (a summary line, or --json)
    stock = _stock_vllm(config, log) if config.stock else None  # before this process does any work
    model, tokenizer = config.model.load()
    log(f"{config.model.name} in {config.model.dtype} (--dtype), weights and KV cache, in every engine")
    engine = RolloutEngine(model, tokenizer, config.sparse.config(), max_batch_size=config.batch)
    schedule, longest = config.sparse.parsed_schedule, cache_tokens(config.context, config.warmup, config.steps)
    if all(schedule.budget_at(n) >= n for n in range(config.context, longest + 1)):
        log(f"warning: {schedule.name} keeps every cached token at these lengths ({config.context}-{longest}): "
            "the sparse decode reads the whole cache as the dense one does, so their ratio is noise; give a longer "
            "--context or a smaller budget to measure sparsity")
    if config.sparse.exact:
        return _run_exact(config, engine, stock, log)
    result = run_benchmark(engine, config.sparse.parsed_schedule, config.context, config.batch, config.steps,
                           config.warmup, config.repeats, config.hf, config.seed, log=log)
    record = {**dataclasses.asdict(result), "config": to_nested(config),
              "machine": machine_info(engine.device), "date": datetime.date.today().isoformat()}
    if config.predict:
        record["predicted"] = _predicted(config, {"dense": config.batch / result.dense_tokens_per_s,
                                                  "sparse": config.batch / result.sparse_tokens_per_s})
    if config.backend == "vllm":
        del engine, model
        record["vllm"] = _vllm_results(config, tokenizer, stock, log)
    if config.json:
        print(json.dumps(record))
    else:
        print(f"sparse / dense: {result.sparse_over_dense:.2f}x", end="")
        print(f"   dense / transformers generate: {result.dense_over_hf:.2f}x" if result.hf_tokens_per_s else "")
        if config.backend == "vllm":
            v = record["vllm"]
            print(f"vLLM sparse / vLLM dense: {v['sparse_over_dense']:.2f}x", end="")
            print(f"   vLLM dense (plugin) / stock vLLM: {v['dense_over_stock']:.2f}x" if stock else "")
        if config.predict:
            _print_predicted(record["predicted"], config.machine.hardware)
    return 0


def _run_exact(config: BenchConfig, engine: RolloutEngine, stock: float | None, log) -> int:
    """Dense, sparse and exact decode on real text, alternated (our engine, then with --backend vllm inside vLLM);
    one JSON object or a summary line."""
    result = run_exact_benchmark(engine, config.sparse.parsed_schedule, config.sparse.draft_tokens, config.context,
                                 config.batch, config.steps, config.repeats, config.seed, log=log,
                                 exact_rule=config.exact_rule)
    record = {**dataclasses.asdict(result), "config": to_nested(config), "machine": machine_info(engine.device),
              "date": datetime.date.today().isoformat()}
    if config.backend == "vllm":
        record["vllm"] = _vllm_exact_results(config, engine.tokenizer, stock, log)
    if config.predict:
        rates = {"dense": result.dense_tokens_per_s, "sparse": result.sparse_tokens_per_s,
                 "exact": result.exact_tokens_per_s}
        record["predicted"] = _predicted(config, {name: config.batch / rate for name, rate in rates.items()},
                                         (result.coupled_acceptance, config.sparse.draft_tokens))
    if config.json:
        print(json.dumps(record))
    else:
        same = (f"   identical to dense: {result.identical_sequences} of {result.sequences} sequences"
                if config.exact_rule == "coupled" else "   (residual rule: the dense distribution, not its tokens)")
        print(f"sparse / dense: {result.sparse_over_dense:.2f}x   exact / dense: {result.exact_over_dense:.2f}x "
              f"({result.tokens_per_verify:.2f} tokens per verification){same}")
        if config.backend == "vllm":
            v = record["vllm"]
            print(f"   in vLLM, greedy: sparse / dense {v['sparse_over_dense']:.2f}x, exact / dense "
                  f"{v['exact_over_dense']:.2f}x ({v['tokens_per_verify']:.2f} tokens per verification, "
                  f"{v['identical_sequences']} of {v['sequences']} identical to dense)"
                  + (f"; plugin dense / stock vLLM {v['dense_over_stock']:.2f}x" if stock else ""))
        if config.predict:
            _print_predicted(record["predicted"], config.machine.hardware)
    return 0


def _vllm_setup(config: BenchConfig):
    """(model directory, KV cache GiB, max model length, benchmark arguments) of the vLLM runs."""
    import os

    from sparrow.rollout.vllm_backend import kv_cache_gib_for, model_directory

    directory = model_directory(config.model.name)
    length = config.context + config.steps
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # the benchmark may decode past the trained context
    args = {"context": config.context, "batch": config.batch, "steps": config.steps, "repeats": config.repeats,
            "warmup": config.warmup, "seed": config.seed}
    return directory, kv_cache_gib_for(directory, config.batch * length, config.model.dtype), length, args


_PROGRESS = "SPARROW-PROGRESS "  # the stock child's progress lines, among vLLM's own on its stderr


def _stock_vllm(config: BenchConfig, log) -> float:
    """Dense decode tokens/s of stock vLLM, in a child process where the plugin is not configured; the child's
    progress lines are passed on as they come (its prefill of every prompt takes minutes on a CPU)."""
    import collections
    import os
    import subprocess
    import sys
    import tempfile

    from sparrow.vllm.env import ENV_NAMES

    directory, gib, length, args = _vllm_setup(config)
    child = ("import json, sys\n"
             "from sparrow.bench_vllm import run_vllm_benchmark\n"
             "from sparrow.models import load_model\n"
             "from sparrow.rollout.vllm_backend import VLLMBackend\n"
             "from sparrow.vllm.copied_prefill import kv_transfer_config\n"
             "if __name__ == '__main__':\n"
             "    d, gib, dtype, length, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), "
             "json.loads(sys.argv[5])\n"
             "    _, tok = load_model(d)\n"
             "    b = VLLMBackend(d, tok, dtype=dtype, kv_cache_gib=gib, plugin=False, log=lambda m: None,\n"
             "                    max_model_len=length, kv_transfer_config=kv_transfer_config())\n"
             f"    r = run_vllm_benchmark(b, None, log=lambda m: print({_PROGRESS!r} + m, file=sys.stderr, flush=True), "
             "**args)\n"
             "    print('RESULT' + json.dumps(r.dense_tokens_per_s))\n")
    log(f"stock vLLM (child process), in {config.model.dtype} (--dtype):")
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    last = collections.deque(maxlen=20)
    with tempfile.TemporaryFile("w+") as out:
        with subprocess.Popen([sys.executable, "-c", child, str(directory), str(gib), config.model.dtype, str(length),
                               json.dumps(args)], env=env, stdout=out, stderr=subprocess.PIPE, text=True) as run:
            for line in run.stderr:
                if line.startswith(_PROGRESS):
                    log(" stock: " + line[len(_PROGRESS):].rstrip())
                elif line.strip():
                    last.append(line.rstrip())
        if run.returncode != 0:
            raise SparrowError(f"the stock vLLM benchmark failed: {list(last)[-1:]}")
        out.seek(0)
        stock = json.loads(out.read().split("RESULT")[-1])
    log(f" stock: {stock:8.1f} tokens/s")
    return stock


def _vllm_results(config: BenchConfig, tokenizer, stock: float, log) -> dict:
    """vLLM with the plugin in this process, dense and under the schedule, next to stock vLLM's dense rate."""
    from sparrow.rollout.vllm_backend import VLLMBackend
    from sparrow.vllm.copied_prefill import kv_transfer_config

    directory, gib, length, args = _vllm_setup(config)
    log("vLLM with Sparrow's plugin:")
    blocks = {"block_size": config.block_size} if config.block_size else {}
    backend = VLLMBackend(directory, tokenizer, config.sparse.config(), dtype=config.model.dtype, kv_cache_gib=gib,
                          max_model_len=length, log=lambda m: None, kv_transfer_config=kv_transfer_config(),
                          **blocks)
    try:
        result = run_vllm_benchmark(backend, config.sparse.parsed_schedule, log=log, **args)
    finally:
        backend.close()
    return {"stock_dense_tokens_per_s": stock, "dense_tokens_per_s": result.dense_tokens_per_s,
            "sparse_tokens_per_s": result.sparse_tokens_per_s,
            "sparse_over_dense": result.sparse_tokens_per_s / result.dense_tokens_per_s,
            "dense_over_stock": None if stock is None else result.dense_tokens_per_s / stock,
            "prefill_s": result.prefill_s, "prefill_copied": result.prefill_copied}


def _vllm_exact_results(config: BenchConfig, tokenizer, stock: float | None, log) -> dict:
    """The plugin's dense and sparse decode and exact mode inside vLLM (two engines: vLLM fixes speculative decoding
    when it starts), next to stock vLLM's dense rate."""
    from sparrow.rollout.vllm_backend import VLLMBackend

    directory, gib, length, args = _vllm_setup(config)
    blocks = {"block_size": config.block_size} if config.block_size else {}
    log("vLLM with Sparrow's plugin, and in exact mode (a second engine, the drafter's copy of the model and cache):")
    plain = VLLMBackend(directory, tokenizer, config.sparse.config(), dtype=config.model.dtype, kv_cache_gib=gib,
                        max_model_len=length, log=lambda m: None, **blocks)
    exact = VLLMBackend(directory, tokenizer, config.sparse.config(), dtype=config.model.dtype,
                        kv_cache_gib=2 * gib, max_model_len=length, log=lambda m: None,
                        draft_tokens=config.sparse.draft_tokens, **blocks)
    try:
        result = run_vllm_exact_benchmark(plain, exact, config.sparse.parsed_schedule, config.sparse.draft_tokens,
                                          log=log, **args)
    finally:
        plain.close()
        exact.close()
    return {**dataclasses.asdict(result), "stock_dense_tokens_per_s": stock,
            "dense_over_stock": None if stock is None else result.dense_tokens_per_s / stock}


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="measure decode throughput, dense vs sparse vs transformers (and vLLM)")
    add_config_options(parser, BenchConfig)
    parser.set_defaults(run=run)
