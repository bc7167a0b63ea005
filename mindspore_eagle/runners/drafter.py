"""DrafterRunner: the drafter's context pass and EAGLE-2 dynamic draft-tree expansion.

Legend: K = top_k, D = D_max (max draft depth; root depth 0), M = tree budget (root included),
n_ctx = (feature, next token) pairs in the drafter cache, W = drafter attention window (0 = unlimited),
H = hidden, Sd = drafter max_seq_len.

Pairing (docs/design.md, "Token/feature pairing"): drafter position p holds the pair (teacher feature of token p,
embedding of token p + 1) and predicts token p + 2. After the teacher emits root r, the context pass ends on the
pair (feature of the last committed token, r) and its top-K gives the depth-1 candidates.

Expansion (E ``cnets.Model.topK_genrate``; docs/design.md, "Tree expansion"; here with D = max depth so D - 1 tree
steps): at tree step i = 1 .. D-1 the K selected nodes of depth i run together at position n_ctx + i - 1, each seeing
the whole context (or its last W pairs) and its own tree ancestors (mask ``TM``); their top-K children get
cumulative log-prob scores (fp32); the best K of the K^2 become the next frontier. Finally the best M - 1 of all
candidates are kept (ties: lower candidate id first, so a parent always wins over its child), sorted
by candidate id so parents precede children. The drafter's tree K/V live in a scratch branch that is dropped
after each round; only accepted context (rebuilt from the teacher's true features) persists.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np

from mindspore_eagle.core.tree import NEG_BIAS, DraftTree
from mindspore_eagle.kernels.kv import BlockManager
from mindspore_eagle.kernels.runtime import CompiledFn
from mindspore_eagle.models.eagle3 import Eagle3Drafter
from mindspore_eagle.models.eagle3_host import HostDrafter
from mindspore_eagle.runners.shapes import context_widths, pow2_buckets


class DrafterRunner:
    """Fixed-shape calls of :class:`Eagle3Drafter` over its own paged cache.

    Args:
        drafter: the Cell (weights loaded). num_blocks / block_size / max_seq_len: drafter cache geometry
        (max_seq_len must hold the context plus the tree scratch K * (D - 1)). mode: fused | eager.
        window: W, the drafter attends to at most the last W context pairs (0 = all; paper Table 3).
        chunk: largest context-pass call (power of two).
        host: run calls of at most ``HostDrafter.max_rows`` rows on the host (``models/eagle3_host.py``: the same
            kernels without a graph launch, bit-identical outputs); None = whenever the drafter is on the cpu
            backend. Longer calls (a prompt's context pass) stay compiled graphs.
    """

    def __init__(self, drafter: Eagle3Drafter, num_blocks: int, block_size: int, max_seq_len: int, mode: str,
                 window: int = 0, chunk: int = 128, host: bool | None = None):
        self.drafter, self.K = drafter, drafter.top_k
        self.bm = BlockManager(num_blocks, block_size, max_seq_len)
        self.S, self.B, self.window = max_seq_len, block_size, int(window)
        self.buckets = pow2_buckets(chunk)
        self.widths = context_widths(max_seq_len, block_size)
        self._ctx = CompiledFn(drafter.context, mode)
        self._step = CompiledFn(drafter.construct, mode)
        on_cpu = getattr(drafter.backend, "name", None) == "cpu"
        self.host = HostDrafter(drafter) if (on_cpu if host is None else host) else None
        """The :class:`HostDrafter` that runs the small calls, or None (every call a compiled graph)."""

    @property
    def compiles(self) -> int:
        return self._ctx.compiles + self._step.compiles

    @property
    def loads(self) -> int:
        """Graphs loaded from the graph store so far (fused mode; 0 in eager)."""
        return self._ctx.loads + self._step.loads

    @property
    def compile_ms(self) -> float:
        return self._ctx.compile_ms + self._step.compile_ms

    @property
    def max_positions(self) -> int:
        """Positions the drafter was trained for (its config's ``max_position_embeddings``); past them it still
        runs (RoPE extrapolates) and output stays lossless, but its drafts are accepted less often."""
        return int(self.drafter.cfg.max_position_embeddings)

    def new_seq(self) -> int:
        return self.bm.new_seq()

    def free(self, sid: int) -> None:
        self.bm.free(sid)

    def _visible_ctx(self, upto: int) -> tuple[int, int]:
        lo = max(0, upto - self.window) if self.window > 0 else 0
        return lo, upto

    def _width(self, need: int) -> int:
        return next(w for w in self.widths if w >= need)

    def _context_rows(self, p0: int, m: int, width: int) -> np.ndarray:
        """float32 [m, width] additive mask of m context pairs appended after p0: pair i sees its window of the
        context up to and including itself."""
        mask = np.full((m, width), NEG_BIAS, np.float32)
        for i in range(m):
            lo, hi = self._visible_ctx(p0 + i + 1)
            mask[i, lo:hi] = 0.0
        return mask

    def on_host(self, rows: int) -> bool:
        """True when a call of ``rows`` rows runs on the host (so it has no graph to compile)."""
        return self.host is not None and rows <= self.host.max_rows

    def _call(self, which: str, *args: np.ndarray) -> tuple:
        """One drafter call (``which`` = "context" or "construct" of :class:`Eagle3Drafter`) on numpy arguments
        -> numpy (top_logp float32 [r, K], top_ids int [r, K], h_out [r, H]): on the host when it is on and the
        call has at most ``HostDrafter.max_rows`` rows, else through the compiled graph."""
        if self.on_host(args[0].shape[0]):
            return getattr(self.host, which)(*args)
        fn = self._ctx if which == "context" else self._step
        return tuple(o.asnumpy() for o in fn(*(ms.Tensor(a) for a in args)))

    def _run(self, sid, h, tokens, positions, slots, mask):
        table = self.bm.block_table(sid)[: mask.shape[1] // self.B]
        return self._call("construct", h, np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                          np.asarray(slots, np.int32), table, mask)

    # ------------------------------------------------------------------ context pass
    def extend(self, sid: int, aux: np.ndarray, next_tokens: np.ndarray):
        """Append context pairs (aux[i], next_tokens[i]) and return the last pair's prediction.

        Args:
            aux: float32 [n, 3Ht] teacher features of the committed tokens (n >= 1).
            next_tokens: int [n], the token that follows each of them.
        Returns:
            (top_logp float32 [K], top_ids int64 [K] teacher ids, h_last numpy [1, H] in the compute dtype).

        One graph call per chunk of at most ``chunk`` pairs (``Eagle3Drafter.context``: fc, the layer, and the head
        on the chunk's last pair only).
        """
        n = len(next_tokens)
        chunk = self.buckets[-1]
        for start in range(0, n, chunk):
            part = slice(start, min(n, start + chunk))
            m = part.stop - part.start
            k = next(b for b in self.buckets if b >= m)
            p0 = self.bm.length(sid)
            feats = np.zeros((k, aux.shape[1]), np.float32)
            feats[:m] = aux[part]
            tokens = np.zeros(k, np.int64)
            tokens[:m] = next_tokens[part]
            positions = np.zeros(k, np.int64)
            positions[:m] = np.arange(p0, p0 + m)
            mask = np.full((k, self._width(p0 + m)), NEG_BIAS, np.float32)
            mask[:m] = self._context_rows(p0, m, mask.shape[1])
            mask[m:, 0] = 0.0
            slots = self.bm.append(sid, m, k)
            table = self.bm.block_table(sid)[: mask.shape[1] // self.B]
            top_logp, top_ids, h_last = self._call(
                "context", feats, tokens.astype(np.int32), positions.astype(np.int32), np.asarray(slots, np.int32),
                table, mask, np.array([m - 1], np.int32))
            self.bm.advance(sid, m)
        return top_logp[0], top_ids[0].astype(np.int64), h_last

    # ------------------------------------------------------------------ tree expansion
    def build_tree(self, sid: int, root: int, first, M: int, D: int, grow=None) -> DraftTree:
        """Expand the dynamic draft tree from the context pass output ``first`` = extend(...)'s result.

        Args:
            grow: optional ``grow(tree, frontier_scores, depth) -> bool`` asked before each expansion step with
                the tree drafted so far (best M - 1 candidates), the cumulative log-probs float32 [K] of the
                frontier and its depth; False stops the expansion there (the speculation policy's early exit).
        Returns a DraftTree with at most M nodes (root + best M - 1 candidates), parents before children,
        depth <= D. Every drafter write goes to a scratch branch that is rolled back before returning.
        """
        K = self.K
        e = _Expansion(root, first, K)
        cur_h = np.repeat(first[2], K, 0)           # host arrays: a PyNative tile / gather costs 70-130 us each
        n_ctx = self.bm.length(sid)
        steps = max(0, D - 1)
        if steps:
            self.bm.branch(sid, K * steps)
        window = self._visible_ctx(n_ctx)
        for i in range(1, steps + 1):
            if grow is not None and not grow(e.tree(M), e.frontier_scores, i):
                break
            positions = np.full(K, n_ctx + i - 1, np.int64)
            slots = self.bm.slots(sid, n_ctx + (i - 1) * K + np.arange(K))
            mask = e.mask(i, n_ctx, window, self._width(n_ctx + K * steps))
            lp, ids, h_out = self._run(sid, cur_h, e.cur_tok, positions, slots, mask)
            row = e.advance(i, lp, ids)
            if i < steps:
                cur_h = h_out[row]
        if steps:
            self.bm.rollback(sid)
        return e.tree(M)

    # ------------------------------------------------------------------ batched drafting (continuous batching)
    @property
    def grouped(self) -> bool:
        """True when the backend takes a block table per sequence, so :meth:`draft_batch` batches the calls."""
        return getattr(self.drafter.backend, "grouped", False)

    def draft_batch(self, sids, pending, roots, M: int, D: int, groups: int) -> list:
        """Context pass and tree expansion of several sequences, batched across them (scheduler.py).

        With a grouped backend every context pass of at most ``BATCH_EXTEND_MAX`` pairs runs in one call of
        ``groups`` x bucket rows (a longer one, e.g. the whole prompt after admission, runs alone) and each
        expansion step runs the K frontier rows of every sequence in one call of ``groups`` x K rows, each
        group over its own block table; the trees are exactly those of :meth:`extend` + :meth:`build_tree` per
        sequence (same math per row; float32 summation order aside). Other backends loop over the sequences.

        Args:
            sids: n drafter sequence ids; pending: n pairs (aux float32 [m_i, 3Ht], next tokens int [m_i]);
            roots: n root tokens; M / D: tree budget and depth; groups: static group count (>= n).
        Returns:
            n DraftTrees.
        Raises:
            ValueError: more sequences than ``groups``.
        """
        n = len(sids)
        if n > groups:
            raise ValueError(f"draft_batch: {n} sequences do not fit {groups} groups")
        if not self.grouped:
            return [self.build_tree(sid, r, self.extend(sid, a, t), M, D) for sid, (a, t), r in
                    zip(sids, pending, roots)]
        firsts = [None] * n
        short = [i for i in range(n) if len(pending[i][1]) <= BATCH_EXTEND_MAX]
        for i in sorted(set(range(n)) - set(short)):      # a long context pass (a new prompt) runs alone
            firsts[i] = self.extend(sids[i], *pending[i])
        if short:
            for i, f in zip(short, self._extend_grouped([sids[i] for i in short], [pending[i] for i in short],
                                                        groups)):
                firsts[i] = f
        return self._build_trees(sids, roots, firsts, M, D, groups)

    def _extend_grouped(self, sids, pending, groups: int) -> list:
        """One context-pass call for all ``sids`` (each m_i <= BATCH_EXTEND_MAX pairs): groups x kg rows."""
        ms_ = [len(t) for _, t in pending]
        kg = next(b for b in self.buckets if b >= max(ms_))
        p0s = [self.bm.length(sid) for sid in sids]
        w = self._width(max(p + m for p, m in zip(p0s, ms_)))
        rows = groups * kg
        feats = np.zeros((rows, pending[0][0].shape[1]), np.float32)
        tokens, positions = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        slots = self.bm.pad_slots(rows)
        mask = np.full((rows, w), NEG_BIAS, np.float32)
        mask[:, 0] = 0.0                                  # pad rows see column 0 (real rows overwritten below)
        table = np.full((groups, w // self.B), self.bm.pad_block, np.int32)
        for g, (sid, (aux, nxt), p0, m) in enumerate(zip(sids, pending, p0s, ms_)):
            r = slice(g * kg, g * kg + m)
            feats[r], tokens[r], positions[r] = aux, nxt, np.arange(p0, p0 + m)
            mask[r] = self._context_rows(p0, m, w)
            slots[r] = self.bm.append(sid, m, m)
            table[g] = self.bm.block_table(sid)[: w // self.B]
        pick = np.zeros(groups, np.int32)                 # pad groups pick row 0 (ignored)
        pick[: len(ms_)] = [g * kg + m - 1 for g, m in enumerate(ms_)]
        top_logp, top_ids, h_last = self._call("context", feats, tokens.astype(np.int32),
                                               positions.astype(np.int32), np.asarray(slots, np.int32), table, mask,
                                               pick)
        for sid, m in zip(sids, ms_):
            self.bm.advance(sid, m)
        top_ids = top_ids.astype(np.int64)
        return [(top_logp[g], top_ids[g], h_last[g:g + 1]) for g in range(len(ms_))]

    def _build_trees(self, sids, roots, firsts, M: int, D: int, groups: int) -> list:
        """:meth:`build_tree` for every sequence, each expansion step one call of groups x K rows."""
        K, n = self.K, len(sids)
        es = [_Expansion(r, f, K) for r, f in zip(roots, firsts)]
        steps = max(0, D - 1)
        if not steps:
            return [e.tree(M) for e in es]
        n_ctx = [self.bm.length(sid) for sid in sids]
        for sid in sids:
            self.bm.branch(sid, K * steps)
        w = self._width(max(n_ctx) + K * steps)
        windows = [self._visible_ctx(c) for c in n_ctx]
        table = np.full((groups, w // self.B), self.bm.pad_block, np.int32)
        for g, sid in enumerate(sids):
            table[g] = self.bm.block_table(sid)[: w // self.B]
        rows = groups * K
        cur_h = np.zeros((rows, firsts[0][2].shape[1]), firsts[0][2].dtype)      # pad groups: zeros
        for g, f in enumerate(firsts):
            cur_h[g * K:(g + 1) * K] = f[2]
        for i in range(1, steps + 1):
            tokens, positions = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
            slots = self.bm.pad_slots(rows)
            mask = np.full((rows, w), NEG_BIAS, np.float32)
            mask[n * K:, 0] = 0.0
            for g, (sid, e, c) in enumerate(zip(sids, es, n_ctx)):
                r = slice(g * K, (g + 1) * K)
                tokens[r], positions[r] = e.cur_tok, c + i - 1
                slots[r] = self.bm.slots(sid, c + (i - 1) * K + np.arange(K))
                mask[r] = e.mask(i, c, windows[g], w)
            lp, ids, h_out = self._call("construct", cur_h, tokens.astype(np.int32), positions.astype(np.int32),
                                        np.asarray(slots, np.int32), table, mask)
            sel = np.zeros(rows, np.int32)                 # pad groups keep gathering row 0
            for g, e in enumerate(es):
                sel[g * K:(g + 1) * K] = g * K + e.advance(i, lp[g * K:(g + 1) * K], ids[g * K:(g + 1) * K])
            if i < steps:
                cur_h = h_out[sel]
        for sid in sids:
            self.bm.rollback(sid)
        return [e.tree(M) for e in es]


BATCH_EXTEND_MAX = 16
"""Most context pairs of one sequence that :meth:`DrafterRunner.draft_batch` puts into a batched context-pass call
(a decode step adds 1, a tree step at most D_max + 1, plain steps between probes up to 16); longer passes (the
prompt after admission) run alone, so a batched call never pads every group to a long bucket."""


class _Expansion:
    """Host state of one sequence's tree expansion (E ``cnets.Model.topK_genrate``): every candidate's cumulative
    log-prob, token and parent (global ids: 0 = root, candidate c = c + 1), the frontier of K nodes and its tree
    mask. Shared by :meth:`DrafterRunner.build_tree` and the batched ``_build_trees``.

    Args:
        root: root token; first: (top_logp float32 [K], top_ids int64 [K], h) from the context pass; K: top_k.
    """

    def __init__(self, root: int, first, K: int):
        top_logp, top_ids = first[0], first[1]
        self.root, self.K = root, K
        self.scores, self.tokens = [top_logp.astype(np.float32)], [np.asarray(top_ids, np.int64)]
        self.parents = [np.zeros(K, np.int64)]
        self.frontier_ids = np.arange(1, K + 1)
        self.frontier_scores = top_logp.astype(np.float32)
        self.cur_tok = np.asarray(top_ids, np.int64)
        self.tm = np.eye(K, dtype=bool)

    def tree(self, M: int) -> DraftTree:
        """The best M - 1 candidates so far under the root (:func:`select_tree`)."""
        return select_tree(self.root, np.concatenate(self.scores), np.concatenate(self.tokens),
                           np.concatenate(self.parents), M)

    def mask(self, i: int, n_ctx: int, window: tuple, width: int) -> np.ndarray:
        """float32 [K, width] additive mask of expansion step i: the visible context ``window`` = (lo, hi) and
        each frontier node's own tree ancestors at the scratch slots n_ctx .. n_ctx + K i - 1."""
        K = self.K
        mask = np.full((K, width), NEG_BIAS, np.float32)
        mask[:, window[0]:window[1]] = 0.0
        mask[:, n_ctx:n_ctx + K * i] = np.where(self.tm, 0.0, NEG_BIAS)
        return mask

    def advance(self, i: int, lp: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Take step i's output (lp float32 [K, K] child log-probs, ids [K, K] their teacher ids) and pick the best
        K of the K^2 children (ties by id) as the next frontier. Returns int [K]: the output row (parent in the
        frontier) of each new frontier node, to gather its hidden state."""
        K = self.K
        cand = lp.astype(np.float32) + self.frontier_scores[:, None]                  # [K, K]
        ids = ids.astype(np.int64)
        base = 1 + K + (i - 1) * K * K                                                # first global id
        self.scores.append(cand.reshape(-1))
        self.tokens.append(ids.reshape(-1))
        self.parents.append(np.repeat(self.frontier_ids, K))
        flat = cand.reshape(-1)
        sel = np.lexsort((np.arange(flat.size), -flat))[:K]                           # best K, ties by id
        row = sel // K
        self.frontier_ids, self.frontier_scores = base + sel, flat[sel]
        self.cur_tok = ids.reshape(-1)[sel]
        self.tm = np.concatenate([self.tm[row], np.eye(K, dtype=bool)], axis=1)
        return row


def select_tree(root: int, scores: np.ndarray, tokens: np.ndarray, parents: np.ndarray, M: int) -> DraftTree:
    """Keep the best M - 1 candidates (score desc, then candidate id asc) and link them into a DraftTree.

    Args:
        scores float32 [C], tokens int64 [C], parents int64 [C] (global ids: 0 = root, candidate c = c + 1).
    Raises:
        AssertionError: a kept candidate's parent was not kept (cannot happen: a child's cumulative score never
            exceeds its parent's and ties favour the lower id, the parent).
    """
    order = np.lexsort((np.arange(scores.size), -scores))[: M - 1]
    keep = np.sort(order)                                    # ascending candidate id: parents first
    gid = keep + 1
    local = np.searchsorted(gid, parents[keep])              # position of the parent among kept ids
    par = np.where(parents[keep] == 0, 0, local + 1)
    assert np.all((parents[keep] == 0) | (gid[np.minimum(local, len(gid) - 1)] == parents[keep])), \
        "draft tree selected a child without its parent"
    return DraftTree(np.concatenate([[root], tokens[keep]]), np.concatenate([[0], par]),
                     np.concatenate([[0.0], scores[keep]]).astype(np.float32))
