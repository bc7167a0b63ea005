"""Paired throughput microbenchmark (paper Table 1): teacher-only greedy vs EAGLE-3 tree speculation, per turn.

Protocol (one process, interleaved so machine noise hits both equally):
    for each turn (MT-Bench turn 2 is asked after the teacher's own baseline answer to turn 1):
        baseline   = engine.generate_ids(ids, speculative=False)                     teacher-only greedy
        for each setting (the config's first, then any sweep settings):
            spec   = engine_for(setting).generate_ids(ids, speculative=True)       tree speculation
            spec.token_ids must equal baseline.token_ids (else OutputMismatchError, unless allowed)
    one JSONL line per finished turn in <run>/turns.jsonl (resume: finished turn ids are skipped).

Units: tok/s = new tokens / (prefill + decode) wall seconds (``TurnTrace.tok_per_s``: end-to-end, prefill
included, same definition for both paths); per-phase times in ms (``StepTrace`` fields); L_k = accepted drafts
+ bonus (docs/design.md, "Accepted length"). Speedup of a turn = spec tok/s / baseline tok/s on that turn.

All settings share one compiled teacher (:class:`TeacherRunner`) and one :class:`DrafterRunner` per top_k, so a
sweep costs one extra graph per distinct tree shape instead of a full rebuild; the drafter window W is a host-side
mask setting of the runner and is set before each call.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np

from mindspore_eagle.core.trace import PHASES, summarize
from mindspore_eagle.errors import MsEagleError

ATTN_BUCKETS = ((0, 31), (32, 127), (128, 255), (256, None))   # token distance buckets, paper Figure 7


class OutputMismatchError(MsEagleError, RuntimeError):
    """Speculative output differs from teacher-only greedy output on the same prompt (losslessness broken)."""


# ------------------------------------------------------------------------------------------------ settings --
@dataclass(frozen=True)
class Setting:
    """One speculative configuration timed against the baseline.

    Attributes:
        name: "main" for the config's own setting, else e.g. "M=32", "D=4", "K=8", "W=128".
        M: tree budget (tokens verified per step, root included). D_max: max draft depth. top_k: K.
        window: drafter attention window W in context tokens (0 = unlimited); the teacher is never truncated.
        policy: speculative.policy, "fixed" or "adaptive" (M, D_max then are ceilings).
    """
    name: str
    M: int
    D_max: int
    top_k: int
    window: int = 0
    policy: str = "fixed"

    @property
    def params(self) -> tuple:
        return (self.M, self.D_max, self.top_k, self.window, self.policy)

    def spec(self, base):
        """``base`` (SpeculativeConfig) with this setting's M / D_max / top_k / window / policy, validated."""
        sp = dataclasses.replace(base, M=self.M, D_max=self.D_max, top_k=self.top_k, window=self.window,
                                 policy=self.policy)
        sp.validate()
        return sp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TurnSpec:
    """One timed turn: ``turn_id`` = "<item id>#<turn index>" (e.g. "mtbench/81#1", "HumanEval/0#0")."""
    turn_id: str
    item_id: str
    source: str
    category: str
    index: int
    text: str
    first_turn_id: str = ""          # for index > 0: the turn whose baseline answer forms the history


def turn_specs(items) -> list:
    """Flatten evalsets.EvalItem conversations into TurnSpecs in order (turn 0 before turn 1)."""
    out = []
    for it in items:
        for i, text in enumerate(it.turns):
            out.append(TurnSpec(f"{it.id}#{i}", it.id, it.source, it.category, i, text,
                                f"{it.id}#{i - 1}" if i else ""))
    return out


