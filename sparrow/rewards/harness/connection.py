"""The judge's connection to the worker: requests over two pipes, each reply read as hostile input and awaited no
later than the run's deadline; and the program's exceptions, re-raised in the judge. It runs only in the harness
process and imports its siblings top-level."""

from __future__ import annotations

import builtins
import json
import os
import select
import time

from protocol import DETAIL_CHARS, MAX_MESSAGE_BYTES, decode, dumps, encode
from remote import Remote


class Deadline(BaseException):
    """The run's time is up (a BaseException, so a test's ``except Exception`` cannot swallow it)."""


class WorkerGone(BaseException):
    """The worker exited, closed its pipe or sent something malformed: nothing it says counts any more."""


class FromProgram:
    """Marks an exception the program raised, re-raised in the judge under its builtin type when it has one."""


class ProgramError(Exception, FromProgram):
    """An exception of the program's own type (or a BaseException such as SystemExit) raised in a call."""


_EXCEPTION_TYPES: dict[str, type] = {}


def program_exception(description) -> BaseException:
    """The exception the worker described (worker.py's [name, message, is builtin, traceback tail])."""
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


class Connection:
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
        data = memoryview(dumps(message))
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
            raise program_exception(reply["error"])
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
