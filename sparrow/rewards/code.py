"""Code reward: run a completion's Python program against its tests in a sandbox and score the fraction passed.

The program and its tests run through ``sandbox.run`` (bubblewrap namespaces; see docs/sandbox.md) under the
judge of harness/, which keeps the tests out of the program's reach: stdin/stdout cases run the program once
per case and compare its output in the judge; assert tests run in the judge against a worker process that
executed the program, so a program that exits early, or returns an object that claims to equal everything,
passes nothing. Every program process has rlimits on address space (``memory_mb``), CPU seconds, the size of
any file written (which caps stdout and stderr) and open files, no core dumps, and a cleaned environment; one
wall-clock ``timeout`` covers all the tests of a completion, after which the remaining tests fail as "timeout".
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sparrow.errors import SparrowError
from sparrow.rewards import sandbox
from sparrow.rewards.harness.protocol import DETAIL_CHARS
from sparrow.rewards.harness.testblocks import split_tests

STATUSES = ("ok", "timeout", "crash", "memory", "output_limit", "sandbox_error")
OUTPUT_LIMIT_BYTES = 1 << 20
OPEN_FILES_LIMIT = 64
STDERR_TAIL_CHARS = DETAIL_CHARS
_PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PLAIN_BLOCK = re.compile(r"```[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeResult:
    """Outcome of one program on its tests: ``status`` is the first non-"ok" test's status, else "ok" (a test
    that ran but failed its check is "ok"); ``stderr_tail`` is the first failed test's stderr or error."""

    passed: int
    total: int
    status: str
    stderr_tail: str

    @property
    def reward(self) -> float:
        return self.passed / self.total


def extract_program(completion: str) -> str:
    """The last fenced ```python block, else the last unlabelled ``` block, else the whole completion."""
    for pattern in (_PYTHON_BLOCK, _PLAIN_BLOCK):
        blocks = pattern.findall(completion)
        if blocks:
            return blocks[-1]
    return completion


def _normalize_tests(tests) -> list[tuple[str, str]] | str:
    """Stdin/stdout cases as (input, output) pairs, or an assert block as a str; JSON-encoded lists accepted."""
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            pass
    if isinstance(tests, str):
        if not tests.strip():
            raise SparrowError("tests is an empty string; expected Python assert statements")
        try:
            split_tests(tests)
        except SyntaxError as exc:
            raise SparrowError(f"tests {tests!r:.80} are not valid Python ({exc.msg}, line {exc.lineno}); "
                               "expected assert statements") from exc
        return tests
    if not isinstance(tests, (list, tuple)) or not tests:
        raise SparrowError(
            f"tests is {tests!r:.80}; expected a non-empty list of {{'input': str, 'output': str}} or a str of asserts"
        )
    cases = []
    for i, case in enumerate(tests):
        if not (isinstance(case, dict) and isinstance(case.get("input"), str) and isinstance(case.get("output"), str)):
            raise SparrowError(f"test case {i} is {case!r:.80}; expected {{'input': str, 'output': str}}")
        cases.append((case["input"], case["output"]))
    return cases


def run_code(
    program: str,
    tests,
    timeout: float = 5.0,
    memory_mb: int = 512,
    *,
    output_limit_bytes: int = OUTPUT_LIMIT_BYTES,
    base_dir: str | None = None,
) -> CodeResult:
    """Run ``program`` on ``tests``: stdin/stdout cases (one process each), or an assert block (see
    harness/testblocks.py: each top-level assert with the statements before it is one test).

    A case passes when the program exits 0 and its output matches; an assert test passes when it runs without
    raising. ``timeout`` is wall-clock seconds for all the tests together; ``base_dir`` is where an unsandboxed
    run (see sandbox.require_sandbox) makes its temporary directory. Raises SparrowError when no sandbox is
    available and running unsandboxed was not accepted.
    """
    if not isinstance(program, str):
        raise SparrowError(f"program is a {type(program).__name__}; expected a str")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise SparrowError(f"timeout={timeout!r}; expected a positive number of seconds")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 32:
        raise SparrowError(f"memory_mb={memory_mb!r}; expected an int >= 32 (the interpreter needs room to start)")
    if isinstance(output_limit_bytes, bool) or not isinstance(output_limit_bytes, int) or output_limit_bytes < 1024:
        raise SparrowError(f"output_limit_bytes={output_limit_bytes!r}; expected an int >= 1024")
    cases = _normalize_tests(tests)
    asserts = isinstance(cases, str)
    total = len(split_tests(cases)) if asserts else len(cases)
    job = {
        "program": program,
        "cases": None if asserts else cases,
        "tests": cases if asserts else None,
        "timeout": float(timeout),
        "memory_mb": memory_mb,
        "output_limit": output_limit_bytes,
        "open_files": OPEN_FILES_LIMIT,
    }
    outcome = sandbox.run(job, base_dir)
    missing = "timeout" if outcome.killed else "sandbox_error"
    missing_detail = "the run outlived its timeout" if outcome.killed else f"harness failed: {outcome.error}"
    records = [outcome.records.get(i, {"passed": False, "status": missing, "detail": missing_detail})
               for i in range(total)]
    status = next((r["status"] for r in records if r["status"] != "ok"), "ok")
    failed = [r["detail"] for r in records if not r["passed"]]
    tail = failed[0] if failed else records[-1]["detail"]
    return CodeResult(sum(bool(r["passed"]) for r in records), total, status, str(tail)[-STDERR_TAIL_CHARS:])


def code_reward(prompts, completions, tests, timeout=5.0, memory_mb=512, workers: int = 1, **_) -> list[float]:
    """Reward function (TRL-style): fraction of each completion's tests its extracted program passes."""
    return [r.reward for r in code_results(prompts, completions, tests, timeout, memory_mb, workers)]


def code_results(prompts, completions, tests, timeout=5.0, memory_mb=512, workers: int = 1, **_) -> list[CodeResult]:
    """Like code_reward, but one CodeResult per completion, so the trainer can record what each run did
    (timeout, crash, memory, output_limit). ``workers`` > 1 runs that many completions at once."""
    if len(tests) != len(completions):
        raise SparrowError(
            f"code_reward got {len(completions)} completions but {len(tests)} test sets; expected equal lengths"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SparrowError(f"workers={workers!r}; expected an int >= 1")
    for i, completion in enumerate(completions):
        if not isinstance(completion, str):
            raise SparrowError(f"completion {i} is a {type(completion).__name__}; expected a str")

    def one(pair) -> CodeResult:
        completion, case = pair
        return run_code(extract_program(completion), case, timeout, memory_mb)

    pairs = list(zip(completions, tests, strict=True))
    if workers == 1:
        return [one(pair) for pair in pairs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, pairs))
