"""The code reward's test harness. It runs inside the sandbox and uses the standard library only (no Sparrow).

One file, two roles:

* the *judge* (``python harness.py``, a JSON job on stdin) runs a program's tests and writes one JSON line per
  test to its stdout. It never executes the program's code. Stdin/stdout cases run the program as a child process
  and compare its output here. Assert tests are executed here, against a *worker* child that executed the
  program: every name the program defines is a proxy whose calls go to the worker, and what comes back is plain
  data (numbers, strings, bytes, lists, tuples, dicts, sets), or a handle to an object of the program's own. So
  every comparison an assert makes is made here, on plain data. The program cannot skip the tests (a worker that
  exits answers nothing, so its tests fail), see them (they never leave this process; the worker only sees the
  arguments of the calls made to it) or forge a verdict (none of its code runs here).
* the *worker* (``python harness.py --worker REQUEST_FD REPLY_FD PROGRAM``) executes the program as the module
  ``solution`` and answers the judge's requests (call, getattr, getitem, iter, next, ...), one JSON line each.

The worker is not math.py's worker pool, and cannot be: that pool keeps a few trusted checker processes across
calls, each request self-contained (a completion and its answer) and each worker killed and replaced past its
timeout. This worker runs one untrusted program for one job, inside the sandbox, and holds the program's live
objects between requests (the handles the judge's proxies name); its replies are read as hostile input, and a
worker reused for another job would carry one program's state into the next program's tests.

A test is a top-level ``assert`` of the test block together with the statements before it (imports, helper
definitions); statements after the last assert join the last test; a block without top-level asserts is one test.
The judge protects itself from the worker: it is not dumpable (no /proc access to its memory or files), as pid 1
of the sandbox it ignores signals from inside, and in the root setup the worker runs as another user.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import operator
import os
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
import types

DETAIL_CHARS = 2000
MAX_MESSAGE_BYTES = 16 << 20
_BIG_INT_BITS = 12_000  # beyond this an int travels as hex: json refuses decimal strings over 4300 digits
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
_PR_SET_DUMPABLE = 4


# --- plain data on the wire -------------------------------------------------------------------------------------


def encode(value, ref):
    """JSON-ready form of plain data; anything else (and str/int/float subclasses) becomes ``ref(value)``.

    Container subclasses (namedtuple, Counter, OrderedDict, ...) travel as their base type.
    """
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if value.bit_length() <= _BIG_INT_BITS else ["int", hex(value)]
    if kind is complex:
        return ["complex", value.real, value.imag]
    if kind is bytes or kind is bytearray:
        return [kind.__name__, value.hex()]
    if isinstance(value, dict):
        return ["dict", [[encode(k, ref), encode(v, ref)] for k, v in value.items()]]
    for base in (list, tuple, set, frozenset):
        if isinstance(value, base):
            return [base.__name__, [encode(item, ref) for item in value]]
    return ref(value)


_CONTAINERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def decode(data, deref):
    """Inverse of ``encode``; tagged lists other than plain data go to ``deref``. Raises ValueError if malformed."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"malformed value {str(data)[:80]}")
    tag = data[0]
    if tag in _CONTAINERS:
        return _CONTAINERS[tag](decode(item, deref) for item in data[1])
    if tag == "dict":
        return {decode(k, deref): decode(v, deref) for k, v in data[1]}
    if tag == "int":
        return int(data[1], 16)
    if tag == "complex":
        return complex(float(data[1]), float(data[2]))
    if tag in ("bytes", "bytearray"):
        return (bytes if tag == "bytes" else bytearray).fromhex(data[1])
    return deref(data)


def _dumps(message) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


# --- the worker: executes the program, answers requests ---------------------------------------------------------


def _describe(exc: BaseException) -> list:
    """[type name, message, is a builtin exception type, traceback tail] of an exception the program raised."""
    name = type(exc).__name__
    try:
        message = str(exc)[:500]
    except BaseException:
        message = ""
    try:
        tail = "".join(traceback.format_exception(exc))[-DETAIL_CHARS:]
    except BaseException:
        tail = f"{name}: {message}"
    return [name, message, getattr(builtins, name, None) is type(exc), tail]


