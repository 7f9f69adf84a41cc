"""pass@k against hand values and brute force, and the eval command on a tiny model."""

import itertools
import json

import pytest

from sparrow.cli import main
from sparrow.errors import SparrowError
from sparrow.evaluation import pass_at_k


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
    code = main(["eval", "--model", "tiny-llama", "--data", str(data), "--k", "4", "--max-new-tokens", "4",
                 "--schedule", "const:48", "--reward", "examples/toy_reward.py:byte_mean", "--threshold", "0.3",
                 "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["examples"] == 3 and 0 <= result["mean@4"] <= 1
    assert 0 <= result["pass@1"] <= result["pass@2"] <= result["pass@4"] <= 1
