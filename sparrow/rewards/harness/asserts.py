"""Assert tests: the worker executes the program, and the tests run here, in the judge, with every name the
program defines bound to a proxy (see __init__.py). It runs only in the harness process and imports its siblings
top-level."""

from __future__ import annotations

import ast
import builtins
import os
import sys
import traceback
import types

from child import Run
from connection import Connection, Deadline, FromProgram, WorkerGone, program_exception
from processes import workdir
from protocol import DETAIL_CHARS
from remote import truth
from testblocks import TRUTH, split_tests

HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))  # the worker runs this directory, as the judge does


def _failure(exc: BaseException, source: str) -> tuple[str, str]:
    """(status, detail) of a test that raised."""
    if isinstance(exc, FromProgram):
        status = "memory" if getattr(exc, "sparrow_type", "") == "MemoryError" else "crash"
        return status, getattr(exc, "sparrow_detail", repr(exc))
    lines = source.splitlines()
    where = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<tests>"]
    line = where[-1].lineno if where else None
    text = f"tests line {line}: {lines[line - 1].strip()}\n" if line and line <= len(lines) else ""
    detail = text + "".join(traceback.format_exception_only(exc)).strip()
    return ("ok" if isinstance(exc, AssertionError) else "crash"), detail[-DETAIL_CHARS:]


def run_asserts(job: dict, program: str, report, deadline: float) -> None:
    tests = [compile(ast.Module(body=t, type_ignores=[]), "<tests>", "exec") for t in split_tests(job["tests"])]
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    folder = workdir(job["scratch"], 0)
    argv = [job["python"], "-I", "-B", HARNESS_DIR, "--worker", str(request_r), str(reply_w), program]
    worker = Run(job, argv, folder, pass_fds=(request_r, reply_w))
    os.close(request_r)
    os.close(reply_w)
    conn = Connection(request_w, reply_r, deadline)

    def fail_from(index: int, status: str, detail: str) -> None:
        for i in range(index, len(tests)):
            report(i, False, status, detail)

    def stopped(index: int, exc: BaseException) -> None:
        """The worker is gone or out of time: this test and all later ones fail."""
        worker.timed_out = isinstance(exc, Deadline)
        worker.finish()
        status = worker.status()
        fail_from(index, "crash" if status == "ok" else status, worker.stderr_tail() or str(exc))

    try:
        first = conn.receive()
        if "error" in first:  # the program raised (or exited) while it was executed
            status, detail = _failure(program_exception(first["error"]), "")
            worker.finish()
            fail_from(0, status if worker.status() in ("ok", "crash") else worker.status(), detail)
            return
        namespace = {"__builtins__": builtins, "__name__": "__tests__", TRUTH: truth}
        module = types.ModuleType("solution")
        for entry in first.get("names") or []:
            name, value = str(entry[0]), conn.value(entry[1])
            namespace[name] = value
            setattr(module, name, value)
        sys.modules["solution"] = module
    except (Deadline, WorkerGone) as exc:
        stopped(0, exc)
        return
    except (TypeError, IndexError):
        stopped(0, WorkerGone("the worker sent a malformed list of names"))
        return
    for index, code in enumerate(tests):
        try:
            exec(code, namespace)
        except (Deadline, WorkerGone) as exc:
            stopped(index, exc)
            return
        except BaseException as exc:
            report(index, False, *_failure(exc, job["tests"]))
        else:
            report(index, True, "ok", "")
    worker.finish()
