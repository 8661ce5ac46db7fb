"""A test must be able to fail: one whose every assert sits inside a loop over something computed passes when that
something comes back empty. Each such test asserts the count (or that there is anything) first; this keeps it so."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# Loops over these cannot be empty: literals, range/enumerate/zip/sorted of literals, module constants.
LITERAL_WRAPPERS = ("range", "enumerate", "zip", "sorted", "reversed")


def _literal(node: ast.expr) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id.isupper()
    if isinstance(node, ast.Call) and ast.unparse(node.func) in LITERAL_WRAPPERS:
        return bool(node.args) and all(_literal(a) for a in node.args)
    return False


def _has_unconditional_assert(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[bool, bool]:
    """(asserts at all, an assert not inside a loop over a computed iterable)."""
    found = unconditional = False

    def visit(node: ast.AST, computed_loop: bool) -> None:
        nonlocal found, unconditional
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            inside = computed_loop
            if isinstance(child, ast.For):
                visit(child.iter, computed_loop)
                inside = computed_loop or not _literal(child.iter)
                for stmt in [*child.body, *child.orelse]:
                    visit_stmt(stmt, inside)
                continue
            visit_stmt(child, inside)

    def visit_stmt(node: ast.AST, computed_loop: bool) -> None:
        nonlocal found, unconditional
        if isinstance(node, ast.Assert) or (isinstance(node, ast.With) and any(
                "raises" in ast.unparse(i.context_expr) for i in node.items)):
            found = True
            unconditional = unconditional or not computed_loop
        visit(node, computed_loop)

    visit(fn, False)
    return found, unconditional


def test_no_test_passes_on_an_empty_loop() -> None:
    offenders, checked = [], 0
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                checked += 1
                found, unconditional = _has_unconditional_assert(node)
                if found and not unconditional:
                    offenders.append(f"{path.relative_to(TESTS)}:{node.lineno} {node.name}")
    assert checked > 200  # the walk found the suite
    assert not offenders, "every assert of these is inside a loop over a computed input:\n" + "\n".join(offenders)


def test_the_rule_catches_a_loop_over_nothing() -> None:
    bad = ast.parse("def test_x():\n    for r in rows():\n        assert r\n").body[0]
    good = ast.parse("def test_y():\n    xs = rows()\n    assert len(xs) == 3\n"
                     "    for r in xs:\n        assert r\n").body[0]
    literal = ast.parse("def test_z():\n    for k in (1, 2):\n        assert f(k)\n").body[0]
    assert _has_unconditional_assert(bad) == (True, False)
    assert _has_unconditional_assert(good) == (True, True) and _has_unconditional_assert(literal) == (True, True)
