"""train/vocab.py: the draft vocabulary (top counts, sorted, padded)."""
from __future__ import annotations

import numpy as np
import pytest

from mindspore_eagle.train.vocab import select_vocab


def test_select_vocab_top_counts_sorted_and_padded():
    counts = np.array([0, 5, 0, 9, 1, 0, 5, 0])
    np.testing.assert_array_equal(select_vocab(counts, 3), [1, 3, 6])        # tie 1 vs 6: both kept
    np.testing.assert_array_equal(select_vocab(counts, 2), [1, 3])           # tie broken by smaller id
    np.testing.assert_array_equal(select_vocab(counts, 6), [0, 1, 2, 3, 4, 6])  # padded with unused 0, 2
    with pytest.raises(ValueError):
        select_vocab(counts, 9)
