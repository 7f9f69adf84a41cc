"""The code reward's test harness. It runs inside the sandbox and uses the standard library only (no Sparrow).

One directory, run as a whole (``python DIR``, whose ``__main__.py`` is the entry), two roles:

* the *judge* (``python -I -S -B DIR``, a JSON job on stdin) runs a program's tests and writes one JSON line per
  test to its stdout. It never executes the program's code. Stdin/stdout cases run the program as a child process
  and compare its output here. Assert tests are executed here, against a *worker* child that executed the
  program: every name the program defines is a proxy whose calls go to the worker, and what comes back is plain
  data (numbers, strings, bytes, lists, tuples, dicts, sets), or a handle to an object of the program's own. So
  every comparison an assert makes is made here, on plain data. The program cannot skip the tests (a worker that
  exits answers nothing, so its tests fail), see them (they never leave this process; the worker only sees the
  arguments of the calls made to it) or forge a verdict (none of its code runs here).
* the *worker* (``python -I -B DIR --worker REQUEST_FD REPLY_FD PROGRAM``) executes the program as the module
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

The modules, by idea:

* ``protocol``: plain data on the wire between judge and worker (encode, decode, one JSON message a line);
* ``worker``: the worker, which executes the program and answers requests;
* ``remote``: the judge's proxy for an object of the program's (``Remote``), and an assert's truth test;
* ``connection``: the judge's connection to the worker, and the program's exceptions re-raised in the judge;
* ``testblocks``: an assert block split into tests;
* ``processes``: a program process's rlimits, waiting for it, reaping, and its scratch folder;
* ``child``: one child process of the program and how it ended;
* ``cases``: the stdin/stdout cases; ``asserts``: the assert tests against the worker;
* ``judge``: the judge's main (read the job, report each test); ``__main__``: the entry of both roles.

Two ways in, one rule. Sparrow imports a few modules as ``sparrow.rewards.harness.<module>`` (``protocol``,
``testblocks``, ``processes``); the sandbox runs the directory, where Python puts it first on ``sys.path``, so its
modules import each other as top-level modules (``from protocol import encode``). So a module Sparrow imports uses
the standard library only, with no sibling imports, and the modules that run only in the harness process import
their siblings top-level (tests/test_harness.py checks both). Once a role's modules are loaded, ``__main__`` takes
the directory off ``sys.path`` and their names out of ``sys.modules``, so the program and the tests import what they
would without the harness. This file only documents the package: it imports nothing, and the harness process never
runs it.
"""
