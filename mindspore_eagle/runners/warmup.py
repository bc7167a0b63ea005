"""Compile every graph a chat or batch job can reach, in one fixed order, before the first timed token.

In fused mode each :class:`~mindspore_eagle.kernels.runtime.CompiledFn` compiles one graph per input shape on first use
(~1 s each for the 135M teacher on 2 cores). The shapes a conversation can reach are finite and known from the
configuration:

- teacher: each prefill bucket (16..prefill_chunk) x each attention width (256, 512, ..., S); decode (1 query
  row) and verification (k = each tree budget of ``engine.verify_budgets()``) at each width; the K/V compaction of
  a commit (D_max + 2 rows);
- drafter: each context-pass bucket (1..prefill_chunk rows; feature fusion, layer and the head on the last row
  in one graph) x each width; tree expansion (top_k rows) at each width.

:func:`warmup` visits them directly (synthetic ids on scratch sequences; the K/V written there is garbage and is
released), always in the same order, which is also what lets MindSpore's on-disk compile cache
(``runtime.enable_graph_cache``) be reused safely: that cache numbers graphs by compile order within a process.

Letters: M = tree budget, D = D_max, K = top_k, S = cache.max_seq_len, w = attention width bucket.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import numpy as np

from mindspore_eagle.core.tree import DraftTree, tensorize

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
    """Yield (what, fn) calls compiling every teacher graph: prefill buckets, decode, verify per budget, commit.

    Args:
        teacher: TeacherRunner. budgets: tree budgets M to verify (ints >= 2). D: D_max (commit compaction rows).
    """
    prev = 0
    for w in teacher.widths:
        for b, p0, n in _bucket_calls(teacher.buckets, prev, teacher.S):
            yield f"teacher prefill {b} x {w}", lambda p0=p0, n=n: _prefill(teacher, p0, n)
        p0 = _start(prev, 1, teacher.S, lo=1)
        if p0 is not None:
            yield f"teacher decode 1 x {w}", lambda p0=p0: _decode(teacher, p0)
        for M in budgets:
            p0 = _start(prev, M, teacher.S, lo=1)
            if p0 is not None:
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


def batch_shapes(teacher, rows: int, M: int, D: int, speculative: bool):
    """Yield (what, fn) calls compiling the continuous-batching graphs (``scheduler.py``): ``decode_batch`` of
    ``rows`` = N rows at each width and, when ``speculative``, ``verify_batch`` of N x M rows at each width.

    Only for backends that take a block table per sequence (``TeacherRunner._grouped``; the portable one), whose
    batched widths are the sequence width buckets; a concatenated batch's width depends on the lengths in it, so
    it keeps compiling on first use. Nothing for N = 1 (the one-sequence graphs serve it).
    """
    if rows <= 1 or not teacher._grouped:
        return
    prev = 0
    for w in teacher.widths:
        p0 = _start(prev, 1, teacher.S, lo=1)
        if p0 is not None:
            yield f"teacher decode_batch {rows} x {w}", lambda p0=p0: _decode_batch(teacher, p0, rows)
        p0 = _start(prev, M, teacher.S, lo=1)
        if speculative and p0 is not None:
            yield f"teacher verify_batch {rows * M} x {w}", lambda p0=p0: _verify_batch(teacher, p0, rows, M, D)
        prev = w


def drafter_batch_shapes(drafter, groups: int, M: int, D: int, context_limit: int):
    """Yield (what, fn) calls compiling the drafter's batched graphs (``DrafterRunner.draft_batch``): context
    passes of ``groups`` x b rows for each bucket b <= BATCH_EXTEND_MAX and expansion steps of ``groups`` x K
    rows, at each width. Nothing for one group or a backend without per-sequence block tables."""
    from mindspore_eagle.runners.drafter import BATCH_EXTEND_MAX

    if groups <= 1 or not drafter.grouped:
        return
    width = 3 * drafter.drafter.cfg.target_hidden_size
    scratch = drafter.K * max(0, D - 1)
    limit = min(context_limit, drafter.S - scratch)
    prev = 0
    for w in drafter.widths:
        for b, p0, n in _bucket_calls([b for b in drafter.buckets if b <= BATCH_EXTEND_MAX], prev, limit):
            yield (f"drafter context {groups} x {b} x {w}",
                   lambda p0=p0, n=n: _draft_batch(drafter, p0, n, groups, M, 1, width))
        p0 = _start(prev, 1 + scratch, limit + scratch)
        if D > 1 and p0 is not None:
            yield (f"drafter expansion {groups} x {drafter.K} x {w}",
                   lambda p0=p0: _draft_batch(drafter, p0, 1, groups, M, D, width))
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
    """Yield (what, fn) calls compiling every drafter graph: context-pass buckets and tree expansion per width.

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
            yield f"drafter context {b} x {w}", lambda p0=p0, n=n: _extend(drafter, p0, n, width)
        p0 = _start(prev, 1 + scratch, limit + scratch)   # n_ctx = p0 + 1 pairs, then K (D - 1) scratch rows
        if D > 1 and p0 is not None:
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
    """Compile the graphs of ``engine`` before use (fused mode; eager mode has nothing to compile).

    Args:
        engine: Engine (its teacher, drafter, spec and ``verify_budgets()``).
        gen: GenerationConfig (``short`` mode generates min(8, max_new_tokens) tokens with it).
        mode: ``full``: every shape a chat or job can reach (module docstring), in a fixed order, so no graph
            compiles after it; ``short``: one short speculative (or teacher-only) generation, i.e. the shapes of a
            short prompt; ``none``: nothing.
        log: callable taking one progress line (str), e.g. a stderr printer; None = silent.
        drafters: extra DrafterRunners sharing the engine's teacher (bench's other top_k), warmed like its own.
        budgets: tree budgets to verify (default ``engine.verify_budgets()``).
        max_batch: > 1 also compiles the batched graphs of that many rows (:func:`batch_shapes`; trees too when
            the engine has a drafter), ``full`` mode only.
    Returns:
        {"mode": str, "seconds": float wall s, "compiles": int graphs compiled (0 when all were cached in-process)}.
    Raises:
        ValueError: mode is not one of full, short, none.
    """
    if mode not in MODES:
        raise ValueError(f"warmup mode must be one of {', '.join(MODES)}, got {mode!r}")
    log = log or (lambda line: None)
    runners = [engine.teacher] + ([engine.drafter] if engine.drafter is not None else []) + list(drafters or [])
    count = lambda: sum(r.compiles for r in runners)   # noqa: E731
    t0, c0 = time.perf_counter(), count()
    if mode == "full" and engine.teacher.mode == "fused":
        spec = engine.spec
        calls = list(teacher_shapes(engine.teacher, budgets or engine.verify_budgets(), spec.D_max))
        for dr in runners[1:]:
            calls += list(drafter_shapes(dr, spec.M, spec.D_max, engine.teacher.S))
        calls += list(batch_shapes(engine.teacher, max_batch, spec.M, spec.D_max, engine.drafter is not None))
        if engine.drafter is not None:
            calls += list(drafter_batch_shapes(engine.drafter, max_batch, spec.M, spec.D_max, engine.teacher.S))
        for i, (what, fn) in enumerate(calls):
            before = count()
            fn()
            if count() > before:
                log(f"warm-up: compiled {what} ({i + 1}/{len(calls)}, {time.perf_counter() - t0:.1f} s)")
    elif mode == "short":
        short = dataclasses.replace(gen, max_new_tokens=min(8, gen.max_new_tokens), stop=[])
        engine.generate_ids(engine.encode_chat("Say hello in one short sentence."), short,
                            speculative=engine.drafter is not None, turn_id="warmup")
    out = {"mode": mode, "seconds": time.perf_counter() - t0, "compiles": count() - c0}
    if mode != "none":
        log(f"warm-up ({mode}): {out['compiles']} graphs compiled in {out['seconds']:.1f} s")
    return out


