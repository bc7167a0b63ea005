"""bench/report.py on a small hand-made run (two timed turns, one skipped): report.json values and key order,
report.md rows of every section against numbers worked out by hand, and which figures are written."""
import json

import pytest

from mindspore_eagle.bench import report as report_mod
from mindspore_eagle.core.trace import PHASES


def _phases(n_steps, **ms):
    return {**{f"{p}_ms": float(ms.get(p, 0.0)) for p in PHASES}, "total_ms": float(sum(ms.values())),
            "n_steps": n_steps, "mean_nodes": 8.0}


def _turn(turn_id, source, category, prompt_tokens, base, main):
    """base / main = (new tokens, prefill ms, decode ms); main adds accept_lens, predicted_lens, accepted_from,
    spec_share, phases."""
    new, pre, dec = base
    b = {"new_tokens": new, "prefill_ms": pre, "decode_ms": dec, "tok_s": new / ((pre + dec) / 1e3),
         "compile_count": 0, "stop_reason": "length"}
    new_m, pre_m, dec_m = main["times"]
    tok = new_m / ((pre_m + dec_m) / 1e3)
    m = {"new_tokens": new_m, "prefill_ms": pre_m, "decode_ms": dec_m, "tok_s": tok, "compile_count": 0,
         "speedup": tok / b["tok_s"], "identical": True, "accept_lens": main["accept_lens"],
         "predicted_lens": main["predicted_lens"], "accepted_from": main["accepted_from"],
         "spec_share": main["spec_share"], "phases": main["phases"]}
    return {"turn_id": turn_id, "item_id": turn_id.split("#")[0], "source": source, "category": category,
            "turn_index": 0, "prompt_tokens": prompt_tokens, "baseline": b, "settings": {"main": m}}


# turn A: baseline 10 tokens in 10 + 90 ms = 100 tok/s; speculative 10 in 10 + 40 ms = 200 tok/s (speedup 2)
# turn B: baseline 20 tokens in 20 + 180 ms = 100 tok/s; speculative 20 in 20 + 130 ms = 133.33 tok/s (4/3)
RECORDS = [
    _turn("mtbench/81#0", "mtbench", "writing", 50, (10, 10.0, 90.0),
          {"times": (10, 10.0, 40.0), "accept_lens": [3, 2, 4, 1], "predicted_lens": [2.6, 1.3, 3.2, 1.1],
           "accepted_from": {"drafter": 4, "suffix": 1, "both": 1}, "spec_share": 0.8,
           "phases": _phases(4, draft=8.0, verify=20.0)}),
    _turn("HumanEval/0#0", "humaneval", "humaneval", 30, (20, 20.0, 180.0),
          {"times": (20, 20.0, 130.0), "accept_lens": [1, 2], "predicted_lens": [1.2, 1.6],
           "accepted_from": {"drafter": 1, "suffix": 0, "both": 0}, "spec_share": 0.5,
           "phases": _phases(2, draft=6.0, verify=10.0)}),
    {"turn_id": "HumanEval/1#0", "item_id": "HumanEval/1", "source": "humaneval", "category": "humaneval",
     "turn_index": 0, "prompt_tokens": 9000, "skipped": "prompt does not fit the cache"},
]
MAIN = {"name": "main", "M": 16, "D_max": 4, "top_k": 4, "window": 0, "policy": "fixed"}
SWEEP_ROW = {"axis": "M", "value": 32, "setting": "M=32", "policy": "fixed", "M": 32, "D_max": 4, "top_k": 4,
             "window": 0, "turns": 2, "tok_s": 150.0, "baseline_tok_s": 100.0, "speedup": 1.5,
             "speedups": [1.0, 2.0], "speedup_agg": 1.4, "accept_len_mean": 2.25, "accept_len_p90": 3.5,
             "identical": True, "fastest": True, "fastest_in_axis": True}
META = {"name": "hand", "main": MAIN, "command": "python -m mindspore_eagle bench --turns 3", "turns_requested": 3,
        "subset": None, "max_new_tokens": 20, "teacher": "T", "drafter": "D",
        "machine": {"summary": "test CPU"}, "warmup": {"mode": "short", "seconds": 1.25, "compiles": 3},
        "sessions": [{"started": "2024-05-01 10:00:00", "turns_timed": 2, "wall_s": 90.0,
                      "machine": {"loadavg_start": [1.5], "loadavg_end": [2.25]}}],
        "sweeps": {"budget": [SWEEP_ROW]},
        "policy_state": {"costs": {"decode_ms": 10.0, "verify_ms": {"4": 15.0}, "draft_ctx_ms": 2.0,
                                   "draft_step_ms": 3.0, "host_ms": 0.0}}}


