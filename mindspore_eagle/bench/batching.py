"""``bench --batch-sizes 1,4,16``: total tokens per second of a set of chat prompts against the batch size.

Legend: N = sequences per teacher forward (``batch.max_batch``), P = prompts, T = new tokens per prompt.

One run, one process, one engine, the same P prompts (ShareGPT first user turns from ``--batch-offset`` on,
evaluation prompts excluded), greedy, T new tokens each:
    N = 1, teacher-only      every prompt alone through ``Engine.generate`` (what ``batch`` does at max_batch 1);
                             its tokens are the reference every other row is compared with
    N = 1, speculative       the same with the config's speculative setting and policy (when a drafter is configured)
    N > 1, teacher-only      ``scheduler.BatchScheduler`` with N rows (continuous batching)
    N > 1, speculative       the same with a tree of the fixed budget (speculative.M, D_max) per sequence, all
                             verified in one forward (``batch.speculative: true``)
Total tok/s = all new tokens / wall seconds of the row (prefill included); seconds spent compiling graphs on first
use are measured (``TeacherRunner.compile_ms``) and taken out, and reported. A text that differs from the N = 1
reference is listed with the first differing token and, from a teacher-only replay of the reference prefix, the
top-2 logit gap there (a float near-tie flipped by the batch shape, or a bug when the gap is large).
Writes ``batching.json`` and ``batching.md`` (+ ``fig_batching.png``) into ``--out``.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np


def chat_prompts(n: int, offset: int = 9000, max_chars: int = 600) -> list[str]:
    """``n`` first user turns of ShareGPT conversations from index ``offset`` on (file order), skipping empty ones,
    ones over ``max_chars`` characters and any that matches an MT-Bench / HumanEval prompt (train/data.py rule).

    Raises:
        ValueError: fewer than ``n`` such prompts after ``offset``.
    """
    from mindspore_eagle.evalsets import sharegpt_conversations
    from mindspore_eagle.train.data import eval_prompt_keys, is_eval_prompt

    keys = eval_prompt_keys()
    out = []
    for conv in sharegpt_conversations()[offset:]:
        text = next((m["content"] for m in conv if m["role"] == "user"), "").strip()
        if text and len(text) <= max_chars and not is_eval_prompt(text, keys):
            out.append(text)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} ShareGPT prompts after --batch-offset {offset}; need {n}")


def _timed(engine, fn) -> tuple[object, float, float]:
    """(fn(), wall s, compile s) with the engine's compile time during the call."""
    c0 = engine.compile_ms
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, (engine.compile_ms - c0) / 1e3


