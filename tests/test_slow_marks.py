"""The suite's budget holds itself (docs/design/testing.md): every test marked ``slow`` (over
60 s on a cold compilation cache) says why in its docstring, in a paragraph starting ``Slow:``;
tests/conftest.py's terminal summary names the tests over 60 s that are not marked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _is_slow_mark(node: ast.expr) -> bool:
    """``pytest.mark.slow`` (or a call of it), alone or in a list of marks."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_slow_mark(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node.value).endswith("mark")


def slow_tests_without_reason(source: str) -> list[str]:
    """Test functions of one module marked slow (by a decorator, or by the module's
    ``pytestmark``) whose docstring has no ``Slow:`` paragraph."""
    tree = ast.parse(source)
    module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and _is_slow_mark(n.value) for n in tree.body)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            if module_slow or any(_is_slow_mark(d) for d in node.decorator_list):
                if "Slow:" not in (ast.get_docstring(node) or ""):
                    missing.append(node.name)
    return missing


def test_every_slow_test_says_why():
    missing = {str(p.relative_to(TESTS)): names for p in sorted(TESTS.rglob("test_*.py"))
               if (names := slow_tests_without_reason(p.read_text()))}
    assert not missing, f"marked slow without a 'Slow:' reason in the docstring: {missing}"


@pytest.mark.parametrize(("source", "missing"), [
    ("import pytest\n@pytest.mark.slow\ndef test_a():\n    '''Compiles.'''\n", ["test_a"]),
    ("import pytest\n@pytest.mark.slow\ndef test_a():\n    '''Checks.\n\n    Slow: compiles 9 programs.'''\n", []),
    ("import pytest\npytestmark = [pytest.mark.gemma, pytest.mark.slow]\ndef test_b():\n    pass\n", ["test_b"]),
    ("import pytest\n@pytest.mark.gemma\ndef test_c():\n    pass\n", []),
])
def test_the_check_finds_a_missing_reason(source, missing):
    assert slow_tests_without_reason(source) == missing
