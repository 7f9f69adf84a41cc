"""Resolve a reward function from a spec: a built-in name, ``module:function`` or ``path/to/file.py:function``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

from sparrow.errors import SparrowError
from sparrow.io import require_file
from sparrow.rewards.answer import first_number_reward, number_f1_reward
from sparrow.rewards.code import code_results
from sparrow.rewards.math import math_reward

REWARDS = {"math": math_reward, "code": code_results, "first_number": first_number_reward,
           "number_f1": number_f1_reward}


def _import_file(path: str):
    """Import a .py file under a unique module name (registered, so pickling and dataclasses work)."""
    require_file(path, "reward file")
    real = os.path.realpath(path)
    stem = os.path.splitext(os.path.basename(real))[0]
    name = f"sparrow_reward_{stem}_{hashlib.sha1(real.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, real)
    if spec is None or spec.loader is None:
        raise SparrowError(f"reward file {path!r} cannot be imported; expected a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a sys.exit() at import would end the run without a word
        del sys.modules[name]
        raise SparrowError(f"importing reward file {path!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise SparrowError(
                f"reward module {name!r} not found; expected an importable module or a path ending in .py"
            ) from exc
        raise SparrowError(f"importing reward module {name!r} failed: {exc}") from exc
    except Exception as exc:
        raise SparrowError(f"importing reward module {name!r} failed: {type(exc).__name__}: {exc}") from exc


def load_reward(spec: str):
    """The callable named by ``spec``; a SparrowError says which part (module, attribute, callability) is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise SparrowError(
            f"reward spec {spec!r}; expected a built-in name ({', '.join(REWARDS)}) or 'module:function'"
        )
    spec = spec.strip()
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise SparrowError(
            f"reward spec {spec!r} is not a built-in ({', '.join(REWARDS)}); "
            "expected 'module:function' or 'path/to/file.py:function'"
        )
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise SparrowError(f"reward spec {spec!r} has an empty module or function; expected 'module:function'")
    is_file = target.endswith(".py") or os.sep in target
    module = _import_file(target) if is_file else _import_module(target)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise SparrowError(
                f"reward spec {spec!r}: {target!r} has no attribute {attr!r}; "
                f"expected one of its callables: {', '.join(public[:12]) or '(none)'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise SparrowError(
            f"reward spec {spec!r} names a {type(obj).__name__}, which is not callable; expected a function"
        )
    return obj
