"""Static shapes of the runners' calls: prefill / context-pass row buckets and attention-width buckets.

Every compiled graph is keyed by its shapes, so these two lists decide how many graphs a run can compile: one per
(row bucket, width bucket) pair and call kind (docs/architecture.md, "Static shapes"). Pure Python; the runners and
the warm-up share them.
"""
from __future__ import annotations


def pow2_buckets(limit: int, lo: int = 1) -> list[int]:
    """Query-length buckets lo, 2 lo, 4 lo, ... up to ``limit`` (both powers of two).

    Raises:
        ValueError: limit is not a power of two >= lo (names the prefill chunk, its only user-set source).
    """
    if limit < lo or limit & (limit - 1):
        raise ValueError(f"cache.prefill_chunk must be a power of two >= {lo}, got {limit}")
    out, b = [], lo
    while b <= limit:
        out.append(b)
        b *= 2
    return out


def context_widths(max_seq_len: int, block_size: int, lo: int = 256) -> list[int]:
    """Attention width buckets: 256, 512, ... (multiples of block_size) below max_seq_len, then max_seq_len.

    Each call reads only the first ``w`` slots of the sequence's block table, so a short context does not pay for
    gathering and scoring all S slots (60 gathers of S = 1024 cost ~2x those of S = 256 on the 2-core CPU).
    """
    out, w = [], lo
    while w < max_seq_len:
        if w % block_size == 0:
            out.append(w)
        w *= 2
    return out + [max_seq_len]


def batch_rows(max_batch: int) -> list[int]:
    """Row buckets of the batched round: 1, 2, 4, ... below ``max_batch``, then ``max_batch``.

    A step of n live sequences runs the smallest bucket >= n (:func:`rows_for`), not ``max_batch`` rows: on a CPU a
    forward's matrix products are compute-bound past a few rows (16 rows cost ~1.8x one row on the 135M teacher,
    docs/performance.md), so padding 4 sequences to 16 rows nearly doubled their step."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def rows_for(n: int, max_batch: int) -> int:
    """The row bucket of a step of ``n`` sequences (1 <= n <= max_batch; :func:`batch_rows`).

    Raises:
        ValueError: n outside 1..max_batch."""
    if not 1 <= n <= max_batch:
        raise ValueError(f"a batched step of {n} sequences does not fit max_batch={max_batch}")
    return next(b for b in batch_rows(max_batch) if b >= n)


def batch_budget(bucket: int, M: int, tree_rows: int) -> int:
    """Tokens each sequence of a batched tree step in row bucket ``bucket`` verifies: max(2, min(M, tree_rows //
    bucket)) (``speculative.batch_tree_rows``; the call has bucket x that many rows)."""
    return max(2, min(M, tree_rows // bucket))


__all__ = ["pow2_buckets", "context_widths", "batch_rows", "rows_for", "batch_budget"]
