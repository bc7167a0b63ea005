"""core/costs.py: RowCosts, the learned cost of a batched forward by its row count."""
import numpy as np
import pytest

from mindspore_eagle.core.costs import RowCosts, prior_verify_ratio


def test_row_costs_recover_a_convex_curve_from_varied_rows():
    """Flat-then-steep costs as a CPU forward has them (quadratic here) are recovered from varied row counts."""
    rc = RowCosts(decay=1.0, prior_weight=1.0)
    rng = np.random.default_rng(0)
    for r in rng.integers(1, 65, size=4000):
        rc.observe(int(r), 20.0 + 0.5 * r + 0.03 * r * r)
    a, b, c = rc.fit()
    assert abs(a - 20.0) < 0.6 and abs(b - 0.5) < 0.05 and abs(c - 0.03) < 0.001
    assert np.allclose(rc.ms([1, 10]), [a + b + c, a + 10 * b + 100 * c])


def test_row_costs_follow_a_line_and_hold_the_prior_until_rows_vary():
    rc = RowCosts()
    for _ in range(200):                     # one row count only: the data fix the level, the prior the shape
        rc.observe(16, 50.0)
    assert abs(rc.ms(16) - 50.0) < 0.5
    want = 50.0 * prior_verify_ratio(32) / prior_verify_ratio(16)
    assert abs(rc.ms(32) - want) < 0.15 * want      # the prior's 16 -> 32 ratio, not a flat cost
    for r in (8, 32, 48) * 300:              # then rows that vary along a steeper line: the data win
        rc.observe(r, 10.0 + 3.0 * r)
    assert np.allclose(rc.ms([8, 32, 48]), [34.0, 106.0, 154.0], rtol=0.05)


def test_row_costs_ignore_bad_times_and_never_slope_down():
    rc = RowCosts()
    assert rc.fit() == (0.0, 0.0, 0.0)
    rc.observe(4, float("nan")), rc.observe(4, -1.0), rc.observe(0, 5.0)
    assert rc.observed == 0
    for r in (1, 64) * 100:                  # wider forwards measured cheaper (noise): flat, never downhill
        rc.observe(r, 100.0 - r)
    a, b, c = rc.fit()
    assert b >= 0 and c >= 0 and a > 0
    assert rc.ms(64) >= rc.ms(1)
    with pytest.raises(ValueError, match="decay"):
        RowCosts(decay=0.0)