def stderr_log(line: str) -> None:
    """Print one progress line to stderr (flushed), the way the CLI reports downloads and compiling."""
    print(line, file=sys.stderr, flush=True)


def report_compiles(log=stderr_log) -> None:
    """Report every graph compiled on first use (outside a warm-up) as one ``log`` line, with a note first.

    Installs a :func:`mindspore_eagle.kernels.runtime.set_compile_listener`; the line names the Cell method, the query
    rows x attention width of the call and the seconds it took.
    """
    from mindspore_eagle.kernels import runtime

    state = {"n": 0}

    def listener(name, sig, ms_):
        if state["n"] == 0:
            log("compiling graphs on first use (each new prompt bucket or attention width; --warmup full compiles "
                "all of them once and reuses them from disk in later runs)")
        state["n"] += 1
        rows = sig[0][0][0] if sig and sig[0][0] else 1
        # the attention mask [rows, width] is the last 2-D argument of a forward (a one-argument call: no width)
        width = next((s[0][1] for s in reversed(sig[1:]) if len(s[0]) == 2 and s[0][0] == rows), None)
        shape = f"{rows} x {width}" if width else str(rows)
        log(f"compiled graph {state['n']}: {name} {shape} in {ms_ / 1e3:.1f} s")

    runtime.set_compile_listener(listener)


__all__ = ["warmup", "report_compiles", "teacher_shapes", "drafter_shapes", "stderr_log", "MODES"]
