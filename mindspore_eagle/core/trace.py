"""Per-step and per-turn trace records, JSONL output, phase timing and summaries.

No MindSpore import. Metrics are derived from these records only (docs/design.md, "Traces and metrics"): one
JSONL ``StepTrace`` line per speculative step, one ``TurnTrace`` line per turn. Units: wall milliseconds
(``*_ms``), tokens per second (``tok_per_s``). Accept length L_k counts the bonus token (docs/design.md, "Accepted
length"). Timing is host wall time (``time.perf_counter``); device work is only included if the caller synchronises
(the engine reads the device once per step) before a phase ends.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

import numpy as np

PHASES = ("draft", "tensorize", "mask", "verify", "decode", "accept", "commit")


def _plain(obj):
    """JSON fallback for numpy scalars and arrays."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


class _Record:
    """Mixin: ``to_json`` writes a one-line JSON object tagged with ``kind``; ``from_dict`` reads it back."""

    kind = ""

    def to_json(self) -> str:
        """One-line JSON object (no trailing newline) with ``"kind"`` first, then the dataclass fields."""
        return json.dumps({"kind": self.kind, **asdict(self)}, default=_plain, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict):
        """Rebuild from a parsed JSON object; the ``kind`` key is ignored, unknown keys raise ValueError."""
        names = {f.name for f in fields(cls)}
        extra = set(d) - names - {"kind"}
        if extra:
            raise ValueError(f"unknown {cls.__name__} keys {sorted(extra)}; allowed {sorted(names)}")
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class StepTrace(_Record):
    """One decode step of a speculative turn: draft -> tensorize -> mask -> verify -> accept -> commit, or (when
    the policy chose plain decoding) one teacher decode (budget 1)."""

    kind = "step"
    step: int  # step index within the turn, from 0
    accept_len: int  # L_k = accepted drafts + bonus, >= 1 (1 for a plain decode step)
    accepted: list = field(default_factory=list)  # int [L_k]; accepted node positions, root (0) first
    n_nodes: int = 0  # real nodes in the verified tree (<= budget; 1 for a plain decode step)
    budget: int = 0  # tokens verified this step (the compiled budget m; 1 = plain decode; 0 = not recorded)
    drafted: bool = True  # the drafter ran this step
    accepted_suffix: int = 0  # accepted drafted nodes proposed by suffix candidates only (core/suffix.py)
    accepted_both: int = 0  # accepted drafted nodes proposed by both the drafter and suffix candidates
    predicted_len: float = 0.0  # the policy's expected L_k for the chosen budget (1.0 for plain decode)
    draft_ms: float = 0.0  # drafter context pass + tree expansion (+ suffix candidates and the merge)
    draft_ctx_ms: float = 0.0  # of draft_ms: the drafter's context pass (single-sequence rounds)
    draft_expand_ms: float = 0.0  # of draft_ms: the drafter's tree expansion, all its calls (single-sequence rounds)
    expansions: int = 0  # drafter tree-expansion calls this step (single-sequence rounds)
    tensorize_ms: float = 0.0  # tree.tensorize
    mask_ms: float = 0.0  # attention bias / slot mapping for the tree
    verify_ms: float = 0.0  # teacher forward over the tree tokens
    decode_ms: float = 0.0  # teacher decode of a plain step
    accept_ms: float = 0.0  # verify.accept_greedy / accept_sampling
    commit_ms: float = 0.0  # KV commit + drafter context update
    total_ms: float = 0.0  # whole step wall time (>= sum of phases)

    def __post_init__(self):
        self.accepted = [int(i) for i in self.accepted]


@dataclass
class TurnTrace(_Record):
    """One prompt turn: prefill plus the decode loop."""

    kind = "turn"
    turn_id: str  # caller's id, e.g. "mtbench-81-0"
    prompt_tokens: int  # tokens prefilled
    new_tokens: int  # tokens generated
    prefill_ms: float = 0.0  # prefill wall time
    decode_ms: float = 0.0  # decode loop wall time (excludes prefill)
    tok_per_s: float = 0.0  # new_tokens / decode seconds
    compile_count: int = 0  # graph compilations during the turn
    compile_ms: float = 0.0  # wall ms of the calls that compiled them (inside prefill_ms / decode_ms)
    mean_accept_len: float = 0.0  # mean L_k over the turn's tree-verifying steps (1.0 for teacher-only decoding)
    spec_share: float = 0.0  # share of the turn's steps that verified a tree (0.0 for teacher-only decoding)
    warnings: list = field(default_factory=list)  # str; what the user was warned about (e.g. drafter positions)


