"""Correctness and speed of the attention, engine and trainer on one device (for a lent GPU: --device cuda).

Checks on tiny-qwen3, each printed PASS/FAIL with its number: dense greedy decode equals transformers
`generate`; a budget covering the sequence gives the dense logits; teacher-forced sparse log-probs equal the
decode-time ones under an aggressive schedule; two GRPO steps (examples/tiny.yaml) and two DistillSparse steps
(examples/tiny-distill.yaml) run. Then, unless --no-bench, the SmolLM2 decode benchmark (dense vs sparse vs
transformers). Exit status 1 if any check fails. Run from the repository root:

    .venv/bin/python scripts/device_check.py --device cuda --out runs/device-check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from transformers.utils.logging import disable_progress_bar

from sparrow.attention import SparseConfig
from sparrow.attention.teacher_forced import sparse_forward
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.measure import lockstep_acceptance, teacher_forced_acceptance
from sparrow.models import load_model, resolve_device
from sparrow.rl.config import TrainConfig
from sparrow.rl.trainer import train
from sparrow.schedules import DENSE, const, steps
from sparrow.typed_config import build, flatten_mapping

RESULTS: list[dict] = []


def check(name: str, value: float, limit: float) -> None:
    ok = value <= limit
    RESULTS.append({"check": name, "value": value, "limit": limit, "ok": ok})
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {value:.3g} (limit {limit:g})", flush=True)


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
    greedy = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, greedy, DENSE)
    mismatched = 0
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt], device=device), max_new_tokens=40, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        mismatched += int(ref[0, len(prompt):].tolist() != out.token_ids)
    check("dense greedy vs transformers generate: sequences that differ", mismatched, 0)

    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    with torch.no_grad():
        dense = model(input_ids=padded(seqs, device)).logits
        covering = sparse_forward(model, padded(seqs, device), lengths, const(256)).logits
    diff = max(float((covering[r, : len(s)] - dense[r, : len(s)]).abs().max()) for r, s in enumerate(seqs))
    check("covering budget vs dense: max |logit difference|", diff, 1e-3)

    schedule = steps(100, [64, 80, 96])
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=48, seed=7, ignore_eos=True), schedule)
    seqs = [o.prompt_token_ids + o.token_ids for o in sampled]
    with torch.no_grad():
        logp = torch.log_softmax(sparse_forward(model, padded(seqs, device), lengths, schedule).logits.float(), -1)
    worst = 0.0
    for row, out in enumerate(sampled):
        p, n = len(out.prompt_token_ids), len(out.token_ids)
        got = logp[row, p - 1: p - 1 + n].gather(-1, torch.tensor(out.token_ids, device=device)[:, None])
        worst = max(worst, float((got.squeeze(-1).cpu() - torch.tensor(out.logprobs)).abs().max()))
    check("teacher-forced vs decode sparse log-probs: max |difference|", worst, 2e-3)

    forced = teacher_forced_acceptance(model, sampled, schedule, SparseConfig(), temperature=1.0)
    replay = max(max(abs(a - b) for a, b in zip(alphas, lockstep_acceptance(engine, out, schedule, 1.0)))
                 for alphas, out in zip(forced, sampled))
    check("exact acceptance, teacher-forced vs lockstep replay: max |difference|", replay, 1e-4)


def training_checks(device: torch.device, out: Path) -> None:
    for name in ("tiny", "tiny-distill"):
        path = f"examples/{name}.yaml"
        values = flatten_mapping(TrainConfig, yaml.safe_load(Path(path).read_text()), path)
        config = build(TrainConfig, {**values, "device": str(device), "output_dir": str(out / name)})
        clock = time.perf_counter()
        history = train(config, log=lambda *_: None)
        check(f"{name}.yaml on {device}: steps missing", config.grpo.steps - len(history), 0)
        print(f"      {time.perf_counter() - clock:.1f} s, rewards {[round(h['reward/mean'], 3) for h in history]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="runs/device-check")
    parser.add_argument("--no-bench", action="store_true", help="skip the SmolLM2 benchmark")
    parser.add_argument("--bench-context", type=int, default=8150, help="cached tokens in the benchmark")
    args = parser.parse_args()
    device = resolve_device(args.device)
    disable_progress_bar()
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    out = Path(args.out)
    attention_checks(device)
    training_checks(device, out)
    if not args.no_bench:
        for batch in (8, 32):
            command = [sys.executable, "-c", "import sys; from sparrow.cli import main; sys.exit(main())", "bench",
                       "--model", "smollm2-135m", "--device", str(device), "--context", str(args.bench_context),
                       "--batch", str(batch), "--schedule", "const:1024",
                       "--steps", "32", "--repeats", "3", "--json"]
            result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            RESULTS.append({"bench": result})
            print(f"bench {args.bench_context} cached tokens, batch {batch}: dense {result['dense_tokens_per_s']:.0f} tok/s, sparse "
                  f"{result['sparse_tokens_per_s']:.0f}, transformers {result['hf_tokens_per_s']:.0f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")
    return 0 if all(r.get("ok", True) for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
