"""Benchmark report: ``report.json`` (every table and figure's data), ``report.md`` (tables, our numbers beside
the paper's) and PNG figures 1-7 (matplotlib, Agg backend).

Figures (paper numbering, "EAGLE-Pangu: Accelerator-Safe Tree Speculative Decoding on Ascend NPUs"):
    1 input / output length distributions (prompt tokens, new tokens per turn)
    2 per-turn speedup vs mean accepted length L_k
    3 acceptance by tree position (fraction of steps whose accepted path reaches depth d)
    4 budget sweeps (tok/s and speedup vs M, D_max, top_k)            -- only with --sweep budget
    5 overhead breakdown (prefill, draft, tensorize, mask, verify, accept, commit, other; ms)
    6 drafter-only window truncation (tok/s, speedup, L_k vs W)        -- only with --sweep window
    7 draft attention evidence (top-1 attention distance buckets 0-31, 32-127, 128-255, 256+ tokens)
    8 policy sweep: per-turn speedup distribution of each policy / preset  -- only with --sweep policy

Units: tok/s (new tokens / end-to-end wall seconds of the turn), ms (wall), L_k in tokens (bonus included).
Paper reference numbers (Ascend NPU): mean speedup 1.27x, p99 speedup 2.46x, mean L_k 3.17 (PAPER below).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from mindspore_eagle.bench.throughput import accept_by_depth, attention_buckets, stats
from mindspore_eagle.core.trace import PHASES

PAPER = {"speedup_mean": 1.27, "speedup_p99": 2.46, "accept_len_mean": 3.17,
         "source": "EAGLE-Pangu (Accelerator-Safe Tree Speculative Decoding on Ascend NPUs), Table 1; openPangu "
                   "teacher on Ascend NPU, 240 turns (MT-Bench 80x2 + HumanEval 80)"}
FIGURES = {1: "fig1_lengths.png", 2: "fig2_speedup_vs_accept.png", 3: "fig3_accept_by_depth.png",
           4: "fig4_budget_sweep.png", 5: "fig5_overheads.png", 6: "fig6_window.png", 7: "fig7_attention.png",
           8: "fig8_policy_sweep.png", 9: "fig9_accepted_by_category.png"}
PRED_EDGES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, float("inf"))
OVERHEAD_PHASES = ("prefill",) + PHASES + ("other",)


def _ok(records, name="main"):
    return [r for r in records if "baseline" in r and "tok_s" in r.get("settings", {}).get(name, {})]


def overheads(records, name="main") -> dict:
    """Per-phase wall time of the speculative turns (paper Figure 5).

    prefill = teacher prefill of the turn; draft .. commit = StepTrace phase sums; other = decode time not inside
    a phase (step bookkeeping, token emission, stop checks). Returns {"phases": [...], "total_ms": {phase: ms},
    "ms_per_turn": {...}, "ms_per_step": {...}, "share": {phase: fraction of all speculative turn time},
    "turns", "steps"}.
    """
    ok = _ok(records, name)
    tot = {p: 0.0 for p in OVERHEAD_PHASES}
    steps = 0
    for r in ok:
        s = r["settings"][name]
        ph = s["phases"]
        tot["prefill"] += s["prefill_ms"]
        inside = 0.0
        for p in PHASES:
            tot[p] += ph[f"{p}_ms"]
            inside += ph[f"{p}_ms"]
        tot["other"] += max(0.0, s["decode_ms"] - inside)
        steps += ph["n_steps"]
    all_ms = sum(tot.values())
    n = max(1, len(ok))
    return {"phases": list(OVERHEAD_PHASES), "total_ms": tot,
            "ms_per_turn": {p: v / n for p, v in tot.items()},
            "ms_per_step": {p: (v / steps if steps else float("nan")) for p, v in tot.items() if p != "prefill"},
            "share": {p: (v / all_ms if all_ms else float("nan")) for p, v in tot.items()},
            "turns": len(ok), "steps": steps}


def calibration_of_lengths(records, name="main") -> list:
    """Predicted versus observed accepted length: the tree-verifying steps of setting ``name`` binned by the
    policy's predicted E[L_k] (PRED_EDGES). Returns [{"lo", "hi", "steps", "predicted", "observed"}] for non-empty
    bins (means over the bin's steps)."""
    pred = np.array([x for r in _ok(records, name) for x in r["settings"][name].get("predicted_lens", [])])
    obs = np.array([x for r in _ok(records, name) for x in r["settings"][name]["accept_lens"]], np.float64)
    if pred.size != obs.size:            # records written before predicted_lens existed
        return []
    out = []
    for lo, hi in zip(PRED_EDGES[:-1], PRED_EDGES[1:]):
        sel = (pred >= lo) & (pred < hi)
        if sel.any():
            out.append({"lo": lo, "hi": hi, "steps": int(sel.sum()), "predicted": float(pred[sel].mean()),
                        "observed": float(obs[sel].mean())})
    return out


def accepted_shares(records) -> dict:
    """Accepted drafted tokens of the main setting over ``records`` by source (drafter, suffix, both), as counts
    and as shares of their sum (NaN when nothing was accepted); records without the field count nothing."""
    tot = {"drafter": 0, "suffix": 0, "both": 0}
    for r in records:
        for k, v in r["settings"]["main"].get("accepted_from", {}).items():
            tot[k] += int(v)
    n = sum(tot.values())
    return {**tot, **{f"{k}_share": v / n if n else float("nan") for k, v in list(tot.items())}}


def by_category(records) -> dict:
    """Per turn category (the MT-Bench category, or "humaneval"; ``TurnSpec.category``), in first-seen order:
    {"turns", "speedup" (stats of per-turn speedups), "accept_len_mean" (over the category's steps),
    "accepted_from" (:func:`accepted_shares`)} of the main setting. Records need the "category" field."""
    out = {}
    for cat in dict.fromkeys(r["category"] for r in records):
        sub = [r for r in records if r["category"] == cat]
        lens = [x for r in sub for x in r["settings"]["main"]["accept_lens"]]
        out[cat] = {"turns": len(sub), "speedup": stats([r["settings"]["main"]["speedup"] for r in sub]),
                    "accept_len_mean": float(np.mean(lens)) if lens else float("nan"),
                    "accepted_from": accepted_shares(sub)}
    return out


def peer_runs(rec: dict) -> dict:
    """{row name: that peer's result} of one turn record: ``peers`` (llama-server variants, bench/llama_server.py)
    and, in records of older runs, ``peer_llamacpp`` (llama-cpp-python greedy and its prompt lookup)."""
    out = dict(rec.get("peers") or {})
    old = rec.get("peer_llamacpp")
    if isinstance(old, dict) and "tok_s" in old:
        out["llama-cpp-python greedy"] = old
        for n, r in sorted(old.get("lookup", {}).items(), key=lambda kv: int(kv[0])):
            out[f"llama-cpp-python prompt lookup {n}"] = r
    return out


def peer_aggregate(ok: list) -> dict:
    """Aggregate tok/s (total new tokens / total seconds) of ours and of each peer row over the turns where a peer
    ran: {"turns", "baseline_tok_s", "ea_tok_s", "best", "rows": {name: {"tok_s", "ea_over", "baseline_over",
    "turns", "same_turns", "draft_acceptance"}}}; ``ea_over`` = our speculative tok/s / that row's,
    ``baseline_over`` = our teacher-only tok/s / that row's, ``same_turns`` = turns whose tokens equal our
    teacher-only tokens (None where the peer did not say), ``draft_acceptance`` = accepted / drafted tokens of
    its speculation (None without), ``best`` = the fastest row's name."""
    turns = [r for r in ok if peer_runs(r)]

    def agg(parts):
        new, sec = sum(p[0] for p in parts), sum(p[1] for p in parts)
        return new / sec if sec else float("nan")

    base = agg([(r["baseline"]["new_tokens"], (r["baseline"]["prefill_ms"] + r["baseline"]["decode_ms"]) / 1e3)
                for r in turns])
    ea = agg([(r["settings"]["main"]["new_tokens"],
               (r["settings"]["main"]["prefill_ms"] + r["settings"]["main"]["decode_ms"]) / 1e3) for r in turns])
    variants: dict = {}
    for r in turns:
        for name, p in peer_runs(r).items():
            variants.setdefault(name, []).append(p)
    rows = {}
    for name, recs in variants.items():
        t = agg([(p["new_tokens"], p["seconds"]) for p in recs])
        drafted = sum(p.get("draft_n", 0) for p in recs)
        rows[name] = {"tok_s": t, "ea_over": ea / t if t else float("nan"),
                      "baseline_over": base / t if t else float("nan"), "turns": len(recs),
                      "same_turns": (sum(bool(p["same_tokens"]) for p in recs)
                                     if all("same_tokens" in p for p in recs) else None),
                      "draft_acceptance": sum(p.get("draft_accepted", 0) for p in recs) / drafted if drafted else None}
    best = max(rows, key=lambda n: rows[n]["tok_s"] if rows[n]["tok_s"] == rows[n]["tok_s"] else -1.0) if rows else None
    return {"turns": len(turns), "baseline_tok_s": base, "ea_tok_s": ea, "best": best, "rows": rows}


def _identical(records) -> bool:
    """True when no speculative output of any record differed from its baseline."""
    return bool(all(s.get("identical", True) for r in records for s in r.get("settings", {}).values())
                and not any(r.get("mismatch") for r in records))


def _aggregate(ok) -> dict:
    """Total new tokens over total end-to-end seconds of the baseline and of the main setting, and their ratio."""
    base_new = sum(r["baseline"]["new_tokens"] for r in ok)
    base_s = sum(r["baseline"]["prefill_ms"] + r["baseline"]["decode_ms"] for r in ok) / 1e3
    ea_new = sum(r["settings"]["main"]["new_tokens"] for r in ok)
    ea_s = sum(r["settings"]["main"]["prefill_ms"] + r["settings"]["main"]["decode_ms"] for r in ok) / 1e3
    return {"baseline_tok_s": base_new / base_s if base_s else float("nan"),
            "ea_tok_s": ea_new / ea_s if ea_s else float("nan"),
            "speedup": (ea_new / ea_s) / (base_new / base_s) if ea_s and base_s and base_new else float("nan"),
            "baseline_tokens": base_new, "ea_tokens": ea_new, "baseline_s": base_s, "ea_s": ea_s}


def _compiles_during_timing(ok) -> int:
    """Graph compilations inside the timed generations (baseline and every setting)."""
    return int(sum(r["baseline"]["compile_count"] for r in ok)
               + sum(s.get("compile_count", 0) for r in ok for s in r["settings"].values()))


def _by_source(ok) -> dict:
    """Per evaluation source (sorted): turns, mean tok/s of both paths, speedup and L_k stats, accepted shares."""
    out = {}
    for src in sorted({r["source"] for r in ok}):
        sub = [r for r in ok if r["source"] == src]
        out[src] = {
            "turns": len(sub), "baseline_tok_s": stats([r["baseline"]["tok_s"] for r in sub])["mean"],
            "ea_tok_s": stats([r["settings"]["main"]["tok_s"] for r in sub])["mean"],
            "speedup": stats([r["settings"]["main"]["speedup"] for r in sub]),
            "accept_len": stats([x for r in sub for x in r["settings"]["main"]["accept_lens"]]),
            "accepted_from": accepted_shares(sub)}
    return out


def _peer_summary(records, ok) -> dict:
    """The peers' keys of report.json: ``peers`` (peer_aggregate) and, where a greedy peer row ran,
    ``peer_llamacpp_tok_s`` / ``peer_llamacpp_match`` (its per-turn tok/s and match_prefix stats); {} when no peer
    ran."""
    if not any(peer_runs(r) for r in records):
        return {}
    out = {"peers": peer_aggregate(ok)}
    greedy = [p for r in records for name, p in peer_runs(r).items() if name.endswith(" greedy")]
    if greedy:
        out["peer_llamacpp_tok_s"] = stats([p["tok_s"] for p in greedy])
        out["peer_llamacpp_match"] = stats([p.get("match_prefix", float("nan")) for p in greedy])
    return out


def _speedup_vs_accept(ok) -> dict:
    """Figure 2's data: per-turn mean L_k and speedup, and their Pearson r (NaN when undefined)."""
    pts = [{"turn_id": r["turn_id"], "source": r["source"],
            "accept_len_mean": float(np.mean(r["settings"]["main"]["accept_lens"]))
            if r["settings"]["main"]["accept_lens"] else 1.0,
            "speedup": r["settings"]["main"]["speedup"]} for r in ok]
    corr = float(np.corrcoef([p["accept_len_mean"] for p in pts], [p["speedup"] for p in pts])[0, 1]) \
        if len(pts) > 2 and np.std([p["speedup"] for p in pts]) > 0 and \
        np.std([p["accept_len_mean"] for p in pts]) > 0 else float("nan")
    return {"points": pts, "pearson_r": corr}


def _figures(records, ok, flat, main, sweeps) -> dict:
    """Every figure's data (report.json "figures"): fig1_lengths .. fig8_policy_sweep."""
    dists = [d for r in ok for d in r.get("attn_dist", [])]
    tops = [t for r in ok for t in r.get("attn_top", [])]
    cols = [c for _, c in tops] if len(tops) == len(dists) else None
    return {
        "fig1_lengths": {"prompt_tokens": [r["prompt_tokens"] for r in ok],
                         "new_tokens": [r["baseline"]["new_tokens"] for r in ok],
                         "prompt_stats": stats([r["prompt_tokens"] for r in ok]),
                         "new_stats": stats([r["baseline"]["new_tokens"] for r in ok])},
        "fig2_speedup_vs_accept": _speedup_vs_accept(ok),
        "fig3_accept_by_depth": accept_by_depth(flat, main["D_max"]),
        "fig4_budget_sweep": sweeps.get("budget", []),
        "fig5_overheads": overheads(records),
        "fig6_window": sweeps.get("window", []),
        "fig7_attention": {**attention_buckets(dists, cols), "distances": dists, "top": tops,
                           "window": main["window"]},
        "fig8_policy_sweep": sweeps.get("policy", []),
    }


def build_report(records, meta: dict) -> dict:
    """Assemble report.json from the turn records and run metadata.

    Args:
        records: turn records (throughput.run_turn) in turn order. meta: {"main": Setting dict, "D_max", "config",
            "sweeps": {"budget": [...], "window": [...]} (sweeps.summarize_points rows), "machine", "warmup",
            "command", ...}; copied under "run".
    Returns:
        dict with top level turns, M, D_max, top_k, window, identical_outputs, baseline_tok_s, ea_tok_s, speedup,
        accept_len (each {mean, p50, p90, p99, n}), aggregate, paper, by_source, compiles_during_timing,
        turns_skipped, figures {fig1..fig7}, sweeps, optional peer_llamacpp_tok_s, run.
    """
    main = meta["main"]
    ok = _ok(records)
    flat = [x for r in ok for x in r["settings"]["main"]["accept_lens"]]
    rep = {
        "turns": len(ok), "M": main["M"], "D_max": main["D_max"], "top_k": main["top_k"], "window": main["window"],
        "identical_outputs": _identical(records),
        "baseline_tok_s": stats([r["baseline"]["tok_s"] for r in ok]),
        "ea_tok_s": stats([r["settings"]["main"]["tok_s"] for r in ok]),
        "speedup": stats([r["settings"]["main"]["speedup"] for r in ok]),
        "accept_len": stats(flat),
        "aggregate": _aggregate(ok),
        "paper": PAPER,
        "turns_skipped": [{"turn_id": r["turn_id"], "reason": r["skipped"]} for r in records if "skipped" in r],
        "compiles_during_timing": _compiles_during_timing(ok),
        "by_source": _by_source(ok),
        "policy": main.get("policy", "fixed"),
        "spec_share": stats([r["settings"]["main"].get("spec_share", 1.0) for r in ok]),
        "calibration": calibration_of_lengths(records),
        "policy_state": meta.get("policy_state"),
    }
    rep["accepted_from"] = accepted_shares(ok)
    rep["by_category"] = by_category(ok)
    rep.update(_peer_summary(records, ok))
    loads = [r["loadavg_1m"] for r in ok if "loadavg_1m" in r]
    sweeps = meta.get("sweeps", {})
    rep["figures"] = _figures(records, ok, flat, main, sweeps)
    rep["loadavg_1m"] = stats(loads)
    rep["sweeps"] = sweeps
    rep["run"] = {k: v for k, v in meta.items() if k not in ("sweeps",)}
    return rep


def _clean(obj, cache: str | None = None):
    """NaN / inf -> None so report.json is strict JSON; a path under the package's cache folder is written from
    ``$MSEAGLE_CACHE`` on, so a report names no machine's folders."""
    if cache is None:
        from mindspore_eagle.config import cache_dir

        cache = str(cache_dir())
    if isinstance(obj, str) and obj.startswith(cache + os.sep):
        return "$MSEAGLE_CACHE" + obj[len(cache):]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v, cache) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v, cache) for v in obj]
    if isinstance(obj, np.generic):
        return _clean(obj.item(), cache)
    return obj


