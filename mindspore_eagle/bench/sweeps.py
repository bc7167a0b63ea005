"""Budget sweeps (paper Table 2, Figure 4) and drafter-only window truncation (paper Table 3, Figure 6).

Policy sweep: the config's budget under the fixed and the adaptive policy beside fixed presets (policy.py).

Budget sweep: M in ``budgets`` at the config's D_max and top_k; D_max in ``depths`` at the config's M and
top_k; top_k in ``top_ks`` at the config's M and D_max. Window study: the drafter attends only to the last W
context tokens (W in ``windows``; 0 = none = unlimited) at the config's M / D_max / top_k, teacher unchanged.

Every sweep point is a :class:`~mindspore_eagle.bench.throughput.Setting` timed on the same turns, right after
that turn's baseline (throughput.run_turn), so all points share one baseline per turn. A point whose parameters
equal the config's own setting reuses the "main" run instead of timing it twice. Reported per point: mean tok/s,
mean speedup (mean over turns of spec tok/s / baseline tok/s), aggregate speedup (total tokens / total seconds,
spec over baseline), mean and p90 L_k; the fastest point (highest mean tok/s) is marked.
"""
from __future__ import annotations

from mindspore_eagle.bench.throughput import Setting, stats

DEFAULT_BUDGETS = (8, 16, 32, 64, 128)
DEFAULT_DEPTHS = (2, 4, 6, 8)
DEFAULT_WINDOWS = (0, 128, 256, 512)
DEFAULT_FIXED = ((8, 2, 4), (8, 3, 4))        # configs/presets/cpu_2core.yaml, and issue 14's measuring budget


def main_setting(sp) -> Setting:
    """The config's own setting (name "main") from a SpeculativeConfig."""
    return Setting("main", sp.M, sp.D_max, sp.top_k, sp.window, sp.policy)


def policy_points(sp, fixed_presets=DEFAULT_FIXED) -> list:
    """[("policy", label, Setting)] for ``--sweep policy``: the config's M / D_max / top_k under the fixed and
    the adaptive policy, plus each fixed (M, D_max, top_k) of ``fixed_presets`` (the CPU preset by default)."""
    out = [("policy", f"{p} M={sp.M} D={sp.D_max} K={sp.top_k}",
            Setting(f"{p}", sp.M, sp.D_max, sp.top_k, sp.window, p)) for p in ("fixed", "adaptive")]
    for m, d, k in fixed_presets:
        out.append(("policy", f"fixed M={m} D={d} K={k}", Setting(f"fixed-M{m}-D{d}-K{k}", m, d, k, sp.window,
                                                                   "fixed")))
    return [p for p in out if p[2].top_k <= p[2].M]


def budget_points(sp, budgets=DEFAULT_BUDGETS, depths=DEFAULT_DEPTHS, top_ks=()) -> list:
    """[(axis, value, Setting)] for the budget sweep; each non-empty axis also gets the config's own value (run
    once, as "main"), values sorted; points with top_k > M are dropped (invalid trees)."""
    out = []
    axes = (("M", budgets, sp.M), ("D_max", depths, sp.D_max), ("top_k", top_ks, sp.top_k))
    for axis, values, own in axes:
        if not values:
            continue
        for v in sorted(set(values) | {own}):
            m, d, k = (v if axis == "M" else sp.M), (v if axis == "D_max" else sp.D_max), (v if axis == "top_k" else sp.top_k)
            name = {"M": f"M={v}", "D_max": f"D={v}", "top_k": f"K={v}"}[axis]
            out.append((axis, v, Setting(name, m, d, k, sp.window, sp.policy)))
    return [p for p in out if p[2].top_k <= p[2].M]


def window_points(sp, windows=DEFAULT_WINDOWS) -> list:
    """[("window", W, Setting)] for the drafter-only truncation study (W = 0 means no truncation; always
    included, first; the others ascending)."""
    ws = [0] + sorted(set(windows) - {0})
    return [("window", w, Setting(f"W={w or 'none'}", sp.M, sp.D_max, sp.top_k, w, sp.policy)) for w in ws]


