"""Where the slow turns of a benchmark run lose: per speedup group, the cost of a token and of each kind of step.

Reads a bench run's ``turns.jsonl`` (``python -m mindspore_eagle bench ... --out RUN``; one line per turn with the
teacher-only baseline and the speculative setting's trace summary, bench/throughput.py) and prints, for the turns
sorted by speedup and cut into groups (slowest tenth first), a markdown table: mean speedup, ms per token of the
baseline and of speculation, tree steps and their mean accepted length L_k per budget m, verify ms per tree step,
draft ms per step, plain steps (and how many of them ran the drafter first), and the share of the speculative
time spent drafting for steps that then decoded plainly (draft ms per step x drafted plain steps: the drafter's
cost is not traced per step, so this uses the turn's mean).

    python scripts/slow_turns.py RUN [--setting main] [--groups 10]
"""
from __future__ import annotations

import argparse
import collections
import os

import numpy as np

from mindspore_eagle.bench.throughput import read_records


def load_turns(run: str, setting: str) -> list:
    """The turns of ``run``/turns.jsonl that have ``setting``, as (baseline dict, setting dict) pairs.

    A missing file gives no turns (``main`` then exits with "error: no turn ..."); a torn last line of an
    interrupted run is skipped (``read_records``).
    """
    rows = read_records(os.path.join(run, "turns.jsonl")).values()
    return [(r["baseline"], r["settings"][setting]) for r in rows if setting in r.get("settings", {})]


def group_stats(turns: list) -> dict:
    """Means over a group of (baseline, setting) pairs (module docstring for the fields)."""
    budgets, lens = collections.Counter(), collections.defaultdict(list)
    for _, s in turns:
        for m, a in zip(s["budgets"], s["accept_lens"]):
            budgets[m] += 1
            lens[m].append(a)
    ph = {k: float(np.sum([s["phases"][k] for _, s in turns])) for k in ("draft_ms", "verify_ms", "total_ms",
                                                                           "n_steps")}
    tree_steps = sum(budgets.values())
    draft_per_step = ph["draft_ms"] / max(ph["n_steps"], 1)
    drafted_plain = float(np.sum([s["drafted_plain_steps"] for _, s in turns]))
    return {
        "turns": len(turns),
        "speedup": float(np.mean([s["speedup"] for _, s in turns])),
        "base_ms_tok": float(np.mean([b["decode_ms"] / max(b["new_tokens"] - 1, 1) for b, _ in turns])),
        "spec_ms_tok": float(np.mean([s["phases"]["total_ms"] / max(s["new_tokens"], 1) for _, s in turns])),
        "budgets": {m: (budgets[m] / max(tree_steps, 1), float(np.mean(lens[m]))) for m in sorted(budgets)},
        "verify_ms_tree_step": ph["verify_ms"] / max(tree_steps, 1),
        "draft_ms_step": draft_per_step,
        "plain_steps": float(np.mean([s["plain_steps"] for _, s in turns])),
        "drafted_plain_steps": drafted_plain / len(turns),
        "wasted_draft_share": draft_per_step * drafted_plain / max(ph["total_ms"], 1e-9),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--setting", default="main")
    ap.add_argument("--groups", type=int, default=10)
    a = ap.parse_args(argv)
    turns = sorted(load_turns(a.run, a.setting), key=lambda t: t[1]["speedup"])
    if not turns:
        raise SystemExit(f"error: no turn of {a.run}/turns.jsonl has setting {a.setting!r}")
    print("| speedup group | turns | speedup | ms/token baseline / speculative | tree steps by m: share, L_k | "
          "verify ms / tree step | draft ms / step | plain steps (drafted) | drafting before plain steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g, part in enumerate(np.array_split(np.arange(len(turns)), a.groups)):
        st = group_stats([turns[i] for i in part])
        by_m = ", ".join(f"{m}: {sh:.2f}, {L:.2f}" for m, (sh, L) in st["budgets"].items())
        print(f"| {g + 1} of {a.groups} | {st['turns']} | {st['speedup']:.3f}x | {st['base_ms_tok']:.1f} / "
              f"{st['spec_ms_tok']:.1f} | {by_m} | {st['verify_ms_tree_step']:.1f} | {st['draft_ms_step']:.1f} | "
              f"{st['plain_steps']:.1f} ({st['drafted_plain_steps']:.1f}) | {100 * st['wasted_draft_share']:.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
