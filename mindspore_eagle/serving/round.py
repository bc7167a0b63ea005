"""The decode round: one step of every live sequence, plain or tree, for every caller.

Legend: n = live sequences in the step, N = ``rows`` (the most sequences of a batched call), b = the row bucket of
the step (1, 2, 4, ..., N: the smallest >= n, ``runners.shapes.rows_for``), M = tree budget ceiling, m = budget of one step (1 = plain decode), D = D_max, V = vocabulary, H = teacher hidden size,
L_k = accepted length of the step (accepted drafts + bonus).

One round (docs/architecture.md, "The decode round"):

    plan       N = 1: the speculation policy (core/policy.py) answers "draft?", "one more level?", "budget m?"
               N > 1: a RateGate picks the step's kind by measured tokens per ms: the drafter's trees (merged
               with copies), copies of earlier text alone, or a plain step (speculation steps aside)
    draft      drafter context pass on the pairs the drafter has not seen, then the EAGLE-2 tree; with suffix
               candidates (core/suffix.py) the continuations of the longest earlier match in the sequence's own
               text and in the process's earlier outputs are merged into it (core.tree.merge_trees), or verified
               alone when the drafter does not run or there is none
    allot      N > 1: every candidate node valued by calibrated acceptance (core.calibration.node_values), and
               the step's rows given to the nodes worth their cost (core.policy.allot_rows under the learned
               a + b x rows ms of a forward, core.costs.RowCosts): sequence i verifies its root and its best
               m_i - 1 nodes (m_i = 1: its pending token alone), m_i <= M
    tensorize  core.tree.tensorize at each sequence's budget [+ validate_tree in eager mode / when asked]
    forward    a plain step: one teacher decode (N = 1) or one batched decode of n rows (the row bucket b when the
               call runs as a graph); a tree step: one teacher verification of m rows (N = 1) or of sum(m_i) rows
               (``BatchLayout``; a graph's b x m_b rows, ``runners.shapes.batch_budget``, when not on the host)
    accept     greedy longest path + bonus, or seeded sampling by coupling (core/accept.py): a draft is accepted
               when it equals the teacher's own sample at its position
    commit     teacher KV of the accepted path moved after the prefix; (feature, token) pairs queued for the drafter
    emit       every token goes through the sequence's Emitter (EOS, stop strings, max_new_tokens)

The single-sequence engine, the continuous-batching scheduler, teacher regeneration and the server all advance
their sequences with :meth:`DecodeRound.step`; teacher-only decoding is the same round without a drafter. One
sequence alone (N = 1) runs the single-sequence graphs (decode k = 1, verify k = m) under the configured policy,
so a batch of one is served exactly as ``generate`` serves it.

Losslessness: greedy acceptance keeps exactly the teacher's argmax tokens and every token passes the same Emitter
as teacher-only decoding, so at temperature 0 (float32) both give identical ids. Sampling draws the token at
position t by a race keyed by (seed, t, token id) (core.accept.keyed_draw) on every path, and accepts a draft
exactly when it equals that draw, so a seeded sampled text is the same with or without speculation, alone or in
any batch, and follows the teacher's warped distribution exactly.

A live sequence is a :class:`Sequence` (or any object with its attributes):
``sid`` (teacher cache sequence), ``next`` (the pending token: emitted, not yet fed to the teacher), ``gen``
(GenerationConfig; sampling draws with ``gen.seed``), ``emitter`` (core.emit.Emitter), ``accept_lens`` (list; L_k of
every tree step is appended), ``steps`` (list; one core.trace.StepTrace per step is appended), ``state`` (the
round's, set by :meth:`DecodeRound.start`) and, with ``features=True``, ``features`` (list).

Suffix candidates and benchmarks: the process's index of earlier outputs (``suffix``) receives a sequence's output
only when the sequence finishes, keyed by its prompt, and a sequence never reads outputs of its own prompt; a
teacher-only round (no drafter, no ``suffix``) adds nothing. So a bench that decodes a turn teacher-only and then
speculatively drafts only from other turns' outputs, as a server that has answered other users would.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from mindspore_eagle.config import SpeculativeConfig
from mindspore_eagle.core.accept import (
    accept_greedy,
    accept_coupled,
    sample_token,
    token_logprobs,
    warp_probs,
)
from mindspore_eagle.core.calibration import AcceptanceModel, node_values, observe_tree, top_nodes
from mindspore_eagle.core.costs import RowCosts
from mindspore_eagle.core.gate import RateGate
from mindspore_eagle.core.policy import Choice, allot_rows
from mindspore_eagle.core.suffix import SuffixIndex, propose
from mindspore_eagle.core.trace import StepTrace, Timer
from mindspore_eagle.core.tree import SOURCE_BOTH, SOURCE_SUFFIX, DraftTree, merge_trees, tensorize, validate_tree
from mindspore_eagle.kernels.runtime import graph_stats
from mindspore_eagle.runners.interfaces import DrafterRunnerLike, TeacherRunnerLike
from mindspore_eagle.runners.shapes import batch_budget, rows_for


@dataclass
class BatchLayout:
    """Where each sequence's rows sit in one stacked teacher forward (the batch analogue of a tree budget).

    Sequence i owns rows ``offsets[i] .. offsets[i + 1] - 1`` of the call's outputs; rows from ``offsets[-1]`` to
    ``rows - 1`` are padding (they write to the pad block and are never read).
    """

    budgets: np.ndarray  # int64 [n]; rows of each sequence (1 = plain decode, m = tree of budget m)
    rows: int  # static row count of the call (>= budgets.sum())
    offsets: np.ndarray = field(init=False)  # int64 [n + 1]; first row of each sequence, then the end

    def __post_init__(self):
        self.budgets = np.asarray(self.budgets, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.budgets)]).astype(np.int64)
        if (self.budgets < 1).any() or self.offsets[-1] > self.rows:
            raise ValueError(f"BatchLayout: budgets {self.budgets.tolist()} must be >= 1 and fit {self.rows} rows")

    @classmethod
    def uniform(cls, n: int, per_seq: int, rows: int) -> "BatchLayout":
        """n sequences of ``per_seq`` rows each in a call of ``rows`` rows."""
        return cls(np.full(n, per_seq, np.int64), rows)

    def rows_of(self, i: int) -> slice:
        """The rows of sequence i."""
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


@dataclass
class Sequence:
    """One live sequence of a round (the attributes :class:`DecodeRound` reads and writes; module docstring)."""

    sid: int  # teacher cache sequence id
    next: int  # pending token: emitted, not yet fed to the teacher
    gen: object  # config.GenerationConfig of this sequence (temperature, top_p, top_k, stop, max_new_tokens)
    emitter: object  # core.emit.Emitter: stop rules and the emitted ids
    accept_lens: list = field(default_factory=list)  # int; L_k of each tree step
    steps: list = field(default_factory=list)  # core.trace.StepTrace of each step
    state: object = None  # the round's drafter state (DecodeRound.start)
    features: list = field(default_factory=list)  # (hidden [1, H], aux [1, 3H]) per fed token (features=True)
    notes: list = field(default_factory=list)  # str; warnings about this turn (e.g. past the drafter's positions)
    error: str = ""  # set by the round when this sequence's logits were not finite: the caller ends it with it
    logprobs: list = field(default_factory=list)  # with gen.logprobs: (id, logprob, top) per emitted token


@dataclass
class StepPlan:
    """What one sequence does this step, decided before the teacher's forward (``DecodeRound._draft``)."""
    tree: DraftTree | None = None  # the tree to verify; None: a plain step (its pending token alone)
    choice: Choice | None = None  # the policy's choice (budget m, predicted L_k); None: nothing was drafted
    expansions: int = 0  # drafter tree-expansion calls run for it
    drafted: bool = False  # whether the drafter ran for it (its context pass and tree)


