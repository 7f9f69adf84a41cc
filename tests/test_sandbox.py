"""The code reward's sandbox: each way out of it we know of, contained, the reward hacks, and the refusal path.

Every escape case checks the same things: reward 0 and the expected status, nothing written outside the scratch
directory (the host folders, files and package source are unchanged), nothing read from the home or the
project, the listener on 127.0.0.1 saw no connection, the parent is alive and no process is left behind.
The sandbox tool must be installed (scripts/setup.sh does it); without it these tests fail, they do not skip.
"""

import hashlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import sparrow.rewards.code as code_module
from sparrow.errors import SparrowError
from sparrow.rewards import code_results, run_code, sandbox

REPO = Path(__file__).resolve().parents[1]
SOURCE = Path(code_module.__file__)
NEVER = [{"input": "", "output": "this output means the escape worked"}]


@pytest.fixture(scope="module", autouse=True)
def bwrap_works():
    sandbox.problem.cache_clear()
    problem = sandbox.problem()
    assert problem is None, f"the code-reward sandbox does not work here: {problem} (run scripts/setup.sh)"


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _wait_gone(token: str, seconds: float = 2.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def host(tmp_path, monkeypatch):
    """Things on the host the program must not reach: a folder with a file, a secret in the home, the package
    source, the trainer's environment, and a listener on 127.0.0.1."""
    token = uuid.uuid4().hex
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    home_secret = Path.home() / f".sparrow-test-secret-{token}"
    home_secret.write_text(f"home-{token}")
    monkeypatch.setenv("SPARROW_TEST_SECRET", f"env-{token}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
    info = {"token": token, "tmp": tmp_path, "victim": victim, "home_secret": home_secret,
            "port": listener.getsockname()[1], "pid": os.getpid(), "processes": token}
    try:
        yield info
        try:
            listener.accept()
            connected = True
        except BlockingIOError:
            connected = False
        assert not connected, "the program reached the listener on 127.0.0.1"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
        assert victim.read_text() == "original"
        assert home_secret.read_text() == f"home-{token}"
        assert hashlib.sha256(SOURCE.read_bytes()).hexdigest() == digest
        assert not list(Path("/tmp").glob(f"*{token}*")) and not list(Path.home().glob(f"*{token}*x"))
        assert _wait_gone(info["processes"]) == []
    finally:
        listener.close()
        home_secret.unlink()


ESCAPES = {
    # name: (program, expected status); {…} fields are filled from the host fixture
    "write /tmp": ("open('/tmp/escape-{token}', 'w').write('x')", "crash"),
    "write $HOME": ("open('{home}/escape-{token}x', 'w').write('x')", "crash"),
    "write ../../..": ("open('../../../../../../../..{tmp}/escape.txt', 'w').write('x')", "crash"),
    "overwrite the parent's file": ("open('{victim}', 'w').write('pwned')", "crash"),
    "append to the package source": ("open('{source}', 'a').write('# pwned')", "crash"),
    "append to the harness": ("open('/sparrow/harness/__main__.py', 'a').write('# pwned')", "crash"),
    "add a module to the harness": ("open('/sparrow/harness/site.py', 'w').write('# pwned')", "crash"),
    "read /etc/passwd": ("print(open('/etc/passwd').read())", "crash"),
    "read a home file": ("print(open('{home_secret}').read())", "crash"),
    "read the project": ("print(open('{repo}/pyproject.toml').read())", "crash"),
    "parent environ by host pid": ("print(open('/proc/{pid}/environ').read())", "crash"),
    "parent environ by ppid": ("import os\nprint(open(f'/proc/{{os.getppid()}}/environ').read())", "crash"),
    "connect to 127.0.0.1": ("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", "crash"),
    "kill the trainer by pid": ("import os\nos.kill({pid}, 9)", "crash"),
    "kill the parent": ("import os, time\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\n"
                        "time.sleep(0.2)\nprint('still here')", "ok"),
}


@pytest.mark.parametrize("name", ESCAPES)
def test_escape_is_contained(host, name):
    program, status = ESCAPES[name]
    program = program.format(home=Path.home(), source=SOURCE, repo=REPO, **host)
    result = run_code(program, NEVER, timeout=3.0)
    assert (result.reward, result.status) == (0.0, status), result.stderr_tail
    for secret in (f"home-{host['token']}", f"env-{host['token']}", "root:x:0:0"):
        assert secret not in result.stderr_tail
    os.kill(host["pid"], 0)  # the trainer (this process) is alive


def test_sandbox_sees_only_system_files_and_its_scratch(host):
    program = textwrap.dedent(f"""
        import os, sys
        print(sorted(os.listdir('/')), file=sys.stderr)
        print(os.getcwd(), os.environ['HOME'], sorted(os.environ), file=sys.stderr)
        assert not os.path.exists('{REPO}') and not os.path.exists('/etc/passwd')
        assert not os.path.exists('/home') or os.listdir('/home') == []
        assert all(p.isdigit() is False or int(p) < 100 for p in os.listdir('/proc'))
        open('here.txt', 'w').write('cwd')
        open(os.path.expanduser('~/home.txt'), 'w').write('home')
        open('../up-one.txt', 'w').write('up one')
        raise SystemExit(1)
    """)
    result = run_code(program, NEVER, timeout=3.0)
    assert result.status == "crash" and "AssertionError" not in result.stderr_tail, result.stderr_tail
    assert "/sandbox/run-0/work /sandbox/run-0/work" in result.stderr_tail
    assert "SPARROW_TEST_SECRET" not in result.stderr_tail


HARNESS_SPY = textwrap.dedent("""
    import os, sys
    def listing():
        return sorted(os.listdir('/sparrow/harness'))
    def traces():
        return [p for p in sys.path if 'harness' in p] + [m for m in ('protocol', 'worker') if m in sys.modules]
    def importable():
        try:
            import protocol
        except ImportError:
            return False
        return True
""")


def test_the_sandbox_shows_the_harness_sources_only_and_no_import_reaches_them():
    expected = sorted(p.name for p in Path(sandbox.HARNESS).glob("*.py"))
    assert "__main__.py" in expected
    tests = (f"assert listing() == {expected!r}\nassert traces() == []\nassert importable() is False\n"
             "import sys\nassert [p for p in sys.path if 'harness' in p] == [] and 'connection' not in sys.modules\n")
    result = run_code(HARNESS_SPY, tests, timeout=5.0)
    assert (result.passed, result.total) == (4, 4), result.stderr_tail


def test_only_the_harness_sources_are_bound(tmp_path, monkeypatch):
    for name in ("__main__.py", "judge.py", "notes.txt", "__pycache__/judge.cpython-311.pyc"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    monkeypatch.setattr(sandbox, "HARNESS", str(tmp_path))
    assert sandbox.harness_files() == ["__main__.py", "judge.py"]


def test_processes_that_leave_the_group_do_not_outlive_the_run(host):
    host["processes"] = sleeper = f"1000.{int(host['token'][:6], 16)}"
    program = textwrap.dedent(f"""
        import os, subprocess
        sleeper = ['sleep', '{sleeper}']
        subprocess.Popen(sleeper, start_new_session=True)           # setsid
        subprocess.Popen(sleeper, process_group=0)                  # setpgid(0, 0)
        if os.fork() == 0:                                          # double fork
            if os.fork() == 0:
                os.setsid()
                os.execvp('sleep', sleeper)
            os._exit(0)
        print('spawned')
    """)
    result = run_code(program, [{"input": "", "output": "spawned"}], timeout=3.0)
    assert (result.reward, result.status) == (1.0, "ok"), result.stderr_tail
    assert _wait_gone(sleeper, 0.5) == []


def test_a_killed_trainer_leaves_no_process_and_no_folder(host):
    host["processes"] = sleeper = f"1000.{int(host['token'][:6], 16)}"
    # A small "trainer": a process that scores one completion (importing only the reward modules, not torch).
    trainer = textwrap.dedent(f"""
        import sys, types
        package = {str(REPO / "sparrow")!r}
        for name, path in (("sparrow", package), ("sparrow.rewards", package + "/rewards")):
            module = types.ModuleType(name)
            module.__path__ = [path]
            sys.modules[name] = module
        from sparrow.rewards.code import run_code
        sleeper = "1000." + "{sleeper[5:]}"  # split, so this trainer's own command line does not match
        run_code(f"import subprocess, time\\nsubprocess.Popen(['sleep', '{{sleeper}}'])\\ntime.sleep(60)",
                 [{{"input": "", "output": ""}}], timeout=30.0, base_dir={str(host["tmp"])!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", trainer])
    try:
        deadline = time.monotonic() + 15
        while not _processes_with(sleeper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(sleeper) and proc.pid not in _processes_with(sleeper), "the child never started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _wait_gone(sleeper) == []


def test_fork_bomb_is_capped_and_ends_with_the_run(host):
    token = host["token"]
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    program = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {token!r}])\n"
    counts = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            counts.append(len(_processes_with(token)))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        result = run_code(program, NEVER, timeout=1.0)
    finally:
        stop.set()
        watcher.join()
    assert time.monotonic() - start < 3.0
    assert (result.reward, result.status) == (0.0, "timeout")
    assert 1 <= max(counts) <= sandbox.PROCESS_LIMIT


# --- reward hacking ---------------------------------------------------------------------------------------------

ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(-1, 1) == 0\n"


@pytest.mark.parametrize(
    "program",
    [
        "import os\nos._exit(0)\n",
        "raise SystemExit(0)\n",
        "import atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)\n",
        "import sys\nsys.exit()\n",
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "    def __bool__(self):\n        return True\n"
        "def add(a, b):\n    return Anything()\n",
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\ndef add(a, b):\n    return 5\n",
    ],
    ids=["os._exit", "SystemExit", "atexit", "sys.exit", "always-equal", "patched-builtins"],
)
def test_reward_hacks_score_zero(program):
    result = run_code(program, TESTS, timeout=3.0)
    assert (result.passed, result.total) == (0, 3), result.stderr_tail


def test_the_program_cannot_see_the_tests():
    # The expected values appear only in the tests; a program that finds them anywhere it can read wins.
    spy = textwrap.dedent("""
        import gc, os, sys
        needle = str(int('9182736') * 100 + 45)  # not spelled out: the program's own text must not match
        found = None
        def scan(path):
            global found
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                data = os.read(fd, 1 << 20)
                os.close(fd)
            except OSError:
                return
            if needle.encode() in data:
                found = int(needle)
                print('found in', path, file=sys.stderr)
        for pid in os.listdir('/proc'):
            if pid.isdigit():
                for name in ('cmdline', 'environ'):
                    scan(f'/proc/{pid}/{name}')
                try:
                    for fd in os.listdir(f'/proc/{pid}/fd'):
                        scan(f'/proc/{pid}/fd/{fd}')
                except OSError:
                    pass
        for folder, _, files in os.walk('/sandbox'):
            for name in files:
                scan(os.path.join(folder, name))
        if any(needle in o for o in gc.get_objects() if isinstance(o, str) and o is not needle):
            found = int(needle)
            print('found in memory', file=sys.stderr)
        def answer(x):
            return found
        print(found)
    """)
    result = run_code(spy, "assert answer(1) == 918273645", timeout=5.0)
    assert (result.passed, result.status) == (0, "ok"), result.stderr_tail
    result = run_code(spy, [{"input": "", "output": "918273645"}], timeout=5.0)
    assert result.passed == 0


# --- one timeout per run, throughput ----------------------------------------------------------------------------


def test_one_timeout_covers_all_the_tests():
    start = time.monotonic()
    result = run_code("while True:\n    pass\n", [{"input": "", "output": ""}] * 4, timeout=1.0)
    assert time.monotonic() - start < 2.5
    assert (result.passed, result.total, result.status) == (0, 4, "timeout")
    looping = "def f(x):\n    while True:\n        pass\n"
    start = time.monotonic()
    result = run_code(looping, "assert f(1)\nassert f(2)\nassert f(3)\nassert f(4)\n", timeout=1.0)
    assert time.monotonic() - start < 2.5
    assert (result.passed, result.total, result.status) == (0, 4, "timeout")


def test_parallel_workers_score_each_completion():
    completions = [f"```python\nprint(int(input()) + {k})\n```" for k in range(6)]
    results = code_results(None, completions, [[{"input": "1", "output": "3"}]] * 6, workers=3)
    assert [r.passed for r in results] == [0, 0, 1, 0, 0, 0]


# --- no sandbox: refuse unless accepted -------------------------------------------------------------------------


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "_unsafe_accepted", False)
    monkeypatch.setattr(sandbox, "_warned", False)
    sandbox.problem.cache_clear()
    yield
    sandbox.problem.cache_clear()


def test_without_the_sandbox_tool_code_rewards_refuse(no_bwrap):
    with pytest.raises(SparrowError, match="bubblewrap.*--unsafe-code-reward"):
        sandbox.require_sandbox()
    with pytest.raises(SparrowError, match="no sandbox available"):
        run_code("print(1)", [{"input": "", "output": "1"}])


def test_without_the_sandbox_tool_the_user_can_accept_the_risk(no_bwrap, monkeypatch, capsys):
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "maybe")
    with pytest.raises(SparrowError, match="SPARROW_UNSAFE_CODE_REWARD='maybe'"):
        sandbox.require_sandbox()
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    assert sandbox.require_sandbox() == "unsafe"
    assert "WITHOUT a sandbox" in capsys.readouterr().err
    result = run_code(ADD, TESTS.replace("== 0", "== 1"))
    assert (result.passed, result.total, result.status) == (2, 3, "ok")
    monkeypatch.delenv(sandbox.UNSAFE_ENV)
    monkeypatch.setattr(sandbox, "_unsafe_accepted", False)
    assert sandbox.require_sandbox(allow_unsafe=True) == "unsafe"
    assert run_code("print(6 * 7)", [{"input": "", "output": "42"}]).reward == 1.0
