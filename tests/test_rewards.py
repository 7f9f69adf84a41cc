"""Reward functions: math-verify scoring and its time limit, code runs and their limits, custom loading, scoring.

The code reward's sandbox and reward-hacking cases are in test_sandbox.py."""

import os
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from sparrow.errors import SparrowError
from sparrow.rewards import (
    REWARDS,
    RewardError,
    code_reward,
    extract_program,
    first_number_reward,
    last_boxed,
    load_reward,
    math_reward,
    run_code,
    score,
)
from sparrow.rewards import math as math_module
from sparrow.rewards.math import math_score

# --- math -------------------------------------------------------------------------------------------------------


def test_math_reward_plain_number_and_latex_fraction():
    rewards = math_reward(
        ["p"] * 4,
        ["so \\boxed{42}", "\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{41}"],
        answer=["42", "0.5", "\\frac{1}{2}", "42"],
    )
    assert rewards == [1.0, 1.0, 1.0, 0.0]


def test_math_reward_numeric_gold_and_nested_braces():
    assert last_boxed("x \\boxed{\\frac{\\sqrt{2}}{2}} y") == "\\frac{\\sqrt{2}}{2}"
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert math_score("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 1.0
    assert math_score("\\boxed{\\{2, 1\\}}", "\\{1,2\\}") == 1.0
    assert math_score("\\boxed{42}", 42) == 1.0


def test_math_reward_no_boxed_and_last_boxed_wins():
    assert math_reward(None, ["the answer is 42", "\\boxed{42"], answer=["42", "42"]) == [0.0, 0.0]
    assert math_score("first \\boxed{41}, no wait: \\boxed{42}", "42") == 1.0
    assert math_score("first \\boxed{42}, no wait: \\boxed{41}", "42") == 0.0


def test_math_reward_off_main_thread_and_bad_inputs():
    out = []
    worker = threading.Thread(target=lambda: out.append(math_reward(None, ["\\boxed{\\frac{1}{2}}"], answer=["0.5"])))
    worker.start()
    worker.join()
    assert out == [[1.0]]
    with pytest.raises(SparrowError, match="2 answers"):
        math_reward(None, ["\\boxed{1}"], answer=["1", "2"])
    with pytest.raises(SparrowError, match="ground-truth answer None"):
        math_score("\\boxed{1}", None)


PATHOLOGICAL = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{(10^{10})!}", "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"]


def test_pathological_answers_time_out_off_the_main_thread_and_the_records_say_so():
    out = []
    completions = [*PATHOLOGICAL, "\\boxed{42}"]
    worker = threading.Thread(target=lambda: out.append(math_reward(None, completions, ["42"] * 4, timeout=3)))
    start = time.monotonic()
    worker.start()
    worker.join()
    assert time.monotonic() - start < 7.0
    assert [(float(v), v.status) for v in out[0]] == [(0.0, "timeout")] * 3 + [(1.0, "ok")]
    scored = score([("math", lambda p, c, **_: out[0], 1.0)], ["p"] * 4, completions)
    assert [r["status"] for r in scored.records["math"]] == ["timeout"] * 3 + ["ok"]


def test_a_check_stuck_past_its_time_is_killed_and_the_pool_recovers(monkeypatch):
    monkeypatch.setattr(math_module, "_soft_seconds", lambda timeout: 60)  # math-verify's own limits never fire
    start = time.monotonic()
    values = math_reward(None, [PATHOLOGICAL[0], "\\boxed{7}"], ["42", "7"], timeout=2)
    assert time.monotonic() - start < 4.0
    assert [(float(v), v.status) for v in values] == [(0.0, "timeout"), (1.0, "ok")]
    assert math_reward(None, ["\\boxed{1/2}"], ["0.5"]) == [1.0]


# --- code: scoring ----------------------------------------------------------------------------------------------

DOUBLER = "Here you go:\n```python\nprint(int(input()) * 2)\n```\n"


def test_first_number_reward_takes_only_the_first_number():
    completions = ["The pass key is 73154.", "The pass key is 1311, or maybe 73154.", "Entry 12: 73154",
                   "no digits here", "It is 73,154", "73154.0"]
    assert first_number_reward([""] * 6, completions, ["73154"] * 6) == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert load_reward("first_number") is first_number_reward


def test_code_reward_stdin_stdout_fraction():
    tests = [{"input": "2\n", "output": "4"}, {"input": "3", "output": " 6\n"}, {"input": "5", "output": "11"}]
    assert code_reward(["p"], [DOUBLER], tests=[tests]) == pytest.approx([2 / 3])
    result = run_code(extract_program(DOUBLER), tests, timeout=5.0)
    assert (result.passed, result.total, result.status) == (2, 3, "ok")


def test_code_reward_assert_style_and_last_block():
    completion = "```python\ndef f(x):\n    return x\n```\nbetter:\n```python\ndef f(x):\n    return x + 1\n```"
    assert extract_program(completion).strip() == "def f(x):\n    return x + 1"
    rewards = code_reward(["p", "p"], [completion, "def f(x): return x"], tests=["assert f(1) == 2"] * 2)
    assert rewards == [1.0, 0.0]


def test_code_reward_rejects_malformed_tests():
    with pytest.raises(SparrowError, match="test case 0"):
        run_code("print(1)", [{"stdin": "", "output": "1"}])
    with pytest.raises(SparrowError, match="non-empty list"):
        run_code("print(1)", [])
    with pytest.raises(SparrowError, match="not valid Python"):
        run_code("print(1)", "assert f(1) ==")


def test_each_top_level_assert_is_a_test_and_usual_test_styles_work():
    program = textwrap.dedent("""
        from collections import Counter, namedtuple
        LIMIT = 10 ** 30
        Point = namedtuple("Point", "x y")
        class ListNode:
            def __init__(self, val=0, next=None):
                self.val, self.next = val, next
        class Solution:
            def reverse(self, head):
                prev = None
                while head:
                    head.next, prev, head = prev, head, head.next
                return prev
        def evens(n):
            yield from range(0, n, 2)
        def sort_in_place(items):
            items.sort()
        def counts(text):
            return Counter(text)
        def point(x):
            return Point(x, -x)
        def checked(x):
            if x < 0:
                raise ValueError("negative")
            return x ** 0.5
    """)
    tests = textwrap.dedent("""
        import math
        from solution import evens
        def to_list(node):
            out = []
            while node:
                out.append(node.val)
                node = node.next
            return out
        head = ListNode(1, ListNode(2, ListNode(3)))
        assert to_list(Solution().reverse(head)) == [3, 2, 1]
        assert list(evens(7)) == [0, 2, 4, 6] and 4 in evens(7)
        items = [3, 1, 2]
        sort_in_place(items)
        assert items == [1, 2, 3]
        assert counts("abca") == {"a": 2, "b": 1, "c": 1} and point(2) == (2, -2)
        assert math.isclose(checked(2), 1.41421356, rel_tol=1e-6) and LIMIT + 1 > 10 ** 30
        try:
            checked(-1)
            raise AssertionError("no error")
        except ValueError as error:
            assert "negative" in str(error)
        assert checked(9) == 3
        assert checked(4) == 3
    """)
    result = run_code(program, tests)
    assert (result.passed, result.total, result.status) == (6, 7, "ok"), result.stderr_tail
    assert "assert checked(4) == 3" in result.stderr_tail


# --- code: containment ------------------------------------------------------------------------------------------


def test_infinite_loop_is_killed_on_timeout():
    run_code("pass", "assert True", timeout=1.0)
    start = time.monotonic()
    result = run_code("while True:\n    pass", [{"input": "", "output": ""}], timeout=1.0)
    assert time.monotonic() - start < 2.0
    assert (result.status, result.passed) == ("timeout", 0)


def test_huge_allocation_is_refused_fast():
    start = time.monotonic()
    result = run_code("x = bytearray(2 * 1024 ** 3)\nprint(len(x))", "assert True", timeout=5.0, memory_mb=256)
    assert time.monotonic() - start < 4.0
    assert result.status != "ok" and result.reward == 0.0
    assert result.status == "memory" and "MemoryError" in result.stderr_tail


def test_ten_megabytes_of_output_are_contained():
    tracemalloc.start()
    try:
        result = run_code("import sys\nfor _ in range(10):\n    sys.stdout.write('x' * 2 ** 20)\n", "assert True")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.status == "output_limit" and result.reward == 0.0
    assert peak < 3 * 2**20
    assert len(result.stderr_tail) <= 2000


def test_writes_stay_inside_the_scratch_directory(tmp_path):
    (tmp_path / "marker").write_text("")
    program = (
        "import os, tempfile\n"
        "open('../escape.txt', 'w').write('up one')\n"
        "open('here.txt', 'w').write('cwd')\n"
        "open(os.path.expanduser('~/home.txt'), 'w').write('home')\n"
        "tempfile.NamedTemporaryFile(delete=False).write(b'tmp')\n"
        "assert os.path.realpath('../escape.txt') == '/sandbox/run-0/escape.txt'\n"
        "assert os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'] == tempfile.gettempdir()\n"
    )
    result = run_code(program, "assert True", base_dir=str(tmp_path))
    assert result.status == "ok", result.stderr_tail
    # Writes by relative path, under ~ and via tempfile land in the sandbox's scratch tmpfs, which goes with it;
    # nothing appears on the host (tests/test_sandbox.py tries absolute paths and enough ../ too).
    assert [p.name for p in tmp_path.iterdir()] == ["marker"]


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("SPARROW_TEST_SECRET", "hunter2")
    program = "import os\nassert 'SPARROW_TEST_SECRET' not in os.environ, sorted(os.environ)\n"
    assert run_code(program, "assert True").status == "ok"


def test_leftover_subprocesses_are_killed():
    marker = f"30.{os.getpid()}{time.monotonic_ns() % 10**6}"
    assert run_code(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\n", "assert True").status == "ok"

    def alive() -> bool:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    deadline = time.monotonic() + 2.0
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


def test_crashing_program():
    result = run_code("raise SystemExit(3)", [{"input": "", "output": ""}])
    assert (result.status, result.passed) == ("crash", 0)
    result = run_code("print(1/0)", "assert True")
    assert result.status == "crash" and "ZeroDivisionError" in result.stderr_tail


# --- custom loading ---------------------------------------------------------------------------------------------


def test_load_reward_builtins_module_and_file(tmp_path):
    assert load_reward("math") is math_reward and load_reward("code") is REWARDS["code"]
    assert load_reward("sparrow.rewards.math:math_reward") is math_reward
    path = tmp_path / "my_reward.py"
    path.write_text("def length(prompts, completions, **_):\n    return [float(len(c)) for c in completions]\nX = 3\n")
    fn = load_reward(f"{path}:length")
    assert fn(["p"], ["abc"]) == [3.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nonsense", "not a built-in"),
        ("no_such_module_xyz:f", "not found"),
        ("/no/such/file.py:f", "reward file '/no/such/file.py' does not exist"),
        ("{loop}:f", "reward file '.*loop.py' is a symlink loop"),
        ("{folder}:f", "reward file '.*folder.py' is a directory; expected a file"),
        ("sparrow.rewards.math:no_such_fn", "no attribute 'no_such_fn'"),
        ("{file}:missing", "no attribute 'missing'"),
        ("{file}:X", "not callable"),
    ],
)
def test_load_reward_errors(tmp_path, spec, message):
    path = tmp_path / "rewards_x.py"
    path.write_text("X = 3\n")
    (tmp_path / "loop.py").symlink_to(tmp_path / "loop.py")
    (tmp_path / "folder.py").mkdir()
    with pytest.raises(SparrowError, match=message):
        load_reward(spec.format(file=path, loop=tmp_path / "loop.py", folder=tmp_path / "folder.py"))


# --- score ------------------------------------------------------------------------------------------------------


def _const(value):
    return lambda prompts, completions, **_: [value] * len(completions)


def test_score_weights_and_per_function_values():
    result = score(
        [("math", math_reward, 1.0), ("bonus", _const(1), 0.5)],
        ["p1", "p2"],
        ["\\boxed{42}", "\\boxed{7}"],
        {"answer": ["42", "8"]},
    )
    assert result.totals == [1.5, 0.5]
    assert result.per_function == {"math": [1.0, 0.0], "bonus": [1.0, 1.0]}


def test_score_checks_lengths_and_values():
    with pytest.raises(SparrowError, match="'short' returned 1 values for 2"):
        score([("short", lambda p, c, **_: [0.0], 1.0)], ["a", "b"], ["x", "y"], {})
    with pytest.raises(SparrowError, match="'nan' returned nan"):
        score([("nan", _const(float("nan")), 1.0)], ["a"], ["x"], {})
    with pytest.raises(SparrowError, match="column 'answer' has 1 values"):
        score([("c", _const(0.0), 1.0)], ["a", "b"], ["x", "y"], {"answer": ["1"]})


def test_score_raising_reward_names_function_and_sample():
    def picky(prompts, completions, **_):
        return [1.0 / (c != "bad completion here") for c in completions]

    with pytest.raises(RewardError) as info:
        score([("picky", picky, 1.0)], ["p"] * 3, ["fine", "ok", "bad completion here"], {})
    error = info.value
    assert (error.function, error.index) == ("picky", 2)
    text = str(error)
    assert "'picky'" in text and "sample 2" in text and "bad completion here" in text and "division by zero" in text
