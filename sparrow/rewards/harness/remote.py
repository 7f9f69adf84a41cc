"""The judge's proxy for an object that lives in the worker, and the truth an assert accepts. It runs only in the
harness process (no imports at all)."""

from __future__ import annotations


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


def truth(value) -> bool:
    """What ``assert value`` accepts (testblocks.py rewrites each assert to ask this): plain data by its truth as
    usual, an object of the program's own never (any object is truthy by default)."""
    return not isinstance(value, Remote) and bool(value)
