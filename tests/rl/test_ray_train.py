"""Commands with their rollouts on Ray workers: a GRPO run gives the same metrics and final weights without Ray,
with 1 worker and with 2, same seed; eval and profile give the same numbers. The commands share one local Ray
(2 CPUs) that this module opens: a command that finds a session open attaches to it and leaves it open (one that
opens its own closes it: tests/rollout/test_ray.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from sparrow.cli import main

ray = pytest.importorskip("ray")

# one prompt per wave (max_batch_size = num_generations): a worker's waves are then the waves of one process, so
# on as many threads the floats match bit for bit (waves of several prompts pad to their longest prompt, and MKL's
# AVX2 products sum in an order that depends on the thread count; either moves log-probs by ~1e-6, see
# docs/scale-out.md)
ARGS = ["--model", "tiny-llama", "--reward", "tests.rl.test_trainer:byte_mean", "--steps", "2", "--prompts-per-step",
        "3", "--num-generations", "2", "--max-batch-size", "2", "--max-new-tokens", "12", "--learning-rate", "1e-3",
        "--schedule", "const:48", "--micro-batch-size", "4", "--bin-size", "64", "--seed", "3"]


def _run(tmp_path, data, name, *extra):
    out = tmp_path / name
    assert main(["train", "--data", str(data), "--output-dir", str(out), *ARGS, *extra]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(out / "checkpoint-2" / "model.safetensors")


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "rollout/"))}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture
def one_thread():
    """This process on one torch thread, as the workers of `--cpus-per-worker 1`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_rollout_workers_give_the_same_run_as_one_process(tmp_path, one_thread):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "abc " * (10 + 3 * i), "answer": str(i)}) + "\n"
                            for i in range(6)))
    alone, weights = _run(tmp_path, data, "native")
    rows, other = _run(tmp_path, data, "ray2", "--rollout-workers", "2", "--cpus-per-worker", "1")
    assert [_comparable(r) for r in rows] == [_comparable(r) for r in alone]
    assert all(torch.equal(weights[k], other[k]) for k in weights)
    assert rows[0]["rollout/sync_bytes"] > 0 and "rollout/worker_1_tokens_per_s" in rows[0]
    # one worker on two threads: the same run to float rounding (bit for bit on AVX-512, not with MKL's AVX2)
    rows, other = _run(tmp_path, data, "ray1", "--rollout-workers", "1", "--cpus-per-worker", "2")
    for mine, theirs in zip(rows, alone, strict=True):
        mine, theirs = _comparable(mine), _comparable(theirs)
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            numeric = isinstance(value, float)
            assert mine[key] == (pytest.approx(value, rel=1e-4, abs=1e-5) if numeric else value), key
    # Adam divides by the gradient's running size, so near-zero gradients carry the rounding up to ~lr (1e-3)
    assert max((weights[k] - other[k]).abs().max().item() for k in weights) < 1e-4
    assert ray.is_initialized()  # the session the commands found open stays open


def test_eval_and_profile_on_a_ray_worker_equal_them_in_this_process(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "abc " * (10 + 3 * i), "answer": str(i)}) + "\n"
                            for i in range(3)))
    common = ["--model", "tiny-llama", "--max-new-tokens", "8", "--seed", "1"]
    results = []
    for extra in ([], ["--rollout-workers", "1"]):
        assert main(["eval", "--data", str(data), "--reward", "tests.rl.test_trainer:byte_mean", "--k", "2",
                     "--schedule", "const:48", "--json", *common, *extra]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0] == results[1] and results[0]["samples_per_example"] == 2
    profiles = []
    for name, extra in (("native", []), ("ray", ["--rollout-workers", "1"])):
        out = tmp_path / name
        assert main(["profile", "--prompts", str(data), "--schedules", "const:48", "--samples-per-prompt", "2",
                     "--bin-size", "32", "--out", str(out), *common, *extra]) == 0
        profiles.append(json.loads((out / "profile.json").read_text())["schedules"]["const:48"]["overall"])
    assert profiles[0] == profiles[1]
    assert ray.is_initialized()  # the session the commands found open stays open