def write_json(rep: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(rep), f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------------------------- markdown --
def _f(x, nd=2, suffix=""):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{nd}f}{suffix}"


def _stat_row(name, s, nd=2, suffix=""):
    return f"| {name} | {_f(s['mean'], nd, suffix)} | {_f(s['p50'], nd, suffix)} | {_f(s['p90'], nd, suffix)} | " \
           f"{_f(s['p99'], nd, suffix)} |"


def _md_summary(rep: dict, run: dict) -> list:
    """report.md title and run summary: command, turns, setting, models, machine, sessions, identical outputs,
    CPU load, compilations."""
    L = ["# EAGLE-3 tree speculative decoding benchmark", "", f"- Run: {run.get('name', '')}"]
    L += [f"- Command: `{run.get('command', '')}`",
          f"- Turns timed: {rep['turns']} (requested {run.get('turns_requested', '?')}, subset "
          f"{run.get('subset') or 'all'}); skipped: {len(rep['turns_skipped'])}",
          f"- Setting: M = {rep['M']}, D_max = {rep['D_max']}, top_k = {rep['top_k']}, drafter window W = "
          f"{rep['window'] or 'none'}; greedy, max_new_tokens = {run.get('max_new_tokens', '?')}",
          f"- Teacher: {run.get('teacher', '?')}; drafter: {run.get('drafter', '?')}",
          f"- Machine: {run.get('machine', {}).get('summary', '?')}",
          *([f"- Peer: {run['peer_llamacpp']}"] if run.get("peer_llamacpp") else []),
          *[f"- Session {i + 1}: started {x['started']}, {x['turns_timed']} turns timed in "
            f"{_f(x['wall_s'] / 60, 1)} min, "
            f"1-minute load average {_f((x['machine'].get('loadavg_start') or [float('nan')])[0])} at start, "
            f"{_f((x['machine'].get('loadavg_end') or [float('nan')])[0])} at end"
            for i, x in enumerate(run.get("sessions", []))],
          f"- Outputs identical to teacher-only greedy on every turn and setting: **{rep['identical_outputs']}**",
          f"- CPU load (1-minute load average at the end of each turn, this run alone adds about 2): mean "
          f"{_f(rep['loadavg_1m']['mean'])}, p99 {_f(rep['loadavg_1m']['p99'])}",
          f"- Graph compilations inside timed turns: {rep['compiles_during_timing']} (warm-up: "
          f"{run.get('warmup', {}).get('mode', '?')}, {run.get('warmup', {}).get('compiles', '?')} graphs in "
          f"{_f(run.get('warmup', {}).get('seconds'), 1)} s)", ""]
    return L


