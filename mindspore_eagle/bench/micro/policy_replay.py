"""Replay data for the speculation policy: the drafter's full candidate tree at EVERY position of teacher-only
greedy replies, with each candidate's acceptance label, so any per-step policy can be simulated offline.

For each prompt: greedy teacher-only reply y (the oracle); at each position p the drafter's candidates rooted at
y[p] (all K + (D-1) K^2 candidates of the EAGLE-2 expansion, cumulative log-prob scores, depth) and whether each
candidate's path equals the teacher's next tokens y[p+1 ..] (greedy acceptance needs nothing else); plus the
teacher's top-1 probability of y[p]. Prompts are ShareGPT first user turns from index --offset on (past the drafter's
training data; no evaluation prompt).

    python -m mindspore_eagle.bench.micro.policy_replay --prompts 24 --out runs/replay.npz            # collect
    python -m mindspore_eagle.bench.micro.policy_replay --simulate runs/replay.npz [--costs costs.json]  # replay policies on it

The simulation drives the real policy objects (mindspore_eagle.core.policy) step by step over the recorded positions:
a step at position p with budget m accepts the recorded labels of the best m - 1 candidates drafted so far, then
moves to p + L. It prints tokens per modelled ms against plain decoding for fixed budgets and the adaptive policy.
Not a test: the data behind docs/design.md, "Measurements behind the design: What the drafter's confidence is
worth" and "... The adaptive policy against fixed budgets".
"""
import argparse
import os
import time

import numpy as np


def rebuild(score, depth, K, M):
    """Candidates of one position -> (scores [C], parents [C] global ids, depth [C]) as drafting.build_tree made
    them: depth-1 block of K, then per depth a block of K*K children of the previous depth's best K (score desc,
    ties by id)."""
    C = int((depth > 0).sum())
    sc, dp = score[:C], depth[:C].astype(np.int64)
    parents = np.zeros(C, np.int64)
    start = 0
    prev = None
    for d in range(1, dp.max() + 1):
        idx = np.flatnonzero(dp == d)
        if d > 1:
            parents[idx] = np.repeat(prev, K)[: idx.size] + 1
        order = np.lexsort((idx, -sc[idx]))[:K]
        prev = idx[order]
        start += idx.size
    return sc, parents, dp


def simulate(path, costs_path, M, D, K):
    import json

    from mindspore_eagle.core.costs import CostTable, compiled_budgets
    from mindspore_eagle.core.policy import AdaptivePolicy

    z = np.load(path)
    if costs_path:
        costs = CostTable(**json.load(open(costs_path)))
    else:   # docs/design.md, "Measurements behind the design: Cost curve by row count"; m = 2 interpolated
        costs = CostTable(decode_ms=55.0, verify_ms={2: 66.0, 4: 76.4, 8: 83.5, 16: 97.8}, draft_ctx_ms=7.8,
                          draft_step_ms=8.8, host_ms=2.0)
    turns = z["turn"]
    print(costs.describe())
    for m, d in [(2, 1), (4, 1), (4, 2), (8, 2), (8, 3), (16, 2), (16, 3), (16, 5)]:
        if m <= M and d <= D:
            _replay(lambda m=m, d=d: _FixedSim(m, d), f"fixed M={m} D={d}", z, turns, costs, M, D, K)
    pol = _replay(lambda: AdaptivePolicy(costs, compiled_budgets(M)), f"adaptive M<={M} D<={D}", z, turns, costs,
                  M, D, K)
    print(json.dumps(pol.report()["child_rate"]))
    for row in pol.report()["calibration"]["bins"]:
        print(row)


def _replay(make, label, z, turns, costs, M, D, K):
    """Run one policy (``make()``) over the recorded positions; print its modelled speedup."""
    from mindspore_eagle.core.calibration import top_nodes
    from mindspore_eagle.runners.drafter import select_tree

    pol = make()
    tok = ms = 0.0
    spec_steps = steps = 0
    lens = []
    for t in np.unique(turns):
        rows = np.flatnonzero(turns == t)
        n = rows.size
        p = 0
        while p < n:
            r = rows[p]
            sc, par, dp = rebuild(z["score"][r], z["depth"][r], K, M)
            lab = z["label"][r][: sc.size]
            left, max_m = n - p, 1024
            cost = 0.0
            choice_m, tree, L = 1, None, 1
            if pol.want_draft(max_m):
                cost += costs.draft_ctx_ms
                d = 1
                while True:
                    keep = dp <= d
                    tree = select_tree(0, np.where(keep, sc, -1e30), np.arange(sc.size) + 1, par, M)
                    tree = top_nodes(tree, M) if len(tree) > M else tree
                    real = tree.scores > -1e29
                    if d >= D:
                        break
                    front = np.sort(sc[dp == d])[::-1][:K]
                    if not pol.want_expand(_strip(tree, real), front, d, max_m, left):
                        break
                    cost += costs.draft_step_ms
                    d += 1
                tree = _strip(tree, real)
                ch = pol.choose(tree, max_m, left)
                pol.after_draft(ch)
                choice_m = ch.m
            if choice_m == 1:
                cost += costs.decode_ms
                path_ = [0]
                L = 1
                verified = None
            else:
                verified = top_nodes(tree, choice_m)
                ids = verified.tokens[1:] - 1
                acc = [0] + [i + 1 for i, c in enumerate(ids) if lab[c]]
                path_ = acc
                L = len(acc)
                cost += costs.step_ms(choice_m)
                lens.append(L)
                spec_steps += 1
            L = min(L, n - p)
            pol.observe(verified, path_, L, cost)
            tok += L
            ms += cost
            steps += 1
            p += L
    rate = tok / ms
    base = 1.0 / costs.decode_ms
    print(f"{label:<28} speedup {rate / base:5.3f}x  L_k {np.mean(lens) if lens else 1:.2f}  "
          f"spec share {spec_steps / steps:.2f}")
    return pol


