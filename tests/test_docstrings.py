"""Every public function and class of the package says what it is (the guide asks each to
name the equation or algorithm it implements); read from the sources, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import torq

PACKAGE = Path(torq.__file__).parent


def _undocumented(source: str) -> list[str]:
    """Top-level public functions and classes of one module without a docstring."""
    return [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and not node.name.startswith("_")
        and not ast.get_docstring(node)
    ]


def test_the_check_finds_a_missing_docstring() -> None:
    source = (
        'def documented():\n    """Eq. 1."""\n\n'
        "def bare():\n    pass\n\n"
        "def _private():\n    pass\n"
    )
    assert _undocumented(source) == ["bare"]


def test_every_public_function_and_class_has_a_docstring() -> None:
    missing = [
        f"{path.relative_to(PACKAGE)}:{name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _undocumented(path.read_text())
    ]
    assert missing == []
