"""The drafter's learning curve: held-out coverage and implied L_k against training tokens, over chained runs.

Each run directory is a trainer ``--out`` (its ``eval_log.jsonl``: one line per checkpoint and one at step 0,
with ``tokens_seen``; train/trainer.py). Runs given in order are chained: a later run that starts ``--init-from``
an earlier one's export continues its x axis (its tokens are added to the earlier run's last ``tokens_seen``).
Prints a markdown table and, with ``--png``, draws the implied L_k (D = 3: chain, top-2 and top-4 trees; the
formula and its assumptions are in train/coverage.py) against training tokens; ``--measured TOKENS:L_K`` adds
benchmark points (real mean accepted length on evaluation turns) to the figure.

    python scripts/lk_curve.py RUN_DIR [RUN_DIR ...] [--png docs/reports/fig_lk_curve.png] [--measured 0:1.72 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def load_curve(run_dirs: list, start_tokens: int = 0) -> list:
    """Rows {"run", "step", "tokens", "acc", "k4", "L_k1", "L_k2", "L_k4"} over the chained runs; ``tokens``
    counts from ``start_tokens`` (what the first run's initial weights were trained on).

    Raises:
        FileNotFoundError: a run directory without eval_log.jsonl.
    """
    rows, offset = [], start_tokens
    for run in run_dirs:
        path = os.path.join(run, "eval_log.jsonl")
        with open(path) as f:
            evals = [json.loads(ln) for ln in f if ln.strip()]
        last = 0
        for e in evals:
            tok = e.get("tokens_seen")
            if tok is None:                       # logs older than tokens_seen: no x value, skipped
                continue
            if rows and e["step"] == 0:           # a chained run's origin repeats the previous run's end
                continue
            L = e["L_implied"]["D3"] if "D3" in e["L_implied"] else e["L_implied"][max(e["L_implied"])]
            rows.append({"run": "/".join(os.path.normpath(run).split(os.sep)[-2:]),
                         "step": e["step"], "tokens": offset + tok, "acc": e["acc"], "k4": e["cov"]["k4"],
                         "L_k1": L["k1"], "L_k2": L["k2"], "L_k4": L["k4"]})
            last = tok
        offset += last
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="trainer --out directories, in training order")
    p.add_argument("--png", default=None, help="write the figure here")
    p.add_argument("--start-tokens", type=int, default=0,
                   help="training tokens behind the first run's initial weights (x offset; default 0)")
    p.add_argument("--measured", nargs="*", default=[], metavar="TOKENS:L_K",
                   help="benchmark L_k points to draw (training tokens : mean accepted length)")
    a = p.parse_args(argv)
    try:
        rows = load_curve(a.runs, a.start_tokens)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| run | step | training tokens | top-1 acc (d1 / d2 / d3) | top-4 coverage (d1 / d2 / d3) | "
          "implied L_k, D 3: chain / top-2 / top-4 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f = lambda v: " / ".join(f"{x:.3f}" for x in v[:3])  # noqa: E731
        print(f"| {r['run']} | {r['step']} | {r['tokens']:,} | {f(r['acc'])} | {f(r['k4'])} | "
              f"{r['L_k1']:.3f} / {r['L_k2']:.3f} / {r['L_k4']:.3f} |")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        x = [r["tokens"] / 1e6 for r in rows]
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for key, label in (("L_k4", "implied, top-4 tree"), ("L_k2", "implied, top-2 tree"),
                           ("L_k1", "implied, chain")):
            ax.plot(x, [r[key] for r in rows], marker="o", ms=3, label=label)
        if a.measured:
            pts = [tuple(float(v) for v in m.split(":")) for m in a.measured]
            ax.plot([t / 1e6 for t, _ in pts], [v for _, v in pts], "k*", ms=10,
                    label="measured L_k (M 8, D_max 3, top_k 4)")
        ax.axhline(2.5, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("mean accepted length L_k (D = 3)")
        ax.set_title("Drafter held-out L_k against training tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