@dataclass
class StepResult:
    """One sequence's outcome of the step's teacher forward (``DecodeRound._decode`` / ``_verify``)."""
    path: np.ndarray  # int32 [L_k]; accepted node indices, root first ([0] for a plain step)
    tokens: np.ndarray  # int64 [L_k]; the tokens emitted: accepted drafts, then the bonus
    aux: np.ndarray | None  # float32 [L_k, 3H]; teacher features of the accepted nodes (None: not captured)
    logprobs: list | None  # with gen.logprobs: core.accept.token_logprobs entries of ``tokens``, else None


@dataclass
class _DraftState:
    """The round's per-sequence drafting state: its drafter cache sequence (None without a drafter), the
    (feature, token) pairs the drafter has not seen yet (aux float32 [k, 3H], next tokens int64 [k]) and, with
    suffix candidates, an index over its own prompt and output and its prompt's key."""
    dsid: int | None
    pending: list
    text: SuffixIndex | None = None
    key: int | None = None


class DecodeRound:
    """One decode step for a set of live sequences (module docstring).

    Args:
        teacher: a runners.interfaces.TeacherRunnerLike (runners.teacher.TeacherRunner). drafter: a
            runners.interfaces.DrafterRunnerLike (runners.drafter.DrafterRunner), or None (teacher-only).
        spec: SpeculativeConfig (M, D_max; ``validate_tree``). rows: N, the most sequences of a batched step; a
            step of n sequences runs ``runners.shapes.rows_for(n, N)`` rows (plain) or that many x M (trees), the
            smallest of the buckets 1, 2, 4, ..., N that holds them; N = 1 uses the single-sequence calls and
            ``policy``.
        policy: N = 1 with a drafter: core.policy.AdaptivePolicy or FixedPolicy (kept by the caller across turns).
        gate: N > 1 with drafts: the step-kind chooser (default ``RateGate(gate_kinds)``: "tree" with a drafter,
            "copy" with ``suffix``, then "plain"); None: every step a copy step.
        validate: check every tensorized tree against its invariants before verifying it (eager mode).
        trace: core.trace.TraceWriter receiving each StepTrace, or None.
        suffix: the process's core.suffix.SuffixIndex of earlier outputs: draft trees also hold suffix candidates
            (core/suffix.py; with ``drafter`` None they are the only drafts). None: the drafter's trees alone.
        costs: N = 1: the core.costs.RunningCosts that keeps the policy's cost table current; every step that
            made no graph (compiled or loaded) is observed. None: the table stays as it is.
        features: also keep the teacher's final-normed hidden state and captured features of every token fed
            (``s.features`` gets (hidden float32 [1, H], aux float32 [1, 3H]) per step; teacher-only, training data).
        width_step: batched calls on a non-grouped attention backend pad the concatenated KV width to a multiple
            of this many slots (``TeacherRunner.decode_batch``).
    Raises:
        ValueError: a drafter at N = 1 without a policy, or features with a drafter.
    """

    def __init__(self, teacher: TeacherRunnerLike, drafter: DrafterRunnerLike | None = None,
                 spec: SpeculativeConfig | None = None, rows: int = 1, policy=None,
                 gate=None, validate: bool = False, trace=None, features: bool = False, width_step: int = 512,
                 suffix: SuffixIndex | None = None, costs=None):
        drafts = drafter is not None or suffix is not None
        if drafts and rows == 1 and policy is None:
            raise ValueError("DecodeRound: drafting at rows = 1 needs a speculation policy")
        if features and drafts:
            raise ValueError("DecodeRound: features are collected on teacher-only rounds")
        self.teacher, self.drafter, self.suffix, self.costs = teacher, drafter, suffix, costs
        self.spec = spec or SpeculativeConfig()
        self.M, self.D = self.spec.M, self.spec.D_max
        self.rows, self.policy, self.validate, self.trace, self.features = rows, policy, validate, trace, features
        self.width_step = width_step
        self.single = rows == 1 and not features
        self.gate_kinds = (("tree",) if drafter is not None else ()) + (("copy",) if suffix is not None else ()) + \
            ("plain",)
        """The batched step kinds the gate picks between: the drafter's trees (merged with copies), copies of
        earlier text alone (with ``suffix``), a plain step (no speculation: what speculation must beat)."""
        self.gate = gate or (RateGate(self.gate_kinds) if drafts and not self.single else None)
        self.extra_slots = self.M if drafts else 0   # KV slots a sequence needs beyond its tokens
        # batched rounds value draft nodes by calibrated acceptance and allot rows by their learned cost (a single
        # sequence's policy keeps its own model and cost table)
        batched = drafts and not self.single
        self.model = AcceptanceModel() if batched else None
        self.row_costs = RowCosts() if batched else None
        self._rows_run = 0                             # rows of the step's forward (for row_costs)
        self._kind = "plain"                           # the gate's choice for the step

    # ------------------------------------------------------------------ sequences
    def start(self, s, prompt_ids, aux: np.ndarray) -> None:
        """After ``s``'s prefill (``s.next`` = its first token): open its drafter sequence; the first context pairs
        are (aux[t], prompt_ids[t + 1]) with the first token after the last prompt position.

        Args:
            prompt_ids: int [T] prompt ids. aux: float32 [T, 3H] captured features of the prompt.
        """
        s.state = None
        if self.drafter is not None:
            nxt = np.asarray(list(prompt_ids[1:]) + [s.next], np.int64)
            s.state = _DraftState(self.drafter.new_seq(), [(aux, nxt)])
            self._check_positions(s, len(prompt_ids))
        if self.suffix is not None:
            ids = [int(t) for t in prompt_ids]
            text = SuffixIndex(self.suffix.max_match, self.suffix.min_match)
            text.add(ids + [int(s.next)])
            if s.state is None:
                s.state = _DraftState(None, [])
            s.state.text, s.state.key = text, hash(tuple(ids))

    def _check_positions(self, s, prompt_len: int) -> None:
        """A turn that can reach past the drafter's trained positions: a note on the sequence (``s.notes``, the
        engine puts it in the turn's trace) and, once per drafter, one line on stderr."""
        limit = getattr(self.drafter, "max_positions", None)
        last = prompt_len + s.gen.max_new_tokens
        if limit is None or last <= limit:
            return
        note = (f"prompt of {prompt_len} tokens + generation.max_new_tokens={s.gen.max_new_tokens} reaches position "
                f"{last}, past the drafter's trained max_position_embeddings={limit}: output stays lossless, drafts "
                f"there are accepted less often")
        s.notes.append(note)
        if id(self.drafter) not in _POSITION_WARNED:
            _POSITION_WARNED.add(id(self.drafter))
            print(f"warning: {note}", file=sys.stderr, flush=True)

    def finish(self, s) -> None:
        """``s`` left (ended or cancelled): free its drafter sequence (its teacher sequence is the caller's) and
        add its output to the process's index of earlier outputs (suffix candidates)."""
        st = getattr(s, "state", None)
        if st is None:
            return
        if st.dsid is not None:
            self.drafter.free(st.dsid)
        if st.text is not None and s.emitter.ids:
            self.suffix.add(s.emitter.ids, key=st.key)
        s.state = None

    def _suffix_tree(self, s, depth: int | None = None, m: int | None = None) -> DraftTree | None:
        """The suffix candidates of ``s`` rooted at its pending token, at most ``depth`` deep and ``m`` nodes
        (default D_max and M; None: no earlier match, or no suffix)."""
        st = s.state
        if st is None or st.text is None:
            return None
        ctx = st.text.docs[0]
        return propose(s.next, [(st.text, ctx, None), (self.suffix, ctx, st.key)], depth or self.D, m or self.M).tree

    def batch_budget(self, n: int) -> tuple[int, int]:
        """(m, depth) of a batched tree step of ``n`` sequences: m tokens verified per sequence
        (``runners.shapes.batch_budget`` of its row bucket) and drafts at most m - 1 deep (and D_max)."""
        m = batch_budget(rows_for(n, self.rows), self.M, self.spec.batch_tree_rows)
        return m, min(self.D, m - 1)

    # ------------------------------------------------------------------ one step
    def step(self, live: list) -> list:
        """Advance every sequence of ``live`` by one step.

        Returns:
            per sequence, the tokens it emitted this step (list[int]: L_k tokens of a tree step or 1 of a plain
            step, cut where its Emitter ended the turn; ``s.emitter.reason`` tells whether it did). A sequence
            whose logits were not finite emits nothing and gets ``s.error``; the others go on unchanged (its
            cache is not committed: the caller ends it and frees its blocks).
        Raises:
            CacheExhaustedError: a sequence's tokens do not fit its cache (callers reserve room first).
        """
        timer = Timer()
        made = graph_stats()
        with timer:
            plans = self._draft(live, timer)
            tree_step = any(p.tree is not None for p in plans)
            results = self._verify(live, plans, timer) if tree_step else self._decode(live, timer)
            out = [self._take(s, plan, res) for s, plan, res in zip(live, plans, results)]
        clean = graph_stats() == made         # a step that compiled or loaded a graph says nothing of what it costs
        if self.gate is not None and clean:
            kind = "tree" if any(p.drafted for p in plans) else self._kind
            backlog = timer.ms.get("draft_catchup", 0.0)
            self.gate.observe(kind, sum(len(t) for t in out), timer.total_ms - backlog, backlog)
        if self.row_costs is not None and clean:
            self.row_costs.observe(self._rows_run, timer.ms.get("verify" if tree_step else "decode", 0.0))
        for s, plan, res in zip(live, plans, results):
            if res is not None:
                self._record(s, plan, res, timer)
        if self.single and self.costs is not None and clean and results[0] is not None:
            self.costs.observe_step(live[0].steps[-1])
        return out

    def _take(self, s, plan: StepPlan, res: StepResult | None) -> list:
        """Apply one sequence's result: queue its (feature, token) pairs for the drafter and its tokens for its
        own suffix index, tell the policy, emit the tokens; returns the ids emitted ([] for a failed sequence)."""
        if res is None:                          # non-finite logits: this sequence alone fails
            return []
        if s.state is not None:
            if s.state.dsid is not None:
                s.state.pending.append((res.aux, res.tokens))
            if s.state.text is not None:
                s.state.text.extend(0, res.tokens)
        if plan.tree is not None:
            s.accept_lens.append(len(res.tokens))
            if self.model is not None:
                observe_tree(self.model, plan.tree, res.path)
        if self.single and self.policy is not None:
            self.policy.observe(plan.tree, res.path, len(res.tokens),
                                self._model_ms(plan.choice, plan.expansions, plan.drafted))
        s.next = int(res.tokens[-1])
        emitted = s.emitter.push_all(res.tokens)
        if res.logprobs is not None:
            s.logprobs += res.logprobs[: len(emitted)]
        return emitted

    def _record(self, s, plan: StepPlan, res: StepResult, timer: Timer) -> None:
        """The sequence's StepTrace of this step (kept on ``s.steps``, written to the trace)."""
        tree, choice = plan.tree, plan.choice
        src = tree.source[res.path[1:]] if tree is not None and tree.source is not None else np.zeros(0, np.int8)
        st = StepTrace(step=len(s.steps), accept_len=len(res.tokens), accepted=res.path.tolist(),
                       n_nodes=len(tree) if tree is not None else 1, budget=choice.m if choice else 1,
                       drafted=plan.drafted, predicted_len=choice.predicted_len if choice else 1.0,
                       accepted_suffix=int((src == SOURCE_SUFFIX).sum()),
                       accepted_both=int((src == SOURCE_BOTH).sum()),
                       total_ms=timer.total_ms, **timer.phase_kwargs(), **self._draft_split(timer, plan.expansions))
        s.steps.append(st)
        if self.trace is not None:
            self.trace.write(st)

    def _draft_split(self, timer: Timer, grown: int) -> dict:
        """StepTrace fields of a single-sequence step's drafting: its context pass, its tree expansion and the
        expansion calls run (``core.costs.RunningCosts`` learns the two drafter costs from them); zeros for a
        batched round, whose drafting is one batched pass over every sequence."""
        if not self.single:
            return {}
        return {"draft_ctx_ms": timer.ms.get("draft_ctx", 0.0), "draft_expand_ms": timer.ms.get("draft_expand", 0.0),
                "expansions": int(grown)}

    # ------------------------------------------------------------------ plan + draft
    def _draft(self, live: list, timer: Timer) -> list:
        """The StepPlan of every sequence of ``live``: a plain step for all, or the trees to verify."""
        plans = [StepPlan() for _ in live]
        if self.drafter is None and self.suffix is None:
            return plans
        if self.single:
            plans[0] = self._plan_one(live[0], timer)
            return plans
        kind = self.gate.choose() if self.gate is not None else "copy"
        self._kind = kind
        if kind == "plain":
            return plans
        dr = self.drafter if kind == "tree" else None
        depth = self.batch_budget(len(live))[1]
        with timer.phase("draft"):
            trees = [None] * len(live)
            if dr is not None:
                with timer.phase("draft_catchup"):
                    self._catch_up(live)
                pending = [_take_pending(s.state) for s in live]
                trees = dr.draft_batch([s.state.dsid for s in live], pending, [s.next for s in live], self.M, depth,
                                       rows_for(len(live), self.rows))
            if self.suffix is not None:
                for i, s in enumerate(live):
                    sfx = self._suffix_tree(s)
                    trees[i] = sfx if trees[i] is None else merge_trees(trees[i], sfx)
            budgets = self._allot(trees)
        grown = max(0, depth - 1) if dr is not None else 0
        return [StepPlan(top_nodes(t, int(m), v) if m > 1 else None, Choice(int(m), 0.0, 0.0) if m > 1 else None,
                         grown, dr is not None) for (t, v), m in zip(trees, budgets)]

    def _catch_up(self, live: list) -> None:
        """Feed the drafter every queued (feature, token) pair of ``live`` but the latest step's: the backlog of
        the steps that did not run it (copies alone, plain steps). Its time is kept apart (timer phase
        ``draft_catchup``): it is left out of the tree kind's rate, so a tree step is judged at the cost it has
        when trees run every step (one step's pairs), not at the debt of the steps before (else a drafter that
        rarely runs looks dearer each time it is probed and is probed ever more rarely), and it paces the probes
        (``RateGate.observe``'s ``extra_ms``), so probing with its backlog stays within the gate's time share."""
        for s in live:
            st = s.state
            if len(st.pending) > 1:
                latest = st.pending.pop()
                self.drafter.extend(st.dsid, *_take_pending(st))
                st.pending = [latest]

    def _allot(self, trees: list) -> list:
        """Replace each tree of ``trees`` (in place) by (tree, its nodes' calibrated values) and return each
        sequence's budget (1 = its pending token alone), by :func:`core.policy.allot_rows` under this round's
        learned row costs, within the step's row limit (:meth:`tree_rows`) and M a sequence."""
        values = []
        for i, t in enumerate(trees):
            v = node_values(t, self.model) if t is not None else np.ones(1)
            trees[i] = (t, v)
            values.append(v[1:])
        counts = allot_rows(values, self.row_costs.ms, self.tree_rows(len(trees)), self.M)
        return (counts + 1).tolist()

    def tree_rows(self, n: int) -> int:
        """The most rows a batched tree step of ``n`` sequences verifies: n x M when the teacher runs it on the
        host (any row count, no graph), else the warmed-up graph's b x m_b (:meth:`batch_budget`; b = the row
        bucket), whatever each sequence's share of it."""
        if self.teacher.on_host(n * self.M):
            return n * self.M
        return rows_for(n, self.rows) * self.batch_budget(n)[0]

    def _plan_one(self, s, timer: Timer) -> StepPlan:
        """N = 1: the policy decides whether to draft, how deep the drafter's tree grows and the budget m."""
        dr, plan = self.drafter, StepPlan()
        max_m = self.teacher.S - self.teacher.length(s.sid)           # tree tokens the cache has room for
        left = s.emitter.left
        with timer.phase("draft"):
            tree = self._suffix_tree(s) if max_m >= 2 else None
        if dr is not None and self.policy.want_draft(max_m, tree, left):
            def grow(tree, frontier, depth):
                ok = self.policy.want_expand(tree, frontier, depth, max_m, left)
                plan.expansions += ok
                return ok
            with timer.phase("draft"):
                with timer.phase("draft_ctx"):
                    first = dr.extend(s.state.dsid, *_take_pending(s.state))
                with timer.phase("draft_expand"):
                    drafted = dr.build_tree(s.state.dsid, s.next, first, self.M, self.D, grow=grow)
                tree = drafted if self.suffix is None else merge_trees(drafted, tree)
            plan.drafted = True
        if tree is None:
            return plan
        plan.choice = self.policy.choose(tree, max_m, left)
        if plan.drafted:
            self.policy.after_draft(plan.choice)
        if plan.choice.m > 1:
            plan.tree = self.policy.select(tree, plan.choice.m)
        return plan

    # ------------------------------------------------------------------ forwards
    def _decode(self, live: list, timer: Timer) -> list:
        """A plain step: one teacher forward of each sequence's pending token. Returns a StepResult per sequence
        (path [0], one token; ``aux`` None on teacher-only batched rounds), None for one whose logits were not
        finite."""
        tg = self.teacher
        n = len(live)
        rows = 1 if self.single else n if tg.on_host(n) else rows_for(n, self.rows)
        self._rows_run = rows
        with timer.phase("decode"):
            if self.single:
                logits, aux = tg.decode(live[0].sid, live[0].next)
                logits = logits[None]
            elif self.features:
                logits, hidden, aux = tg.decode_batch([s.sid for s in live], [s.next for s in live], rows=rows,
                                                      width_step=self.width_step, with_hidden=True)
                for i, s in enumerate(live):          # copies: a view would keep the whole call's output alive
                    s.features.append((hidden[i:i + 1].copy(), aux[i:i + 1].copy()))
            elif self.drafter is not None:        # the drafter will need the (feature, token) pairs
                logits, aux = tg.decode_batch([s.sid for s in live], [s.next for s in live], rows=rows,
                                              width_step=self.width_step, with_aux=True)
            else:
                logits = tg.decode_batch([s.sid for s in live], [s.next for s in live], rows=rows,
                                         width_step=self.width_step)
                aux = [None] * len(live)
            # the token drawn sits at the teacher's new length (sampling draws its noise by position)
            out = []
            for i, s in enumerate(live):
                if _poisoned(s, logits[i:i + 1]):
                    out.append(None)
                    continue
                tokens = np.asarray([sample_token(logits[i], s.gen, tg.length(s.sid) if s.gen.temperature else 0)],
                                    np.int64)
                out.append(StepResult(np.zeros(1, np.int32), tokens, aux[i:i + 1],
                                      _logprobs(s, logits[i:i + 1], tokens)))
            return out

    def _verify(self, live: list, plans: list, timer: Timer) -> list:
        """A tree step: one teacher forward over every sequence's tree at its budget (a sequence without a tree
        verifies its root alone), then acceptance and commit per sequence. Returns a StepResult per sequence
        (None for one whose logits were not finite)."""
        tg, D = self.teacher, self.D
        trees = [p.tree for p in plans]
        budgets = [p.choice.m if p.tree is not None else 1 for p in plans]
        first_pos = [tg.length(s.sid) + 1 if s.gen.temperature else 0 for s in live]   # the token after each root
        with timer.phase("tensorize"):
            if self.single:
                layout = BatchLayout(budgets, budgets[0])
            else:                                     # on the host exactly the rows used, else the graph's rows
                used = int(sum(budgets))
                layout = BatchLayout(budgets, used if self.teacher.on_host(used) else self.tree_rows(len(live)))
            tts = []
            for i, (s, t) in enumerate(zip(live, trees)):
                m = int(layout.budgets[i])
                tts.append(tensorize(t if t is not None else DraftTree(np.asarray([s.next]), np.zeros(1, np.int64)),
                                     m, D))
                if self.validate:
                    validate_tree(tts[-1], m, D)
        if self.single:
            with timer.phase("mask"):
                mask = tg.verify_mask(live[0].sid, tts[0])
            with timer.phase("verify"):
                logits, aux = tg.verify(live[0].sid, tts[0], mask)
        else:
            self._rows_run = layout.rows
            with timer.phase("verify"):
                logits, aux = tg.verify_batch([s.sid for s in live], tts, rows=layout.rows,
                                              width_step=self.width_step)
        out = []
        for i, (s, tt) in enumerate(zip(live, tts)):
            r = layout.rows_of(i)
            if _poisoned(s, logits[r][: tt.n_nodes]):
                out.append(None)
                continue
            with timer.phase("accept"):
                g = s.gen
                if g.temperature == 0:
                    res = accept_greedy(tt, logits[r].argmax(-1))
                else:
                    rows = logits[r]            # warped only at the nodes the walk reaches
                    res = accept_coupled(tt, lambda j: warp_probs(rows[j:j + 1], g.temperature, g.top_p, g.top_k)[0],
                                         g.seed, first_pos[i])
            with timer.phase("commit"):
                tg.commit(s.sid, res.path, D + 2)
            # emitted token j (accepted drafts, then the bonus) was predicted by the row of node path[j]
            out.append(StepResult(res.path, res.tokens, aux[r][res.path],
                                  _logprobs(s, logits[r][res.path], res.tokens)))
        return out

    def _model_ms(self, choice, expansions: int, drafted: bool) -> float:
        """The step's cost by the policy's table (0 without one): the drafter calls made (when ``drafted``) plus
        the forward of the chosen budget (``choice`` None or m = 1: a plain decode)."""
        c = self.policy.costs
        if c is None:
            return 0.0
        forward = c.step_ms(choice.m if choice is not None else 1)
        return forward + (c.draft_ctx_ms + expansions * c.draft_step_ms if drafted else 0.0)


