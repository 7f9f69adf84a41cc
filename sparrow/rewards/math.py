"""Math reward: the last ``\\boxed{...}`` of a completion checked against the ground truth with math-verify.

math-verify compares answers symbolically (``\\frac{1}{2}`` equals ``0.5``, ``\\{1,2\\}`` equals ``\\{2,1\\}``),
which is what the paper's math run scores with. Some answers make it compute forever (``9^{9^{9^{9}}}``,
``(10^{10})!``, thousands of nested parentheses), and its own timeouts use ``signal.alarm``, which works only in a
main thread and cannot interrupt a long computation inside C. So every check runs in a worker process (a small
pool, reused across calls, started on first use): math-verify's timeouts are on there, and a check that outlives
``timeout`` seconds has its worker killed and replaced, whatever thread asked. Either kind of timeout scores 0
with status "timeout" (a MathScore: a float with a status, which the trainer's records show).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import re
import resource
import select
import subprocess
import sys
import threading
import time
from collections import deque

from sparrow.errors import SparrowError

_BOXED = re.compile(r"\\boxed\s*\{")
TIMEOUT_S = 10.0
WORKERS = max(2, min(4, (os.cpu_count() or 1) // 2))
_START_TIMEOUT_S = 120.0
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A worker imports this module without running sparrow/__init__.py (which loads the model stack, seconds of it).
_BOOT = """import sys, types
for name, path in (("sparrow", sys.argv[1]), ("sparrow.rewards", sys.argv[1] + "/rewards")):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from sparrow.rewards.math import serve
serve()
"""


class MathScore(float):
    """A math reward value (a float: 1.0 or 0.0) that also says how its check ended: "ok", "timeout" (killed after
    ``timeout`` seconds) or "crash" (the checking process died); the trainer's records show the status."""

    status: str

    def __new__(cls, value: float, status: str = "ok"):
        score = super().__new__(cls, value)
        score.status = status
        return score

    def __reduce__(self):
        return MathScore, (float(self), self.status)

    @property
    def reward(self) -> float:
        return float(self)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested, escaped braces handled); None if absent/unclosed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _gold_text(answer) -> str:
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
        raise SparrowError(f"ground-truth answer {answer!r} is not usable; expected a non-empty string or number")
    return str(answer).strip()


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout < float("inf"):
        raise SparrowError(f"timeout={timeout!r}; expected a number of seconds >= 1")
    return float(timeout)


# --- the worker side --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, seconds: int) -> tuple:
    """Parsed ground truth, cached because each prompt's answer is scored once per rollout in its group."""
    from math_verify import parse

    text = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    parsed = parse(text, parsing_timeout=seconds)
    if not parsed:
        raise SparrowError(
            f"ground-truth answer {gold!r} could not be parsed by math-verify; expected a number or a LaTeX expression"
        )
    return tuple(parsed)


class _TimeoutLog(logging.Handler):
    """Notes math-verify's own timeouts, which it logs (as warnings) and scores as a mismatch."""

    hit = False

    def emit(self, record) -> None:
        if record.getMessage().startswith("Timeout during"):
            _TimeoutLog.hit = True


