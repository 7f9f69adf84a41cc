"""The package's layers: each imports only from its own layer or below, and no two modules import each other.

Checked twice: statically (every `import` in every module, function-level ones included, against the layer table)
and by importing the layers bottom up in a fresh interpreter, listing which `sparrow.*` modules each loaded.
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sparrow"
TABLE = ROOT.parent / "docs" / "architecture.md"


def read_layers() -> list[list[str]]:
    """The layer table of docs/architecture.md ("## Layers": rows `| N | `a/`, `b.py` | ... |`), as module names
    per layer, layer 0 first."""
    section = TABLE.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            names = re.findall(r"`([\w/.]+)`", cells[1])
            rows[int(cells[0])] = ["sparrow." + n.removesuffix("/").removesuffix(".py") for n in names]
    assert sorted(rows) == list(range(len(rows))), f"{TABLE}: layers numbered {sorted(rows)}; expected 0..N"
    return [rows[n] for n in range(len(rows))]


LAYERS = read_layers()


def layer_of(module: str) -> int:
    top = ".".join(module.split(".")[:2])
    for number, members in enumerate(LAYERS):
        if top in members:
            return number
    raise AssertionError(f"{module} is in no layer; add its package to the layer table of {TABLE}")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """The sparrow modules `module` imports anywhere in its file (a name imported from a package counts as its
    submodule when it is one)."""
    modules, package = _modules(), module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sparrow")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("sparrow"):
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return found - {module}


def test_the_table_names_every_module_of_the_package_once():
    names = [m for layer in LAYERS for m in layer]
    present = {f"sparrow.{p.stem}" for p in ROOT.iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert sorted(names) == sorted(set(names)) and set(names) == present


def test_every_import_goes_to_the_same_layer_or_below():
    climbs = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
              for m, path in _modules().items() if m != "sparrow" for t in _imports(m, path)
              if t != "sparrow" and layer_of(t) > layer_of(m)]
    assert climbs == []


def test_no_two_modules_import_each_other_even_through_others():
    graph = {m: _imports(m, path) - {"sparrow"} for m, path in _modules().items()}

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted({tuple(sorted((m, t))) for m in graph for t in graph[m] if m in reaches(t)})
    assert cycles == []


def test_importing_a_layer_loads_nothing_above_it():
    """One fresh interpreter imports the layers bottom up and lists what is loaded after each: a module above layer
    N loaded at that point came from importing layers 0..N, and a module above N it loads would already show after
    the lowest layer that loads it, so this equals importing each layer alone in its own interpreter."""
    code = ("import importlib, json, sys\n"
            f"for layer in {LAYERS[:-1]!r}:\n"
            "    for name in layer:\n"
            "        importlib.import_module(name)\n"
            "    print(json.dumps(sorted(m for m in sys.modules if m.startswith('sparrow.'))))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent)
    lines = run.stdout.splitlines()
    assert len(lines) == len(LAYERS) - 1
    for number, line in enumerate(lines):
        loaded = json.loads(line)
        above = [m for m in loaded if layer_of(m) > number]
        assert above == [], f"importing layers 0-{number} loads {above}"
        assert set(LAYERS[number]) <= set(loaded)
