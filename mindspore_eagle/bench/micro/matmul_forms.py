"""Matmul formulations of the teacher's whole weight stack on this machine (the measurement behind kernels/dense.linear).

One jitted graph runs every matmul of the embedded default teacher's shapes (30 layers x fused q/k/v [960, 576],
o [576, 576], fused gate/up [3072, 576], down [576, 1536], plus the 49,152-row head [49152, 576]: 538 MB of fp32
weights, random values: speed does not depend on them) for k query rows, in three forms of the same product:

    x @ W.T        MatMul(transpose_b=True)(x, W)        (weight on the right; the fast one-row path)
    (W @ x.T).T    MatMul()(W, x.T).T                    (weight on the left; dense.linear for 8-32 rows)
    (W @ x^T)^T    MatMul(transpose_b=True)(W, x).T      (weight on the left, x transposed by the kernel)

Prints ms per call (minimum of --repeat after one warm call) and the implied weight bandwidth (GB/s).
Not a test: figures only. Usage:
    python -m mindspore_eagle.bench.micro.matmul_forms [--ks 1,2,4,8,16,32,64,128,256] [--repeat 5]
"""
import argparse
import time

import numpy as np

from mindspore_eagle.kernels import runtime

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)
FORMS = ("x @ W.T", "(W @ x.T).T", "(W @ x^T)^T")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="1,2,4,8,16,32,64,128,256", help="query row counts")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    runtime.configure()
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops

    shapes = LAYER_SHAPES * args.layers + [HEAD_SHAPE]
    rng = np.random.default_rng(0)
    weights = [Parameter(Tensor((rng.standard_normal(s) * 0.02).astype(np.float32)), name=f"w{i}")
               for i, s in enumerate(shapes)]
    mbytes = sum(int(np.prod(s)) * 4 for s in shapes) / 1e6

    class Stack(nn.Cell):
        def __init__(self, form):
            super().__init__()
            self.ws = ms.ParameterTuple(weights)
            self.form = form
            self.mm = ops.MatMul()
            self.mm_t = ops.MatMul(transpose_b=True)

        def construct(self, x576, x1536):
            acc = ()
            for w in self.ws:
                x = x576 if w.shape[1] == 576 else x1536
                if self.form == 0:
                    y = self.mm_t(x, w)
                elif self.form == 1:
                    y = self.mm(w, x.T).T
                else:
                    y = self.mm_t(w, x).T
                acc = acc + (y[0, 0],)
            return ops.stack(acc).sum()

    ks = [int(k) for k in args.ks.split(",")]
    print(f"{len(shapes)} matmuls, {mbytes:.0f} MB of fp32 weights; ms per call (GB/s)")
    print(f"{'k':>5} " + " ".join(f"{f:>18}" for f in FORMS))
    nets = [Stack(f) for f in range(len(FORMS))]
    for k in ks:
        a = Tensor(rng.standard_normal((k, 576)).astype(np.float32))
        b = Tensor(rng.standard_normal((k, 1536)).astype(np.float32))
        cells = []
        for net in nets:
            net(a, b).asnumpy()
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                net(a, b).asnumpy()
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{best * 1e3:8.1f} ({mbytes / 1e3 / best:4.1f} GB/s)")
        print(f"{k:>5} " + " ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
