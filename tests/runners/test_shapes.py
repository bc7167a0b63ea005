"""runners/shapes.py: the row and width buckets that decide which graphs a run compiles."""
from __future__ import annotations

import pytest

from mindspore_eagle.runners.shapes import batch_rows, context_widths, pow2_buckets, rows_for


def test_pow2_buckets():
    assert pow2_buckets(16) == [1, 2, 4, 8, 16]
    assert pow2_buckets(128, lo=16) == [16, 32, 64, 128]
    assert pow2_buckets(1) == [1]
    for bad in (0, 12, 3):
        with pytest.raises(ValueError, match=rf"cache.prefill_chunk must be a power of two >= 1, got {bad}"):
            pow2_buckets(bad)
    with pytest.raises(ValueError, match="power of two >= 16, got 8"):
        pow2_buckets(8, lo=16)


@pytest.mark.parametrize("S, B, want", [
    (1024, 16, [256, 512, 1024]),
    (256, 8, [256]),                  # nothing below S: the one width is S
    (2048, 8, [256, 512, 1024, 2048]),
    (600, 8, [256, 512, 600]),        # S itself closes the list even when it is not a power of two
    (96, 16, [96]),
    (1536, 384, [1536]),              # 256, 512, 1024 are not whole blocks of 384: skipped
])
def test_context_widths(S, B, want):
    got = context_widths(S, B)
    assert got == want
    assert all(w % B == 0 for w in got) and got == sorted(set(got)) and got[-1] == S


def test_batch_rows_and_rows_for():
    assert batch_rows(16) == [1, 2, 4, 8, 16] and batch_rows(12) == [1, 2, 4, 8, 12] and batch_rows(1) == [1]
    assert [rows_for(n, 16) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert [rows_for(n, 12) for n in (8, 9, 12)] == [8, 12, 12]
    for bad in (0, 17):
        with pytest.raises(ValueError, match="max_batch=16"):
            rows_for(bad, 16)


def test_batch_budget():
    from mindspore_eagle.runners.shapes import batch_budget

    assert [batch_budget(b, 16, 16) for b in (1, 2, 4, 8, 16)] == [16, 8, 4, 2, 2]
    assert [batch_budget(b, 8, 64) for b in (1, 4, 16)] == [8, 8, 4]
