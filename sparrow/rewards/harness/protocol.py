"""Plain data on the wire between the judge and the worker: JSON, one message a line.

Sparrow imports this module (``DETAIL_CHARS``): standard library only, no sibling imports (see __init__.py).
"""

from __future__ import annotations

import json

DETAIL_CHARS = 2000
MAX_MESSAGE_BYTES = 16 << 20
_BIG_INT_BITS = 12_000  # beyond this an int travels as hex: json refuses decimal strings over 4300 digits


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


def dumps(message) -> bytes:
    """One message as one line."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"
