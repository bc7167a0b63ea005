"""train/coverage.py: top-k coverage and the implied accept length, computed by hand."""
from __future__ import annotations

import numpy as np
import pytest


def test_topk_coverage_and_implied_accept_length_hand_computed():
    from mindspore_eagle.train.coverage import (
        coverage_counts,
        coverage_report,
        implied_accept_length,
        topk_ids,
    )

    used = np.array([2, 5, 7, 9])
    d2t = used - np.arange(4)                                  # offsets: draft id i -> teacher id used[i]
    logits = np.array([[0.1, 0.5, 0.3, -1.0],                 # teacher ids by rank: 5, 7, 2, 9
                       [2.0, 1.0, 0.0, 3.0],                  # 9, 2, 5, 7
                       [0.0, 0.0, 1.0, 0.0],                  # 7, then the ties 2, 5, 9 in draft-id order
                       [9.0, 0.0, 0.0, 0.0]])
    top = topk_ids(logits, d2t, 4)
    np.testing.assert_array_equal(top, [[5, 7, 2, 9], [9, 2, 5, 7], [7, 2, 5, 9], [2, 5, 7, 9]])
    target = np.array([7, 9, 4, 2])                            # rank 2, rank 1, not in the draft vocab, masked
    mask = np.array([1, 1, 1, 0])
    hits, n = coverage_counts(top, target, mask, ks=(1, 2, 4))
    np.testing.assert_array_equal(hits, [1, 2, 2])
    assert n == 3
    hits2, n2 = coverage_counts(top[:, :2], target, np.array([1, 1, 0, 0]), ks=(1, 2))
    np.testing.assert_array_equal(hits2, [1, 2])
    assert n2 == 2
    # chain: 1 + a1 + a1 a2 + a1 a2 a3; a constant alpha gives (1 - alpha^(D+1)) / (1 - alpha) (Leviathan Eq. 1)
    assert implied_accept_length([0.5, 0.5, 0.5]) == pytest.approx(1.875) == (1 - 0.5 ** 4) / (1 - 0.5)
    assert implied_accept_length([1.0, 0.0, 1.0]) == 2.0
    assert implied_accept_length([]) == 1.0
    with pytest.raises(ValueError):
        implied_accept_length([1.2])
    rep = coverage_report(np.array([[1, 2, 2], [0, 1, 2]]), np.array([3, 2]), ks=(1, 2, 4), depths=(1, 2, 3))
    assert rep["cov"] == {"k1": [0.3333, 0.0], "k2": [0.6667, 0.5], "k4": [0.6667, 1.0]}
    assert rep["positions"] == [3, 2]
    assert rep["L_implied"] == {"D1": {"k1": 1.3333, "k2": 1.6667, "k4": 1.6667},
                                "D2": {"k1": 1.3333, "k2": 2.0, "k4": 2.3333}}   # D3 > S = 2: left out