def _soft_seconds(timeout: float) -> int:
    """math-verify's own limit, per parse and per comparison, within the hard ``timeout`` of a whole check."""
    return max(1, int(timeout // 3))


def _check(completion: str, gold: str, seconds: int) -> float:
    from math_verify import parse, verify

    parsed_gold = _parse_gold(gold, seconds)
    content = last_boxed(completion)
    if content is None or not content.strip():
        return 0.0
    predicted = parse("\\boxed{" + content + "}", parsing_timeout=seconds)
    if not predicted:
        return 0.0
    return 1.0 if verify(list(parsed_gold), predicted, timeout_seconds=seconds) else 0.0


def serve() -> None:
    """A worker's loop: one JSON request per stdin line, one JSON reply per stdout line; exits at end of input.

    Before each check the CPU-time limit is moved to what was used so far plus the request's allowance, so the
    kernel ends a check stuck in C code even if the process that started this worker is gone.
    """
    import math_verify  # noqa: F401  (imported before "ready", so no answer's time limit is spent on it)

    log = logging.getLogger("math_verify")
    log.addHandler(_TimeoutLog())
    log.propagate = False
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(usage.ru_utime + usage.ru_stime + request["cpu_seconds"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
        _TimeoutLog.hit = False
        try:
            value = _check(request["completion"], request["gold"], request["seconds"])
            reply = {"value": value, "status": "timeout" if _TimeoutLog.hit and not value else "ok"}
        except SparrowError as exc:
            reply = {"error": str(exc)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# --- the pool ---------------------------------------------------------------------------------------------------


class _Worker:
    """A worker process; ``deadline`` is when it must have answered (or, while starting, said "ready")."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, _PACKAGE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.deadline = time.monotonic() + _START_TIMEOUT_S
        self.index: int | None = None

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, request: dict) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return False
        return True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _Pool:
    """Up to WORKERS worker processes, kept across calls; one batch at a time (a lock), each answer on the first
    free worker. Replacements for killed workers start in the background while the others keep answering."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._starting: list[_Worker] = []

    def score(self, tasks: list[tuple[str, str]], timeout: float) -> list[MathScore]:
        seconds = _soft_seconds(timeout)
        results: list[MathScore | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        busy: list[_Worker] = []
        with self._lock:
            for _ in range(min(WORKERS, len(tasks)) - len(self._idle) - len(self._starting)):
                self._starting.append(_Worker())
            try:
                while pending or busy:
                    while pending and self._idle:
                        worker, index = self._idle.pop(), pending.popleft()
                        request = {"completion": tasks[index][0], "gold": tasks[index][1], "seconds": seconds,
                                   "cpu_seconds": timeout + 1}
                        if not worker.send(request):  # died while idle: not this answer's doing
                            worker.kill()
                            pending.appendleft(index)
                            self._starting.append(_Worker())
                            continue
                        worker.index, worker.deadline = index, time.monotonic() + timeout
                        busy.append(worker)
                    waiting = busy + self._starting
                    wait = max(min(w.deadline for w in waiting) - time.monotonic(), 0)
                    ready, _, _ = select.select(waiting, [], [], wait)
                    for worker in ready:
                        line = worker.proc.stdout.readline()
                        if worker in self._starting:
                            self._starting.remove(worker)
                            if line != "ready\n":
                                worker.kill()
                                raise SparrowError(f"the math reward's worker ({sys.executable}) failed to start; "
                                                   "expected math-verify to be importable")
                            self._idle.append(worker)
                            continue
                        busy.remove(worker)
                        if not line:  # the check killed its process (e.g. over the CPU limit)
                            worker.kill()
                            results[worker.index] = MathScore(0.0, "crash")
                            self._starting.append(_Worker())
                            continue
                        self._idle.append(worker)
                        reply = json.loads(line)
                        if "error" in reply:
                            raise SparrowError(reply["error"])
                        results[worker.index] = MathScore(reply["value"], reply["status"])
                    now = time.monotonic()
                    for worker in [w for w in waiting if w.deadline <= now and w not in ready]:
                        worker.kill()
                        if worker in self._starting:
                            self._starting.remove(worker)
                            raise SparrowError(f"the math reward's worker did not start within "
                                               f"{_START_TIMEOUT_S:.0f} s ({sys.executable})")
                        busy.remove(worker)
                        results[worker.index] = MathScore(0.0, "timeout")
                        self._starting.append(_Worker())
            finally:
                for worker in busy:
                    worker.kill()
        return results

    def close(self) -> None:
        with self._lock:
            for worker in self._idle + self._starting:
                worker.kill()
            self._idle.clear()
            self._starting.clear()


_POOL = _Pool()
atexit.register(_POOL.close)


def math_scores(completions, answers, timeout: float = TIMEOUT_S) -> list[MathScore]:
    """``math_score`` of each completion against its answer, checked in parallel by the worker pool."""
    timeout = _check_timeout(timeout)
    tasks = []
    for completion, answer in zip(completions, answers, strict=True):
        if not isinstance(completion, str):
            raise SparrowError(f"completion is a {type(completion).__name__}; expected a str")
        tasks.append((completion, _gold_text(answer)))
    return _POOL.score(tasks, timeout) if tasks else []


def math_score(completion: str, answer, timeout: float = TIMEOUT_S) -> MathScore:
    """1.0 if the completion's last boxed answer equals ``answer`` per math-verify, else 0.0; at most ``timeout``
    seconds (then 0.0 with status "timeout")."""
    return math_scores([completion], [answer], timeout)[0]


def math_reward(prompts, completions, answer, timeout: float = TIMEOUT_S, **_) -> list[MathScore]:
    """Reward function (TRL-style): ``math_score`` of each completion against the aligned ``answer`` column."""
    if len(answer) != len(completions):
        raise SparrowError(
            f"math_reward got {len(completions)} completions but {len(answer)} answers; expected equal lengths"
        )
    return math_scores(completions, answer, timeout)