def _worker(request_fd: int, reply_fd: int, program_path: str) -> None:
    reader = os.fdopen(request_fd, "rb")
    writer = os.fdopen(reply_fd, "wb")
    handles: dict[int, object] = {}
    keys: dict[int, int] = {}

    def ref(obj):
        key = keys.get(id(obj))
        if key is None:
            key = keys[id(obj)] = len(handles) + 1
            handles[key] = obj
        return ["obj", key, type(obj).__name__]

    def deref(data):
        if data[0] != "ref":
            raise ValueError(f"unexpected tag {data[0]!r}")
        return handles[data[1]]

    def send(message) -> None:
        writer.write(_dumps(message))
        writer.flush()

    module = types.ModuleType("solution")
    module.__file__ = program_path
    sys.modules["solution"] = module
    try:
        with open(program_path, encoding="utf-8") as f:
            exec(compile(f.read(), program_path, "exec"), module.__dict__)
        names = []
        for name, value in list(vars(module).items()):
            if not (name.startswith("__") and name.endswith("__")):
                try:
                    names.append([name, encode(value, ref)])
                except Exception:
                    names.append([name, ref(value)])
    except BaseException as exc:
        send({"error": _describe(exc)})
        return
    send({"names": names})
    for line in reader:
        try:
            reply = _serve(json.loads(line), handles, ref, deref)
        except BaseException as exc:
            reply = {"error": _describe(exc)}
        send(reply)


def _serve(request: dict, handles: dict, ref, deref) -> dict:
    op = request["op"]
    target = handles[request["target"]]
    value = None
    if op == "call":
        args = [decode(a, deref) for a in request["args"]]
        kwargs = {k: decode(v, deref) for k, v in request["kwargs"]}
        value = target(*args, **kwargs)
        mutable = (list, dict, set, bytearray)
        return {
            "value": encode(value, ref),
            "args": [[i, encode(a, ref)] for i, a in enumerate(args) if type(a) in mutable],
            "kwargs": [[k, encode(v, ref)] for k, v in kwargs.items() if type(v) in mutable],
        }
    if op == "getattr":
        value = getattr(target, request["name"])
    elif op == "setattr":
        setattr(target, request["name"], decode(request["value"], deref))
    elif op == "getitem":
        value = target[decode(request["key"], deref)]
    elif op == "setitem":
        target[decode(request["key"], deref)] = decode(request["value"], deref)
    elif op == "iter":
        value = iter(target)
    elif op == "next":
        value = next(target)
    elif op == "len":
        value = len(target)
    elif op == "bool":
        value = bool(target)
    elif op in ("repr", "str"):
        value = builtins.repr(target) if op == "repr" else builtins.str(target)
    elif op in _COMPARISONS:
        value = getattr(operator, op)(target, decode(request["other"], deref))
    else:
        raise ValueError(f"unknown request {op!r}")
    return {"value": encode(value, ref)}


# --- the judge's side of the worker: proxies and the connection -------------------------------------------------


class Deadline(BaseException):
    """The run's time is up (a BaseException, so a test's ``except Exception`` cannot swallow it)."""


class WorkerGone(BaseException):
    """The worker exited, closed its pipe or sent something malformed: nothing it says counts any more."""


class FromProgram:
    """Marks an exception the program raised, re-raised in the judge under its builtin type when it has one."""


class ProgramError(Exception, FromProgram):
    """An exception of the program's own type (or a BaseException such as SystemExit) raised in a call."""


_EXCEPTION_TYPES: dict[str, type] = {}


def _program_exception(description) -> BaseException:
    name, message, is_builtin, tail = (list(description) + [None] * 4)[:4]
    name, message = str(name), str(message)
    base = getattr(builtins, name, None) if is_builtin is True else None
    exc = None
    if isinstance(base, type) and issubclass(base, Exception):
        cls = _EXCEPTION_TYPES.setdefault(name, type(name, (base, FromProgram), {}))
        try:
            exc = cls(message)
        except Exception:
            exc = None
    if exc is None:
        exc = ProgramError(f"{name}: {message}")
    exc.sparrow_detail = str(tail or f"{name}: {message}")[-DETAIL_CHARS:]
    exc.sparrow_type = name
    return exc


def _update_in_place(target, new) -> None:
    """Mirror the worker's view of a mutable argument after a call (tests that check in-place changes)."""
    if type(target) is not type(new):
        return
    if isinstance(target, (list, bytearray)):
        target[:] = new
    else:
        target.clear()
        target.update(new)


