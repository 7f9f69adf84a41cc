"""examples/trl_grpo_sparse.py: TRL's GRPOTrainer through `SparrowGRPOTrainer`, vLLM colocated on CPU decoding
sparsely through Sparrow's plugin, on a tiny random Llama with head size 32 (what vLLM's CPU backend takes): two
GRPO steps under the adaptive schedule, whose first step's verdict moves the budget for the second."""

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
def test_two_adaptive_grpo_steps_log_the_exact_tail_and_the_second_decodes_under_the_moved_budget(tmp_path):
    model = save_tiny_for_vllm(tmp_path / "tiny-llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARROW_VLLM_")}
    env.update(PYTHONPATH=str(ROOT))
    # tau 0.999 is above this model's p5 at 512 tokens: with patience 1 the first step moves the budget up a rung
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_grpo_sparse.py"), "--model", str(model), "--schedule",
         "adaptive", "--adaptive-start", "const:512", "--tau", "0.999", "--adaptive-patience", "1",
         "--adaptive-min-tokens", "20", "--steps", "2", "--prompt-tokens", "520", "--num-generations", "4",
         "--max-completion-length", "16", "--reward", str(ROOT / "examples" / "toy_reward.py:byte_mean"),
         "--output-dir", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("SPARROW_TRL ")]
    found = {k: v for r in reports for k, v in r.items() if k not in ("log", "warning")}
    steps = [r["log"] for r in reports if "log" in r and "loss" in r["log"]]
    warnings = [r["warning"] for r in reports if "warning" in r]

    assert found["prompt_tokens"]["longest"] > 1024  # a prompt longer than the second rung
    # the schedule in force, as the plugin reported it: version 1 at 512 tokens, then the moved version 2 at 1024
    assert [(s["sparrow/schedule_version"], s["adaptive/bin_0/budget"]) for s in steps] == [(1, 512), (2, 1024)]
    assert [w["step"] for w in warnings if "budget up to 1024" in w["message"]] == [1]
    assert any(w["step"] == 2 and "budget up to 2048" in w["message"] for w in warnings)
    for step in steps:  # the exact tail of every rollout token of the step, below tau with its whole interval
        assert 60 <= step["mismatch/exact/tokens"] <= 64
        assert 0.5 < step["mismatch/exact/p5"] < step["mismatch/exact/mean"] <= 1
        assert step["mismatch/bin_0/exact_p5_high"] < 0.999 and step["mismatch/warnings"] == 2
        assert step["time/sparrow_monitor_s"] > 0
    # 4 completions, 15 decode steps each past the prompt, in the two sparse layers of four, both steps
    assert [s["calls"] for s in found["sparse_decode"]["per_step"]] == [30, 30]
    assert found["sparse_decode"]["requests"] >= 2 * 2 * 15 * 4 * 0.9
    first = steps[0]
    assert math.isfinite(first["loss"]) and first["reward_std"] > 0
    assert math.isfinite(first["grad_norm"]) and first["grad_norm"] > 0
    # TRL's truncated IS ratios stay on, on the sparse rollouts, capped at --tis-cap 2
    assert first["sampling/sampling_logp_difference/mean"] > 1e-2
    assert 0 < first["sampling/importance_sampling_ratio/min"] <= first["sampling/importance_sampling_ratio/max"] <= 2
    status = json.loads((tmp_path / "run" / "sparrow" / "schedule.in-force.json").read_text())
    assert (status["version"], status["bins"], status["refused"]) == (2, [{"start": 0, "kv_budget": 1024}], None)