@pytest.fixture(scope="module")
def rep():
    return report_mod.build_report(RECORDS, META)


def test_report_json_values(rep):
    assert list(rep) == ["turns", "M", "D_max", "top_k", "window", "identical_outputs", "baseline_tok_s",
                         "ea_tok_s", "speedup", "accept_len", "aggregate", "paper", "turns_skipped",
                         "compiles_during_timing", "by_source", "policy", "spec_share", "calibration",
                         "policy_state", "accepted_from", "by_category", "figures", "loadavg_1m", "sweeps", "run"]
    assert rep["turns"] == 2 and rep["identical_outputs"] is True and rep["compiles_during_timing"] == 0
    assert rep["turns_skipped"] == [{"turn_id": "HumanEval/1#0", "reason": "prompt does not fit the cache"}]
    agg = rep["aggregate"]                   # 30 tokens in 0.3 s vs 30 tokens in 0.2 s
    assert (agg["baseline_tokens"], agg["ea_tokens"]) == (30, 30)
    assert agg["baseline_s"] == pytest.approx(0.3) and agg["ea_s"] == pytest.approx(0.2)
    assert agg["baseline_tok_s"] == pytest.approx(100.0) and agg["ea_tok_s"] == pytest.approx(150.0)
    assert agg["speedup"] == pytest.approx(1.5)
    assert rep["speedup"]["mean"] == pytest.approx((2.0 + 4 / 3) / 2) and rep["speedup"]["min"] == pytest.approx(4 / 3)
    assert rep["accept_len"]["mean"] == pytest.approx(13 / 6) and rep["accept_len"]["n"] == 6
    assert list(rep["by_source"]) == ["humaneval", "mtbench"] and rep["by_source"]["mtbench"]["turns"] == 1
    assert rep["accepted_from"]["drafter"] == 5 and rep["accepted_from"]["suffix_share"] == pytest.approx(1 / 7)
    assert list(rep["by_category"]) == ["writing", "humaneval"]
    assert rep["figures"]["fig3_accept_by_depth"]["reach"] == pytest.approx([4 / 6, 2 / 6, 1 / 6, 0.0])
    ov = rep["figures"]["fig5_overheads"]    # other = decode time outside phases: (40 - 28) + (130 - 16)
    assert ov["total_ms"]["other"] == pytest.approx(126.0) and ov["steps"] == 6
    assert rep["sweeps"] == {"budget": [SWEEP_ROW]} and rep["figures"]["fig4_budget_sweep"] == [SWEEP_ROW]
    assert "sweeps" not in rep["run"] and rep["run"]["name"] == "hand"
    assert [(c["lo"], c["steps"]) for c in rep["calibration"]] == [(1.0, 2), (1.25, 1), (1.5, 1), (2.5, 1),
                                                                    (3.0, 1)]
    assert "peers" not in rep and "peer_llamacpp_tok_s" not in rep