def _md_table1(rep: dict) -> list:
    """report.md Table 1 (per-turn stats), the llama.cpp peer rows when it ran, and the aggregate line."""
    L = ["## Table 1: throughput microbenchmark (per turn, baseline then speculative, same process)", "",
         "| metric | mean | p50 | p90 | p99 |", "|---|---|---|---|---|",
         _stat_row("baseline tok/s (teacher-only greedy)", rep["baseline_tok_s"]),
         _stat_row("EAGLE-3 tok/s", rep["ea_tok_s"]),
         _stat_row("speedup (x)", rep["speedup"], 2, "x"),
         _stat_row("accepted length L_k (per step)", rep["accept_len"])]
    if "peer_llamacpp_tok_s" in rep:
        L.append(_stat_row("llama.cpp greedy tok/s (peer)", rep["peer_llamacpp_tok_s"]))
    if rep.get("peers"):
        pa = rep["peers"]
        L += ["", f"### Peers (own process, clean environment, same prompt ids, run turn by turn between ours; "
                  f"{pa['turns']} turns)", "",
              "| | aggregate tok/s | ours speculative / it | ours teacher-only / it | turns with our tokens "
              "| draft acceptance |", "|---|---|---|---|---|---|",
              f"| ours, speculative | {_f(pa['ea_tok_s'])} | | | {pa['turns']} / {pa['turns']} | |",
              f"| ours, teacher-only | {_f(pa['baseline_tok_s'])} | | | {pa['turns']} / {pa['turns']} | |"]
        for name, r in pa["rows"].items():
            same = "-" if r.get("same_turns") is None else f"{r['same_turns']} / {r['turns']}"
            acc = "-" if r.get("draft_acceptance") is None else f"{100 * r['draft_acceptance']:.0f} %"
            mark = " (fastest peer)" if name == pa.get("best") and len(pa["rows"]) > 1 else ""
            L.append(f"| {name}{mark} | {_f(r['tok_s'])} | {_f(r['ea_over'])}x | {_f(r['baseline_over'])}x | "
                     f"{same} | {acc} |")
    agg = rep["aggregate"]
    L += ["", f"Aggregate (total tokens / total seconds): baseline {_f(agg['baseline_tok_s'])} tok/s, EAGLE-3 "
              f"{_f(agg['ea_tok_s'])} tok/s, speedup {_f(agg['speedup'])}x.", ""]
    return L


