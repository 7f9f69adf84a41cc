"""The sizes the package holds itself to: no file of sparrow/ over 360 lines and no function over 60, so that a
module is one idea read at once and a function fits a screen.

`EXCEPTIONS` names each file still over the file limit and why (none at present: a file over it is split along
its ideas instead); an exception whose file is back under the limit fails as well, so the list only shrinks. There
are no exceptions to the function limit.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE_LINES = 360
FUNCTION_LINES = 60

EXCEPTIONS: dict[str, str] = {}  # "sparrow/path.py": why it stays over FILE_LINES


def _sources() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted((ROOT / "sparrow").rglob("*.py"))}


def test_no_file_is_over_the_limit_except_the_named_ones():
    sizes = {name: len(text.splitlines()) for name, text in _sources().items()}
    over = {name: n for name, n in sizes.items() if n > FILE_LINES and name not in EXCEPTIONS}
    assert over == {}, f"files over {FILE_LINES} lines; split them along their ideas"
    stale = [name for name in EXCEPTIONS if sizes.get(name, 0) <= FILE_LINES]
    assert stale == [], "back under the limit (or gone): remove them from EXCEPTIONS"


def test_no_function_is_over_the_limit():
    long = {}
    for name, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long[f"{name}:{node.lineno} {node.name}"] = lines
    assert long == {}, f"functions over {FUNCTION_LINES} lines"
