"""Compile every graph a chat or batch job can reach, in one fixed order, before the first timed token.

In fused mode each :class:`~mindspore_eagle.kernels.runtime.CompiledFn` compiles one graph per input shape on first use
(~1 s each for the 135M teacher on 2 cores). The shapes a conversation can reach are finite and known from the
configuration:

- teacher: each prefill bucket (16..prefill_chunk) x each attention width (256, 512, ..., S); decode (1 query
  row) and verification (k = each tree budget of ``engine.verify_budgets()``) at each width; the K/V compaction of
  a commit (D_max + 2 rows); none of them for calls that run on the host (``models/llama_host.py``: in fused mode
  on the cpu backend, every call of a teacher whose matrices are packed);
- drafter: each context-pass bucket (1..prefill_chunk rows; feature fusion, layer and the head on the last row
  in one graph) x each width; tree expansion (top_k rows) at each width; on the cpu backend only the buckets over
  32 rows (smaller calls run on the host without a graph: ``models/eagle3_host.py``).

:func:`warmup` visits them directly (synthetic ids on scratch sequences; the K/V written there is garbage and is
released), always in the same order. With the graph store active (``kernels/graph_cache.py``,
``serving.pipeline.prepare``) each of them is loaded from disk when an earlier process compiled it (~0.3 s against
seconds), whatever order either process compiled in. A teacher-only engine visits no verification or drafter shape.

Progress: :func:`report_compiles` prints one line per graph compiled or loaded and, while one takes longer,
a line every few seconds; :func:`slow` does the same for any other slow step (loading weights).

Letters: M = tree budget, D = D_max, K = top_k, S = cache.max_seq_len, w = attention width bucket.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time

import numpy as np

from mindspore_eagle.core.tree import DraftTree, tensorize
from mindspore_eagle.runners.shapes import batch_budget, batch_rows

MODES = ("full", "short", "none")
_FILL_ID = 100    # any valid token id: warm-up only needs shapes


@contextlib.contextmanager
def _scratch(runner, n: int):
    """A scratch sequence of a TeacherRunner / DrafterRunner already ``n`` positions long (advanced without running
    the model); freed on exit."""
    sid = runner.new_seq()
    try:
        if n:
            runner.bm.append(sid, n, n)
            runner.bm.advance(sid, n)
        yield sid
    finally:
        runner.free(sid)


def _ids(n: int) -> np.ndarray:
    return np.full(n, _FILL_ID, np.int64)


def _start(prev: int, rows: int, limit: int, lo: int = 0):
    """Prefix length p0 >= lo with p0 + rows in (prev, limit], i.e. a call of ``rows`` new positions that needs
    the width bucket right above ``prev``; None when no such p0 exists."""
    p0 = max(lo, min(prev, limit - rows))
    return p0 if prev < p0 + rows <= limit else None


def _bucket_calls(buckets, prev: int, limit: int):
    """(b, p0, n) per bucket b: n real rows (n in (b/2, b], so the call pads to b) after a prefix p0."""
    lower = 0
    for b in buckets:
        n = min(b, limit - prev) if prev < limit else 0
        if n > lower:
            p0 = _start(prev, n, limit)
            if p0 is not None:
                yield b, p0, n
        lower = b


def teacher_shapes(teacher, budgets, D: int):
    """Yield (what, fn) calls compiling every teacher graph: prefill buckets, decode, verify per budget, commit;
    none for the calls that run on the host (``TeacherRunner.on_host``: every call of a packed teacher on the cpu
    backend in fused mode).

    Args:
        teacher: TeacherRunner. budgets: tree budgets M to verify (ints >= 2). D: D_max (commit compaction rows).
    """
    prev = 0
    for w in teacher.widths:
        for b, p0, n in _bucket_calls(teacher.buckets, prev, teacher.S):
            if not teacher.on_host(n):
                yield f"teacher prefill {b} x {w}", lambda p0=p0, n=n: _prefill(teacher, p0, n)
        p0 = _start(prev, 1, teacher.S, lo=1)
        if p0 is not None and not teacher.on_host(1):
            yield f"teacher decode 1 x {w}", lambda p0=p0: _decode(teacher, p0)
        for M in budgets:
            p0 = _start(prev, M, teacher.S, lo=1)
            if p0 is not None and not teacher.on_host(M):
                yield f"teacher verify {M} x {w}", lambda p0=p0, M=M: _verify(teacher, p0, M, D)
        prev = w


def _prefill(teacher, p0: int, n: int) -> None:
    with _scratch(teacher, p0) as sid:
        teacher.prefill(sid, _ids(n))


def _decode(teacher, p0: int) -> None:
    with _scratch(teacher, p0) as sid:
        teacher.decode(sid, _FILL_ID)


def _verify(teacher, p0: int, M: int, D: int) -> None:
    """One verification of a root with two children and a commit of the second child (a non-chain path, so the
    K/V compaction graph runs too)."""
    with _scratch(teacher, p0) as sid:
        n = min(3, M)
        tree = DraftTree(tokens=_FILL_ID + np.arange(n), parents=np.zeros(n, np.int64))
        teacher.verify(sid, tensorize(tree, M, D))
        teacher.commit(sid, np.array([0, min(2, M - 1)]), D + 2)


def batch_shapes(teacher, rows: int, M: int, D: int, speculative: bool, tree_rows: int = 16):
    """Yield (what, fn) calls compiling the continuous-batching graphs (``scheduler.py``): ``decode_batch`` of
    b rows at each width and, when ``speculative``, ``verify_batch`` of b x m_b rows at each width (m_b =
    ``runners.shapes.batch_budget(b, M, tree_rows)``), for every row bucket b of ``runners.shapes.batch_rows(rows)``
    (a step of n sequences runs the smallest b >= n).

    Only for backends that take a block table per sequence (``TeacherRunner._grouped``; the portable one), whose
    batched widths are the sequence width buckets; a concatenated batch's width depends on the lengths in it, so
    it keeps compiling on first use. Nothing for N = 1 (the one-sequence graphs serve it).
    """
    if rows <= 1 or not teacher._grouped:
        return
    for b in batch_rows(rows):
        prev = 0
        for w in teacher.widths:
            p0 = _start(prev, 1, teacher.S, lo=1)
            if p0 is not None and not teacher.on_host(b):
                yield f"teacher decode_batch {b} x {w}", lambda p0=p0, b=b: _decode_batch(teacher, p0, b)
            m = batch_budget(b, M, tree_rows)
            p0 = _start(prev, m, teacher.S, lo=1)
            if speculative and p0 is not None and not teacher.on_host(b * m):
                yield (f"teacher verify_batch {b * m} x {w}",
                       lambda p0=p0, b=b, m=m: _verify_batch(teacher, p0, b, m, D))
            prev = w


def drafter_batch_shapes(drafter, groups: int, M: int, D: int, context_limit: int):
    """Yield (what, fn) calls compiling the drafter's batched graphs (``DrafterRunner.draft_batch``): for every
    group bucket g of ``runners.shapes.batch_rows(groups)``, context passes of g x b rows for each bucket b <=
    BATCH_EXTEND_MAX and expansion steps of g x K rows, at each width, except those that run on the host. Nothing
    for one group or a backend without per-sequence block tables."""
    from mindspore_eagle.runners.drafter import BATCH_EXTEND_MAX

    if groups <= 1 or not drafter.grouped:
        return
    width = 3 * drafter.drafter.cfg.target_hidden_size
    scratch = drafter.K * max(0, D - 1)
    limit = min(context_limit, drafter.S - scratch)
    for g in batch_rows(groups):             # a step of n sequences drafts in the smallest group bucket >= n
        prev = 0
        for w in drafter.widths:
            for b, p0, n in _bucket_calls([b for b in drafter.buckets if b <= BATCH_EXTEND_MAX], prev, limit):
                if not drafter.on_host(g * b):
                    yield (f"drafter context {g} x {b} x {w}",
                           lambda p0=p0, n=n, g=g: _draft_batch(drafter, p0, n, g, M, 1, width))
            p0 = _start(prev, 1 + scratch, limit + scratch)
            if D > 1 and p0 is not None and not drafter.on_host(g * drafter.K):
                yield (f"drafter expansion {g} x {drafter.K} x {w}",
                       lambda p0=p0, g=g: _draft_batch(drafter, p0, 1, g, M, D, width))
            prev = w


def _draft_batch(drafter, p0: int, n: int, groups: int, M: int, D: int, width: int) -> None:
    with _scratch(drafter, p0) as sid:
        drafter.draft_batch([sid], [(np.zeros((n, width), np.float32), _ids(n))], [_FILL_ID], M, D, groups)


def _decode_batch(teacher, p0: int, rows: int) -> None:
    with _scratch(teacher, p0) as sid:
        teacher.decode_batch([sid], [_FILL_ID], rows=rows)


def _verify_batch(teacher, p0: int, rows: int, M: int, D: int) -> None:
    with _scratch(teacher, p0) as sid:
        tree = DraftTree(tokens=_FILL_ID + np.arange(min(3, M)), parents=np.zeros(min(3, M), np.int64))
        teacher.verify_batch([sid], [tensorize(tree, M, D)], rows=rows * M)
        teacher.rollback(sid)


def drafter_shapes(drafter, M: int, D: int, context_limit: int):
    """Yield (what, fn) calls compiling every drafter graph: context-pass buckets and tree expansion per width,
    except the calls that run on the host (``DrafterRunner.on_host``: no graph).

    Args:
        drafter: DrafterRunner. M / D: tree budget and depth of the trees it will build.
        context_limit: most context pairs the drafter holds (the teacher's S; the rest of its cache is scratch).
    """
    width = 3 * drafter.drafter.cfg.target_hidden_size      # fused teacher features per context pair
    scratch = drafter.K * max(0, D - 1)
    limit = min(context_limit, drafter.S - scratch)
    prev = 0
    for w in drafter.widths:
        for b, p0, n in _bucket_calls(drafter.buckets, prev, limit):
            if not drafter.on_host(b):
                yield f"drafter context {b} x {w}", lambda p0=p0, n=n: _extend(drafter, p0, n, width)
        p0 = _start(prev, 1 + scratch, limit + scratch)   # n_ctx = p0 + 1 pairs, then K (D - 1) scratch rows
        if D > 1 and p0 is not None and not drafter.on_host(drafter.K):
            yield f"drafter expansion {drafter.K} x {w}", lambda p0=p0: _expand(drafter, p0, M, D, width)
        prev = w


def _extend(drafter, p0: int, n: int, width: int) -> tuple:
    with _scratch(drafter, p0) as sid:
        return drafter.extend(sid, np.zeros((n, width), np.float32), _ids(n))


def _expand(drafter, p0: int, M: int, D: int, width: int) -> None:
    with _scratch(drafter, p0) as sid:
        first = drafter.extend(sid, np.zeros((1, width), np.float32), _ids(1))
        drafter.build_tree(sid, _FILL_ID, first, M, D)


def warmup(engine, gen, mode: str = "full", log=None, drafters=None, budgets=None, max_batch: int = 1) -> dict:
    """Compile (or load from the graph store) the graphs of ``engine`` before use (fused mode; eager mode has
    nothing to compile).

    Args:
        engine: Engine (its teacher, drafter, spec and ``verify_budgets()``).
        gen: GenerationConfig (``short`` mode generates min(8, max_new_tokens) tokens with it).
        mode: ``full``: every shape a chat or job of this engine can reach (module docstring), in a fixed order,
            so no graph compiles after it; an engine without a drafter visits no verification or drafter shape;
            ``short``: one short speculative (or teacher-only) generation, i.e. the shapes of a short prompt;
            ``none``: nothing.
        log: callable taking one progress line (str), e.g. a stderr printer; None = silent.
        drafters: extra DrafterRunners sharing the engine's teacher (bench's other top_k), warmed like its own.
        budgets: tree budgets to verify (default ``engine.verify_budgets()``; none without a drafter).
        max_batch: > 1 also compiles the batched graphs of that many rows (:func:`batch_shapes`; trees too when
            the engine has a drafter), ``full`` mode only.
    Returns:
        {"mode": str, "seconds": float wall s, "compiles": int graphs compiled, "loads": int graphs loaded from
        the graph store (both 0 when every graph was already made in this process)}.
    Raises:
        ValueError: mode is not one of full, short, none.
    """
    from mindspore_eagle.kernels.runtime import graph_stats

    if mode not in MODES:
        raise ValueError(f"warmup mode must be one of {', '.join(MODES)}, got {mode!r}")
    log = log or (lambda line: None)
    runners = [engine.teacher] + ([engine.drafter] if engine.drafter is not None else []) + list(drafters or [])
    count = lambda: sum(r.compiles for r in runners)   # noqa: E731
    t0, c0, l0 = time.perf_counter(), count(), graph_stats()["loads"]
    if mode == "full" and engine.teacher.mode == "fused":
        calls = full_shapes(engine, drafters, budgets, max_batch)
        log(f"warm-up: {len(calls)} calls (a tree verification also makes the graph that commits its path)")
        for what, fn in calls:
            fn()
    elif mode == "short":
        short = dataclasses.replace(gen, max_new_tokens=min(8, gen.max_new_tokens), stop=[])
        engine.generate_ids(engine.encode_chat("Say hello in one short sentence."), short,
                            speculative=engine.speculates, turn_id="warmup")
    out = {"mode": mode, "seconds": time.perf_counter() - t0, "compiles": count() - c0,
           "loads": graph_stats()["loads"] - l0}
    if mode != "none":
        log(f"warm-up ({mode}): {out['compiles']} graphs compiled, {out['loads']} loaded from the graph cache in "
            f"{out['seconds']:.1f} s")
    return out


def full_shapes(engine, drafters=None, budgets=None, max_batch: int = 1) -> list:
    """(what, fn) of every shape a full warm-up visits, in its fixed order: the teacher's, then (with a drafter)
    every drafter's, then the batched ones. A teacher-only engine gets no verification, tree or drafter shape; one
    that drafts from suffix candidates alone (``speculative.method: suffix``) gets the trees and no drafter."""
    spec, tree, drafter = engine.spec, engine.speculates, engine.drafter is not None
    budgets = (budgets or engine.verify_budgets()) if tree else []
    calls = list(teacher_shapes(engine.teacher, budgets, spec.D_max))
    for dr in ([engine.drafter] if drafter else []) + list(drafters or []):
        calls += list(drafter_shapes(dr, spec.M, spec.D_max, engine.teacher.S))
    calls += list(batch_shapes(engine.teacher, max_batch, spec.M, spec.D_max, tree, spec.batch_tree_rows))
    if drafter:
        calls += list(drafter_batch_shapes(engine.drafter, max_batch, spec.M, spec.D_max, engine.teacher.S))
    return calls


def verify_signature(teacher, m: int, width: int) -> tuple:
    """The input signature (as ``runtime.CompiledFn`` records it) of ``teacher.verify`` at budget ``m`` over
    ``width`` attention slots: tokens, positions, slots [m], block table [width / B], mask [m, width], rows [m]."""
    i32 = "Int32"
    return (((m,), i32), ((m,), i32), ((m,), i32), ((width // teacher.B,), i32), ((m, width), "Float32"), ((m,), i32))


def budgets_at_hand(teacher, budgets, length: int, prefer: int = 4) -> list:
    """The verification budgets a step at sequence ``length`` can use without compiling or loading a graph (made
    in this process at this attention width); when there is none, one budget: a stored one (graph store,
    ``kernels/graph_cache.py``) nearest to ``prefer`` if any, else the one nearest to ``prefer``. So a process that
    makes graphs on first use (a one-shot answer) makes one verification graph, not one per budget. A budget
    whose call runs on the host (``TeacherRunner.on_host``) is always at hand."""
    from mindspore_eagle.kernels import graph_cache

    def near(ms_):
        return min(ms_, key=lambda m: (abs(np.log2(m) - np.log2(prefer)), m))

    fwd, out = teacher._fwd, []
    for m in budgets:
        if length + m <= teacher.S and (teacher.on_host(m) or
                                        verify_signature(teacher, m, teacher.width(length + m)) in fwd._seen):
            out.append(m)
    if out:
        return out
    fits = [m for m in budgets if length + m <= teacher.S] or list(budgets)
    store = graph_cache.active()
    stored = [m for m in fits if store is not None and length + m <= teacher.S
              and store.contains(fwd._raw, verify_signature(teacher, m, teacher.width(length + m)))]
    return [near(stored or fits)]


def stderr_log(line: str) -> None:
    """Print one progress line to stderr (flushed), the way the CLI reports downloads and compiling."""
    print(line, file=sys.stderr, flush=True)


class Heartbeat:
    """While a slow step runs, call ``say(seconds so far)`` first after ``after_s`` and then every ``every_s``
    seconds, from a daemon thread (MindSpore releases the GIL while it compiles, so the thread gets to run).

    Use as a context manager, or :meth:`start` / :meth:`stop`; ``spoke`` tells whether it said anything.
    """

    def __init__(self, say, after_s: float = 4.0, every_s: float = 4.0):
        self.say, self.after_s, self.every_s = say, after_s, every_s
        self.spoke = False
        self._done = threading.Event()
        self._thread = None

    def start(self) -> Heartbeat:
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True, name="mseagle-heartbeat")
        self._thread.start()
        return self

    def _run(self) -> None:
        wait = self.after_s
        while not self._done.wait(wait):
            self.say(time.perf_counter() - self.t0)
            self.spoke = True
            wait = self.every_s

    def stop(self) -> float:
        """Stop; returns the seconds since :meth:`start`."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        return time.perf_counter() - self.t0

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