def _md_paper(rep: dict) -> list:
    """report.md: our headline numbers beside the paper's, and what differs in the setup."""
    P = rep["paper"]
    return ["### Beside the paper", "", "| | ours | paper (Ascend) |", "|---|---|---|",
            f"| mean speedup | {_f(rep['speedup']['mean'])}x | {P['speedup_mean']:.2f}x |",
            f"| p99 speedup | {_f(rep['speedup']['p99'])}x | {P['speedup_p99']:.2f}x |",
            f"| mean L_k | {_f(rep['accept_len']['mean'])} | {P['accept_len_mean']:.2f} |", "",
            "What differs: the paper runs an openPangu teacher on Ascend NPUs with fused kernels, where one verify "
            "call over M tree tokens costs about the same as one decode step (memory-bound), so every accepted token "
            "is nearly free. Here the teacher (named above) runs in float32 on the CPU above (MindSpore, with its "
            "CPU kernels called from the host): multi-row products are compute-bound, so a verify over M tokens "
            "costs noticeably more than a "
            "decode, the drafter's layer is a larger fraction of a small teacher's cost, and host-side work "
            "(tree building, masks, Python) is not hidden behind device time. The drafter is our own small EAGLE-3 "
            "head trained on a CPU budget, not the paper's. Speedup and L_k are therefore not expected to match; "
            "the identical-output check and the shape of the distributions are the comparable parts.", ""]


