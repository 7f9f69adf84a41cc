"""generate()'s argument checks: one function, shared by the native engine, the vLLM backend and the Ray backend."""

import pytest

from sparrow.engine.arguments import check_generate
from sparrow.errors import SparrowError


@pytest.mark.parametrize("args, message", [
    ((["a"], 0, None), "num_samples must be >= 1, got 0"),
    (([], 1, None), "no prompts given"),
    ((["a", "b"], 1, [0]), "prompt_keys has 1 keys for 2 prompts"),
    ((["a", "b"], 1, [4, 4]), "prompt key 4 is given twice"),
    ((["a"], 1, [-1]), r"prompt keys must be integers in \[0, 2\*\*32\), got -1"),
    ((["a"], 1, None, 65), r"draft_tokens must be an integer in \[1, 64\] or 0 \(auto\), got 65"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    with pytest.raises(SparrowError, match=message):
        check_generate(*args)


def test_keys_default_to_the_prompt_indices():
    assert check_generate(["a", "b", "c"], 2, None, 0) == [0, 1, 2]
    assert check_generate(["a", "b"], 1, [7, 3]) == [7, 3]


def test_every_backend_calls_the_one_check():
    from sparrow.engine import engine
    from sparrow.rollout import ray_backend, vllm_backend

    for module in (engine, ray_backend, vllm_backend):
        assert module.check_generate is check_generate