def _strip(tree, real):
    from mindspore_eagle.core.tree import DraftTree
    if real.all():
        return tree
    keep = np.flatnonzero(real)
    new = np.full(len(tree), -1)
    new[keep] = np.arange(keep.size)
    return DraftTree(tree.tokens[keep], np.maximum(new[tree.parents[keep]], 0), tree.scores[keep])


class _FixedSim:
    """FixedPolicy with a depth cap (expansions stop at depth d) for the simulation."""

    def __init__(self, m, d):
        from mindspore_eagle.core.policy import FixedPolicy
        self.p, self.d = FixedPolicy(m, d), d
        self.costs = None

    def want_draft(self, max_m):
        return True

    def want_expand(self, tree, f, depth, max_m, left):
        return depth < self.d

    def choose(self, tree, max_m, left):
        return self.p.choose(tree, max_m, left)

    def after_draft(self, *a):
        pass

    def observe(self, *a):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulate", default="")
    ap.add_argument("--costs", default="")
    ap.add_argument("--M", type=int, default=16)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--offset", type=int, default=6000)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--out", default="runs/replay.npz")
    a = ap.parse_args()
    if a.simulate:
        return simulate(a.simulate, a.costs, a.M, a.depth, 4)

    from mindspore_eagle.config import load_config
    from mindspore_eagle.evalsets import sharegpt_conversations
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = load_config(a.config, [f"speculative.D_max={a.depth}", "speculative.top_k=4"])
    eng = build_engine(cfg)
    tg, dr = eng.teacher, eng.drafter
    K, D = dr.K, a.depth
    C = K + (D - 1) * K * K
    convs = sharegpt_conversations(a.offset + 4 * a.prompts)[a.offset:]
    prompts = []
    for c in convs:
        ids = eng.encode_chat([c[0]])
        if 8 <= len(ids) <= 384:
            prompts.append(ids)
        if len(prompts) == a.prompts:
            break
    rows = {k: [] for k in ("turn", "pos", "t_conf", "score", "depth", "label")}
    t0 = time.time()
    for ti, ids in enumerate(prompts):
        sid, dsid = tg.new_seq(), dr.new_seq()
        try:
            logits, aux = tg.prefill(sid, ids)
            ys, confs, auxs = [], [], []
            for _ in range(a.max_new):
                p = np.exp(logits - logits.max())
                y = int(np.argmax(logits))
                ys.append(y)
                confs.append(float(p.max() / p.sum()))
                if y in eng.eos:
                    break
                logits, ax = tg.decode(sid, y)
                auxs.append(ax)
            ctx_aux, ctx_next = aux, np.asarray(ids[1:] + [ys[0]], np.int64)
            for p, root in enumerate(ys):
                first = dr.extend(dsid, ctx_aux, ctx_next)
                tree = dr.build_tree(dsid, root, first, C + 1, D)
                n = len(tree)
                depth = np.zeros(n, np.int64)
                for i in range(1, n):
                    depth[i] = depth[tree.parents[i]] + 1
                ok = np.zeros(n, bool)
                ok[0] = True
                for i in range(1, n):
                    q = p + depth[i]
                    ok[i] = ok[tree.parents[i]] and q < len(ys) and tree.tokens[i] == ys[q]
                sc = np.full(C, -1e9, np.float32)
                dp = np.zeros(C, np.int8)
                lb = np.zeros(C, bool)
                sc[:n - 1], dp[:n - 1], lb[:n - 1] = tree.scores[1:], depth[1:], ok[1:]
                rows["turn"].append(ti)
                rows["pos"].append(p)
                rows["t_conf"].append(confs[p])
                rows["score"].append(sc)
                rows["depth"].append(dp)
                rows["label"].append(lb)
                if p + 1 < len(ys):
                    ctx_aux, ctx_next = auxs[p], np.asarray([ys[p + 1]], np.int64)
        finally:
            tg.free(sid)
            dr.free(dsid)
        print(f"turn {ti}: {len(ys)} tokens, {time.time() - t0:.0f} s", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    np.savez_compressed(a.out, **{k: np.asarray(v) for k, v in rows.items()})
    print("wrote", a.out)


if __name__ == "__main__":
    main()
