"""float16 vs float32 greedy on the same prompts, and speculative float16 vs teacher-only float16 (one run).

For N prompts — ``--source eval``: the first user turn of the first N evaluation items (``evalsets.eval_turns``);
``--source chat``: N ShareGPT first turns from conversation 9000 on, evaluation prompts excluded (the batching
benchmark's ``bench.batching.chat_prompts``) — greedy ``--tokens`` new tokens, speculation policy ``--policy``
(fixed: a tree every step, the strictest losslessness check):
  1. teacher-only float32 (the reference),
  2. teacher-only float16 and EAGLE-3 float16 (same engine).
Prints and writes (``--out`` JSON): per prompt the first position where float16 departs from float32 (None = the
whole continuation identical), the share of positions with the same token, whether speculative float16 equals
teacher-only float16 token for token, and decode tok/s of each run (after one uncounted warm-up turn per engine).
Not a test: figures only. Usage:
    python -m mindspore_eagle.bench.micro.dtype_agreement --config configs/presets/cpu_2core.yaml --source chat \
        --prompts 24 --tokens 64 --out runs/dtype.json
"""
import argparse
import gc
import json
import os

import numpy as np


def run(cfg_path, dtype, prompts, tokens, speculative_too, policy="fixed"):
    from mindspore_eagle.config import load_config
    from mindspore_eagle.serving.pipeline import build_engine

    over = [f"model.dtype={dtype}", f"generation.max_new_tokens={tokens}", "generation.temperature=0",
            f"speculative.policy={policy}"]
    if not speculative_too:
        over.append("model.drafter=none")
    cfg = load_config(cfg_path, over)
    eng = build_engine(cfg)
    gen = cfg.generation
    eng.generate(prompts[0], gen, speculative=False)                     # warm-up: compile the graphs
    if speculative_too:
        eng.generate(prompts[0], gen, speculative=True)
    out = {"base": [], "base_tps": [], "spec": [], "spec_tps": [], "L_k": []}
    for p in prompts:
        g = eng.generate(p, gen, speculative=False)
        out["base"].append(list(g.token_ids))
        out["base_tps"].append(g.turn.tok_per_s)
        if speculative_too:
            s = eng.generate(p, gen, speculative=True)
            out["spec"].append(list(s.token_ids))
            out["spec_tps"].append(s.turn.tok_per_s)
            out["L_k"].append(float(np.mean(s.accept_lens)) if s.accept_lens else 0.0)
    if speculative_too:                 # where speculation departs: the float16 teacher's top-2 logit gap there
        from mindspore_eagle.bench.batching import _near_tie

        out["gap"] = []
        for p, b, s in zip(prompts, out["base"], out["spec"]):
            at = first_divergence(b, s)
            out["gap"].append(None if at is None else _near_tie(eng, p, b, at))
    del eng
    gc.collect()
    return out


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/presets/cpu_2core.yaml")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="")
    ap.add_argument("--fp32-from", default="", help="reuse the float32 runs of an earlier --out JSON")
    ap.add_argument("--source", choices=("eval", "chat"), default="eval")
    ap.add_argument("--policy", choices=("fixed", "adaptive"), default="fixed")
    ap.add_argument("--only", default="", help="comma-separated prompt indices to run (default: all N)")
    a = ap.parse_args()
    if a.source == "chat":
        from mindspore_eagle.bench.batching import chat_prompts

        prompts = chat_prompts(a.prompts)
    else:
        from mindspore_eagle.evalsets import eval_turns

        prompts = [item.turns[0] for item in eval_turns()][: a.prompts]
    index = [int(i) for i in a.only.split(",")] if a.only else list(range(len(prompts)))
    prompts = [prompts[i] for i in index]
    if a.fp32_from:
        with open(a.fp32_from) as f:
            r32 = json.load(f)["fp32"]                 # runs of all N prompts, in order
        r32 = {k: [v[i] for i in index] if v else v for k, v in r32.items()}
    else:
        r32 = run(a.config, "float32", prompts, a.tokens, False)
    r16 = run(a.config, "float16", prompts, a.tokens, True, a.policy)
    rows, same, total = [], 0, 0
    for i, (x, y, s) in enumerate(zip(r32["base"], r16["base"], r16["spec"])):
        eq = sum(int(u == v) for u, v in zip(x, y))
        same, total = same + eq, total + max(len(x), len(y))
        rows.append({"prompt": index[i], "first_divergence": first_divergence(x, y), "same_tokens": eq,
                     "len32": len(x), "len16": len(y), "spec16_equals_base16": s == y,
                     "spec16_first_divergence": first_divergence(y, s), "spec16_top2_gap": r16["gap"][i]})
    div = [r["first_divergence"] for r in rows]
    summary = {
        "prompts": len(rows), "tokens": a.tokens, "source": a.source, "policy": a.policy,
        "fp16_identical_to_fp32": sum(d is None for d in div),
        "same_token_share": same / max(total, 1),
        "first_divergence_positions": div,
        "spec16_identical_to_base16": sum(r["spec16_equals_base16"] for r in rows),
        "spec16_top2_gaps": [r["spec16_top2_gap"] for r in rows if r["spec16_top2_gap"] is not None],
        "tok_s_fp32_base": float(np.mean(r32["base_tps"])), "tok_s_fp16_base": float(np.mean(r16["base_tps"])),
        "tok_s_fp16_spec": float(np.mean(r16["spec_tps"])), "L_k_fp16": float(np.mean(r16["L_k"])),
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"summary": summary, "rows": rows, "fp32": r32, "fp16": r16}, f)


if __name__ == "__main__":
    main()
