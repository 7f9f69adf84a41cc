"""An assert block split into tests: each top-level ``assert`` with the statements before it (see __init__.py),
every assert rewritten so that an object of the program's own never passes it by its truth alone.

Sparrow imports this module (``split_tests``, to check a block before a run): standard library only, no sibling
imports (see __init__.py).
"""

from __future__ import annotations

import ast

TRUTH = "__sparrow_truth__"


class _GuardAsserts(ast.NodeTransformer):
    """``assert x`` -> ``assert __sparrow_truth__(x)``: an object of the program's own never passes an assert by
    its truth value alone (any object is truthy by default); plain data does as usual (the judge binds the name
    to remote.truth)."""

    def visit_Assert(self, node):
        self.generic_visit(node)
        node.test = ast.Call(func=ast.Name(id=TRUTH, ctx=ast.Load()), args=[node.test], keywords=[])
        return node


def split_tests(source: str) -> list[list[ast.stmt]]:
    """The tests of an assert block: each top-level assert with the statements before it (see the package doc).
    Raises SyntaxError for a block that is not Python."""
    body = ast.fix_missing_locations(_GuardAsserts().visit(ast.parse(source, "<tests>"))).body
    tests, current = [], []
    for statement in body:
        current.append(statement)
        if isinstance(statement, ast.Assert):
            tests.append(current)
            current = []
    if current:
        if tests:
            tests[-1].extend(current)
        else:
            tests.append(current)
    return tests
