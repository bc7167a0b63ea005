"""House rules of the training loop's modules: no function of trainer.py / regen_run.py longer than 80 lines
(``def`` to its last line, docstring included), so each reads as an outline of named steps."""
import ast
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[2] / "mindspore_eagle" / "train"
MAX_LINES = 80


@pytest.mark.parametrize("name", ["trainer.py", "regen_run.py"])
def test_functions_are_at_most_80_lines(name):
    tree = ast.parse((TRAIN / name).read_text(encoding="utf-8"))
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_LINES]
    assert long == [], f"{name}: functions over {MAX_LINES} lines: {long}"