# ------------------------------------------------------------------------------------------------- engines --
class EnginePool:
    """Engines for several settings over one teacher runner and one drafter runner per top_k.

    Args:
        cfg: Config (its speculative section is the "main" setting). loaded: pipeline.Loaded (numpy weights).
        settings: list of Setting (the drafter scratch is sized for the largest D_max among them).
    The base engine comes from ``pipeline.build_engine``; drafter runners for other K mirror its construction.
    """

    def __init__(self, cfg, loaded, settings):
        from mindspore_eagle.core.trace import TraceWriter
        from mindspore_eagle.serving.engine import Engine
        from mindspore_eagle.serving.pipeline import build_engine

        if loaded.drafter_cfg is None and cfg.speculative.method != "suffix":
            raise ValueError("bench needs a drafter: model.drafter is 'none' (use 'embedded', 'random' or a path, "
                             "or speculative.method=suffix)")
        self.cfg, self.loaded = cfg, loaded
        self.d_max = max(s.D_max for s in settings)
        k0 = settings[0].top_k
        base_cfg = dataclasses.replace(cfg, speculative=dataclasses.replace(
            cfg.speculative, D_max=self.d_max, top_k=k0, window=0, trace=""))
        self.base = build_engine(base_cfg, loaded, trace=TraceWriter(None))
        self.teacher, self.tokenizer = self.base.teacher, self.base.tokenizer
        self.drafters = {k0: self.base.drafter}
        self.settings = {s.name: s for s in settings}
        self.engines = {}
        for s in settings:
            if s.top_k not in self.drafters:
                self.drafters[s.top_k] = self._make_drafter(s.top_k)
            self.engines[s.name] = Engine(self.teacher, self.tokenizer, loaded.teacher_cfg.eos_token_ids,
                                          self.drafters[s.top_k], s.spec(cfg.speculative), TraceWriter(None))

    def _make_drafter(self, K: int):
        """A DrafterRunner with top_k = K sharing the teacher's embedding (as pipeline.build_engine builds it)."""
        from mindspore_eagle.models.eagle3 import Eagle3Drafter
        from mindspore_eagle.runners.drafter import DrafterRunner
        from mindspore_eagle.serving.pipeline import weight_dtypes

        c = self.cfg.cache
        scratch = K * max(0, self.d_max - 1)
        d_len = -(-(c.max_seq_len + scratch) // c.block_size) * c.block_size
        cell = Eagle3Drafter(self.loaded.drafter_cfg, self.teacher.model.embed, K, d_len // c.block_size,
                             c.block_size, d_len, weight_dtype=weight_dtypes(self.cfg)[1])
        cell.load_tensors(self.loaded.drafter_tensors)
        return DrafterRunner(cell, d_len // c.block_size, c.block_size, d_len, self.cfg.exec_mode, 0,
                             c.prefill_chunk)

    @property
    def baseline(self):
        """The engine used for teacher-only decoding (any engine: they share the teacher)."""
        return self.base

    def engine(self, name: str):
        """The Engine of setting ``name`` with its drafter window applied."""
        eng = self.engines[name]
        if eng.drafter is not None:                 # speculative.method suffix has none
            eng.drafter.window = self.settings[name].window
        return eng

    @property
    def compiles(self) -> int:
        return self.teacher.compiles + sum(d.compiles for d in self.drafters.values())

    def warmup(self, gen, mode: str = "full", log=print) -> dict:
        """Compile before timing (uncounted), with :func:`mindspore_eagle.serving.pipeline.prepare` over the base engine,
        every drafter of the pool and every setting's tree budget. Returns {"mode", "seconds", "compiles",
        "graph_cache"}.

        ``full``: every fixed shape a timed turn can hit (no graph compiles inside a timed turn; graphs reused
        from $MSEAGLE_CACHE/graphs when this pool was warmed before). ``short``: one short generation.
        ``none``: nothing (the first turns then include compile time; their compile_count says so).
        """
        from mindspore_eagle.serving.pipeline import prepare

        budgets = sorted({M for eng in self.engines.values() for M in eng.verify_budgets()})
        others = [d for k, d in self.drafters.items() if d is not self.base.drafter]
        out = prepare(self.base, self.cfg, gen, mode, log, drafters=others,
                      graph_cache=self.cfg.context.graph_cache, budgets=budgets)
        for name in self.engines:       # the adaptive policy's starting table (nothing is measured up front)
            eng = self.engine(name)
            if eng.spec.policy == "adaptive":
                where = f"stored in {eng.cost_file}" if eng.cost_file else "the prior (core.costs.prior_table)"
                log(f"cost table of setting {name}, {where}; every step keeps it current:\n"
                    f"{eng.policy.costs.describe()}")
        return out



# ------------------------------------------------------------------------------------ attention evidence --
class AttnProbe:
    """Records the drafting rows of a DrafterRunner's context passes and, after the turn, the drafter's top-1
    attention distance at a few of them (paper Figure 7).

    While installed, ``runner.extend`` is wrapped: after each original call it keeps (position, teacher feature,
    next token) of the call's last row (the row whose prediction seeds the draft tree) and the sequence's block
    table (host copies only; nothing is computed on the device, so decoding and its timing are unchanged).
    ``finish(n)`` then runs ``Eagle3Drafter.attention_probs`` (PyNative, read-only) for ``n`` evenly spaced
    recorded rows against the drafter cache the turn left behind (freed blocks keep their contents until the next
    speculative turn writes them), with the same window mask the drafter used, and returns the distances
    ``position - argmax column`` in tokens (0 = the row attends most to itself).
    """

    def __init__(self, runner):
        self.runner, self.rows, self.table = runner, [], None
        self._orig = runner.extend

        def extend(sid, aux, next_tokens):
            p0 = runner.bm.length(sid)
            out = self._orig(sid, aux, next_tokens)
            self.rows.append((p0 + len(next_tokens) - 1, np.array(aux[-1], np.float32), int(next_tokens[-1])))
            self.table = runner.bm.block_table(sid).copy()
            return out

        runner.extend = extend

    def remove(self) -> None:
        if self.runner.__dict__.get("extend") is not None:
            del self.runner.extend

    def finish(self, n: int) -> list:
        """Remove the hook and return up to ``n`` sampled rows as [position, top-1 column] pairs (ints; the
        top-1 attention distance in tokens is position - column)."""
        import mindspore as ms

        from mindspore_eagle.core.tree import NEG_BIAS

        self.remove()
        if not self.rows or n <= 0 or self.table is None:
            return []
        cell, S = self.runner.drafter, self.runner.S
        pick = np.unique(np.linspace(0, len(self.rows) - 1, min(n, len(self.rows))).round().astype(int))
        dists = []
        for i in pick:
            pos, feat, tok = self.rows[i]
            lo = max(0, pos + 1 - self.runner.window) if self.runner.window > 0 else 0
            mask = np.full((1, S), NEG_BIAS, np.float32)
            mask[0, lo:pos + 1] = 0.0
            h = cell.fuse(ms.Tensor(feat[None]))
            probs = cell.attention_probs(h, ms.Tensor(np.array([tok], np.int32)), ms.Tensor(np.array([pos], np.int32)),
                                         ms.Tensor(self.table), ms.Tensor(mask)).asnumpy()[0]
            dists.append([int(pos), int(np.argmax(probs[: pos + 1]))])
        return dists


def attention_buckets(distances, columns=None, sink: int = 4) -> dict:
    """Fraction of top-1 attention distances in each ATTN_BUCKETS range: {"0-31": f, "32-127": f, "128-255": f,
    "256+": f, "n": count} (fractions are NaN when n == 0). With ``columns`` (the top-1 key positions), also
    "sink": the fraction whose top-1 key is among the first ``sink`` positions of the sequence (attention sink at
    the start of the prompt), and "far_not_sink": distance >= 128 but not a sink."""
    d = np.asarray(list(distances), np.int64)
    out = {}
    for lo, hi in ATTN_BUCKETS:
        key = f"{lo}-{hi}" if hi is not None else f"{lo}+"
        sel = (d >= lo) & (d <= hi) if hi is not None else d >= lo
        out[key] = float(sel.mean()) if d.size else float("nan")
    out["n"] = int(d.size)
    if columns is not None:
        c = np.asarray(list(columns), np.int64)
        out["sink"] = float((c < sink).mean()) if c.size else float("nan")
        out["far_not_sink"] = float(((d >= 128) & (c >= sink)).mean()) if c.size else float("nan")
    return out


# -------------------------------------------------------------------------------------------------- stats --
def stats(values) -> dict:
    """{"mean", "p50", "p90", "p99", "n", "p10", "min"} of a sample (trace.summarize: numpy linear percentiles;
    p10 and min are NaN for an empty sample)."""
    x = np.asarray(list(values), np.float64).reshape(-1)
    out = summarize(x)
    out["p10"] = float(np.percentile(x, 10, method="linear")) if x.size else float("nan")
    out["min"] = float(x.min()) if x.size else float("nan")
    return out


def accept_by_depth(accept_lens, D: int) -> dict:
    """Acceptance by tree position (paper Figure 3).

    Args:
        accept_lens: L_k of every step (accepted drafts + bonus, >= 1). D: D_max.
    Returns:
        {"depth": [1..D], "reach": [fraction of steps whose accepted draft path reaches depth d, i.e. L_k - 1 >= d],
        "conditional": [reach[d] / reach[d-1] (reach[0] = 1), NaN where the denominator is 0], "n_steps": n}.
    """
    a = np.asarray(list(accept_lens), np.int64) - 1
    n = int(a.size)
    reach = [float((a >= d).mean()) if n else float("nan") for d in range(1, D + 1)]
    cond, prev = [], 1.0
    for r in reach:
        cond.append(r / prev if prev and prev == prev else float("nan"))
        prev = r
    return {"depth": list(range(1, D + 1)), "reach": reach, "conditional": cond, "n_steps": n}


def accepted_from(steps) -> dict:
    """Accepted drafted tokens of ``steps`` (core.trace.StepTrace) by who proposed them: {"drafter", "suffix",
    "both"} (ints; the bonus tokens are nobody's)."""
    suffix = sum(st.accepted_suffix for st in steps)
    both = sum(st.accepted_both for st in steps)
    return {"drafter": sum(st.accept_len - 1 for st in steps) - suffix - both, "suffix": suffix, "both": both}


def phase_totals(steps) -> dict:
    """Sum over steps of each phase's ms (PHASES), of total_ms, plus the step count and mean tree size."""
    out = {f"{p}_ms": float(sum(getattr(s, f"{p}_ms") for s in steps)) for p in PHASES}
    out["total_ms"] = float(sum(s.total_ms for s in steps))
    out["n_steps"] = len(steps)
    out["mean_nodes"] = float(np.mean([s.n_nodes for s in steps])) if steps else 0.0
    return out


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -------------------------------------------------------------------------------------------- the run loop --
def read_records(path) -> dict:
    """turn_id -> record of a turns.jsonl (a torn last line from an interrupted run is ignored)."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[rec["turn_id"]] = rec
    return out


def _turn_result(g) -> dict:
    t = g.turn
    return {"new_tokens": t.new_tokens, "prefill_ms": t.prefill_ms, "decode_ms": t.decode_ms, "tok_s": t.tok_per_s,
            "compile_count": t.compile_count, "stop_reason": g.stop_reason}


def run_turn(pool, ts: TurnSpec, history: list, gen, settings, attn_samples: int = 4, peer=None) -> dict:
    """Time one turn: baseline, then each setting's speculative run; returns the JSONL record.

    Record fields: turn_id, item_id, source, category, turn_index, prompt_tokens, baseline {new_tokens,
    prefill_ms, decode_ms, tok_s, compile_count, stop_reason, text, token_ids}, settings {name: {new_tokens,
    prefill_ms, decode_ms, tok_s, compile_count, stop_reason, speedup, identical, first_diff, accept_lens [L_k per
    tree-verifying step], predicted_lens [the policy's E[L_k] per such step], budgets [m per such step],
    plain_steps, drafted_plain_steps (drafter ran, policy then decoded plainly), spec_share, phases {<phase>_ms
    sums, total_ms, n_steps, mean_nodes}}}, attn_dist (main setting, tokens), optional
    peers {row name: {tok_s, new_tokens, seconds, same_tokens, match_prefix, ...}} (bench/llama_server.py
    ``LlamaServerPeer.run``), mismatch [messages] when a speculative output differs from
    the baseline, or skipped (reason) when the prompt does not fit the cache.
    """
    from mindspore_eagle.serving.engine import GenerationError

    rec = {"turn_id": ts.turn_id, "item_id": ts.item_id, "source": ts.source, "category": ts.category,
           "turn_index": ts.index}
    base_eng = pool.baseline
    ids = base_eng.encode_chat(history + [{"role": "user", "content": ts.text}])
    rec["prompt_tokens"] = len(ids)
    try:
        b = base_eng.generate_ids(ids, gen, speculative=False, turn_id=ts.turn_id)
    except GenerationError as e:
        rec["skipped"] = str(e)
        return rec
    rec["baseline"] = {**_turn_result(b), "text": b.text, "token_ids": list(b.token_ids)}
    rec["settings"] = {}
    for s in settings:
        eng = pool.engine(s.name)
        probe = AttnProbe(eng.drafter) if (s.name == "main" and attn_samples > 0 and eng.drafter is not None
                                           and hasattr(eng.drafter.drafter, "attention_probs")) else None
        try:
            g = eng.generate_ids(ids, gen, speculative=True, turn_id=ts.turn_id)
        except GenerationError as e:
            if probe:
                probe.remove()
            rec["settings"][s.name] = {"skipped": str(e)}
            continue
        if probe:
            top = probe.finish(attn_samples)
            rec["attn_top"] = top
            rec["attn_dist"] = [p - c for p, c in top]
        same = list(g.token_ids) == list(b.token_ids)
        tree_steps = [st for st in g.steps if st.budget != 1]
        r = {**_turn_result(g), "speedup": g.turn.tok_per_s / b.turn.tok_per_s if b.turn.tok_per_s else float("nan"),
             "identical": same, "first_diff": _first_diff(list(g.token_ids), list(b.token_ids)),
             "accept_lens": [int(st.accept_len) for st in tree_steps],
             "predicted_lens": [round(float(st.predicted_len), 3) for st in tree_steps],
             "budgets": [int(st.budget) for st in tree_steps], "plain_steps": len(g.steps) - len(tree_steps),
             "drafted_plain_steps": sum(1 for st in g.steps if st.budget == 1 and st.drafted),
             "accepted_from": accepted_from(tree_steps),
             "spec_share": g.turn.spec_share, "phases": phase_totals(g.steps)}
        rec["settings"][s.name] = r
        if not same:
            rec.setdefault("mismatch", []).append(
                f"turn {ts.turn_id}, setting {s.name} (M={s.M}, D_max={s.D_max}, top_k={s.top_k}, W={s.window}): "
                f"speculative output differs from teacher-only greedy at generated token {r['first_diff']} "
                f"({len(g.token_ids)} vs {len(b.token_ids)} tokens); speculative decoding must be lossless")
    if peer is not None:
        rec["peers"] = peer.run(ids, gen.max_new_tokens, b.token_ids)
    if hasattr(os, "getloadavg"):
        rec["loadavg_1m"] = os.getloadavg()[0]
    return rec


def run_turns(pool, turns: list, gen, settings, jsonl_path: str, attn_samples: int = 4, peer=None,
              allow_mismatch: bool = False, progress: bool = True) -> list:
    """Run every turn not yet in ``jsonl_path`` (resume), appending one record per finished turn.

    MT-Bench turn i > 0 is asked after the conversation so far with the teacher's own baseline answers (read from
    the records, so a resumed run rebuilds the same history). Returns all records in ``turns`` order.
    Raises:
        OutputMismatchError: a speculative output differed from the baseline (after its record is appended, so
            the evidence stays in the JSONL), unless ``allow_mismatch``.
    """
    from tqdm import tqdm

    done = read_records(jsonl_path)
    todo = [t for t in turns if t.turn_id not in done]
    bar = tqdm(total=len(turns), initial=len(turns) - len(todo), desc="bench turns", unit="turn",
               disable=not progress, dynamic_ncols=True)
    try:
        for ts in todo:
            history = _history(ts, turns, done)
            if history is None:
                rec = {"turn_id": ts.turn_id, "item_id": ts.item_id, "source": ts.source, "category": ts.category,
                       "turn_index": ts.index, "skipped": f"previous turn {ts.first_turn_id} was skipped"}
            else:
                rec = run_turn(pool, ts, history, gen, settings, attn_samples, peer)
            _append(jsonl_path, rec)
            done[ts.turn_id] = rec
            if rec.get("mismatch") and not allow_mismatch:
                raise OutputMismatchError("; ".join(rec["mismatch"]))
            main = rec.get("settings", {}).get("main", {})
            if "speedup" in main:
                bar.set_postfix(speedup=f"{main['speedup']:.2f}x",
                                L=f"{np.mean(main['accept_lens']) if main['accept_lens'] else 1:.2f}")
            bar.update(1)
    finally:
        bar.close()
    return [done[t.turn_id] for t in turns]


def _history(ts: TurnSpec, turns, done) -> list | None:
    """Messages before turn ``ts``: earlier user turns of the same item with the baseline answers (None if one
    of them was skipped)."""
    msgs = []
    by_id = {t.turn_id: t for t in turns}
    for i in range(ts.index):
        tid = f"{ts.item_id}#{i}"
        rec = done.get(tid)
        if rec is None or "baseline" not in rec:
            return None
        msgs += [{"role": "user", "content": by_id[tid].text}, {"role": "assistant", "content": rec["baseline"]["text"]}]
    return msgs


def _append(path: str, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


__all__ = ["Setting", "TurnSpec", "EnginePool", "AttnProbe", "OutputMismatchError", "turn_specs", "run_turn",
           "run_turns", "read_records", "stats", "accept_by_depth", "accepted_from", "attention_buckets", "phase_totals",
           "ATTN_BUCKETS"]
