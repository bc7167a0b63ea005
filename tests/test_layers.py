"""The package's layers, read from its source: the numpy layer (core/, config.py, errors.py) never imports MindSpore,
no module imports from a higher layer, and there is no import cycle.

Every import statement counts, including those inside functions (a lazy import still ties the layers together at
run time); imports under ``if TYPE_CHECKING:`` do not.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mindspore_eagle"

# Layers, lowest first; a module may import from its own layer and the ones below it. The rank of
# mindspore_eagle.X.Y is the rank of X (a subpackage or a top-level module).
LAYERS = [
    ("mindspore_eagle", "errors", "config", "core"),     # numpy / pure Python: never MindSpore
    ("kernels",),
    ("models", "evalsets"),                              # evalsets reads its files through models/fetch.py
    ("runners",),
    ("serving",),
    ("bench", "train"),                                  # clients of serving
    ("cli", "__main__"),
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}

# Imports that break the layering, each named once so that it stays visible (none today); remove an entry when the
# code is fixed (the test fails on an entry that no longer occurs).
KNOWN_UPWARD: set = set()

MINDSPORE = {"mindspore", "mindformers"}        # mindformers imports mindspore


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()
NUMPY_LAYER = sorted(m for m in MODULES if m.startswith("mindspore_eagle.core.")
                     or m in ("mindspore_eagle.config", "mindspore_eagle.errors"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@lru_cache(maxsize=None)
def imports_of(module: str) -> tuple[tuple[int, str], ...]:
    """(line, imported module) for every import statement of ``module``: package modules by their full dotted name
    (``from mindspore_eagle.serving import batch_job`` -> mindspore_eagle.serving.batch_job; a name that is not a
    submodule -> the package), other packages by their top-level name."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((node.lineno, a.name if a.name.startswith("mindspore_eagle") else a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base[:len(base) - node.level + 1]
                mod = ".".join(pkg + ([node.module] if node.module else []))
            else:
                mod = node.module
            if not mod.startswith("mindspore_eagle"):
                out.append((node.lineno, mod.split(".")[0]))
                return
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else mod))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return tuple(out)


def _parents(module: str) -> list[str]:
    """The packages whose __init__.py runs before ``module``: mindspore_eagle, mindspore_eagle.X, ..."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]


def _package_edges(module: str):
    """(line, imported package module) of ``module``, plus the parent packages each import runs (line 0)."""
    for line, target in imports_of(module):
        if target in MODULES:
            yield line, target
            for p in _parents(target):
                yield 0, p


def _rank(module: str) -> int:
    part = module.split(".")[1] if "." in module else module
    assert part in RANK, f"{module}: not in LAYERS of tests/test_layers.py; give it a layer"
    return RANK[part]


def mindspore_path(start: str) -> list[str] | None:
    """The import chain by which importing ``start`` reaches MindSpore, as 'file:line imports X' steps, or None."""
    seen = {start: None}
    todo = deque([start, *_parents(start)])
    for p in _parents(start):
        seen.setdefault(p, (start, 0))
    while todo:
        m = todo.popleft()
        for line, target in imports_of(m):
            if target in MINDSPORE:
                steps = [f"{_rel(MODULES[m])}:{line} imports {target}"]
                while seen.get(m):
                    prev, pline = seen[m]
                    steps.insert(0, f"{_rel(MODULES[prev])}:{pline} imports {m}" if pline else
                                 f"importing {prev} runs {_rel(MODULES[m])}")
                    m = prev
                return steps
        for line, target in _package_edges(m):
            if target not in seen:
                seen[target] = (m, line)
                todo.append(target)
    return None


# ------------------------------------------------------------------------------------------- numpy layer --
def test_numpy_layer_is_known():
    assert "mindspore_eagle.core.tree" in NUMPY_LAYER and "mindspore_eagle.config" in NUMPY_LAYER
    assert "mindspore_eagle.errors" in NUMPY_LAYER and len(NUMPY_LAYER) >= 6


@pytest.mark.parametrize("module", NUMPY_LAYER)
def test_numpy_layer_never_imports_mindspore_statically(module):
    """Through every package module it imports (and their imports, and the packages' __init__.py), no import
    statement names mindspore or mindformers."""
    path = mindspore_path(module)
    assert path is None, f"{module} reaches MindSpore: " + " -> ".join(path)


def test_numpy_layer_never_imports_mindspore_when_run():
    """Each numpy-layer module imported alone, in a fresh interpreter, leaves no mindspore module loaded."""
    code = ("import importlib, json, sys\n"
            "out = {}\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "    out[name] = sorted(m for m in sys.modules if m.split('.')[0] in ('mindspore', 'mindformers'))\n"
            "print(json.dumps(out))\n")
    found = {}
    for name in NUMPY_LAYER:                        # one interpreter per module: nothing is shared between them
        res = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        found.update(json.loads(res.stdout.strip().splitlines()[-1]))
    assert set(found) == set(NUMPY_LAYER)
    bad = {name: mods[:5] for name, mods in found.items() if mods}
    assert not bad, f"importing these loads MindSpore: {bad}"


# ---------------------------------------------------------------------------------------------- layering --
def test_every_module_has_a_layer():
    missing = sorted({m.split(".")[1] for m in MODULES if "." in m} - set(RANK))
    assert not missing, f"give these a layer in LAYERS: {missing}"


def test_no_module_imports_from_a_higher_layer():
    upward, seen = [], set()
    for module in MODULES:
        for line, target in imports_of(module):
            if target not in MODULES or _rank(target) <= _rank(module):
                continue
            seen.add((module, target))
            if (module, target) not in KNOWN_UPWARD:
                below = sorted(p for p, r in RANK.items() if r <= _rank(module) and p != "mindspore_eagle")
                upward.append(f"{_rel(MODULES[module])}:{line} imports {target} "
                              f"({module.split('.')[1]} may import only {', '.join(below)})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)
    stale = sorted(KNOWN_UPWARD - seen)
    assert not stale, f"fixed, remove from KNOWN_UPWARD in tests/test_layers.py: {stale}"


def test_no_import_cycle():
    """No cycle among the package's modules, counting every import statement (lazy ones too)."""
    graph = {m: sorted({t for _, t in imports_of(m) if t in MODULES and t != m}) for m in MODULES}
    state, stack, cycles = {}, [], []

    def walk(m):
        state[m] = "open"
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                walk(t)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            walk(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_imports():
    """The readers above find what they look for (guards against a check that passes because it reads nothing)."""
    assert any(t == "mindspore_eagle.errors" for _, t in imports_of("mindspore_eagle.config"))
    assert any(t in MINDSPORE for _, t in imports_of("mindspore_eagle.kernels.runtime"))
    chain = mindspore_path("mindspore_eagle.runners.teacher")
    assert chain and chain[0].startswith("mindspore_eagle/runners/teacher.py:")
    assert _rank("mindspore_eagle.serving.engine") > _rank("mindspore_eagle.runners.teacher")