class Remote:
    """An object that lives in the worker. Calls, attributes, items, iteration, length, truth, repr and
    comparisons with other remote objects are asked of it. Comparing it with plain data is never asked (a program
    answering "equal" to whatever it is compared with would forge the test): ``==`` and ``!=`` raise TypeError
    (except against None, which it is not), ordering raises, and ``x in remote`` iterates it here."""

    __slots__ = ("_conn", "_key", "_kind")

    def __init__(self, conn, key: int, kind: str):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_kind", kind)

    def _ask(self, op: str, **fields):
        return self._conn.request(op, self._key, **fields)

    def __getattr__(self, name):
        if name in Remote.__slots__:
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __setattr__(self, name, value):
        self._ask("setattr", name=name, value=value)

    def __call__(self, *args, **kwargs):
        return self._conn.call(self._key, args, kwargs)

    def __getitem__(self, key):
        return self._ask("getitem", key=key)

    def __setitem__(self, key, value):
        self._ask("setitem", key=key, value=value)

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __len__(self):
        return self._ask("len")

    def __bool__(self):
        return self._ask("bool")

    def __repr__(self):
        text = self._ask("repr")
        return text if type(text) is str else f"<{self._kind}>"

    def __str__(self):
        text = self._ask("str")
        return text if type(text) is str else f"<{self._kind}>"

    def __hash__(self):
        return hash((Remote, self._key))

    def _compare(self, other, op: str):
        return self._ask(op, other=other) if isinstance(other, Remote) else NotImplemented

    def _equal(self, other, op: str):
        if isinstance(other, Remote):
            return self._ask(op, other=other)
        if other is None:
            return op == "ne"
        raise TypeError(f"the program's {self._kind} object was compared with plain data; expected plain data")

    def __eq__(self, other):
        return self._equal(other, "eq")

    def __ne__(self, other):
        return self._equal(other, "ne")

    def __lt__(self, other):
        return self._compare(other, "lt")

    def __le__(self, other):
        return self._compare(other, "le")

    def __gt__(self, other):
        return self._compare(other, "gt")

    def __ge__(self, other):
        return self._compare(other, "ge")


class _Connection:
    """Requests to the worker over two pipes, each reply awaited no later than the run's deadline."""

    def __init__(self, request_fd: int, reply_fd: int, deadline: float):
        self._out = request_fd
        self._in = reply_fd
        self._deadline = deadline
        self._buffer = bytearray()
        self._remotes: dict[int, Remote] = {}
        self.broken: BaseException | None = None
        os.set_blocking(request_fd, False)

    def _ref(self, value):
        if isinstance(value, Remote) and value._conn is self:
            return ["ref", value._key]
        raise TypeError(f"a {type(value).__name__} cannot be passed to the program; expected plain data")

    def _deref(self, data):
        if data[0] != "obj" or type(data[1]) is not int:
            raise ValueError(f"unexpected tag {data[0]!r}")
        remote = self._remotes.get(data[1])
        if remote is None:
            remote = self._remotes[data[1]] = Remote(self, data[1], str(data[2])[:100])
        return remote

    def _wait(self, fd: int, writing: bool) -> None:
        remaining = max(self._deadline - time.monotonic(), 0)
        readable, writable, _ = select.select([] if writing else [fd], [fd] if writing else [], [], remaining)
        if not (readable or writable):
            self.broken = Deadline()
            raise self.broken

    def _send(self, message) -> None:
        data = memoryview(_dumps(message))
        while data:
            self._wait(self._out, writing=True)
            try:
                data = data[os.write(self._out, data):]
            except BlockingIOError:
                continue
            except OSError:
                self.broken = WorkerGone("the worker closed its request pipe")
                raise self.broken from None

    def receive(self) -> dict:
        """The next reply, a dict; raises Deadline or WorkerGone (and keeps raising it from then on)."""
        if self.broken is not None:
            raise self.broken
        while b"\n" not in self._buffer:
            self._wait(self._in, writing=False)
            chunk = os.read(self._in, 1 << 16)
            if not chunk or len(self._buffer) + len(chunk) > MAX_MESSAGE_BYTES:
                self.broken = WorkerGone("the worker exited" if not chunk else "the worker's reply is too large")
                raise self.broken
            self._buffer += chunk
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if type(reply) is not dict:
            self.broken = WorkerGone("the worker sent a malformed reply")
            raise self.broken
        return reply

    def value(self, data):
        """Decode a value the worker sent; malformed data ends the conversation."""
        try:
            return decode(data, self._deref)
        except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError):
            self.broken = WorkerGone("the worker sent a malformed value")
            raise self.broken from None

    def _exchange(self, message) -> dict:
        if self.broken is not None:
            raise self.broken
        self._send(message)
        reply = self.receive()
        if "error" in reply:
            raise _program_exception(reply["error"])
        return reply

    def request(self, op: str, key: int, **fields):
        message = {"op": op, "target": key}
        message.update({name: encode(value, self._ref) for name, value in fields.items()})
        return self.value(self._exchange(message).get("value"))

    def call(self, key: int, args: tuple, kwargs: dict):
        message = {
            "op": "call",
            "target": key,
            "args": [encode(a, self._ref) for a in args],
            "kwargs": [[str(k), encode(v, self._ref)] for k, v in kwargs.items()],
        }
        reply = self._exchange(message)
        result = self.value(reply.get("value"))
        for index, data in reply.get("args") or []:
            if type(index) is int and 0 <= index < len(args):
                _update_in_place(args[index], self.value(data))
        for name, data in reply.get("kwargs") or []:
            if name in kwargs:
                _update_in_place(kwargs[name], self.value(data))
        return result


