"""The code reward's harness (sparrow/rewards/harness/) runs in the sandbox without Sparrow, as the directory
itself, where its modules import each other top-level; Sparrow imports a few of them as
``sparrow.rewards.harness.<module>``. So every module imports the standard library and its siblings only, no
module shadows a standard-library one, and the modules Sparrow imports have no sibling imports at all."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "sparrow" / "rewards" / "harness"
MODULES = {p.stem: p for p in HARNESS.glob("*.py")}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import cannot run in the sandbox"
            found.add(node.module.split(".")[0])
    return found


def _imported_by_sparrow() -> set[str]:
    pattern = re.compile(r"sparrow\.rewards\.harness\.(\w+)")
    paths = [p for p in (ROOT / "sparrow").rglob("*.py") if HARNESS not in p.parents]
    return {name for p in paths + sorted((ROOT / "tests").glob("*.py")) for name in pattern.findall(p.read_text())}


def test_the_harness_is_a_runnable_directory():
    assert {"__init__", "__main__", "judge", "worker"} <= set(MODULES)
    assert _imports(MODULES["__init__"]) == set(), "__init__.py is documentation; Sparrow imports the modules"


def test_the_harness_imports_the_standard_library_and_its_siblings_only():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert sorted(set(MODULES) & stdlib - {"__init__", "__main__"}) == []
    outside = {name: sorted(_imports(path) - stdlib - set(MODULES)) for name, path in MODULES.items()}
    assert {name: found for name, found in outside.items() if found} == {}


def test_the_modules_sparrow_imports_import_no_sibling():
    used = _imported_by_sparrow()
    assert used and used <= set(MODULES) - {"__init__", "__main__"}
    siblings = {name: sorted(_imports(MODULES[name]) & set(MODULES)) for name in used}
    assert {name: found for name, found in siblings.items() if found} == {}
