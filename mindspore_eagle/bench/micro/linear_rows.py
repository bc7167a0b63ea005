"""Time of the CPU matmul kernel (``cpu.CpuKernels().linear``) on a teacher-sized MLP pair, by row count.

    python -m mindspore_eagle.bench.micro.linear_rows [--rows 1,2,3,4,5,6,8,16] [--calls 30]

Prints, per row count k, the kernel's own time (``cpu.kernel_stats``) of one gate/up (3072 x 576) plus one down
(576 x 1536) call on random float32 data, and the FLOP rate. Use it to compare the kernel library before and
after a change of its matmul tiles (the current tiles and the loop that chose them: docs/cpu_kernels.md, "Tiles"),
alternating with an older worktree's copy (``cd <worktree> && python -m mindspore_eagle.bench.micro.linear_rows``:
``-m`` imports the package of the current folder first, whatever PYTHONPATH says). Not a test.
"""
from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,5,6,8,16")
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    import mindspore as ms

    from mindspore_eagle.kernels import cpu, runtime

    runtime.configure()
    kern = cpu.CpuKernels()
    cpu.set_threads(runtime.kernel_threads())
    rng = np.random.default_rng(0)
    w_gu = ms.Tensor(rng.normal(size=(3072, 576)).astype(np.float32))
    w_d = ms.Tensor(rng.normal(size=(576, 1536)).astype(np.float32))
    flop_row = 2 * (3072 * 576 + 576 * 1536)
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {k: (ms.Tensor(rng.normal(size=(k, 576)).astype(np.float32)),
                  ms.Tensor(rng.normal(size=(k, 1536)).astype(np.float32))) for k in rows}
    for _ in range(5):                   # first calls build the op, start the thread pool, page the weights in
        for x, x2 in inputs.values():
            kern.linear(x, w_gu).asnumpy(), kern.linear(x2, w_d).asnumpy()
    for k in rows:
        x, x2 = inputs[k]
        cpu.kernel_stats(reset=True)
        for _ in range(args.calls):
            kern.linear(x, w_gu).asnumpy(), kern.linear(x2, w_d).asnumpy()
        ms_total, _ = cpu.kernel_stats()["linear"]
        us = ms_total / args.calls * 1e3
        print(f"rows {k:>3}: {us:7.0f} us per gate/up + down pair, {k * flop_row / us / 1e3:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
