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


# ------------------------------------------------------------------------------------------------------------
# THE MANUAL: README.md and docs/*.md. Fast checks, nothing loaded or run: machine paths, dated headings, cited
# paths, the commands of the code blocks (parsed by the real argparse parsers), and the reference pages
# (configuration.md, serving.md, batch.md) against the code they document.
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402

MANUAL = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))


def _read(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


FENCE_RE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```[ \t]*$", flags=re.S | re.M)   # fences may be indented


def _fenced_blocks(text: str) -> list[str]:
    return FENCE_RE.findall(text)


def _without_fences(text: str) -> str:
    return FENCE_RE.sub("", text)


def _spans(text: str) -> list[str]:
    """Fenced blocks (indented ones too) and inline code spans."""
    return _fenced_blocks(text) + re.findall(r"`([^`\n]+)`", _without_fences(text))


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [f for f in out.decode("utf-8", "replace").split("\0") if f]


# A path that names one machine's layout: a home directory, a container's work folder, a run folder under /tmp.
# Not matched: URLs and code paths (the character before the slash is part of a word or a path), /tmp alone or
# one level deep (a default or a folder an instruction creates), /dev/null, HTTP routes (/health, /v1/...).
def _abs(*parts: str) -> str:
    """An absolute path from its parts (this file spells machine folders only in pieces, so it names none)."""
    return "/" + "/".join(parts)


_NOT_A_PATH_TAIL = r"(?<![\w.~$/-])"          # the slash starts a path: not a URL's or a relative path's
MACHINE_PATH_RES = [re.compile(_NOT_A_PATH_TAIL + re.escape(_abs(d, "")) + tail)
                    for d, tail in (("root", ""), ("home", r"[\w.-]+/"), ("Users", ""), ("work", ""))] + [
    re.compile(r"\b[A-Za-z]:\\\\?" + "Users" + r"\\"),
]
TMP_RUN_RE = re.compile(_NOT_A_PATH_TAIL + re.escape(_abs("tmp", "")) + r"[\w.-]+/[\w.-]+")   # a run folder
DOC_SUFFIXES = {".md", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".toml", ".json", ".rst"}
CODE_SUFFIXES = {".py", ".sh"}
# Tracked files outside this test's owner's paths that still name a machine's folders; each is reported to be
# fixed (then remove it here). Any other file with such a path fails the test.
MACHINE_PATH_KNOWN: set[str] = set()


def machine_paths(text: str, prose: bool) -> list[str]:
    """The machine-specific absolute paths in ``text`` (``prose``: documentation and config files, where a
    /tmp run folder counts too; code may use /tmp folders as defaults)."""
    res = MACHINE_PATH_RES + ([TMP_RUN_RE] if prose else [])
    return [m.group(0) for r in res for m in r.finditer(text)]


def test_machine_path_rule():
    home, run = _abs("home", "alice", "run"), _abs("tmp", "train_run", "drafter")
    assert machine_paths(f"see {_abs('root', 'x')} and {home} and {_abs('work', 'main', 'docs')}", True) == [
        _abs("root", ""), _abs("home", "alice", ""), _abs("work", "")]
    assert machine_paths("C:" + "\\" + "Users" + "\\bob\\x", True) and machine_paths(f"--out {run}", True)
    assert not machine_paths(f"--out {run}", False)
    for ok in ("GET /health", "POST /v1/chat/completions", "> /dev/null",
               "out=${2:-" + _abs("tmp", "regen_bench") + "}", "https://github.com" + _abs("home", "x", "y"),
               "specforge/data/preprocessing.py", "git worktree add " + _abs("tmp", "snap") + " HEAD",
               "$HOME" + _abs("work", "x"), "~/.cache/mindspore_eagle", "/cache/drafter", "/path/to/openPangu"):
        assert not machine_paths(ok, True), ok


def test_no_tracked_text_names_a_machine_path():
    hits = []
    for rel in _tracked_files():
        suffix = Path(rel).suffix.lower()
        prose = suffix in DOC_SUFFIXES or rel.startswith("configs/")
        if not (prose or suffix in CODE_SUFFIXES) or rel in MACHINE_PATH_KNOWN or not (ROOT / rel).is_file():
            continue
        text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
        hits += [f"{rel}:{text.count(chr(10), 0, text.find(h)) + 1}: {h}" for h in machine_paths(text, prose)]
    assert not hits, "tracked files name a machine's absolute paths:\n" + "\n".join(hits)


DATE_RES = [re.compile(p) for p in (
    r"20\d\d-\d\d",                                              # 2026-12-04
    r"\b20\d{6}\b|\b20\d{6}-",                                   # 20261204, 20261204-172723
    r"\b\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* 20\d\d",
    r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{1,2},? 20\d\d",
)]


def test_no_heading_in_docs_is_dated():
    bad = []
    for p in sorted((ROOT / "docs").rglob("*.md")):
        for line in _without_fences(p.read_text(encoding="utf-8")).splitlines():
            if re.match(r"^#+ ", line) and any(r.search(line) for r in DATE_RES):
                bad.append(f"{_rel(p)}: {line}")
    assert not bad, "dated headings (the manual is not a notebook):\n" + "\n".join(bad)


LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
CITED_RE = re.compile(r"(?<![\w./-])((?:docs|configs|scripts|mindspore_eagle|tests|data)/[\w./{},*-]*[\w/*}])")


def _cited_paths(rel: str) -> list[tuple[str, Path]]:
    """(as written, resolved path) of every relative link and every repository path in a code span or block."""
    text = _read(rel)
    base = (ROOT / rel).parent
    out = []
    for target in LINK_RE.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                                             # a URL or an anchor
        out.append((target, base / target.split("#", 1)[0]))
    for span in _spans(text):
        out += [(p, ROOT / p) for p in CITED_RE.findall(span)]
    return out


def _exists(path: Path) -> bool:
    text = str(path).rstrip("/.")
    if "{" in text:                                              # results_{auto,float16}.json
        head, alts, tail = re.match(r"(.*?)\{([^}]*)\}(.*)", text).groups()
        return all(_exists(Path(head + a + tail)) for a in alts.split(","))
    if "*" in text:
        return any(Path("/").glob(text.lstrip("/")))
    return Path(text).exists()


@pytest.mark.parametrize("doc", MANUAL)
def test_cited_files_exist(doc):
    missing = sorted({written for written, path in _cited_paths(doc) if not _exists(path)})
    assert not missing, f"{doc} cites files that do not exist: {missing}"


# -- commands in code blocks, parsed by the parsers the commands use (nothing is run) --
def _parse_ours(argv: list[str]) -> None:
    """Parse ``argv`` (after ``mindspore-eagle``) with the parser that command uses; SystemExit on a bad one."""
    from mindspore_eagle import bench, cli
    from mindspore_eagle.bench import serving as bench_serving
    from mindspore_eagle.train import __main__ as train_main
    from mindspore_eagle.train import regen_run

    if argv[:2] == ["bench", "serve"]:
        bench_serving.build_parser().parse_args(argv[2:])
    elif argv[:1] == ["bench"]:
        bench.build_parser().parse_args(argv[1:])
    elif argv[:2] == ["train-drafter", "regen"]:
        regen_run.parse_args(argv[2:])
    elif argv[:1] == ["train-drafter"]:
        train_main.parse_args(argv[1:])
    else:
        args = cli.build_parser().parse_args(argv)
        assert getattr(args, "func", None), "no sub-command"


STARTS = {("mindspore-eagle",): [], ("python", "-m", "mindspore_eagle"): [],
          ("python", "-m", "mindspore_eagle.bench"): ["bench"], ("python", "-m", "mindspore_eagle.train"): ["train-drafter"]}


def _placeholder(tok: str) -> str:
    """A command's placeholder token as a value the parser accepts: IN.jsonl stays, N / DIR / $LR / <n> become 1."""
    if re.fullmatch(r"[A-Z][A-Z_]*|\$\{?\w+\}?|<[^>]+>", tok):
        return "1"
    return tok


def commands_in(text: str) -> list[list[str]]:
    """Every ``mindspore-eagle ...`` / ``python -m mindspore_eagle[.bench|.train] ...`` command of the fenced
    blocks of ``text``, as the argv after the program (``[--opt X]`` brackets dropped, ``...`` left out)."""
    found = []
    for block in _fenced_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            try:
                toks = list(lex)
            except ValueError:                                   # an unbalanced quote: not a shell line
                continue
            i = 0
            while i < len(toks):
                start = next((s for s in STARTS if tuple(toks[i:i + len(s)]) == s), None)
                if start is None:
                    i += 1
                    continue
                j = i + len(start)
                argv = list(STARTS[start])
                while j < len(toks) and not re.fullmatch(r"[;&|<>()]+", toks[j]):
                    tok = toks[j].strip("[]")
                    if tok and tok != "...":
                        argv.append(_placeholder(tok))
                    j += 1
                found.append(argv)
                i = j
    return found


def test_command_finder():
    text = "```bash\npip install x && python -m mindspore_eagle generate --prompt \"a b\"   # note\n" \
           "mindspore-eagle batch --input IN.jsonl --output o [--max-batch N] [--resume]\n" \
           "msrun --worker_num 2 python -m mindspore_eagle.train --out d \\\n  --steps 5 >> log 2>&1 &\n```\n"
    assert commands_in(text) == [["generate", "--prompt", "a b"],
                                 ["batch", "--input", "IN.jsonl", "--output", "o", "--max-batch", "1", "--resume"],
                                 ["train-drafter", "--out", "d", "--steps", "5"]]
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        _parse_ours(["generate", "--no-such-flag"])


def test_commands_in_the_manual_parse():
    bad, n = [], 0
    for doc in MANUAL:
        for argv in commands_in(_read(doc)):
            n += 1
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    _parse_ours(argv)
            except (SystemExit, AssertionError) as e:
                bad.append(f"{doc}: mindspore-eagle {shlex.join(argv)}\n    {err.getvalue().strip() or e}")
    assert n >= 20, f"only {n} commands found: is the finder broken?"
    assert not bad, "commands in the manual that their parser refuses:\n" + "\n".join(bad)


# -- configuration.md against config.py --
def _config_sections() -> dict[str, set[str]]:
    from mindspore_eagle.config import Config

    return {f.name: {g.name for g in dataclasses.fields(f.default_factory())} for f in dataclasses.fields(Config)}


def _documented_keys() -> dict[str, list[str]]:
    """configuration.md: each ``## `section` `` heading and the keys of its table (first column, in backticks)."""
    out: dict[str, list[str]] = {}
    section = None
    for line in _without_fences(_read("docs/configuration.md")).splitlines():
        m = re.match(r"^## `(\w+)`\s*$", line)
        if m:
            section = m.group(1)
            out[section] = []
        elif line.startswith("## "):
            section = None
        elif section and (m := re.match(r"^\| `(\w+)` \|", line)):
            out[section].append(m.group(1))
    return out


def test_configuration_md_lists_every_key_and_only_real_ones():
    real, documented = _config_sections(), _documented_keys()
    assert list(documented) == list(real), f"sections: page {list(documented)}, config.py {list(real)}"
    for section, keys in documented.items():
        assert len(keys) == len(set(keys)), f"{section}: a key is listed twice"
        assert set(keys) == real[section], (f"{section}: missing from the page {sorted(real[section] - set(keys))}, "
                                            f"not in config.py {sorted(set(keys) - real[section])}")


KEY_REF_RE = re.compile(r"(?<![\w./-])(context|model|speculative|generation|cache|batch|serve)\.([A-Za-z_]\w*)")
NOT_KEYS = FILE_SUFFIXES | {"safetensors", "bin"}


def test_config_keys_named_in_the_manual_exist():
    real, bad = _config_sections(), []
    for doc in MANUAL:
        for span in _spans(_read(doc)):
            if "unknown key" in span:                           # errors.md quotes the error for a wrong key
                continue
            for section, key in KEY_REF_RE.findall(span):
                if key not in NOT_KEYS and key not in real[section]:
                    bad.append(f"{doc}: {section}.{key}")
    assert not bad, "config keys that config.py does not have:\n" + "\n".join(sorted(set(bad)))


# -- serving.md against the server's code --
def _metric_names() -> set[str]:
    """The exposed names of the server's metrics, read from metrics.py (counters get Prometheus' _total)."""
    src = (PKG / "serving" / "metrics.py").read_text(encoding="utf-8")
    return {"mseagle_" + name + ("_total" if kind == "Counter" else "")
            for kind, name in re.findall(r"\b(Gauge|Counter|Histogram)\(p \+ \"(\w+)\"", src)}


def test_serving_md_names_every_metric_and_only_real_ones():
    names = _metric_names()
    assert len(names) >= 15
    page = set(re.findall(r"\bmseagle_\w+", _read("docs/serving.md")))
    assert names <= page, f"metrics missing from docs/serving.md: {sorted(names - page)}"
    assert page <= names, f"docs/serving.md names metrics the server does not have: {sorted(page - names)}"


def test_serving_md_names_every_request_field():
    from mindspore_eagle.serving import openai_protocol as protocol

    page = _read("docs/serving.md")
    fields = set(protocol.ChatCompletionRequest.model_fields) | set(protocol.CompletionRequest.model_fields)
    missing = sorted(f for f in fields if f"`{f}`" not in page and f"`{f}." not in page)
    assert not missing, f"request fields missing from docs/serving.md: {missing}"


def test_batch_md_names_every_record_field():
    from mindspore_eagle.serving import batch_job

    page = _read("docs/batch.md")
    missing = [f for f in (*batch_job.KINDS, *batch_job.GEN_FIELDS, "id", "line", "text", "prompt_tokens",
                           "new_tokens", "tok_per_s", "mean_accept_len", "stop_reason", "error")
               if f"`{f}`" not in page]
    assert not missing, f"record fields missing from docs/batch.md: {missing}"