def test_markdown_rows_hand_computed(rep):
    lines = report_mod.markdown(rep).split("\n")

    def has(*rows):
        for row in rows:
            assert row in lines, row

    assert lines[0] == "# EAGLE-3 tree speculative decoding benchmark"                 # no date in a heading
    has("- Run: hand",
        "- Turns timed: 2 (requested 3, subset all); skipped: 1",
        "- Setting: M = 16, D_max = 4, top_k = 4, drafter window W = none; greedy, max_new_tokens = 20",
        "- Session 1: started 2024-05-01 10:00:00, 2 turns timed in 1.5 min, 1-minute load average 1.50 at start, "
        "2.25 at end",
        "- Graph compilations inside timed turns: 0 (warm-up: short, 3 graphs in 1.2 s)")
    # Table 1: two per-turn values lo, hi -> p = lo + q (hi - lo); tok/s 133.33 / 200, speedup 4/3 / 2
    has("| baseline tok/s (teacher-only greedy) | 100.00 | 100.00 | 100.00 | 100.00 |",
        "| EAGLE-3 tok/s | 166.67 | 166.67 | 193.33 | 199.33 |",
        "| speedup (x) | 1.67x | 1.67x | 1.93x | 1.99x |",
        "| accepted length L_k (per step) | 2.17 | 2.00 | 3.50 | 3.95 |",   # sorted 1 1 2 2 3 4
        "Aggregate (total tokens / total seconds): baseline 100.00 tok/s, EAGLE-3 150.00 tok/s, speedup 1.50x.",
        "| mean speedup | 1.67x | 1.27x |", "| p99 speedup | 1.99x | 2.46x |", "| mean L_k | 2.17 | 3.17 |")
    has("| humaneval | 1 | 100.00 | 133.33 | 1.33x | 1.33x | 1.50 | 0.000 | 0.000 |",
        "| mtbench | 1 | 100.00 | 200.00 | 2.00x | 2.00x | 2.50 | 0.167 | 0.167 |",
        "| writing | 1 | 2.00x | 2.00x | 2.50 | 4 (0.667) | 1 (0.167) | 1 (0.167) |",
        "| humaneval | 1 | 1.33x | 1.33x | 1.50 | 1 (1.000) | 0 (0.000) | 0 (0.000) |",
        "Accepted draft tokens by who proposed them (speculative.method eagle3): drafter 5, suffix candidates 1, "
        "both 1.")
    has("## Speculation policy: fixed",
        "Speedup per turn: min 1.33x, p10 1.40x, mean 1.67x. Share of steps that verified a tree, per turn: "
        "mean 0.65, p10 0.53, p90 0.77.",
        "| [1, 1.25) | 2 | 1.15 | 1.00 |", "| [1.25, 1.5) | 1 | 1.30 | 2.00 |", "| [1.5, 1.75) | 1 | 1.60 | 2.00 |",
        "| [2.5, 3) | 1 | 2.60 | 3.00 |", "| [3, inf) | 1 | 3.20 | 4.00 |",
        "| decode (plain step) | 10.0 | 1.00 |", "| verify step, m = 4 | 15.0 | 1.50 |",
        "| drafter context pass | 2.0 | 0.20 |", "| drafter expansion step | 3.0 | 0.30 |")
    has("| depth d | 1 | 2 | 3 | 4 |", "| reach | 0.667 | 0.333 | 0.167 | 0.000 |",
        "| conditional | 0.667 | 0.500 | 0.500 | 0.000 |")
    # Figure 5: prefill 30, draft 14, verify 30, other 126 ms over 2 turns, 6 steps, 200 ms in all
    has("2 turns, 6 speculative steps. other = decode time outside the named phases.",
        "| prefill | 30.0 | 15.0 | - | 15.0% |", "| draft | 14.0 | 7.0 | 2.33 | 7.0% |",
        "| mask | 0.0 | 0.0 | 0.00 | 0.0% |", "| verify | 30.0 | 15.0 | 5.00 | 15.0% |",
        "| other | 126.0 | 63.0 | 21.00 | 63.0% |")
    has("## Table 2 / Figure 4: budget sweeps",
        "| M | 32 | fixed | 32 | 4 | 4 | none | 2 | 150.00 **(fastest)** | 1.50x | 1.10x | 1.40x | 2.25 | 3.50 "
        "| True |",
        "Not run (use `--sweep window`).", "Not run (use `--sweep policy`).")
    has("| fraction | n/a | n/a | n/a | n/a |",
        "| prompt tokens | 40.0 | 40.0 | 48.0 | 49.8 |", "| new tokens | 15.0 | 15.0 | 19.0 | 19.9 |",
        "Figure 2: Pearson r between per-turn mean L_k and speedup = n/a.")   # two points: r undefined
    assert "## Figures" not in lines and not any("Peers" in x for x in lines)
    order = [x for x in lines if x.startswith("## ")]
    assert order == ["## Table 1: throughput microbenchmark (per turn, baseline then speculative, same process)",
                     "## Speculation policy: fixed", "## Figure 3: acceptance by tree position",
                     "## Figure 5: overhead breakdown of the speculative turns",
                     "## Table 2 / Figure 4: budget sweeps",
                     "## Table 3 / Figure 6: drafter-only window truncation", "## Figure 8: policies side by side",
                     "## Figure 7: draft attention evidence", "## Figure 1: lengths"]


def test_report_json_names_no_cache_folder(rep, tmp_path, monkeypatch):
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path / "c"))
    run = dict(rep["run"], warmup={"graph_cache": str(tmp_path / "c" / "graphs" / "ms"), "other": str(tmp_path)})
    report_mod.write_json(dict(rep, run=run), str(tmp_path / "r.json"))
    got = json.loads((tmp_path / "r.json").read_text())["run"]["warmup"]
    assert got == {"graph_cache": "$MSEAGLE_CACHE/graphs/ms", "other": str(tmp_path)}


def test_write_all_figures_and_links(rep, tmp_path):
    pytest.importorskip("matplotlib")
    out = report_mod.write_all(dict(rep, run=dict(rep["run"])), str(tmp_path))
    F = report_mod.FIGURES
    assert out["run"]["figure_files"] == [F[1], F[2], F[3], F[4], F[5], F[9], F[7]]   # no window / policy sweep
    for name in out["run"]["figure_files"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert md.endswith("## Figures\n\n" + "\n".join(f"![{f}]({f})" for f in out["run"]["figure_files"]) + "\n")
