"""What the README promises about seeded sampling, on whatever CPU runs the suite, and again with PyTorch's and
MKL's AVX2 kernels (the kernels an AMD machine without AVX-512 runs).

With a seed, sample s of a prompt draws from its own random stream, keyed by the prompt (its content in
`sparrow generate`) and s. Its tokens are therefore those of any other batch, wave size, sample count or thread
count; its log-probs agree to float rounding (matrix products and padded attention sum in an order that depends
on the batch's shape), bit for bit when the batch's shape is the same.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparrow.cli import main
from sparrow.engine import RolloutEngine, SamplingParams
from sparrow.schedules import DENSE, const
from tests.conftest import random_prompts

ROUNDING = 1e-4  # largest log-prob gap we accept between two batch shapes (measured: about 2e-6)
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
STRICT_MKL = {"MKL_CBWR": "AVX2,STRICT"}  # MKL's reproducible mode, the README's recipe for bits across threads


def _same_samples(first, second, exact: bool = False):
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    for a, b in zip(first, second, strict=True):
        gap = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        assert gap == 0.0 if exact else gap < ROUNDING, gap


@pytest.mark.parametrize("schedule", [DENSE, const(48)], ids=["dense", "sparse"])
def test_a_prompts_samples_do_not_depend_on_the_batch(llama, schedule):
    prompts = random_prompts([30, 70, 45], seed=4)
    sampling = SamplingParams(max_new_tokens=24, seed=7, ignore_eos=True)
    engine = RolloutEngine(*llama)
    together = engine.generate(prompts, sampling, schedule, num_samples=3)
    again = engine.generate(prompts, sampling, schedule, num_samples=3)
    _same_samples(together, again, exact=True)  # the same batch: bit for bit
    alone = engine.generate(prompts[1:2], sampling, schedule, num_samples=3, prompt_keys=[1])
    _same_samples(together[3:6], alone)
    more = engine.generate(prompts[1:2], sampling, schedule, num_samples=5, prompt_keys=[1])
    _same_samples(together[3:6], more[:3])  # sample s of n is sample s of n + 2
    narrow = RolloutEngine(*llama, max_batch_size=1).generate(prompts, sampling, schedule, num_samples=3)
    _same_samples(together, narrow)


def test_a_prompts_samples_do_not_depend_on_the_thread_count(llama):
    prompts = random_prompts([40, 60], seed=6)
    sampling = SamplingParams(max_new_tokens=24, seed=2, ignore_eos=True)
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            runs.append(RolloutEngine(*llama).generate(prompts, sampling, const(48), num_samples=4))
    finally:
        torch.set_num_threads(threads)
    _same_samples(*runs, exact=os.environ.get("MKL_CBWR") == STRICT_MKL["MKL_CBWR"])


def test_generate_keys_a_prompt_by_its_content_not_its_line(tmp_path, capsys):
    texts = ["The quick brown fox", "Once upon a time there was a little", "abc " * 20, "Numbers: 1 2 3 4 5", "Hi",
             "Hi"]
    outputs = {}
    for name, lines in {"all": texts, "fewer": texts[:1] + texts[2:], "reordered": texts[::-1]}.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in lines))
        assert main(["generate", "--model", "tiny-qwen3", "--prompts", str(path), "--seed", "7", "--num-samples",
                     "3", "--temperature", "1", "--max-new-tokens", "32", "--json"]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        copies = {}
        for row in rows:  # the k-th copy of a text, for each of its samples
            text = lines[row["prompt_index"]]
            k = copies.setdefault((text, row["sample_index"]), 0)
            copies[text, row["sample_index"]] += 1
            outputs.setdefault(name, {})[text, k, row["sample_index"]] = row
    first = outputs["all"]
    assert first["Hi", 0, 0]["token_ids"] != first["Hi", 1, 0]["token_ids"]  # two copies: two streams
    for other in ("fewer", "reordered"):
        for key, row in outputs[other].items():
            assert row["token_ids"] == first[key]["token_ids"], (other, key)
            gap = max((abs(a - b) for a, b in zip(row["logprobs"], first[key]["logprobs"])), default=0.0)
            assert gap < ROUNDING


def _pytest(env: dict, *args: str) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *args],
                          cwd=root, env={**os.environ, **env}, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.skipif(all(os.environ.get(k) == v for k, v in AVX2.items()), reason="already on AVX2 kernels")
def test_the_same_holds_on_avx2_kernels():
    """This file's claims and the engine's sampling tests again, in a process that runs PyTorch's and MKL's AVX2
    code paths (skipped where this process already runs PyTorch's AVX2 kernels: it would repeat the run above);
    then the thread-count test bit for bit under MKL's reproducible mode."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        _pytest(AVX2, "tests/engine/test_determinism.py", "tests/engine/test_engine.py", "-k",
                "not avx2 and (batch or thread or content or seed or waves or finish)")
    _pytest({**AVX2, **STRICT_MKL}, "tests/engine/test_determinism.py", "-k", "thread")
