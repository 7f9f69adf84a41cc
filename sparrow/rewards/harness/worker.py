"""The worker: executes the program as the module ``solution`` and answers the judge's requests, one JSON line
each (see __init__.py). It runs only in the harness process and imports its siblings top-level."""

from __future__ import annotations

import builtins
import json
import operator
import os
import sys
import traceback
import types

from protocol import DETAIL_CHARS, decode, dumps, encode

_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


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


def serve(request_fd: int, reply_fd: int, program_path: str) -> None:
    """Execute the program, send the names it defines, then answer requests until the judge closes the pipe."""
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
        writer.write(dumps(message))
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