def dedupe(main: Setting, points: list) -> tuple[list, list]:
    """Settings to run (main first, one per distinct parameter tuple) and the points relabelled to the setting
    name that actually holds their parameters. Returns (settings, [(axis, value, run_name)])."""
    by_params = {main.params: main}
    settings = [main]
    rows = []
    for axis, value, s in points:
        if s.params not in by_params:
            by_params[s.params] = s
            settings.append(s)
        rows.append((axis, value, by_params[s.params].name))
    return settings, rows


def summarize_points(records, rows, settings) -> list:
    """One summary dict per sweep point over the records that ran it (skipped turns excluded).

    Returns [{"axis", "value", "setting", "M", "D_max", "top_k", "window", "policy", "turns", "tok_s" (mean spec
    tok/s),
    "baseline_tok_s" (mean), "speedup" (mean per-turn), "speedup_agg", "accept_len_mean", "accept_len_p90",
    "identical" (all outputs equal the baseline), "fastest" (bool, highest tok_s among points of the same study),
    "fastest_in_axis" (highest tok_s along its own axis)}].
    """
    by_name = {s.name: s for s in settings}
    out = []
    for axis, value, name in rows:
        s = by_name[name]
        rs = [(r["baseline"], r["settings"][name]) for r in records
              if "baseline" in r and name in r.get("settings", {}) and "tok_s" in r["settings"][name]]
        lens = [x for _, sr in rs for x in sr["accept_lens"]]
        tok = [sr["tok_s"] for _, sr in rs]
        base_time = sum((b["prefill_ms"] + b["decode_ms"]) for b, _ in rs)
        spec_time = sum((sr["prefill_ms"] + sr["decode_ms"]) for _, sr in rs)
        base_new = sum(b["new_tokens"] for b, _ in rs)
        spec_new = sum(sr["new_tokens"] for _, sr in rs)
        agg = (spec_new / spec_time) / (base_new / base_time) if rs and spec_time and base_time and base_new else \
            float("nan")
        ls = stats(lens)
        out.append({"axis": axis, "value": value, "setting": name, "M": s.M, "D_max": s.D_max, "top_k": s.top_k,
                    "window": s.window, "policy": s.policy, "turns": len(rs), "tok_s": stats(tok)["mean"],
                    "baseline_tok_s": stats([b["tok_s"] for b, _ in rs])["mean"],
                    "speedup": stats([sr["speedup"] for _, sr in rs])["mean"], "speedup_agg": agg,
                    "speedups": [sr["speedup"] for _, sr in rs],
                    "accept_len_mean": ls["mean"], "accept_len_p90": ls["p90"],
                    "identical": all(sr["identical"] for _, sr in rs), "fastest": False, "fastest_in_axis": False})
    finite = [p for p in out if p["tok_s"] == p["tok_s"]]
    if finite:
        best = max(p["tok_s"] for p in finite)
        for p in finite:
            p["fastest"] = p["tok_s"] == best
    for axis in {p["axis"] for p in finite}:
        best = max(p["tok_s"] for p in finite if p["axis"] == axis)
        for p in finite:
            if p["axis"] == axis:
                p["fastest_in_axis"] = p["tok_s"] == best
    return out


def parse_int_list(text: str, allow_none: bool = False) -> tuple:
    """"8,16,32" -> (8, 16, 32); with allow_none, "none" / "0" -> 0 (no window). Raises ValueError naming it."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        if allow_none and part in ("none", "all", "inf"):
            out.append(0)
            continue
        try:
            v = int(part)
        except ValueError:
            raise ValueError(f"expected a comma-separated list of integers, got {part!r} in {text!r}") from None
        if v < (0 if allow_none else 1):
            raise ValueError(f"value {v} out of range in {text!r}")
        out.append(v)
    if not out:
        raise ValueError(f"empty list {text!r}")
    return tuple(out)


__all__ = ["DEFAULT_BUDGETS", "DEFAULT_DEPTHS", "DEFAULT_WINDOWS", "main_setting", "budget_points", "policy_points",
           "window_points", "dedupe", "summarize_points", "parse_int_list"]
