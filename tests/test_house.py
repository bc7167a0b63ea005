"""House rule read from the package's source (nothing imported): every function of mindspore_eagle/ is at most 80
lines (``def`` to its last line, docstring included), so each reads as an outline of named steps."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mindspore_eagle"
MAX_LINES = 80


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function or method of ``source`` longer than MAX_LINES."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_LINES]


def test_no_function_over_80_lines():
    long = {p.relative_to(ROOT).as_posix(): found for p in sorted(PKG.rglob("*.py"))
            if (found := long_functions(p.read_text(encoding="utf-8")))}
    assert long == {}, f"functions over {MAX_LINES} lines: {long}"


def test_the_rule_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"class A:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n") == \
        [("f", MAX_LINES + 1)]
    assert long_functions(f"def g():\n{body[:-len(body.splitlines()[-1]) - 1]}\n") == []
