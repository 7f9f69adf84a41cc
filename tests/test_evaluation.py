"""pass@k against hand values and brute force, and the eval command on a tiny model."""

import itertools
import json

import pytest

from sparrow.cli import main
from sparrow.errors import SparrowError
from sparrow.evaluation import interval_text, pass_at_k, reward_range


@pytest.mark.parametrize("n, c, k", [(5, 2, 1), (5, 2, 2), (6, 1, 3), (4, 0, 2), (4, 4, 1), (7, 3, 4)])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_pass(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert abs(pass_at_k(n, c, k) - sum(any(s) for s in subsets) / len(subsets)) < 1e-12


def test_pass_at_1_is_the_pass_rate_and_bad_arguments_fail():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(SparrowError):
        pass_at_k(3, 4, 1)
    with pytest.raises(SparrowError):
        pass_at_k(3, 1, 4)


def test_eval_command_reports_mean_and_pass_at_k(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(3)))
    results = {}
    for threshold in ("0", "2"):  # byte_mean lies in [0, 1]: every sample passes at 0, none at 2
        code = main(["eval", "--model", "tiny-llama", "--data", str(data), "--k", "4", "--max-new-tokens", "4",
                     "--schedule", "const:48", "--reward", "examples/toy_reward.py:byte_mean", "--threshold",
                     threshold, "--json"])
        assert code == 0
        results[threshold] = json.loads(capsys.readouterr().out)
    every, none = results["0"], results["2"]
    assert every["examples"] == 3 and every["mean@4"] == none["mean@4"]  # same seed, same samples
    assert [every[f"pass@{k}"] for k in (1, 2, 4)] == [1.0, 1.0, 1.0]
    assert [none[f"pass@{k}"] for k in (1, 2, 4)] == [0.0, 0.0, 0.0]
    assert sum(every["per_example_mean"]) / 3 == pytest.approx(every["mean@4"]) and len(every["prompt_length"]) == 3


def test_eval_in_exact_mode_scores_the_dense_policys_own_samples(capsys):
    base = ["eval", "--model", "tiny-qwen3", "--data", "examples/tiny-data.jsonl", "--k", "3",
            "--max-new-tokens", "24", "--reward", "examples/toy_reward.py:byte_mean", "--json"]
    results = {}
    for name, extra in {"dense": ["--schedule", "dense"], "sparse": ["--schedule", "const:48"],
                        "exact": ["--schedule", "const:48", "--rollout-mode", "exact", "--draft-tokens", "3"]}.items():
        assert main(base + extra) == 0
        results[name] = json.loads(capsys.readouterr().out)
    assert results["exact"]["per_example_mean"] == results["dense"]["per_example_mean"]
    assert results["sparse"]["per_example_mean"] != results["dense"]["per_example_mean"]
    assert results["exact"]["rollout_mode"] == "exact"


def test_built_in_rewards_bound_the_interval_and_user_rewards_do_not():
    def fn(*_, **__):
        return []

    assert reward_range([("first_number", fn, 1.0)]) == (0.0, 1.0)
    assert reward_range([("number_f1", fn, 2.0), ("math", fn, -0.5)]) == (-0.5, 2.0)
    assert reward_range([("first_number", fn, 1.0), ("my.module:score", fn, 1.0)]) is None
    assert interval_text({"examples": 2, "mean_low": float("nan"), "mean_high": float("nan")}) == (
        "2 prompts: too few for an interval (needs 3)")
    assert interval_text({"examples": 4, "mean_low": 0.886, "mean_high": 1.0}) == "95% interval 0.886..1.000"


def test_eval_on_two_prompts_says_they_are_too_few_for_an_interval(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(2)))
    args = ["eval", "--model", "tiny-llama", "--data", str(data), "--k", "2", "--max-new-tokens", "3",
            "--reward", "first_number"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "interval: 2 prompts: too few for an interval (needs 3)" in out and "nan" not in out
    assert "[eval 0:00] sampling 2 prompts x 2 (sparse rollouts, schedule dense), then scoring with first_number" in err
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # progress stays on stderr
    assert result["reward_range"] == [0.0, 1.0] and result["examples"] == 2