_KINDS = {StepTrace.kind: StepTrace, TurnTrace.kind: TurnTrace}


def read_jsonl(path) -> list:
    """Parse a trace file written by ``TraceWriter``.

    Returns:
        list of StepTrace / TurnTrace in file order (blank lines skipped).
    Raises:
        ValueError: a line's ``kind`` is not "step" or "turn", or it has unknown keys.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            kind = d.get("kind")
            if kind not in _KINDS:
                raise ValueError(f"{path}:{lineno}: kind = {kind!r} must be one of {sorted(_KINDS)}")
            out.append(_KINDS[kind].from_dict(d))
    return out


class TraceWriter:
    """Append trace records as JSONL, one line per ``write``, flushed immediately; a no-op when path is None.

    Args:
        path: output file (parent folders are created; the file is appended to) or None to disable.
    """

    def __init__(self, path=None):
        self.path = path
        self._f = None
        if path is not None:
            parent = os.path.dirname(os.fspath(path))
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def write(self, record) -> None:
        """Append ``record.to_json()`` and a newline, then flush."""
        if self._f is None:
            return
        self._f.write(record.to_json() + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Timer:
    """Phase stopwatch on ``time.perf_counter``.

    ``with timer.phase("draft"): ...`` adds the block's wall time in ms to ``timer.ms["draft"]`` (accumulating
    over repeated phases); ``with Timer() as t: ...`` also sets ``t.total_ms`` for the whole block.
    """

    def __init__(self):
        self.ms: dict[str, float] = {}
        self.total_ms = 0.0
        self._t0 = 0.0

    @contextmanager
    def phase(self, name: str):
        """Context manager timing one named phase; the time is recorded even if the block raises."""
        t0 = time.perf_counter()
        try:
            yield self
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def phase_kwargs(self) -> dict:
        """``{"draft_ms": ..., ...}`` for every name in PHASES (0.0 when not timed), for ``StepTrace(**...)``."""
        return {f"{p}_ms": self.ms.get(p, 0.0) for p in PHASES}

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.total_ms = (time.perf_counter() - self._t0) * 1e3


def summarize(values) -> dict:
    """Summary statistics of a 1-D sample.

    Args:
        values: iterable of numbers.
    Returns:
        {"mean", "p50", "p90", "p99": float (numpy percentile, linear interpolation), "n": int}; NaN stats when
        n == 0.
    """
    x = np.asarray(list(values), dtype=np.float64).reshape(-1)
    if x.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "n": 0}
    p50, p90, p99 = np.percentile(x, [50, 90, 99], method="linear")
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "n": int(x.size)}


def _row(name: str, values) -> str:
    s = summarize(values)
    return f"{name:<16}{s['n']:>7d}{s['mean']:>11.3f}{s['p50']:>11.3f}{s['p90']:>11.3f}{s['p99']:>11.3f}"


def format_summary(step_traces, turn_traces) -> str:
    """Fixed-width table: per-step accept length, tree size and phase ms; per-turn tok/s, prefill/decode ms.

    The last line gives totals: new tokens, decode seconds, aggregate tok/s (sum new tokens / sum decode s),
    compilations, and the mean accept length over all steps.
    Args:
        step_traces: iterable of StepTrace. turn_traces: iterable of TurnTrace.
    Returns:
        the table as one string (no trailing newline).
    """
    steps, turns = list(step_traces), list(turn_traces)
    lines = [f"{'metric':<16}{'n':>7}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}"]
    lines.append(_row("accept_len", [s.accept_len for s in steps]))
    lines.append(_row("n_nodes", [s.n_nodes for s in steps]))
    for p in PHASES + ("total",):
        lines.append(_row(f"{p}_ms", [getattr(s, f"{p}_ms") for s in steps]))
    for name in ("tok_per_s", "prefill_ms", "decode_ms", "new_tokens"):
        lines.append(_row(name, [getattr(t, name) for t in turns]))
    new = sum(t.new_tokens for t in turns)
    decode_s = sum(t.decode_ms for t in turns) / 1e3
    rate = new / decode_s if decode_s > 0 else float("nan")
    mean_l = summarize([s.accept_len for s in steps])["mean"]
    lines.append(f"total: {new} new tokens in {decode_s:.3f} s decode = {rate:.2f} tok/s; "
                 f"compiles {sum(t.compile_count for t in turns)}; mean accept_len {mean_l:.3f}")
    return "\n".join(lines)
