"""DrafterRunner: the drafter's context pass and EAGLE-2 dynamic draft-tree expansion.

Legend: K = top_k, D = D_max (max draft depth; root depth 0), M = tree budget (root included),
n_ctx = (feature, next token) pairs in the drafter cache, W = drafter attention window (0 = unlimited),
H = hidden, Sd = drafter max_seq_len.

Pairing (eagle3.md §2 "Token/feature pairing"): drafter position p holds the pair (teacher feature of token p,
embedding of token p + 1) and predicts token p + 2. After the teacher emits root r, the context pass ends on the
pair (feature of the last committed token, r) and its top-K gives the depth-1 candidates.

Expansion (E ``cnets.Model.topK_genrate``, eagle3.md §2 steps 0-2, here with D = max depth so D - 1 tree steps):
at tree step i = 1 .. D-1 the K selected nodes of depth i run together at position n_ctx + i - 1, each seeing
the whole context (or its last W pairs) and its own tree ancestors (mask ``TM``); their top-K children get
cumulative log-prob scores (fp32); the best K of the K^2 become the next frontier. Finally the best M - 1 of all
candidates are kept (ties: lower candidate id first, so a parent always wins over its child, pitfall P8), sorted
by candidate id so parents precede children. The drafter's tree K/V live in a scratch branch that is dropped
after each round; only accepted context (rebuilt from the teacher's true features, P6) persists.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms

from .kv import BlockManager
from .models.eagle3 import Eagle3Drafter
from .runtime import CompiledFn
from .target import context_widths, pow2_buckets
from .tree import NEG_BIAS, DraftTree


class DrafterRunner:
    """Fixed-shape calls of :class:`Eagle3Drafter` over its own paged cache.

    Args:
        drafter: the Cell (weights loaded). num_blocks / block_size / max_seq_len: drafter cache geometry
        (max_seq_len must hold the context plus the tree scratch K * (D - 1)). mode: fused | eager.
        window: W, the drafter attends to at most the last W context pairs (0 = all; paper Table 3).
        chunk: largest context-pass call (power of two).
    """

    def __init__(self, drafter: Eagle3Drafter, num_blocks: int, block_size: int, max_seq_len: int, mode: str,
                 window: int = 0, chunk: int = 128):
        self.drafter, self.K = drafter, drafter.top_k
        self.bm = BlockManager(num_blocks, block_size, max_seq_len)
        self.S, self.B, self.window = max_seq_len, block_size, int(window)
        self.buckets = pow2_buckets(chunk)
        self.widths = context_widths(max_seq_len, block_size)
        self._fuse = CompiledFn(drafter.fuse, mode)
        self._step = CompiledFn(drafter.construct, mode)

    @property
    def compiles(self) -> int:
        return self._fuse.compiles + self._step.compiles

    @property
    def compile_ms(self) -> float:
        return self._fuse.compile_ms + self._step.compile_ms

    def new_seq(self) -> int:
        return self.bm.new_seq()

    def free(self, sid: int) -> None:
        self.bm.free(sid)

    def _visible_ctx(self, upto: int) -> tuple[int, int]:
        lo = max(0, upto - self.window) if self.window > 0 else 0
        return lo, upto

    def _width(self, need: int) -> int:
        return next(w for w in self.widths if w >= need)

    def _run(self, sid, h, tokens, positions, slots, mask):
        table = self.bm.block_table(sid)[: mask.shape[1] // self.B]
        return self._step(h, ms.Tensor(np.asarray(tokens, np.int32)), ms.Tensor(np.asarray(positions, np.int32)),
                          ms.Tensor(np.asarray(slots, np.int32)), ms.Tensor(table),
                          ms.Tensor(mask))

    # ------------------------------------------------------------------ context pass
    def extend(self, sid: int, aux: np.ndarray, next_tokens: np.ndarray):
        """Append context pairs (aux[i], next_tokens[i]) and return the last pair's prediction.

        Args:
            aux: float32 [n, 3Ht] teacher features of the committed tokens (n >= 1).
            next_tokens: int [n], the token that follows each of them.
        Returns:
            (top_logp float32 [K], top_ids int64 [K] teacher ids, h_last mindspore.Tensor [1, H]).
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
            for i in range(m):
                lo, hi = self._visible_ctx(p0 + i + 1)
                mask[i, lo:hi] = 0.0
            mask[m:, 0] = 0.0
            slots = self.bm.append(sid, m, k)
            h = self._fuse(ms.Tensor(feats))
            top_logp, top_ids, h_out = self._run(sid, h, tokens, positions, slots, mask)
            self.bm.advance(sid, m)
        row = m - 1
        return top_logp.asnumpy()[row], top_ids.asnumpy()[row].astype(np.int64), h_out[row:row + 1]

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
        top_logp, top_ids, h_last = first
        n_ctx = self.bm.length(sid)
        # candidate arrays; candidate c (0-based) has global id c + 1, id 0 is the root
        scores, tokens, parents = [top_logp.astype(np.float32)], [top_ids], [np.zeros(K, np.int64)]
        frontier_ids = np.arange(1, K + 1)
        frontier_scores = top_logp.astype(np.float32)
        cur_tok = top_ids
        cur_h = ms.ops.tile(h_last, (K, 1))
        tm = np.eye(K, dtype=bool)
        steps = max(0, D - 1)
        if steps:
            self.bm.branch(sid, K * steps)
        lo, hi = self._visible_ctx(n_ctx)
        for i in range(1, steps + 1):
            if grow is not None and not grow(select_tree(root, np.concatenate(scores), np.concatenate(tokens),
                                                         np.concatenate(parents), M), frontier_scores, i):
                break
            positions = np.full(K, n_ctx + i - 1, np.int64)
            slots = self.bm.slots(sid, n_ctx + (i - 1) * K + np.arange(K))
            mask = np.full((K, self._width(n_ctx + K * steps)), NEG_BIAS, np.float32)
            mask[:, lo:hi] = 0.0
            mask[:, n_ctx:n_ctx + K * i] = np.where(tm, 0.0, NEG_BIAS)
            lp, ids, h_out = self._run(sid, cur_h, cur_tok, positions, slots, mask)
            cand = lp.asnumpy().astype(np.float32) + frontier_scores[:, None]           # [K, K]
            ids = ids.asnumpy().astype(np.int64)
            base = 1 + K + (i - 1) * K * K                                                # first global id
            scores.append(cand.reshape(-1))
            tokens.append(ids.reshape(-1))
            parents.append(np.repeat(frontier_ids, K))
            flat = cand.reshape(-1)
            sel = np.lexsort((np.arange(flat.size), -flat))[:K]                           # best K, ties by id
            row = sel // K
            frontier_ids, frontier_scores = base + sel, flat[sel]
            cur_tok = ids.reshape(-1)[sel]
            cur_h = ms.ops.gather(h_out, ms.Tensor(row.astype(np.int32)), 0)
            tm = np.concatenate([tm[row], np.eye(K, dtype=bool)], axis=1)
        if steps:
            self.bm.rollback(sid)
        return select_tree(root, np.concatenate(scores), np.concatenate(tokens), np.concatenate(parents), M)


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