def _md_by_category(rep: dict) -> list:
    """report.md "By category" table (Figure 9's numbers); [] without per-category data."""
    if not rep.get("by_category"):
        return []
    L = ["", "### By category", "",
         f"Accepted draft tokens by who proposed them (Figure 9: {FIGURES[9]}).", "",
         "| category | turns | speedup mean | speedup p10 | L_k mean | from drafter | from suffix | from both |",
         "|---|---|---|---|---|---|---|---|"]
    for cat, c in rep["by_category"].items():
        f = c["accepted_from"]
        L.append(f"| {cat} | {c['turns']} | {_f(c['speedup']['mean'])}x | {_f(c['speedup']['p10'])}x | "
                 f"{_f(c['accept_len_mean'])} | {f.get('drafter', 0)} ({_f(f.get('drafter_share'), 3)}) | "
                 f"{f.get('suffix', 0)} ({_f(f.get('suffix_share'), 3)}) | "
                 f"{f.get('both', 0)} ({_f(f.get('both_share'), 3)}) |")
    return L


def _md_by_source(rep: dict) -> list:
    """report.md "By source" table, then "By category", then the accepted-draft-token counts; [] without
    per-source data."""
    if not rep["by_source"]:
        return []
    L = ["### By source", "", "| source | turns | baseline tok/s | EAGLE-3 tok/s | speedup mean | speedup p90 | "
         "L_k mean | accepted from suffix | from both |", "|---|---|---|---|---|---|---|---|---|"]
    for src, s in rep["by_source"].items():
        a = s.get("accepted_from", {})
        L.append(f"| {src} | {s['turns']} | {_f(s['baseline_tok_s'])} | {_f(s['ea_tok_s'])} | "
                 f"{_f(s['speedup']['mean'])}x | {_f(s['speedup']['p90'])}x | {_f(s['accept_len']['mean'])} | "
                 f"{_f(a.get('suffix_share'), 3)} | {_f(a.get('both_share'), 3)} |")
    a = rep.get("accepted_from", {})
    L += _md_by_category(rep)
    L += ["", f"Accepted draft tokens by who proposed them (speculative.method "
          f"{rep['run'].get('config', {}).get('speculative', {}).get('method', 'eagle3')}"
          f"): drafter {a.get('drafter', 0)}, suffix candidates {a.get('suffix', 0)}, both {a.get('both', 0)}.",
          ""]
    return L


def _md_fig3(rep: dict) -> list:
    """report.md Figure 3 table: acceptance by tree depth (reach and conditional rate)."""
    f3 = rep["figures"]["fig3_accept_by_depth"]
    return ["## Figure 3: acceptance by tree position", "",
            "Fraction of speculative steps whose accepted draft path reaches depth d (L_k - 1 >= d), and the "
            f"conditional rate given depth d - 1 was reached ({f3['n_steps']} steps).", "",
            "| depth d | " + " | ".join(str(d) for d in f3["depth"]) + " |",
            "|---|" + "---|" * len(f3["depth"]),
            "| reach | " + " | ".join(_f(x, 3) for x in f3["reach"]) + " |",
            "| conditional | " + " | ".join(_f(x, 3) for x in f3["conditional"]) + " |", ""]


def _md_fig5(rep: dict) -> list:
    """report.md Figure 5 table: time of the speculative turns by phase."""
    ov = rep["figures"]["fig5_overheads"]
    L = ["## Figure 5: overhead breakdown of the speculative turns", "",
         f"{ov['turns']} turns, {ov['steps']} speculative steps. other = decode time outside the named phases.", "",
         "| phase | total ms | ms / turn | ms / step | share |", "|---|---|---|---|---|"]
    for p in ov["phases"]:
        L.append(f"| {p} | {_f(ov['total_ms'][p], 1)} | {_f(ov['ms_per_turn'][p], 1)} | "
                 f"{_f(ov['ms_per_step'].get(p), 2) if p != 'prefill' else '-'} | {_f(100 * ov['share'][p], 1)}% |")
    L.append("")
    return L


