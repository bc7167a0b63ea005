"""Paged KV cache: MindFormers block bookkeeping on the host, portable write/read ops on the device,
and the branch / commit / rollback protocol of tree verification.

Legend: NB = num_blocks, B = block_size, S = max_seq_len (slots one sequence can address, a multiple of B),
n_kv = KV heads, hd = head dim, M = tree budget, P = max path length (D_max + 2).

Layout: the slots of MindFormers' paged layout (``mindformers/modules/paged_attention_mgr.py``, ``[NB, B,
n_kv * hd]`` per layer; slot = block * B + offset) stored **head-major and flat**: one Parameter per layer and
K / V of shape ``[n_kv * (NB + 1) * B, hd]``, row = head * (NB + 1) * B + slot. Two measured reasons (MindSpore
2.9 CPU, 2026-11-29): a write is then a row update along axis 0, which ``ScatterUpdate`` does in place (60 writes:
1.6-2.0 ms whatever the pool size) where ``scatter_nd_update`` into a 4-D layout copied the whole Parameter each
call (60 writes: 2.4 ms at 9 blocks, 8.8 ms at 65, 59 ms at 513); and a read by block table gathers straight into
the ``[n_kv, S, hd]`` operand the attention matmuls want, with no transpose of the gathered keys and values.
Block ``NB`` is the explicit **pad block**: it is never handed out by
the pool, every padding entry of a block table and every padding slot points into it, so no index is ever -1
(MindFormers pads with -1; Gather with -1 is an error on CPU and undefined on Ascend: docs/design.md, "MindFormers
KV-cache API").

Host bookkeeping uses MindFormers' own ``BlockMemPool`` and ``CacheEngine`` (``mindformers/modules/
cache_engine.py``), loaded from the installed mindformers distribution by file so that the 4 s package import
(and its ``./output/log`` side effect) is not paid; the classes are MindFormers' unchanged.

Device side: :class:`PortableKVOps` writes by slot mapping (``ScatterUpdate``, the portable stand-in for
Ascend's ``ReshapeAndCache``) and reads a sequence's blocks by block table (``gather``, the stand-in for the
cache read inside ``PagedAttention``). An Ascend backend replaces exactly these two methods.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import ops

from mindspore_eagle.errors import MsEagleError


class CacheExhaustedError(MsEagleError, RuntimeError):
    """Raised before any write when a sequence would exceed its slots or the pool has too few free blocks."""


def _load_mindformers_cache_engine():
    spec = importlib.util.find_spec("mindformers")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mindformers is not installed: pip install mindformers==1.9.0")
    path = os.path.join(list(spec.submodule_search_locations)[0], "modules", "cache_engine.py")
    mod_spec = importlib.util.spec_from_file_location("_mindformers_cache_engine", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.BlockMemPool, mod.CacheEngine


BlockMemPool, CacheEngine = _load_mindformers_cache_engine()


@dataclass
class _Seq:
    engine: object                 # MindFormers CacheEngine (block_table, num_token)
    length: int = 0                # committed tokens whose K/V are valid, positions [0, length)
    branch: int = 0                # scratch slots reserved after `length` for one verification step


class BlockManager:
    """Host-side block allocation for one model's cache, on MindFormers' BlockMemPool / CacheEngine.

    Args:
        num_blocks: blocks in the pool (NB); the pad block NB is extra.
        block_size: tokens per block (B).
        max_seq_len: slots one sequence may address (S); must be a multiple of block_size.
    Raises:
        ValueError: sizes out of range (names the field).
    """

    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int):
        if block_size < 1:
            raise ValueError(f"cache.block_size must be >= 1, got {block_size}")
        if max_seq_len < block_size or max_seq_len % block_size:
            raise ValueError(f"cache.max_seq_len must be a positive multiple of cache.block_size={block_size}, "
                             f"got {max_seq_len}")
        if num_blocks < 1:
            raise ValueError(f"cache.num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.block_size, self.max_seq_len = num_blocks, block_size, max_seq_len
        self.table_width = max_seq_len // block_size
        self.pad_block = num_blocks
        self.pool = BlockMemPool(num_blocks, block_size)
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0

    # ---------------------------------------------------------------- sequences
    def new_seq(self) -> int:
        """Open an empty sequence and return its id."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq(CacheEngine(self.block_size, self.pool))
        return sid

    def length(self, sid: int) -> int:
        """Committed tokens of sequence ``sid``."""
        return self._seqs[sid].length

    def free_blocks(self) -> int:
        return len(self.pool.free_blocks)

    def free(self, sid: int) -> None:
        """Release every block of ``sid`` back to the pool."""
        seq = self._seqs.pop(sid)
        seq.engine.release_cache()

    def reserve(self, sid: int, n: int) -> None:
        """Make room for ``n`` tokens after the committed prefix (idempotent for the same total).

        Raises:
            CacheExhaustedError: the sequence would exceed max_seq_len, or the pool lacks blocks.
        """
        seq = self._seqs[sid]
        need = seq.length + n
        if need > self.max_seq_len:
            raise CacheExhaustedError(f"sequence needs {need} KV slots but cache.max_seq_len is {self.max_seq_len}")
        have = seq.engine.num_token
        if need > have:
            blocks_needed = -(-need // self.block_size) - len(seq.engine.block_table)
            if blocks_needed > len(self.pool.free_blocks):
                raise CacheExhaustedError(f"KV pool exhausted: need {blocks_needed} more blocks, "
                                          f"{len(self.pool.free_blocks)} free of cache.num_blocks={self.num_blocks}")
            seq.engine.prepare_cache(need - have)

    def _trim(self, seq: _Seq) -> None:
        keep = -(-seq.length // self.block_size)
        extra = seq.engine.block_table[keep:]
        if extra:
            self.pool.free_block(extra)
            del seq.engine.block_table[keep:]
        seq.engine.num_token = seq.length

    # ---------------------------------------------------------------- addressing
    def block_table(self, sid: int) -> np.ndarray:
        """int32 [S/B]: the sequence's physical blocks, padded with the pad block id (never -1)."""
        table = np.full(self.table_width, self.pad_block, dtype=np.int32)
        blocks = self._seqs[sid].engine.block_table
        table[: len(blocks)] = blocks
        return table

    def slots(self, sid: int, positions: np.ndarray) -> np.ndarray:
        """int32 [k]: physical slot (block * B + offset) of each logical position; positions must be reserved."""
        table = self._seqs[sid].engine.block_table
        positions = np.asarray(positions, dtype=np.int64)
        blocks = np.asarray(table, dtype=np.int64)[positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).astype(np.int32)

    def pad_slots(self, k: int) -> np.ndarray:
        """int32 [k]: slots inside the pad block, for padding rows of a fixed-shape batch."""
        return (self.pad_block * self.block_size + np.arange(k) % self.block_size).astype(np.int32)

    # ---------------------------------------------------------------- append (prefill / decode)
    def append(self, sid: int, n_valid: int, k: int) -> np.ndarray:
        """Reserve ``n_valid`` new positions and return int32 [k] slots (rows past n_valid use the pad block).

        The caller runs the forward that writes them, then calls :meth:`advance`.
        """
        if not 0 <= n_valid <= k:
            raise ValueError(f"n_valid must be in [0, {k}], got {n_valid}")
        self.reserve(sid, n_valid)
        seq = self._seqs[sid]
        out = self.pad_slots(k)
        out[:n_valid] = self.slots(sid, np.arange(seq.length, seq.length + n_valid))
        return out

    def advance(self, sid: int, n: int) -> None:
        """Mark ``n`` appended positions as committed."""
        seq = self._seqs[sid]
        seq.length += n
        self._trim(seq)

    # ---------------------------------------------------------------- tree branch / commit / rollback
    def branch(self, sid: int, m: int) -> np.ndarray:
        """Reserve M scratch positions [length, length + M) for one verification step; int32 [M] slots.

        Raises:
            CacheExhaustedError: before any write, if the branch does not fit.
        """
        seq = self._seqs[sid]
        self.reserve(sid, m)
        seq.branch = m
        return self.slots(sid, np.arange(seq.length, seq.length + m))

    def commit_plan(self, sid: int, path: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination slots (int32 [width] each) that move accepted tree nodes into place.

        ``path`` holds the accepted tree-node indices, root first, strictly increasing (a root-to-node path
        of a tensorized tree). Node j sits at logical position length + j; it moves to length + i. Padding
        entries copy a pad slot onto itself.
        Raises:
            ValueError: no open branch, path not increasing, or longer than the branch or ``width``.
        """
        seq = self._seqs[sid]
        path = np.asarray(path, dtype=np.int64)
        if seq.branch == 0:
            raise ValueError("commit without an open branch")
        if len(path) > width or len(path) > seq.branch or (len(path) > 1 and np.any(np.diff(path) <= 0)):
            raise ValueError(f"commit path must be increasing, at most {min(width, seq.branch)} long: {path}")
        if len(path) and path[-1] >= seq.branch:
            raise ValueError(f"commit path index {int(path[-1])} outside the branch of {seq.branch}")
        src, dst = self.pad_slots(width), self.pad_slots(width)
        src[: len(path)] = self.slots(sid, seq.length + path)
        dst[: len(path)] = self.slots(sid, seq.length + np.arange(len(path)))
        return src, dst

    def finish_commit(self, sid: int, n_accepted: int) -> None:
        """After the device moved the K/V: extend the prefix by ``n_accepted`` and release the rest."""
        seq = self._seqs[sid]
        seq.length += n_accepted
        seq.branch = 0
        self._trim(seq)

    def rollback(self, sid: int) -> None:
        """Drop the open branch; the committed prefix is untouched."""
        seq = self._seqs[sid]
        seq.branch = 0
        self._trim(seq)


def make_cache(num_blocks: int, block_size: int, n_kv: int, head_dim: int, dtype, name: str):
    """One zero-initialised cache Parameter of shape [n_kv * (NB + 1) * B, hd] (head-major slot rows).

    Slots ``NB * B .. (NB + 1) * B - 1`` of every head form the pad block. Memory: n_kv * (NB + 1) * B * hd
    elements (4 bytes each in float32).
    """
    shape = (n_kv * (num_blocks + 1) * block_size, head_dim)
    return ms.Parameter(ms.Tensor(np.zeros(shape, np.float32), dtype), name=name, requires_grad=False)


def cache_index_constants(num_blocks: int, block_size: int, n_kv: int) -> tuple[ms.Tensor, ms.Tensor]:
    """The two int32 constants :meth:`PortableKVOps.indices` needs: offsets = arange(B) [B] and
    head_base = arange(n_kv) * (NB + 1) * B [n_kv] (first row of each head's slot range)."""
    offsets = np.arange(block_size, dtype=np.int32)
    head_base = (np.arange(n_kv) * (num_blocks + 1) * block_size).astype(np.int32)
    return ms.Tensor(offsets), ms.Tensor(head_base)


def slot_view(cache: np.ndarray, n_kv: int) -> np.ndarray:
    """Host view of a cache array [n_kv * slots, hd] as [slots, n_kv, hd] (inspection and tests)."""
    return cache.reshape(n_kv, -1, cache.shape[-1]).transpose(1, 0, 2)


_SCATTER_UPDATE = ops.ScatterUpdate()


class PortableKVOps:
    """Write / read of a paged cache with portable MindSpore ops (CPU, GPU and Ascend).

    Ascend's fused kernels (``ReshapeAndCache`` for the write, ``PagedAttention`` for read + attention) are the
    drop-in replacement for these methods. Indices are computed once per forward and shared by all layers.
    """

    @staticmethod
    def indices(slots, block_table, offsets, head_base):
        """Row indices of one call: slots int32 [k], block_table int32 [S/B] -> (write [k * n_kv], read [n_kv, S]);
        a grouped call's block_table int32 [G, S/B] -> read [G, n_kv, S].

        ``offsets`` / ``head_base`` come from :func:`cache_index_constants`. All values are >= 0 by construction
        (padding uses the pad block, never -1).
        """
        return PortableKVOps.write_rows(slots, head_base), PortableKVOps.read_rows(block_table, offsets, head_base)

    @staticmethod
    def write_rows(slots, head_base):
        """Cache rows of ``slots`` int32 [k] for every KV head -> int32 [k * n_kv] (slot-major)."""
        return (slots.reshape(-1, 1) + head_base.reshape(1, -1)).reshape(-1)

    @staticmethod
    def read_rows(block_table, offsets, head_base):
        """Cache rows of a block table int32 [S/B] for every KV head -> int32 [n_kv, S]; of G tables
        int32 [G, S/B] -> int32 [G, n_kv, S]."""
        if block_table.ndim == 2:
            G = block_table.shape[0]
            ctx = (block_table.reshape(G, -1, 1) * offsets.shape[0] + offsets.reshape(1, 1, -1)).reshape(G, 1, -1)
            return head_base.reshape(1, -1, 1) + ctx
        ctx = (block_table.reshape(-1, 1) * offsets.shape[0] + offsets.reshape(1, -1)).reshape(1, -1)
        return head_base.reshape(-1, 1) + ctx

    @staticmethod
    def write(cache, write_idx, kv):
        """Write kv [k, n_kv, hd] (or [k * n_kv, hd]) into the cache rows ``write_idx`` [k * n_kv], in place.

        Several padding rows may share one pad slot; which of them lands there is unspecified (never read).
        """
        return _SCATTER_UPDATE(cache, write_idx, kv.reshape(-1, cache.shape[-1]))

    @staticmethod
    def read(cache, read_idx):
        """Gather the rows ``read_idx`` int32 [(G,) n_kv, S] -> [(G,) n_kv, S, hd]."""
        return ops.gather(cache, read_idx, 0)
