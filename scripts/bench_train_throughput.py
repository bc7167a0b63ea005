#!/usr/bin/env python3
"""Drafter training throughput on this machine: TTT length x rows per step x packing (one process).

Each configuration "S:B[:P]" (ttt_length S, B rows per optimiser step, rows packed to P tokens; no P = one
sample per row of --max-len tokens) gets its own TTTDrafter + TrainStep over the same feature set and draft
vocabulary. After one untimed step per configuration (it compiles), the configurations take turns for
``--rounds`` rounds of ``--seconds`` each (round-robin, so load changes on a shared machine hit all of them
alike), each continuing its own sample stream. Printed per configuration: steps, samples and real tokens per
second (tokens of the samples, padding excluded) and padded tokens per second (B x row length per step).
Not a test: figures only.

Usage: python scripts/bench_train_throughput.py --features-dir DIR [--configs 7:1 3:1 3:4 3:2:512]
       [--max-len 256] [--vd 8192] [--rounds 4] [--seconds 40]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mindspore_eagle.kernels import runtime  # noqa: E402


def parse_config(text: str) -> tuple:
    parts = [int(x) for x in text.split(":")]
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise SystemExit(f"--configs: {text!r} is not S:B or S:B:P with positive integers")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features-dir", required=True)
    p.add_argument("--teacher", default=None)
    p.add_argument("--configs", nargs="+", default=["7:1", "3:1", "3:4", "3:2:512"])
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--vd", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=40.0)
    a = p.parse_args()
    runtime.configure()
    from mindspore_eagle.models.checkpoints import load_teacher
    from mindspore_eagle.models.eagle3 import vocab_maps
    from mindspore_eagle.models.fetch import embedded_teacher_path
    from mindspore_eagle.train.features import FeatureSet, head_weight
    from mindspore_eagle.train.trainer import (
        TrainConfig,
        drafter_config,
        initial_tensors,
        next_batch,
    )
    from mindspore_eagle.train.ttt import TrainStep, TTTDrafter
    from mindspore_eagle.train.vocab import build_vocab

    cfg, tensors, _ = load_teacher(a.teacher or str(embedded_teacher_path()))
    fs = FeatureSet(a.features_dir)
    n = len(fs)
    dv = build_vocab([(fs[i]["input_ids"], fs[i]["loss_mask"]) for i in range(n)], cfg.vocab_size, a.vd,
                     [(fs[i]["argmax"][:-1], fs[i]["loss_mask"][1:]) for i in range(n)])
    vocab = vocab_maps(dv.used, cfg.vocab_size)
    lengths = np.array([min(len(fs[i]["input_ids"]), a.max_len) for i in range(n)])
    print(f"[data] {n} samples, mean length {lengths.mean():.1f} tokens (max_len {a.max_len}: "
          f"{1 - lengths.mean() / a.max_len:.3f} of a padded row is padding)", flush=True)
    dcfg = drafter_config(cfg, a.vd)
    head = head_weight(cfg, tensors)[dv.used]
    runs = []
    for text in a.configs:
        S, B, P = parse_config(text)
        tc = TrainConfig(out="", features_dir=a.features_dir, vd=a.vd, ttt_length=S, max_len=a.max_len,
                         batch_size=B, pack_len=P)
        tc.check()
        net = TTTDrafter(dcfg, tensors["model.embed_tokens.weight"], head, vocab["d2t"], P or a.max_len, S,
                         max_len=a.max_len)
        net.load_tensors(initial_tensors(dcfg, 0, dv.used, "random", cfg, tensors))
        ts = TrainStep(net)
        t0 = time.time()
        b, cursor = next_batch(fs, 0, lengths, tc, vocab["t2d"])
        ts(b, 1e-4)
        print(f"[compile] {text}: first step {time.time() - t0:.1f} s", flush=True)
        runs.append({"name": text, "tc": tc, "ts": ts, "cursor": cursor, "steps": 0, "samples": 0, "tokens": 0,
                     "padded": 0, "sec": 0.0, "row": (P or a.max_len) * B})
    for r in range(a.rounds):
        for run in runs:
            t_end = time.time() + a.seconds
            while time.time() < t_end:
                t0 = time.time()
                b, run["cursor"] = next_batch(fs, run["cursor"], lengths, run["tc"], vocab["t2d"])
                run["ts"](b, 1e-4)
                run["sec"] += time.time() - t0
                run["steps"] += 1
                run["samples"] += b.n_samples
                run["tokens"] += b.n_valid
                run["padded"] += run["row"]
        load = os.getloadavg()[0]
        print(f"[round {r + 1}/{a.rounds}] load average {load:.1f}", flush=True)
    print(f"\n{'config (S:B[:P])':18s} {'steps':>6s} {'steps/s':>8s} {'samples/s':>10s} {'tokens/s':>9s} "
          f"{'padded tok/s':>13s}")
    for run in runs:
        s = run["sec"]
        print(f"{run['name']:18s} {run['steps']:6d} {run['steps'] / s:8.3f} {run['samples'] / s:10.3f} "
              f"{run['tokens'] / s:9.1f} {run['padded'] / s:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