_SWEEP_SECTIONS = (("budget", "Table 2 / Figure 4: budget sweeps", "--sweep budget"),
                   ("window", "Table 3 / Figure 6: drafter-only window truncation", "--sweep window"),
                   ("policy", "Figure 8: policies side by side", "--sweep policy"))


def _md_sweep_row(p: dict) -> str:
    """One sweep point (sweeps.summarize_points row) as a report.md table row."""
    star = " **(fastest)**" if p["fastest"] else ""
    p10 = stats(p.get("speedups", []))["p10"]
    return (f"| {p['axis']} | {p['value'] if p['value'] else 'none'} | {p.get('policy', 'fixed')} | {p['M']} "
            f"| {p['D_max']} | {p['top_k']} | {p['window'] or 'none'} | {p['turns']} | {_f(p['tok_s'])}{star} "
            f"| {_f(p['speedup'])}x | {_f(p10)}x | {_f(p['speedup_agg'])}x | {_f(p['accept_len_mean'])} | "
            f"{_f(p['accept_len_p90'])} | {p['identical']} |")


def _md_sweeps(rep: dict) -> list:
    """report.md sections of the budget sweep, the window study and the policy comparison ("Not run" when absent)."""
    L = []
    for key, title, what in _SWEEP_SECTIONS:
        rows = rep["sweeps"].get(key) or []
        L += [f"## {title}", ""]
        if not rows:
            L += [f"Not run (use `{what}`).", ""]
            continue
        if key == "window":
            L += ["The drafter attends only to the last W context tokens; the teacher is unchanged (so outputs stay "
                  "identical).", ""]
        L += ["| axis | value | policy | M | D_max | top_k | W | turns | tok/s | speedup (mean) | speedup p10 | "
              "speedup (aggregate) | L_k mean | L_k p90 | identical |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        L += [_md_sweep_row(p) for p in rows]
        L.append("")
    return L


def _md_fig7(rep: dict) -> list:
    """report.md Figure 7 table: where the drafter's top-1 attention falls, and the attention-sink share."""
    f7 = rep["figures"]["fig7_attention"]
    L = ["## Figure 7: draft attention evidence", "",
         f"Where the drafter's top-1 attention falls (distance in tokens back from the drafting row), "
         f"{f7['n']} sampled context-pass rows (mean over heads).", "",
         "| distance | 0-31 | 32-127 | 128-255 | 256+ |", "|---|---|---|---|---|",
         f"| fraction | {_f(f7['0-31'], 3)} | {_f(f7['32-127'], 3)} | {_f(f7['128-255'], 3)} | "
         f"{_f(f7['256+'], 3)} |", ""]
    if "sink" in f7:
        L += [f"Top-1 on one of the first 4 tokens of the sequence (attention sink): {_f(f7['sink'], 3)}; "
              f"distance >= 128 and not a sink: {_f(f7['far_not_sink'], 3)}.", ""]
    return L


def _md_fig1_fig2(rep: dict) -> list:
    """report.md Figure 1 length stats and Figure 2's correlation line."""
    f1 = rep["figures"]["fig1_lengths"]
    return ["## Figure 1: lengths", "", "| | mean | p50 | p90 | p99 |", "|---|---|---|---|---|",
            _stat_row("prompt tokens", f1["prompt_stats"], 1), _stat_row("new tokens", f1["new_stats"], 1), "",
            f"Figure 2: Pearson r between per-turn mean L_k and speedup = "
            f"{_f(rep['figures']['fig2_speedup_vs_accept']['pearson_r'], 3)}.", ""]


def markdown(rep: dict) -> str:
    """report.md text: run summary, Table 1 beside the paper, acceptance by depth, overheads, sweeps, attention,
    figure links, notes on what differs from the paper's setup."""
    run = rep.get("run", {})
    L = _md_summary(rep, run)
    L += _md_table1(rep)
    L += _md_paper(rep)
    L += _md_by_source(rep)
    L += policy_markdown(rep)
    L += _md_fig3(rep)
    L += _md_fig5(rep)
    L += _md_sweeps(rep)
    L += _md_fig7(rep)
    L += _md_fig1_fig2(rep)
    figs = run.get("figure_files", [])
    if figs:
        L += ["## Figures", ""] + [f"![{f}]({f})" for f in figs] + [""]
    return "\n".join(L)


def policy_markdown(rep: dict) -> list:
    """report.md lines on the speculation policy: speedup tail, share of steps that speculated, predicted versus
    observed L_k, the measured cost table and the acceptance calibration (adaptive policy)."""
    sp, sh = rep["speedup"], rep["spec_share"]
    L = [f"## Speculation policy: {rep.get('policy', 'fixed')}", "",
         f"Speedup per turn: min {_f(sp.get('min'))}x, p10 {_f(sp.get('p10'))}x, mean {_f(sp['mean'])}x. Share of "
         f"steps that verified a tree, per turn: mean {_f(sh['mean'])}, p10 {_f(sh.get('p10'))}, "
         f"p90 {_f(sh['p90'])}.",
         ""]
    if rep.get("calibration"):
        L += ["Predicted E[L_k] (policy) against the observed L_k of the tree-verifying steps:", "",
              "| predicted bin | steps | mean predicted | mean observed |", "|---|---|---|---|"]
        hi = lambda v: "inf" if v is None else f"{v:g}"    # report.json keeps the last bin's inf as null
        L += [f"| [{c['lo']:g}, {hi(c['hi'])}) | {c['steps']} | {_f(c['predicted'])} | {_f(c['observed'])} |"
              for c in rep["calibration"]]
        L.append("")
    st = rep.get("policy_state") or {}
    if st.get("costs"):
        c = st["costs"]
        L += ["Cost table measured at warm-up (ms; multiple of a decode):", "", "| call | ms | x decode |",
              "|---|---|---|",
              f"| decode (plain step) | {_f(c['decode_ms'], 1)} | 1.00 |"]
        L += [f"| verify step, m = {m} | {_f(v, 1)} | {_f(v / c['decode_ms'])} |"
              for m, v in c["verify_ms"].items()]
        L += [f"| drafter context pass | {_f(c['draft_ctx_ms'], 1)} | {_f(c['draft_ctx_ms'] / c['decode_ms'])} |",
              f"| drafter expansion step | {_f(c['draft_step_ms'], 1)} | "
              f"{_f(c['draft_step_ms'] / c['decode_ms'])} |",
              ""]
    bins = (st.get("calibration") or {}).get("bins", [])
    if bins:
        L += ["Acceptance calibration at the end of the run (draft nodes, by proposer, depth, the likeliest child of "
              "its parent or another, and drafter path probability):",
              "", "| source | depth | child | drafter prob | nodes | mean drafter prob | accepted | estimate |",
              "|---|---|---|---|---|---|---|---|"]
        L += [f"| {b.get('source', '')} | {b['depth']} | {b.get('child', '')} | [{b['prob_lo']:g}, {b['prob_hi']:g}) | "
              f"{b['nodes']:.0f} | {_f(b['drafter_prob'], 3)} | {_f(b['accepted'], 3)} | {_f(b['estimate'], 3)} |"
              for b in bins]
        L.append("")
    return L


# ----------------------------------------------------------------------------------------------- figures --
def _fig1_lengths(plt, f1):
    """Figure 1: histograms of prompt tokens and generated tokens per turn."""
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    ax[0].hist(f1["prompt_tokens"] or [0], bins=20, color="#4c72b0")
    ax[0].set(title="Figure 1a: input length", xlabel="prompt tokens", ylabel="turns")
    ax[1].hist(f1["new_tokens"] or [0], bins=20, color="#dd8452")
    ax[1].set(title="Figure 1b: output length", xlabel="generated tokens", ylabel="turns")
    return fig


def _fig2_speedup_vs_accept(plt, f2):
    """Figure 2: per-turn speedup against mean L_k, MT-Bench and HumanEval turns in two colours."""
    pts = f2["points"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for src, c in (("mtbench", "#4c72b0"), ("humaneval", "#55a868")):
        sel = [p for p in pts if p["source"] == src]
        ax.scatter([p["accept_len_mean"] for p in sel], [p["speedup"] for p in sel], s=14, c=c, label=src)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(title="Figure 2: speedup vs mean L_k per turn", xlabel="mean accepted length L_k", ylabel="speedup (x)")
    ax.legend(fontsize=8)
    return fig


def _fig3_accept_by_depth(plt, f3):
    """Figure 3: share of steps reaching tree depth d (bars) and the conditional rate (line)."""
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.bar(f3["depth"], [x if x == x else 0 for x in f3["reach"]], color="#4c72b0", label="reach depth d")
    ax.plot(f3["depth"], [x if x == x else 0 for x in f3["conditional"]], "o-", color="#c44e52",
            label="conditional")
    ax.set(title="Figure 3: acceptance by position", xlabel="tree depth d", ylabel="fraction of steps",
           ylim=(0, 1.05))
    ax.legend(fontsize=8)
    return fig


def _fig4_budget_panel(ax, a, sel):
    """One Figure 4 panel on ``ax``: tok/s along sweep axis ``a`` (fastest point starred, baseline dashed), mean
    L_k on a twin axis."""
    x = [r["value"] for r in sel]
    ax.plot(x, [r["tok_s"] for r in sel], "o-", color="#4c72b0", label="EAGLE-3 tok/s")
    ax.axhline(float(np.nanmean([r["baseline_tok_s"] for r in sel])), ls="--", color="gray",
               label="baseline tok/s")
    for r in sel:
        if r.get("fastest_in_axis"):
            ax.plot([r["value"]], [r["tok_s"]], "*", ms=14, color="#c44e52")
    if a == "M":
        ax.set_xscale("log", base=2)
    ax.set(title=f"Figure 4: sweep {a}", xlabel=a, ylabel="tok/s")
    t = ax.twinx()
    t.plot(x, [r["accept_len_mean"] for r in sel], "s:", color="#55a868", label="mean L_k (right)")
    t.set_ylabel("mean L_k")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = t.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="best")


def _fig4_budget_sweep(plt, rows):
    """Figure 4: one panel per swept axis (M, D_max, top_k); None without budget sweep rows."""
    if not rows:
        return None
    axes_ = [a for a in ("M", "D_max", "top_k") if any(r["axis"] == a for r in rows)]
    fig, ax = plt.subplots(1, len(axes_), figsize=(4 * len(axes_), 3.4), squeeze=False)
    for i, a in enumerate(axes_):
        _fig4_budget_panel(ax[0, i], a, [r for r in rows if r["axis"] == a])
    return fig


def _fig5_overheads(plt, ov):
    """Figure 5: ms per speculative turn by phase (horizontal bars labelled with their share)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    names = ov["phases"]
    ax.barh(names, [ov["ms_per_turn"][p] for p in names], color="#4c72b0")
    for i, p in enumerate(names):
        share = ov["share"][p]
        ax.text(ov["ms_per_turn"][p], i, f" {100 * share:.1f}%" if share == share else "", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(title="Figure 5: time per speculative turn by phase", xlabel="ms per turn")
    return fig


def _fig6_window(plt, rows):
    """Figure 6: tok/s and L_k against the drafter window W; None without window study rows."""
    if not rows:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = [str(r["value"] or "none") for r in rows]
    ax[0].bar(labels, [r["tok_s"] for r in rows], color=["#c44e52" if r["fastest"] else "#4c72b0" for r in rows])
    ax[0].axhline(rows[0]["baseline_tok_s"], color="gray", ls="--", lw=0.8, label="baseline")
    ax[0].set(title="Figure 6a: tok/s vs drafter window W", xlabel="W (context tokens)", ylabel="tok/s")
    ax[0].legend(fontsize=8)
    ax[1].plot(labels, [r["accept_len_mean"] for r in rows], "o-", label="mean L_k")
    ax[1].plot(labels, [r["accept_len_p90"] for r in rows], "s--", label="p90 L_k")
    ax[1].set(title="Figure 6b: L_k vs W", xlabel="W (context tokens)", ylabel="L_k")
    ax[1].legend(fontsize=8)
    return fig


def _fig7_attention(plt, f7):
    """Figure 7: fraction of sampled rows whose top-1 drafter attention falls in each distance bucket."""
    keys = ("0-31", "32-127", "128-255", "256+")
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.bar(keys, [f7[k] if f7[k] == f7[k] else 0 for k in keys], color="#8172b2")
    ax.set(title=f"Figure 7: drafter top-1 attention distance (n={f7['n']})", xlabel="distance (tokens)",
           ylabel="fraction of rows", ylim=(0, 1.05))
    return fig


def _fig8_policy_sweep(plt, rows):
    """Figure 8: per-turn speedup box plot of each policy / preset; None without policy sweep rows."""
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 3.6))
    data = [[x for x in r.get("speedups", []) if x == x] or [float("nan")] for r in rows]
    ax.boxplot(data, showmeans=True)
    ax.set_xticks(range(1, len(rows) + 1), [str(r["value"]).replace(" M=", "\nM=") for r in rows], fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(title="Figure 8: per-turn speedup by policy", ylabel="speedup (x)")
    return fig


def write_figures(rep: dict, outdir: str) -> list:
    """Write the PNGs of Figures 1-9 that have data; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, num):
        if fig is None:
            return
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, FIGURES[num]), dpi=110)
        plt.close(fig)
        written.append(FIGURES[num])

    F = rep["figures"]
    save(_fig1_lengths(plt, F["fig1_lengths"]), 1)
    save(_fig2_speedup_vs_accept(plt, F["fig2_speedup_vs_accept"]), 2)
    save(_fig3_accept_by_depth(plt, F["fig3_accept_by_depth"]), 3)
    save(_fig4_budget_sweep(plt, F["fig4_budget_sweep"]), 4)
    save(_fig5_overheads(plt, F["fig5_overheads"]), 5)
    save(_fig6_window(plt, F["fig6_window"]), 6)
    save(_fig8_policy_sweep(plt, F.get("fig8_policy_sweep") or []), 8)
    fig9 = draw_accepted_by_category(rep.get("by_category") or {}, outdir)
    if fig9:
        written.append(fig9)
    save(_fig7_attention(plt, F["fig7_attention"]), 7)
    return written


