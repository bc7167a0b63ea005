"""The documentation names what exists: every repository path and every dotted code reference (``module.Name``,
``module.Class.member``, ``Class.member``) in docs/architecture.md is in the source, read with ast (nothing is
imported); and no file of the package, the tests or the scripts points at a document the repository does not have.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mindspore_eagle"
DOCS = ["docs/architecture.md"]                 # documents whose code references are checked

PATH_RE = re.compile(r"\b(?:mindspore_eagle|tests|scripts|docs|configs)/[\w./-]*[\w/]")
DOTTED_RE = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "sh", "txt", "safetensors", "gguf", "whl", "mindir"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


@lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(encoding="utf-8"))


def _class_members(cls: ast.ClassDef) -> set[str]:
    """Methods, class attributes, dataclass fields and ``self.x = ...`` attributes of a class."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


@lru_cache(maxsize=None)
def _top_level(module: str) -> dict[str, ast.AST | None]:
    """Names a module defines at top level (functions, classes, assignments, imports; a package's submodules)."""
    names: dict[str, ast.AST | None] = {}
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try)):        # try: import x / except: x = None, if/else definitions
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.setdefault(sub.name, sub)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.setdefault(sub.id, None)
                elif isinstance(sub, ast.alias):
                    names.setdefault((sub.asname or sub.name).split(".")[0], None)
    for m in MODULES:
        if m.startswith(module + ".") and "." not in m[len(module) + 1:]:
            names.setdefault(m.rsplit(".", 1)[1], None)
    return names


@lru_cache(maxsize=None)
def _classes() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for m in MODULES:
        for node in ast.walk(_tree(m)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(node)
    return out


def _resolves_in(module: str, rest: list[str]) -> bool:
    if not rest:
        return True
    top = _top_level(module)
    if rest[0] not in top:
        return False
    sub = f"{module}.{rest[0]}"
    if sub in MODULES:
        return _resolves_in(sub, rest[1:])
    node = top[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
        return rest[1] in _class_members(node)
    return True                                             # a function's or a value's attribute: not followed


def check_reference(ref: str) -> str | None:
    """Why ``ref`` does not exist, or None when it exists or is not a reference to this package's code."""
    parts = ref.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None                                          # a file name (kv.py); paths are checked separately
    if parts[0] == "mindspore_eagle":
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in MODULES:
                return None if _resolves_in(".".join(parts[:i]), parts[i:]) else f"{ref}: no such name"
        return f"{ref}: no such module"
    for i in range(len(parts) - 1, 0, -1):                   # longest module-path suffix first: serving.engine.X
        suffix = ".".join(parts[:i])
        cands = [m for m in MODULES if m.endswith("." + suffix)]
        if cands:
            if any(_resolves_in(m, parts[i:]) for m in cands):
                return None
            return f"{ref}: {parts[i]} is not defined in {', '.join(_rel(MODULES[m]) for m in cands)}"
    if parts[0][:1].isupper() and parts[0][1:2].islower():  # Class.member
        classes = _classes().get(parts[0])
        if classes is None:
            return f"{ref}: no class {parts[0]} in mindspore_eagle"
        if not any(parts[1] in _class_members(c) for c in classes):
            return f"{ref}: class {parts[0]} has no member {parts[1]}"
    return None                                              # a config key (cache.block_size), mindspore.jit, ...


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _code_spans(text: str) -> list[str]:
    """Inline code spans and fenced blocks: where the documentation names code."""
    blocks = re.findall(r"^```.*?\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


@pytest.mark.parametrize("doc", DOCS)
def test_paths_in_docs_exist(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted({p for p in PATH_RE.findall(text) if not (ROOT / p.rstrip("/.")).exists()})
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_code_references_in_docs_exist(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    refs = sorted({r for span in _code_spans(text) for r in DOTTED_RE.findall(span)})
    assert refs, f"{doc}: no code references found"
    problems = [p for p in map(check_reference, refs) if p]
    assert not problems, f"{doc} names code that does not exist:\n" + "\n".join(problems)


def test_reference_checker_tells_existing_from_missing():
    assert check_reference("tree.DraftTree") is None and check_reference("core.tree.DraftTree") is None
    assert check_reference("mindspore_eagle.runners.teacher.TeacherRunner") is None
    assert check_reference("TeacherRunner.verify") is None and check_reference("kv.py") is None
    assert check_reference("cache.block_size") is None and check_reference("mindspore.jit") is None
    assert check_reference("tree.NoSuchThing") and check_reference("TeacherRunner.no_such_method")
    assert check_reference("PanguTeacher.forward") and check_reference("mindspore_eagle.verify")
    assert PATH_RE.findall("see `mindspore_eagle/core/tree.py` and docs/errors.md.") == [
        "mindspore_eagle/core/tree.py", "docs/errors.md"]


# ------------------------------------------------------------------------------------------------------------
# DOCUMENTS THE REPOSITORY DOES NOT HAVE: nothing under mindspore_eagle/, tests/ or scripts/ may point at them.
ABSENT_DOCS = ("eagle3" + ".md", "feasibility" + ".md", "pangu_mindformers" + ".md")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".yaml", ".yml", ".json", ".sh", ".cfg", ".ini", ".toml"}


def test_no_mention_of_absent_docs():
    assert not any((ROOT / "docs" / d).exists() for d in ABSENT_DOCS)
    hits = []
    for top in ("mindspore_eagle", "tests", "scripts"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix not in TEXT_SUFFIXES or "__pycache__" in p.parts or not p.is_file():
                continue
            for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                hits += [f"{_rel(p)}:{n}: {d}" for d in ABSENT_DOCS if d in line]
    assert not hits, "mentions of documents the repository does not have:\n" + "\n".join(hits)
