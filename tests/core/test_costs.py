"""core/costs.py: RowCosts, the learned cost of a batched forward by its row count."""
import numpy as np
import pytest

from mindspore_eagle.core.costs import RowCosts, prior_verify_ratio


def test_row_costs_recover_a_line_from_varied_rows():
    rc = RowCosts(decay=1.0, prior_weight=1.0)
    rng = np.random.default_rng(0)
    for r in rng.integers(1, 65, size=4000):
        rc.observe(int(r), 20.0 + 2.0 * r)
    a, b = rc.fit()
    assert abs(a - 20.0) < 0.2 and abs(b - 2.0) < 0.02
    assert np.allclose(rc.ms([1, 10]), [a + b, a + 10 * b])


def test_row_costs_hold_the_prior_slope_until_rows_vary():
    rc = RowCosts()
    for _ in range(200):                     # one row count only: the data fix the level, the prior the slope
        rc.observe(16, 50.0)
    a, b = rc.fit()
    want = 50.0 * (prior_verify_ratio(32) / prior_verify_ratio(16) - 1) / 16
    assert abs(b - want) < 1e-9 and abs(rc.ms(16) - 50.0) < 0.2
    for r in (8, 32) * 200:                  # then rows that vary, a steeper machine: the data win
        rc.observe(r, 10.0 + 3.0 * r)
    a, b = rc.fit()
    assert abs(b - 3.0) < 0.15 and abs(a - 10.0) < 3.0


def test_row_costs_ignore_bad_times_and_never_slope_down():
    rc = RowCosts()
    assert rc.fit() == (0.0, 0.0)
    rc.observe(4, float("nan")), rc.observe(4, -1.0), rc.observe(0, 5.0)
    assert rc.observed == 0
    for r in (1, 64) * 100:                  # wider forwards measured cheaper (noise): slope 0, not negative
        rc.observe(r, 100.0 - r)
    a, b = rc.fit()
    assert b == 0.0 and a > 0
    with pytest.raises(ValueError, match="decay"):
        RowCosts(decay=0.0)
