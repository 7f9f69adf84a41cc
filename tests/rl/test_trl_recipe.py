"""examples/trl_grpo_sparse.py: one GRPO step of TRL's GRPOTrainer with vLLM (colocated, CPU) decoding sparsely
through Sparrow's plugin, on a tiny random Llama with head size 32 (what vLLM's CPU backend takes)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import save_tiny_for_vllm

pytest.importorskip("trl")
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_grpo_step_runs_with_sparse_vllm_rollouts_and_trls_importance_sampling(tmp_path):
    model = save_tiny_for_vllm(tmp_path / "tiny-llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARROW_VLLM_")}
    env.update(SPARROW_VLLM_DENSE_LAYERS="0,1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_grpo_sparse.py"), "--model", str(model), "--schedule",
         "const:64", "--steps", "1", "--prompt-tokens", "128", "--max-completion-length", "16",
         "--reward", str(ROOT / "examples" / "toy_reward.py:byte_mean"), "--output-dir", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("SPARROW_TRL ")]
    found = {k: v for r in reports for k, v in r.items() if k != "log"}
    logs = [r["log"] for r in reports if "log" in r]

    assert found["plugin"]["bins"] == [[0, 64]] and found["plugin"]["dense_layers"] == [0, 1]
    assert found["prompt_tokens"]["longest"] >= 128 + 64  # byte tokens: the ledger grows by whole entries
    # 4 completions, 15 decode steps each past the prompt at a 64-token budget, in the two sparse layers of four
    sparse = found["sparse_decode"]
    assert sparse["calls"] >= 2 * 15 and sparse["requests"] >= 2 * 15 * 4 * 0.9
    step = next(row for row in logs if "loss" in row)
    assert math.isfinite(step["loss"]) and step["reward_std"] > 0
    assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    # TRL's truncated IS ratios on the sparse rollouts: their log-probs differ from the dense policy's (by ~1e-6
    # under SPARROW_VLLM_SCHEDULE=dense, measured), and the per-token ratios are capped at --tis-cap 2
    assert step["sampling/sampling_logp_difference/mean"] > 1e-2
    assert 0 < step["sampling/importance_sampling_ratio/min"] <= step["sampling/importance_sampling_ratio/max"] <= 2
