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


__all__ = ["pow2_buckets", "context_widths"]
