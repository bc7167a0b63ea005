"""scripts/lk_curve.py: the drafter's learning curve over chained training runs."""
from __future__ import annotations

import json


def test_lk_curve_chains_runs_by_tokens_seen(tmp_path):
    """scripts/lk_curve.py: a second run started from the first one's export continues the x axis; its step-0
    line (the same weights as the first run's end) is not repeated; the implied L_k is read at D = 3."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("lk_curve", Path(__file__).parents[2] / "scripts" / "lk_curve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def line(step, tok, l4):
        L = {"D3": {"k1": 1.1, "k2": 1.2, "k4": l4}}
        return json.dumps({"step": step, "tokens_seen": tok, "acc": [0.3] * 3, "cov": {"k4": [0.5] * 3},
                           "L_implied": L}) + "\n"

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "eval_log.jsonl").write_text(line(0, 0, 2.0) + line(100, 1000, 2.1) + line(200, 2000, 2.2))
    (b / "eval_log.jsonl").write_text(line(0, 0, 2.2) + line(50, 700, 2.4))
    rows = mod.load_curve([str(a), str(b)], start_tokens=10)
    assert [r["tokens"] for r in rows] == [10, 1010, 2010, 2710]
    assert [r["L_k4"] for r in rows] == [2.0, 2.1, 2.2, 2.4]
    assert mod.main([str(a), str(tmp_path / "missing")]) == 2