def _logprobs(s, rows, tokens) -> list | None:
    """``core.accept.token_logprobs`` of the tokens ``s`` emits from these logits rows, when its request asked
    for log-probabilities (``gen.logprobs`` not None); else None."""
    n = getattr(s.gen, "logprobs", None)
    return None if n is None else token_logprobs(rows, tokens, n)


def first_token(s, logits, pos: int) -> int | None:
    """The first token of ``s`` from the prefill's last logits row (f32 [V]), drawn at position ``pos`` (the prompt
    length) as ``core.accept.sample_token``, its log-probability entry appended when asked (``gen.logprobs``); None
    (and ``s.error`` set) when those logits are not finite. Every caller's prologue (engine, scheduler) uses it."""
    row = np.asarray(logits)[None]
    if _poisoned(s, row):
        return None
    tok = sample_token(logits, s.gen, pos)
    if s.gen.logprobs is not None:
        s.logprobs += token_logprobs(row, [tok], s.gen.logprobs)
    return tok


def non_finite_message(at: int) -> str:
    """The error of a sequence whose teacher logits were NaN or infinite at output token ``at``."""
    return (f"the teacher's logits for this sequence were not finite (NaN or infinity) at output token {at}; "
            "this request was stopped, the others go on")


def _poisoned(s, rows) -> bool:
    """True (and ``s.error`` set) when the teacher's logits rows of ``s`` hold a NaN or an infinity."""
    if np.isfinite(rows).all():
        return False
    s.error = non_finite_message(len(s.emitter.ids))
    return True


_POSITION_WARNED: set = set()          # ids of drafter runners whose position warning was printed


def _take_pending(state: _DraftState) -> tuple:
    """The (aux float32 [k, 3H], tokens int64 [k]) the drafter has not seen, concatenated; the queue is emptied."""
    aux = np.concatenate([a for a, _ in state.pending])
    toks = np.concatenate([t for _, t in state.pending])
    state.pending = []
    return aux, toks


__all__ = ["BatchLayout", "DecodeRound", "Sequence", "StepPlan", "StepResult", "first_token", "non_finite_message"]
