"""Wall time of the drafter's calls, hot and right after a teacher decode (cold caches, as in the decode loop).

    python -m mindspore_eagle.bench.micro.drafter_calls [--config configs/default.yaml] [--repeat 25]

Prints the median ms of: the context pass over n = 1, 2, 4 new pairs (``DrafterRunner.extend``, what a step adds
after L_k accepted tokens), the tree expansion for D_max = 2, 3 (``build_tree``), and a teacher decode; each
drafter call once back to back (weights hot in the CPU caches) and once right after a teacher decode, which is how
the engine calls it (the teacher's weights have just evicted the drafter's). The figures in docs/design.md,
"Measurements behind the design: The drafter's context pass" and docs/cpu_kernels.md, "Host calls" came from this
script run against the code before and after a change: run each worktree's own copy
(``cd <worktree> && python -m mindspore_eagle.bench.micro.drafter_calls``: ``-m`` imports the package of the current
folder first; PYTHONPATH does not override that). Nothing is written to disk; the timed context passes extend the scratch sequence (by 7 pairs a
repeat), the tree expansions' writes are rolled back.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--repeat", type=int, default=25)
    args = p.parse_args()
    from mindspore_eagle.config import load_config
    from mindspore_eagle.serving.pipeline import build_engine

    eng = build_engine(load_config(args.config))
    dr, tg = eng.drafter, eng.teacher
    if dr is None:
        raise SystemExit("model.drafter is 'none': nothing to time")
    ids = (np.arange(300) % 1000 + 100).tolist()
    sid, dsid = tg.new_seq(), dr.new_seq()
    _, aux = tg.prefill(sid, ids)
    first = dr.extend(dsid, aux, np.asarray(ids[1:] + [ids[0]], np.int64))

    def extend(n):
        dr.bm.branch(dsid, 16)
        t0 = time.perf_counter()
        dr.extend(dsid, aux[-n:], np.full(n, 7, np.int64))
        dt = time.perf_counter() - t0
        dr.bm.rollback(dsid)
        return dt

    def tree(d):
        t0 = time.perf_counter()
        dr.build_tree(dsid, 5, first, eng.spec.M, d)
        return time.perf_counter() - t0

    def decode():
        t0 = time.perf_counter()
        tg.decode(sid, 5)
        return time.perf_counter() - t0

    calls = [(f"context pass, {n} pair{'s' if n > 1 else ''}", lambda n=n: extend(n)) for n in (1, 2, 4)]
    calls += [(f"tree expansion, D_max {d}", lambda d=d: tree(d)) for d in (2, 3)]
    for name, fn in calls:
        for _ in range(3):
            fn()
        hot = [fn() for _ in range(args.repeat)]
        cold = []
        for _ in range(args.repeat):
            decode()
            cold.append(fn())
        print(f"{name:26s} hot {np.median(hot) * 1e3:6.2f} ms   after a decode {np.median(cold) * 1e3:6.2f} ms",
              flush=True)
    print(f"{'teacher decode':26s}     {np.median([decode() for _ in range(args.repeat)]) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
