"""TeacherRunner: fixed-shape prefill / decode / tree-verify / commit calls of the teacher over its paged cache.

Legend: n = committed tokens of the sequence, k = query rows of one call, M = tree budget, S = max_seq_len,
V = vocab, H = hidden.

Static shapes, so the fused (jit) path compiles a small fixed set of graphs: prefill runs in chunks of at most
``prefill_chunk`` tokens, each padded to a power-of-two bucket >= 16 (docs/design.md, "Static shapes on CPU": dynamic
shapes are 10-15x slower on CPU); decode is k = 1; verification is k = M; the attended context is cut to a width bucket
(256, 512, ..., S slots), so each (k, width) pair is one graph. Padding rows write into the pad block and
attend only to slot 0, so they never touch the sequence.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np

from mindspore_eagle.core.tree import NEG_BIAS, TreeTensors, tree_attention_bias
from mindspore_eagle.kernels.kv import BlockManager, CacheExhaustedError
from mindspore_eagle.kernels.runtime import CompiledFn
from mindspore_eagle.models.llama import KVCompactor, LlamaModel
from mindspore_eagle.models.llama_host import HostTeacher
from mindspore_eagle.runners.shapes import context_widths, pow2_buckets


class TeacherRunner:
    """Drives one :class:`LlamaModel` with a MindFormers-backed :class:`BlockManager`.

    Args:
        teacher: the Cell (weights loaded). num_blocks / block_size / max_seq_len: cache geometry (max_seq_len
        is S, the slots one sequence can address, and must not exceed the teacher's RoPE table).
        mode: "fused" (jit) or "eager" (PyNative). prefill_chunk: largest prefill call.
        host: run the calls whose trunk is one DecoderStack call, and the commits, on the host
            (``models/llama_host.py``: the same kernels without a graph launch, bit-identical outputs; a prefill
            chunk then carries no padding rows); None = in fused mode on the cpu backend. Eager mode keeps the
            PyNative Cell calls it exists for.
    """

    def __init__(self, teacher: LlamaModel, num_blocks: int, block_size: int, max_seq_len: int, mode: str,
                 prefill_chunk: int = 128, host: bool | None = None):
        self.model, self.mode = teacher, mode
        self.bm = BlockManager(num_blocks, block_size, max_seq_len)
        self.S, self.B = max_seq_len, block_size
        self.buckets = pow2_buckets(prefill_chunk, 16)
        self.widths = context_widths(max_seq_len, block_size)
        self._fwd = CompiledFn(teacher.construct, mode)
        self._hidden = CompiledFn(teacher.hidden, mode)
        self._both = CompiledFn(teacher.logits_hidden, mode)
        self._compact = CompiledFn(KVCompactor(teacher.caches(), teacher.backend), mode)
        self._methods = {self._fwd: "construct", self._hidden: "hidden", self._both: "logits_hidden"}
        on_host = mode == "fused" and teacher.stack is not None
        self.host = HostTeacher(teacher) if (on_host if host is None else host) else None
        """The :class:`HostTeacher` that runs the calls whose trunk is one DecoderStack call (every call of a
        packed teacher) and the commits, or None (every call a graph)."""

    @property
    def compiles(self) -> int:
        """Distinct graphs compiled so far (fused mode; 0 in eager)."""
        return sum(f.compiles for f in (self._fwd, self._hidden, self._both, self._compact))

    @property
    def loads(self) -> int:
        """Distinct graphs loaded from the graph store so far (fused mode; 0 in eager)."""
        return sum(f.loads for f in (self._fwd, self._hidden, self._both, self._compact))

    @property
    def compile_ms(self) -> float:
        """Wall ms spent in calls that compiled a graph (fused mode)."""
        return sum(f.compile_ms for f in (self._fwd, self._hidden, self._both, self._compact))

    # ------------------------------------------------------------------ sequences
    def new_seq(self) -> int:
        return self.bm.new_seq()

    def free(self, sid: int) -> None:
        self.bm.free(sid)

    def length(self, sid: int) -> int:
        return self.bm.length(sid)

    # ------------------------------------------------------------------ calls
    def width(self, need: int) -> int:
        """Key slots attended by a call whose sequence needs ``need`` positions: the smallest width bucket."""
        return next(w for w in self.widths if w >= need)

    def on_host(self, rows: int) -> bool:
        """True when a call of ``rows`` query rows runs on the host (so it has no graph to compile)."""
        return self.host is not None and self.host.takes(rows)

    def _call(self, fn, sid, tokens, positions, slots, mask, out_rows):
        return self._run(fn, self.bm.block_table(sid)[: mask.shape[1] // self.B], tokens, positions, slots, mask,
                         out_rows)

    def _run(self, fn, table, tokens, positions, slots, mask, out_rows):
        """``fn`` (``_fwd``, ``_hidden`` or ``_both``) over one call's arrays -> its outputs as numpy: on the host
        when :meth:`on_host`, else through the graph (bit for bit the same numbers)."""
        if self.on_host(len(tokens)):
            return self.host.run(self._methods[fn], tokens, positions, slots, table, mask, out_rows)
        args = (ms.Tensor(np.asarray(tokens, np.int32)), ms.Tensor(np.asarray(positions, np.int32)),
                ms.Tensor(np.asarray(slots, np.int32)), ms.Tensor(np.asarray(table, np.int32)),
                ms.Tensor(mask), ms.Tensor(np.asarray(out_rows, np.int32)))
        return tuple(o.asnumpy() for o in fn(*args))

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def prefill(self, sid: int, ids, hidden: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Append ``ids`` (int [T], T >= 1) to the sequence.

        Returns:
            (last, aux): last = logits float32 [V] of the final token (or, with ``hidden=True``, the final-normed
            hidden states float32 [T, H] of every token), aux = captured features float32 [T, 3H].
        Raises:
            CacheExhaustedError: the sequence would not fit (raised before any write).
        """
        if hidden:
            outs = self._prefill(sid, ids, self._hidden, True)
            return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])
        outs = self._prefill(sid, ids, self._fwd, False)
        return outs[-1][0][0], np.concatenate([o[1] for o in outs])

    def prefill_with_hidden(self, sid: int, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`prefill` that returns the final token's logits (the same numbers as ``prefill``) and the
        final-normed hidden states of every token, in one pass (regeneration writing training features).

        Returns:
            (logits float32 [V], hidden float32 [T, H], aux float32 [T, 3H]).
        Raises:
            CacheExhaustedError: the sequence would not fit (raised before any write).
        """
        outs = self._prefill(sid, ids, self._both, False)
        return (outs[-1][0][0], np.concatenate([o[1] for o in outs]), np.concatenate([o[2] for o in outs]))

    def _prefill(self, sid: int, ids, fn, all_rows: bool) -> list:
        """Run ``fn`` over ``ids`` in chunks of at most ``prefill_chunk`` tokens; returns, per chunk, its outputs cut
        to the chunk's n real rows (the first, ``out_rows``-indexed output: all n rows with ``all_rows``, else the
        chunk's last token only)."""
        ids = np.asarray(ids, np.int64)
        self.bm.reserve(sid, len(ids))
        res = []
        chunk = self.buckets[-1]
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            n, p0 = len(part), self.bm.length(sid)
            k = n if self.on_host(n) else self._bucket(n)         # a graph has its static rows; the host needs none
            tokens = np.zeros(k, np.int64)
            tokens[:n] = part
            positions = np.zeros(k, np.int64)
            positions[:n] = np.arange(p0, p0 + n)
            w = self.width(p0 + n)
            mask = np.full((k, w), NEG_BIAS, np.float32)
            cols = np.arange(w)[None, :]
            rows = positions[:n, None]
            mask[:n] = np.where(cols <= rows, 0.0, NEG_BIAS)
            mask[n:, 0] = 0.0
            slots = self.bm.append(sid, n, k)
            out = self._call(fn, sid, tokens, positions, slots, mask, np.arange(k) if all_rows else np.array([n - 1]))
            self.bm.advance(sid, n)
            first = out[0] if not all_rows else out[0][:n]            # out_rows-indexed; the rest hold all k rows
            res.append((first,) + tuple(o[:n] for o in out[1:]))
        return res

    def decode(self, sid: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        """Append one token; returns (logits float32 [V], aux float32 [1, 3H]).

        In half precision the call carries one padding row (k = 2; it writes into the pad block and sees slot 0):
        MindSpore's CPU float16 MatMul rounds a row differently at k = 1 than at k = 2..15 (docs/ascend.md), and
        tree verification runs M rows, so a k = 1 decode could flip a greedy near-tie against verification.
        float32 keeps k = 1.
        """
        p = self.bm.length(sid)
        rows = 1 if self.model.dtype == ms.float32 else 2
        slots = self.bm.append(sid, 1, rows)
        mask = np.full((rows, self.width(p + 1)), NEG_BIAS, np.float32)
        mask[0, :p + 1] = 0.0
        mask[1:, 0] = 0.0
        out, aux = self._call(self._fwd, sid, [token] + [0] * (rows - 1), [p] + [0] * (rows - 1), slots, mask, [0])
        self.bm.advance(sid, 1)
        return out[0], aux[:1]

    def decode_batch(self, sids, tokens, rows: int, width_step: int = 512, with_aux: bool = False,
                     with_hidden: bool = False):
        """Append one token to each of several sequences in a single forward (batched greedy generation).

        Layout (:meth:`_batch_layout`): with a grouped backend (portable) row i reads its own block table
        (table [rows, w/B], w = the width bucket of the longest sequence), so each row scores w slots; otherwise
        the sequences' used blocks are concatenated into one table and a block-diagonal additive mask lets row i
        see only its own positions 0..len_i (width ``width_step`` x a power of two). Either way row i sees
        exactly its own prefix, so the logits are those of a one-sequence decode. Shapes are fixed per
        (rows, width); pad rows write to the pad block and see column 0.

        Args:
            sids: n <= rows live sequence ids; tokens: int [n], the token appended to each.
            rows: static row count of the call; width_step: concatenated layout only (see above).
        Returns:
            logits float32 [n, V] of the appended tokens; with ``with_aux`` also their captured features
            float32 [n, 3H] (the drafter's context pairs): (logits, aux); with ``with_hidden`` (logits, hidden
            float32 [n, H] final-normed, aux) from one graph whose logits equal the plain call's.
        Raises:
            ValueError: more sequences than rows, or len(tokens) != len(sids).
            CacheExhaustedError: a sequence would not fit (raised before any write).
        """
        n = len(sids)
        if not 0 < n <= rows or len(tokens) != n:
            raise ValueError(f"decode_batch: need 1..{rows} sequences with one token each, got {n} / {len(tokens)}")
        for sid in sids:
            self.bm.reserve(sid, 1)
        lengths = [self.bm.length(sid) for sid in sids]
        table, mask, cols = self._batch_layout(sids, [p + 1 for p in lengths], np.arange(n), rows, width_step)
        for i, (c, p) in enumerate(zip(cols, lengths)):
            mask[i, c:c + p + 1] = 0.0
        slots = self.bm.pad_slots(rows)
        positions = np.zeros(rows, np.int64)
        toks = np.zeros(rows, np.int64)
        for i, sid in enumerate(sids):
            slots[i] = self.bm.append(sid, 1, 1)[0]
            positions[i], toks[i] = lengths[i], tokens[i]
        outs = self._run(self._both if with_hidden else self._fwd, table, toks, positions, slots, mask,
                         np.arange(rows))                               # all rows: one graph for any n
        for sid in sids:
            self.bm.advance(sid, 1)
        if with_hidden:
            return tuple(o[:n] for o in outs)
        return (outs[0][:n], outs[1][:n]) if with_aux else outs[0][:n]

    def verify_batch(self, sids, trees, rows: int, width_step: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """Verify one draft tree per sequence in a single forward (speculative continuous batching).

        The trees may have different budgets m_i (a sequence with nothing worth verifying brings its root alone,
        m_i = 1): sequence i's rows are ``o_i .. o_i + m_i - 1`` with o_i = m_0 + ... + m_{i-1}, its tree at
        positions n_i + depth, each row seeing only its own committed prefix and its own tree ancestors
        (``tree_attention_bias``): through its sequence's block table, repeated for every row of the sequence in
        the grouped layout (table [rows, w/B]), or through its segment of one concatenated table and a
        block-diagonal mask (:meth:`_batch_layout`). Rows past sum(m_i) are padding (pad block, see column 0).
        Shapes are fixed per (rows, width).

        Args:
            sids: n live sequence ids; trees: n TreeTensors (budget m_i each, sum(m_i) <= rows).
        Returns:
            (logits float32 [sum(m_i), V], aux float32 [sum(m_i), 3H]) in row order; follow with :meth:`commit`
            (or rollback) for every sequence.
        Raises:
            ValueError: an empty batch, n trees != n sequences, or more tree rows than ``rows``.
            CacheExhaustedError: a sequence's branch does not fit (before any write).
        """
        n = len(sids)
        budgets = [t.budget for t in trees]
        if n == 0 or len(trees) != n or sum(budgets) > rows:
            raise ValueError(f"verify_batch: need 1..{rows} tree rows from one tree per sequence, got {n} "
                             f"sequences, {len(trees)} trees, {sum(budgets)} tree rows")
        for sid, m in zip(sids, budgets):
            self.bm.reserve(sid, m)
        lengths = [self.bm.length(sid) for sid in sids]
        row_seq = np.repeat(np.arange(n), budgets)
        table, mask, cols = self._batch_layout(sids, [p + m for p, m in zip(lengths, budgets)], row_seq, rows,
                                               width_step)
        tokens = np.zeros(rows, np.int64)
        positions = np.zeros(rows, np.int64)
        slots = self.bm.pad_slots(rows)
        o = 0
        for sid, tt, c, p, m in zip(sids, trees, cols, lengths, budgets):
            r = slice(o, o + m)
            w = mask.shape[1] - c if self._grouped else -(-(p + m) // self.B) * self.B
            mask[r, c:c + w] = tree_attention_bias(tt, p, w)
            tokens[r], positions[r] = tt.tokens, p + tt.depth
            slots[r] = self.bm.branch(sid, m)
            o += m
        out, aux = self._run(self._fwd, table, tokens, positions, slots, mask, np.arange(rows))  # one graph for any n
        return out[:o], aux[:o]

    @property
    def _grouped(self) -> bool:
        return getattr(self.model.backend, "grouped", False)

    def _batch_layout(self, sids, need, row_seq, rows: int, width_step: int):
        """Block table(s) and an all-hidden mask for a batched call whose used rows belong to ``row_seq``.

        Args:
            sids: n sequences; need: positions each must see (its length + new rows); row_seq: int [r] the
                sequence index of each used row (r <= rows); rows: static row count.
        Returns:
            (table int32 [rows, w/B] grouped (row j reads sequence row_seq[j]'s blocks, padding rows the pad
            block) or [w/B] concatenated, mask float32 [rows, w] of NEG_BIAS with column 0 visible for pad rows,
            cols: the first mask column of each sequence's slots (0 grouped).
        """
        used = len(row_seq)
        if self._grouped:
            w = self.width(max(need))
            per_seq = np.stack([self.bm.block_table(sid)[: w // self.B] for sid in sids])
            table = np.full((rows, w // self.B), self.bm.pad_block, np.int32)
            table[:used] = per_seq[row_seq]
            cols = [0] * len(sids)
        else:
            tables, cols, off = [], [], 0
            for sid, m in zip(sids, need):
                nb = -(-m // self.B)                      # blocks holding positions 0..m-1
                tables.append(self.bm.block_table(sid)[:nb])
                cols.append(off)
                off += nb * self.B
            w = width_step
            while w < off:                                # power-of-two multiples: few graphs per row count
                w *= 2
            table = np.full(w // self.B, self.bm.pad_block, np.int32)
            table[: off // self.B] = np.concatenate(tables)
        mask = np.full((rows, w), NEG_BIAS, np.float32)
        mask[used:, 0] = 0.0
        return table, mask, cols

    def verify(self, sid: int, tt: TreeTensors, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One forward over the tensorized tree placed after the committed prefix (opens a branch).

        Args:
            tt: TreeTensors of budget M. mask: float32 [M, S] from ``tree_attention_bias(tt, length, S)``
                (computed here when None).
        Returns (logits float32 [M, V], aux float32 [M, 3H]); follow with :meth:`commit` or :meth:`rollback`.
        Raises:
            CacheExhaustedError: the branch of M slots does not fit (before any write).
        """
        n = self.bm.length(sid)
        slots = self.bm.branch(sid, tt.budget)
        if mask is None:
            mask = self.verify_mask(sid, tt)
        return self._call(self._fwd, sid, tt.tokens, n + tt.depth, slots, mask, np.arange(tt.budget))

    def verify_mask(self, sid: int, tt: TreeTensors) -> np.ndarray:
        """float32 [M, w] additive bias of the tree placed after the committed prefix (w = width bucket)."""
        n = self.bm.length(sid)
        return tree_attention_bias(tt, n, self.width(n + tt.budget))

    def commit(self, sid: int, path, width: int) -> None:
        """Move the K/V of accepted tree nodes ``path`` (root first) to the positions after the prefix."""
        src, dst = self.bm.commit_plan(sid, path, width)
        if np.array_equal(src, dst):         # a chain prefix [0, 1, ..., a] is already in place: no device work
            pass
        elif self.host is not None:
            self.host.move(src, dst)
        else:
            self._compact(ms.Tensor(np.asarray(src, np.int32)), ms.Tensor(np.asarray(dst, np.int32)))
        self.bm.finish_commit(sid, len(path))

    def rollback(self, sid: int) -> None:
        self.bm.rollback(sid)


__all__ = ["TeacherRunner", "CacheExhaustedError"]
