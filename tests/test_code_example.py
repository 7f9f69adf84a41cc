"""The code reward's example (examples/code-tasks.jsonl, examples/smollm2-code.yaml): every task's tests pass a
correct program and fail a wrong one inside the sandbox, and the config trains end to end with the code reward."""

import json
from pathlib import Path

import pytest

from sparrow.rewards import code_results

TASKS = Path("examples/code-tasks.jsonl")
SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "reverse_words": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
    "is_palindrome": "def is_palindrome(s):\n    return s == s[::-1]\n",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
    "factorial": "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n        result *= k\n"
                 "    return result\n",
    "max_of_list": "def max_of_list(xs):\n    best = xs[0]\n    for x in xs[1:]:\n"
                   "        best = x if x > best else best\n    return best\n",
    "fizzbuzz": "def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else "
                "'Buzz' if n % 5 == 0 else str(n)\n",
    "square_sum": "def square_sum(n):\n    return sum(k * k for k in range(1, n + 1))\n",
}


def _rows() -> list[dict]:
    return [json.loads(line) for line in TASKS.read_text().splitlines()]


def _function(row: dict) -> str:
    return row["prompt"][0]["content"].split("`")[1].split("(")[0]


def test_every_task_passes_a_correct_program_and_fails_a_wrong_one_in_the_sandbox():
    rows = _rows()
    assert sorted(_function(r) for r in rows) == sorted(SOLUTIONS)
    prompts = [r["prompt"] for r in rows]
    tests = [r["tests"] for r in rows]
    right = [f"Here it is:\n```python\n{SOLUTIONS[_function(r)]}```" for r in rows]
    wrong = [f"```python\ndef {_function(r)}(*args):\n    return None\n```" for r in rows]
    assert [r.reward for r in code_results(prompts, right, tests, workers=2)] == [1.0] * len(rows)
    assert [r.reward for r in code_results(prompts, wrong, tests, workers=2)] == [0.0] * len(rows)


def test_the_code_config_trains_with_the_code_reward(tmp_path):
    """The example's settings with a tiny model in place of SmolLM2 (a random model writes no passing program)."""
    from sparrow.cli import main

    out = tmp_path / "code"
    assert main(["train", "--config", "examples/smollm2-code.yaml", "--model", "tiny-qwen3", "--steps", "1",
                 "--max-new-tokens", "16", "--schedule", "const:48", "--bin-size", "64",
                 "--output-dir", str(out)]) == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # the first token after the dense prefill records the prompt's length, every later one the budget of 48
    assert row["reward/mean"] == pytest.approx(0.0) and 48 < row["rollout/kv_budget_mean"] < min(row["prompts/length"])