@contextlib.contextmanager
def slow(what: str, log=stderr_log, after_s: float = 2.0, every_s: float = 3.0):
    """Report a step that may be slow: nothing when it ends within ``after_s``; else "``what`` ..." then a line
    every ``every_s`` seconds, and "``what``: done in S s" at the end."""
    beat = Heartbeat(lambda s: log(f"{what} ... {s:.0f} s" if beat.spoke else f"{what} ..."), after_s, every_s)
    with beat:
        yield
    if beat.spoke:
        log(f"{what}: done in {beat.stop():.1f} s")


def _shape_text(sig) -> str:
    """"rows x width" of a call signature: the first argument's rows and the attention mask's width (the last
    2-D argument whose rows match), or just the rows."""
    rows = sig[0][0][0] if sig and sig[0][0] else 1
    width = next((s[0][1] for s in reversed(sig[1:]) if len(s[0]) == 2 and s[0][0] == rows), None)
    return f"{rows} x {width}" if width else str(rows)


def report_compiles(log=stderr_log, every_s: float = 3.0) -> None:
    """Report every graph made on first use as one ``log`` line (compiled, or loaded from the graph cache), a note
    before the first compile, and a line every ``every_s`` seconds while a graph takes longer.

    Installs a :func:`mindspore_eagle.kernels.runtime.set_compile_listener` (process-wide, until replaced or
    ``set_compile_listener(None)``); the line names the Cell method, the query rows x attention width of the call
    and the seconds it took ("failed graph N: ..." when the compile raised; its heartbeat stops either way).
    """
    from mindspore_eagle.kernels import runtime

    state = {"n": 0, "noted": False}
    beats: dict = {}    # (name, signature) -> (graph number, Heartbeat) of each compile under way
    lock = threading.Lock()

    def listener(event, name, sig, ms_):
        shape = _shape_text(sig)
        if event in ("compiling", "loading"):
            with lock:
                state["n"] += 1
                n, first = state["n"], event == "compiling" and not state["noted"]
                state["noted"] |= first
            if first:
                log("compiling graphs on first use (each new prompt bucket, attention width or tree budget; each is "
                    "kept in $MSEAGLE_CACHE/graphs and loaded by later runs in well under a second)")
            beat = Heartbeat(lambda s: log(f"{event} graph {n}: {name} {shape} ... {s:.0f} s"), every_s, every_s)
            with lock:
                old = beats.pop((name, sig), None)
                beats[(name, sig)] = (n, beat)
            if old is not None:     # a store that notified twice (loading, then compiling after a bad file)
                old[1].stop()
            beat.start()
            return
        with lock:
            n, beat = beats.pop((name, sig), (state["n"], None))
        if beat is not None:
            beat.stop()
        log(f"{event} graph {n}: {name} {shape} in {ms_ / 1e3:.1f} s")

    runtime.set_compile_listener(listener)


__all__ = [
    "MODES",
    "Heartbeat",
    "budgets_at_hand",
    "drafter_shapes",
    "full_shapes",
    "report_compiles",
    "slow",
    "stderr_log",
    "teacher_shapes",
    "verify_signature",
    "warmup",
]
