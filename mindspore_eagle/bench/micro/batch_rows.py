"""Cost of one batched teacher forward by its row count: ``decode_batch`` of n sequences and ``verify_batch`` of n
chains of m tokens each (n x m rows), after a context of ``--context`` tokens per sequence.

    python -m mindspore_eagle.bench.micro.batch_rows [--config configs/default.yaml] [--context 300] [--repeat 7]

Prints, per n in 1, 2, 4, 8, 16 (up to ``serve.max_batch``), the median ms of a batched decode and of
verifications at m = 2, 3, 4, 8, with the teacher built as ``serve`` builds it (on the host when the cpu backend
runs it; random prompt tokens: the cost does not depend on them). The figures behind docs/performance.md,
"Continuous batching" (what a verified row costs, so what ``core.policy.allot_rows`` weighs). Not a test.
"""
from __future__ import annotations

import argparse

import numpy as np

from mindspore_eagle.bench.micro.forward import median_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    from mindspore_eagle.config import load_config
    from mindspore_eagle.core.tree import DraftTree, tensorize
    from mindspore_eagle.serving.api_server import serve_config
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = serve_config(load_config(args.config))
    tg = build_engine(cfg).teacher
    rng = np.random.default_rng(0)
    N = cfg.serve.max_batch
    sids = []
    for _ in range(N):
        sid = tg.new_seq()
        tg.prefill(sid, rng.integers(100, 40000, args.context))
        sids.append(sid)
    print(f"teacher on the host: {tg.host is not None}; context {args.context} tokens a sequence; ms, median of "
          f"{args.repeat}")
    for n in (b for b in (1, 2, 4, 8, 16) if b <= N):
        line = f"n={n:2d}  decode {n:3d} rows {median_ms(lambda: _decode(tg, sids[:n]), args.repeat):6.1f}"
        for m in (2, 3, 4, 8):
            tts = [tensorize(DraftTree(np.arange(5, 5 + m), np.maximum(np.arange(m) - 1, 0)), m, m)
                   for _ in range(n)]
            line += f" | verify {n * m:3d} rows {median_ms(lambda: _verify(tg, sids[:n], tts), args.repeat):6.1f}"
        print(line, flush=True)


def _decode(tg, sids) -> None:
    tg.decode_batch(sids, [5] * len(sids), rows=len(sids), with_aux=True)   # each repeat appends one token


def _verify(tg, sids, tts) -> None:
    tg.verify_batch(sids, tts, rows=sum(t.budget for t in tts))
    for s in sids:
        tg.rollback(s)


if __name__ == "__main__":
    main()
