"""Run sparrow's CLI, or a script, with the sparrow package of another checkout: the baseline of a before/after
benchmark.

    git worktree add /tmp/old <commit>
    .venv/bin/python benchmarks/at_worktree.py /tmp/old sparrow bench --model smollm2-135m ...
    .venv/bin/python benchmarks/at_worktree.py /tmp/old benchmarks/bench_attention_kernel.py --spans 5

`PYTHONPATH=/tmp/old` alone is not enough: the venv's editable install puts an import finder ahead of the path,
so `import sparrow` still loads this checkout and a "before" run measures the new code. This removes that finder,
puts the worktree first and checks where sparrow came from. Give the old run its own TORCH_EXTENSIONS_DIR so the
two kernels' builds do not replace each other between runs.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    worktree = Path(sys.argv[1]).resolve()
    if not (worktree / "sparrow" / "__init__.py").is_file():
        raise SystemExit(f"{worktree} holds no sparrow package (expected {worktree}/sparrow/__init__.py)")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
    sys.path.insert(0, str(worktree))
    import sparrow

    if not Path(sparrow.__file__).resolve().is_relative_to(worktree):
        raise SystemExit(f"sparrow was imported from {sparrow.__file__}, not from {worktree}")
    what, rest = sys.argv[2], sys.argv[3:]
    if what == "sparrow":
        sys.argv = ["sparrow", *rest]
        runpy.run_module("sparrow.cli", run_name="__main__", alter_sys=True)
    else:
        sys.argv = [what, *rest]
        runpy.run_path(what, run_name="__main__")


if __name__ == "__main__":
    main()