def _near_tie(engine, prompt: str, ref_ids: list, at: int) -> float:
    """Top-2 logit gap of the teacher alone at reference position ``at`` (prefix = prompt + ref_ids[:at])."""
    ids = engine.encode_chat(prompt) + list(ref_ids[:at])
    sid = engine.teacher.new_seq()
    try:
        logits, _ = engine.teacher.prefill(sid, ids)
    finally:
        engine.teacher.free(sid)
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def run_batch_sizes(engine, prompts: list, sizes: list, gen, log, speculative: bool = True) -> dict:
    """Time every batch size of ``sizes`` over ``prompts`` (module docstring); returns the result dict.

    Args:
        engine: an Engine whose pool (and drafter cache) holds max(sizes) sequences of prompt + T (+ M) tokens.
        gen: GenerationConfig (greedy). log: callable(str).
        speculative: also time speculative decoding at every N (needs a drafter): at N = 1 the engine's own
            policy (``Engine.generate``), at N > 1 trees of the fixed budget speculative.M / D_max verified
            together (``serving.round.DecodeRound`` with N rows).
    """
    from mindspore_eagle.serving.batch_job import parse_record, run_records
    from mindspore_eagle.serving.scheduler import BatchScheduler

    speculative = speculative and engine.speculates
    if speculative:
        engine.policy           # the adaptive policy measures its cost table now, not inside a timed row
    recs = [parse_record(i + 1, i, json.dumps({"id": i, "prompt": p})) for i, p in enumerate(prompts)]
    rows, ref, texts = [], None, {}
    for n in sizes:
        for kind in ("teacher-only", "speculative") if speculative else ("teacher-only",):
            spec = kind == "speculative"
            lens = []
            if n == 1:
                gens, wall, comp = _timed(engine, lambda: [engine.generate(p, gen, speculative=spec)
                                                           for p in prompts])
                ids, got = [g.token_ids for g in gens], [g.text for g in gens]
                lens = [s.accept_len for g in gens for s in g.steps if s.budget != 1]
            else:
                sched, res, all_ids = BatchScheduler(engine, gen, n, speculative=spec), {}, {}
                _, wall, comp = _timed(engine, lambda: run_records(sched, recs, lambda r: res.__setitem__(r["id"], r),
                                                                   all_ids))
                got = [res[i].get("text", "") for i in range(len(prompts))]
                ids = [all_ids.get(i, [[]])[0] for i in range(len(prompts))]
                lens = [res[i]["mean_accept_len"] for i in range(len(prompts)) if spec]
            new = sum(len(g) for g in ids)
            row = {"max_batch": n, "kind": kind, "prompts": len(prompts), "new_tokens": new,
                   "wall_s": round(wall, 2), "compile_s": round(comp, 2),
                   "tok_s": round(new / max(wall - comp, 1e-9), 2),
                   "mean_accept_len": round(float(np.mean(lens)), 3) if lens else None}
            if ref is None:
                ref = {"texts": got, "ids": ids}
            diffs = [i for i in range(len(prompts)) if ids[i] != ref["ids"][i] or got[i] != ref["texts"][i]]
            row["identical"] = len(prompts) - len(diffs)
            row["mismatches"] = []
            for i in diffs:
                r_ids, t_ids = ref["ids"][i], ids[i]
                at = next((j for j, (a, b) in enumerate(zip(r_ids, t_ids)) if a != b), min(len(r_ids), len(t_ids)))
                row["mismatches"].append({"prompt": i, "first_diff_token": at,
                                          "top2_gap": round(_near_tie(engine, prompts[i], r_ids, at), 5)})
            rows.append(row)
            texts[f"{kind}@{n}"] = got
            log(f"max_batch {n:>3} {kind:<13} {row['tok_s']:7.2f} tok/s  ({new} tokens, {wall:.1f} s, "
                f"compile {comp:.1f} s, L_k {row['mean_accept_len']}, identical {row['identical']}/{len(prompts)})")
    base = rows[0]["tok_s"]
    for r in rows:
        r["x_vs_batch1"] = round(r["tok_s"] / base, 3)
    return {"rows": rows, "texts": texts}


def write_report(result: dict, meta: dict, out: str) -> None:
    """batching.json (rows, meta, texts), batching.md (table) and fig_batching.png (tok/s against N)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "batching.json"), "w", encoding="utf-8") as f:
        json.dump({**meta, **result}, f, indent=1)
    lines = [f"# Throughput against batch size ({meta.get('name', '')})", "",
             f"- Command: `{meta.get('command', '')}`", f"- Machine: {meta.get('machine', '')}",
             f"- {meta.get('prompts')} prompts x {meta.get('max_new_tokens')} new tokens, greedy; "
             f"compile seconds taken out of tok/s", "",
             "| max_batch | decoding | tok/s | x batch 1 teacher-only | L_k | new tokens | wall s | compile s | "
             "identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['max_batch']} | {r['kind']} | {r['tok_s']:.2f} | {r['x_vs_batch1']:.2f}x | "
                     f"{r['mean_accept_len'] or '-'} | {r['new_tokens']} | {r['wall_s']:.1f} | "
                     f"{r['compile_s']:.1f} | {r['identical']} / {r['prompts']} |")
    mism = [(r["max_batch"], r["kind"], m) for r in result["rows"] for m in r.get("mismatches", [])]
    if mism:
        lines += ["", "Texts that differ from one-at-a-time greedy (first differing token, top-2 logit gap there):"]
        lines += [f"- max_batch {n} {k}: prompt {m['prompt']}, token {m['first_diff_token']}, gap {m['top2_gap']}"
                  for n, k, m in mism]
    with open(os.path.join(out, "batching.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for kind, marker in (("teacher-only", "o"), ("speculative", "s")):
            pts = [(r["max_batch"], r["tok_s"]) for r in result["rows"] if r["kind"] == kind]
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=kind)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_batch (sequences per forward)")
        ax.set_ylabel("total tok/s")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "fig_batching.png"), dpi=120)
        plt.close(fig)
    except ImportError:   # pragma: no cover - matplotlib is a dependency of bench
        pass


__all__ = ["chat_prompts", "run_batch_sizes", "write_report"]
