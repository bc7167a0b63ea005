"""Cost of one teacher forward in float32 vs float16 on this machine (graph mode), interleaved A/B.

Both teachers (embedded default unless --teacher) are built in one process; after a 256-token context, one
forward over k query tokens (k = 1 is a decode; k = 8 / 16 a tree verification) is timed alternately on the
float32 and the float16 teacher, ``--repeat`` rounds, so load from other processes hits both alike. Prints the
median ms per forward and the float16 / float32 ratio. Not a test: figures only.
    python -m mindspore_eagle.bench.micro.dtype_forward [--ks 1,8,16] [--repeat 15]
"""
import argparse
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="embedded")
    ap.add_argument("--ks", default="1,8,16")
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    from mindspore_eagle.kernels import runtime

    runtime.configure()
    import mindspore as ms

    from mindspore_eagle.core.tree import chain_tree, tensorize
    from mindspore_eagle.models.checkpoints import load_teacher
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner
    from mindspore_eagle.serving.pipeline import resolve_teacher

    cfg, tensors, _ = load_teacher(resolve_teacher(a.teacher))
    runners = {}
    for name, dt in (("float32", ms.float32), ("float16", ms.float16)):
        net = LlamaModel(cfg, 40, 16, 512, dt)
        net.load_hf_weights(tensors)
        r = TeacherRunner(net, 40, 16, 512, "fused", 128)
        sid = r.new_seq()
        r.prefill(sid, np.random.default_rng(0).integers(3, cfg.vocab_size, 256))
        runners[name] = (r, sid)
    ks = [int(k) for k in a.ks.split(",")]
    times = {(n, k): [] for n in runners for k in ks}
    for rep in range(a.repeat + 1):
        for k in ks:
            tt = tensorize(chain_tree(list(range(5, 5 + k))), k, k)
            for name, (r, sid) in runners.items():
                t0 = time.perf_counter()
                r.verify(sid, tt)                        # k = 1: the decode's graph shape (one row, logits)
                ms_ = (time.perf_counter() - t0) * 1e3
                r.rollback(sid)                          # same 256-token context every round
                if rep:                                  # round 0 compiles
                    times[(name, k)].append(ms_)
    print(f"{'k':>3} {'float32 ms':>11} {'float16 ms':>11} {'fp16/fp32':>10}")
    for k in ks:
        f32, f16 = np.median(times[("float32", k)]), np.median(times[("float16", k)])
        print(f"{k:>3} {f32:>11.1f} {f16:>11.1f} {f16 / f32:>10.2f}")


if __name__ == "__main__":
    main()