# --- test blocks ------------------------------------------------------------------------------------------------

TRUTH = "__sparrow_truth__"


class _GuardAsserts(ast.NodeTransformer):
    """``assert x`` -> ``assert __sparrow_truth__(x)``: an object of the program's own never passes an assert by
    its truth value alone (any object is truthy by default); plain data does as usual."""

    def visit_Assert(self, node):
        self.generic_visit(node)
        node.test = ast.Call(func=ast.Name(id=TRUTH, ctx=ast.Load()), args=[node.test], keywords=[])
        return node


def _truth(value) -> bool:
    return not isinstance(value, Remote) and bool(value)


def split_tests(source: str) -> list[list[ast.stmt]]:
    """The tests of an assert block: each top-level assert with the statements before it (see the module doc).
    Raises SyntaxError for a block that is not Python."""
    body = ast.fix_missing_locations(_GuardAsserts().visit(ast.parse(source, "<tests>"))).body
    tests, current = [], []
    for statement in body:
        current.append(statement)
        if isinstance(statement, ast.Assert):
            tests.append(current)
            current = []
    if current:
        if tests:
            tests[-1].extend(current)
        else:
            tests.append(current)
    return tests


# --- the judge ------------------------------------------------------------------------------------------------


class _Run:
    """One child process of the program (a stdin/stdout case, or the worker) and its captured output."""

    def __init__(self, job: dict, argv: list[str], workdir: str, stdin_text: str = "", pass_fds=()):
        self.limit = job["output_limit"]
        self.stdout = os.memfd_create("stdout")
        self.stderr = os.memfd_create("stderr")
        stdin = os.memfd_create("stdin")
        os.write(stdin, stdin_text.encode("utf-8"))
        os.lseek(stdin, 0, os.SEEK_SET)
        env = dict(job["env"], HOME=workdir, TMPDIR=workdir)
        uid = job["uid"]
        self.proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=self.stdout,
            stderr=self.stderr,
            cwd=workdir,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
            preexec_fn=_limits(job),
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
        )
        os.close(stdin)
        self.timed_out = False
        self.returncode: int | None = None

    def wait(self, deadline: float) -> None:
        self.timed_out = not wait_exit(self.proc, deadline - time.monotonic())
        self.finish()

    def finish(self) -> None:
        """Kill the program and everything it started (the whole sandbox when this is its pid 1)."""
        if self.returncode is not None:
            return
        early = self.proc.poll()
        try:
            if os.getpid() == 1:
                os.kill(-1, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.wait()
        self.returncode = code if early is None else early
        if os.getpid() == 1:
            _reap_all()

    def output(self) -> str:
        os.lseek(self.stdout, 0, os.SEEK_SET)
        return os.read(self.stdout, self.limit).decode("utf-8", errors="replace")

    def stderr_tail(self) -> str:
        size = os.fstat(self.stderr).st_size
        os.lseek(self.stderr, max(0, size - 4 * DETAIL_CHARS), os.SEEK_SET)
        return os.read(self.stderr, 4 * DETAIL_CHARS).decode("utf-8", errors="replace")[-DETAIL_CHARS:]

    def status(self) -> str:
        """How the process ended: ok, timeout, crash, memory or output_limit (the first that applies, in the order
        output_limit, timeout, memory, crash)."""
        rc, tail = self.returncode, self.stderr_tail()
        sizes = os.fstat(self.stdout).st_size, os.fstat(self.stderr).st_size
        if max(sizes) >= self.limit or rc == -signal.SIGXFSZ or (rc != 0 and "File too large" in tail):
            return "output_limit"
        if self.timed_out or rc == -signal.SIGXCPU:
            return "timeout"
        if rc != 0 and any(marker in tail for marker in _MEMORY_MARKERS):
            return "memory"
        return "crash" if rc != 0 else "ok"


def wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to exit (True if it did) and reap it then. A pidfd wakes up the
    moment it exits; Popen.wait(timeout) polls with sleeps of up to 50 ms, which every run would pay."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        exited, _, _ = select.select([pidfd], [], [], max(timeout, 0))
    finally:
        os.close(pidfd)
    if exited:
        proc.wait()
    return bool(exited)


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _limits(job: dict):
    """preexec_fn for a program process: the rlimits, set between fork and exec (the judge has one thread)."""
    memory = job["memory_mb"] << 20
    cpu = math.ceil(job["timeout"]) + 1
    limit = job["output_limit"]
    pairs = [
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (limit, limit)),
        (resource.RLIMIT_NOFILE, (job["open_files"], job["open_files"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if job["process_limit"] is not None:
        pairs.append((resource.RLIMIT_NPROC, (job["process_limit"], job["process_limit"])))

    def apply() -> None:
        for which, pair in pairs:
            resource.setrlimit(which, pair)

    return apply


def _workdir(scratch: str, index: int) -> str:
    """A fresh writable folder for one run: ``scratch/run-N/work``; ``run-N`` is closed again by ``_close``."""
    run = os.path.join(scratch, f"run-{index}")
    work = os.path.join(run, "work")
    os.makedirs(work)
    os.chmod(run, 0o777)
    os.chmod(work, 0o777)
    return work


def _close(workdir: str) -> None:
    os.chmod(os.path.dirname(workdir), 0)


def same_output(actual: str, expected: str) -> bool:
    """Equal after stripping surrounding whitespace, trailing spaces on each line and CRLF differences."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return norm(actual) == norm(expected)


def _run_cases(job: dict, program: str, report, deadline: float) -> None:
    python = job["python"]
    for index, (stdin, expected) in enumerate(job["cases"]):
        if time.monotonic() >= deadline:
            report(index, False, "timeout", "the run's time was used up by earlier cases")
            continue
        workdir = _workdir(job["scratch"], index)
        run = _Run(job, [python, "-I", "-B", program], workdir, stdin)
        run.wait(deadline)
        _close(workdir)
        status = run.status()
        report(index, status == "ok" and same_output(run.output(), expected), status, run.stderr_tail())


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


def _run_asserts(job: dict, program: str, report, deadline: float) -> None:
    tests = [compile(ast.Module(body=t, type_ignores=[]), "<tests>", "exec") for t in split_tests(job["tests"])]
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    workdir = _workdir(job["scratch"], 0)
    argv = [job["python"], "-I", "-B", os.path.abspath(__file__), "--worker", str(request_r), str(reply_w), program]
    worker = _Run(job, argv, workdir, pass_fds=(request_r, reply_w))
    os.close(request_r)
    os.close(reply_w)
    conn = _Connection(request_w, reply_r, deadline)

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
            status, detail = _failure(_program_exception(first["error"]), "")
            worker.finish()
            fail_from(0, status if worker.status() in ("ok", "crash") else worker.status(), detail)
            return
        namespace = {"__builtins__": builtins, "__name__": "__tests__", TRUTH: _truth}
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


def _not_dumpable() -> None:
    """No other process of the same user may read this one's memory or open its files through /proc."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main() -> None:
    """The judge: read the job, run the tests, write one JSON line per test and a final ``{"end": true}``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as pid 1, signals without a handler from inside are dropped
    _not_dumpable()
    job = json.loads(sys.stdin.buffer.read())
    os.close(0)
    channel = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # test code that prints cannot write into the report
    deadline = time.monotonic() + job["timeout"]

    def report(index: int, passed: bool, status: str, detail: str) -> None:
        record = {"i": index, "passed": bool(passed), "status": status, "detail": str(detail)[-DETAIL_CHARS:]}
        channel.write(json.dumps(record) + "\n")
        channel.flush()

    program = os.path.join(job["scratch"], "main.py")
    with open(program, "w", encoding="utf-8") as f:
        f.write(job["program"])
    os.chmod(program, 0o444)
    if job["cases"] is not None:
        _run_cases(job, program, report, deadline)
    else:
        _run_asserts(job, program, report, deadline)
    channel.write('{"end": true}\n')
    channel.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
