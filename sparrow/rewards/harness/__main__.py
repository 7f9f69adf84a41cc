"""The harness's entry (see __init__.py): ``python -I -S -B DIR`` runs the judge, ``python -I -B DIR --worker
REQUEST_FD REPLY_FD PROGRAM`` the worker.

Python puts DIR first on ``sys.path`` (even in isolated mode), so the modules here import each other top-level.
Once a role's modules are loaded, DIR leaves ``sys.path`` and their names leave ``sys.modules``: the program (in
the worker) and the tests (in the judge) import what they would without the harness (the standard library, and in
the worker the base installation's site-packages), and a module of theirs never resolves to one of the harness's.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _forget_the_harness() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != _HERE]
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name != "__main__" and path and os.path.dirname(os.path.abspath(path)) == _HERE:
            del sys.modules[name]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        from worker import serve

        _forget_the_harness()
        serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        from judge import main

        _forget_the_harness()
        main()