def draw_accepted_by_category(cats: dict, outdir: str) -> str | None:
    """Figure 9: per category (:func:`by_category`), the shares of accepted draft tokens proposed by the drafter,
    by suffix candidates and by both, stacked, with the category's mean speedup above its bar. Returns the file
    name written into ``outdir``, or None when no category accepted a draft token."""
    if not any(sum(c["accepted_from"][k] for k in ("drafter", "suffix", "both")) for c in cats.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cats)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(names) + 2), 3.8))
    bottom = np.zeros(len(names))
    for key, color in (("drafter", "#4c72b0"), ("suffix", "#dd8452"), ("both", "#55a868")):
        share = np.array([np.nan_to_num(cats[n]["accepted_from"][f"{key}_share"]) for n in names])
        ax.bar(names, share, bottom=bottom, color=color, label=key)
        bottom += share
    for i, n in enumerate(names):
        ax.text(i, 1.02, f"{cats[n]['speedup']['mean']:.2f}x", ha="center", fontsize=7)
    ax.set(title="Figure 9: accepted draft tokens by source (mean speedup above)", ylabel="share of accepted",
           ylim=(0, 1.12))
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    os.makedirs(outdir, exist_ok=True)
    fig.savefig(os.path.join(outdir, FIGURES[9]), dpi=110)
    plt.close(fig)
    return FIGURES[9]


def write_all(rep: dict, outdir: str) -> dict:
    """Write figures, then report.json and report.md into ``outdir``; returns the report (with figure names)."""
    rep.setdefault("run", {})["figure_files"] = write_figures(rep, outdir)
    write_json(rep, os.path.join(outdir, "report.json"))
    with open(os.path.join(outdir, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown(rep))
    return rep


__all__ = ["PAPER", "FIGURES", "build_report", "by_category", "draw_accepted_by_category", "markdown",
           "write_figures", "write_json", "write_all", "overheads"]
