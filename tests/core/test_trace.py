"""trace.py: JSONL round-trip, writer no-op, Timer with a fake clock, summaries checked by hand."""
from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest

import mindspore_eagle.core.trace as trace
from mindspore_eagle.core.trace import (
    PHASES,
    StepTrace,
    Timer,
    TraceWriter,
    TurnTrace,
    format_summary,
    read_jsonl,
    summarize,
)


def _step(k, L):
    return StepTrace(step=k, accept_len=L, accepted=list(range(L)), n_nodes=8, draft_ms=1.0 + k,
                     tensorize_ms=0.1, mask_ms=0.2, verify_ms=3.0, accept_ms=0.05, commit_ms=0.3,
                     total_ms=10.0 * (k + 1))


def test_json_is_one_tagged_line_and_handles_numpy():
    s = StepTrace(step=np.int64(2), accept_len=np.int32(3), accepted=np.array([0, 4, 5]), n_nodes=8,
                  total_ms=np.float32(1.5))
    line = s.to_json()
    assert "\n" not in line
    d = json.loads(line)
    assert d["kind"] == "step" and d["accepted"] == [0, 4, 5] and d["accept_len"] == 3 and d["total_ms"] == 1.5
    assert StepTrace.from_dict(d) == StepTrace(step=2, accept_len=3, accepted=[0, 4, 5], n_nodes=8,
                                               total_ms=1.5)
    assert json.loads(TurnTrace("t0", 12, 30).to_json())["kind"] == "turn"


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown StepTrace keys"):
        StepTrace.from_dict({"kind": "step", "step": 0, "accept_len": 1, "bogus": 1})


def test_writer_round_trip_and_flush(tmp_path):
    path = tmp_path / "sub" / "trace.jsonl"
    records = [_step(0, 1), _step(1, 3),
               TurnTrace(turn_id="mt-81-0", prompt_tokens=40, new_tokens=4, prefill_ms=12.5, decode_ms=20.0,
                         tok_per_s=200.0, compile_count=2, mean_accept_len=2.0)]
    w = TraceWriter(path)
    for k, r in enumerate(records):
        w.write(r)
        assert len(path.read_text().splitlines()) == k + 1  # flushed per line, before close
    w.close()
    w.close()
    assert read_jsonl(path) == records
    with TraceWriter(path) as w2:  # appends
        w2.write(_step(2, 2))
    assert len(read_jsonl(path)) == 4


def test_writer_none_is_noop(tmp_path):
    w = TraceWriter(None)
    w.write(_step(0, 1))
    w.close()
    assert list(tmp_path.iterdir()) == []


def test_read_rejects_unknown_kind(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"kind": "nope"}\n')
    with pytest.raises(ValueError, match="kind"):
        read_jsonl(p)


def test_timer_with_fake_clock(monkeypatch):
    ticks = iter([10.0, 10.5, 11.0, 11.002, 12.0, 12.25, 13.0, 14.0])
    monkeypatch.setattr(trace, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    with Timer() as t:  # 10.0
        with t.phase("draft"):  # 10.5 -> 11.0
            pass
        with t.phase("verify"):  # 11.002 -> 12.0
            pass
        with pytest.raises(RuntimeError):
            with t.phase("draft"):  # 12.25 -> 13.0, recorded despite the error
                raise RuntimeError
    # exit at 14.0
    assert t.ms["draft"] == pytest.approx(500.0 + 750.0)
    assert t.ms["verify"] == pytest.approx(998.0)
    assert t.total_ms == pytest.approx(4000.0)
    kw = t.phase_kwargs()
    assert set(kw) == {f"{p}_ms" for p in PHASES} and kw["mask_ms"] == 0.0
    StepTrace(step=0, accept_len=1, total_ms=t.total_ms, **kw)


def test_timer_real_clock_is_non_negative():
    t = Timer()
    with t.phase("draft"):
        sum(range(1000))
    assert t.ms["draft"] >= 0.0


def test_summarize_hand_computed():
    s = summarize(range(1, 11))
    assert s == {"mean": 5.5, "p50": 5.5, "p90": pytest.approx(9.1), "p99": pytest.approx(9.91), "n": 10}
    assert summarize([4]) == {"mean": 4.0, "p50": 4.0, "p90": 4.0, "p99": 4.0, "n": 1}
    empty = summarize([])
    assert empty["n"] == 0 and all(math.isnan(empty[k]) for k in ("mean", "p50", "p90", "p99"))


def test_format_summary_hand_computed():
    steps = [_step(k, L) for k, L in enumerate([1, 2, 3, 4])]
    turns = [TurnTrace("a", 10, 10, prefill_ms=5.0, decode_ms=1000.0, tok_per_s=10.0, compile_count=1),
             TurnTrace("b", 20, 30, prefill_ms=7.0, decode_ms=3000.0, tok_per_s=10.0, compile_count=0)]
    text = format_summary(steps, turns)
    lines = {ln.split()[0]: ln.split()[1:] for ln in text.splitlines()}
    # accept_len [1,2,3,4]: mean 2.5, p50 2.5, p90 = 3 + 0.7, p99 = 3 + 0.97
    assert lines["accept_len"] == ["4", "2.500", "2.500", "3.700", "3.970"]
    # total_ms [10,20,30,40]: p90 = 30 + 0.7 * 10
    assert lines["total_ms"] == ["4", "25.000", "25.000", "37.000", "39.700"]
    assert lines["draft_ms"] == ["4", "2.500", "2.500", "3.700", "3.970"]
    assert lines["new_tokens"] == ["2", "20.000", "20.000", "28.000", "29.800"]
    assert text.splitlines()[-1] == ("total: 40 new tokens in 4.000 s decode = 10.00 tok/s; compiles 1; "
                                     "mean accept_len 2.500")


def test_format_summary_empty():
    text = format_summary([], [])
    assert "nan" in text and text.splitlines()[-1].startswith("total: 0 new tokens")
