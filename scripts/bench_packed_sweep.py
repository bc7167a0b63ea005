#!/usr/bin/env python3
"""Time of the packed matmul kernel (``Linear`` on [N / 16, K, 16] panels) over a teacher's layers, by row count,
for one or more builds of the kernel library.

    python scripts/bench_packed_sweep.py [LIB.so ...] [--rows 1,8,16,32] [--layers 30] [--sweeps 15]

One sweep calls the kernel on the q/k/v, o, gate/up and down matrices of --layers layers of the 135M teacher's
shape (960 x 576, 576 x 576, 3072 x 576, 576 x 1536; 405 MB of float32 at 30 layers, so the weights stream from
memory as in a forward). Several libraries (this checkout's build, ``cpu.library_path()``, and older ones from
``$MSEAGLE_CACHE/kernels/``) run in one process, alternated sweep by sweep so that a machine's drift hits all;
their outputs are compared bit for bit first. Prints the median and minimum ms per sweep. Not a test.
"""
import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def linear_call(x, w, y):
    """ctypes arguments of one ``Linear(x [k, K], w [N / 16, K, 16], y [k, N])`` call (kernels/cpu.py)."""
    arrs = (x, w, y)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrs]
    return ((ctypes.c_void_p * 3)(*[a.ctypes.data for a in arrs]), (ctypes.c_int * 3)(*[a.ndim for a in arrs]),
            (ctypes.POINTER(ctypes.c_int64) * 3)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]),
            (ctypes.c_char_p * 3)(b"float32", b"float32", b"float32"), shapes, y, x)   # x: kept alive


def sweep(lib, calls) -> float:
    t0 = time.perf_counter()
    for c in calls:
        if lib.Linear(3, c[0], c[1], c[2], c[3], None, None) != 0:
            raise SystemExit("Linear returned an error")
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("libs", nargs="*", help="kernel libraries (default: this checkout's build)")
    p.add_argument("--rows", default="1,8,16,32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--sweeps", type=int, default=15)
    args = p.parse_args()
    from mindspore_eagle.kernels import cpu, runtime

    runtime.configure()
    paths = args.libs or [str(cpu.library_path())]
    libs = [ctypes.CDLL(x) for x in paths]
    for lib in libs:
        lib.SetThreads(runtime.kernel_threads())
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((n // 16, k, 16), dtype=np.float32) for n, k in SHAPES * args.layers]
    print(f"{args.layers} layers, {sum(m.nbytes for m in mats) / 2**20:.0f} MB of packed float32 matrices")
    for k in [int(v) for v in args.rows.split(",")]:
        calls = [linear_call(rng.standard_normal((k, m.shape[1]), dtype=np.float32), m,
                             np.zeros((k, m.shape[0] * 16), np.float32)) for m in mats]
        outs = []
        for lib in libs:
            sweep(lib, calls)
            outs.append(np.concatenate([c[5].ravel() for c in calls]))
        same = all(np.array_equal(outs[0], o) for o in outs[1:])
        times = [[] for _ in libs]
        for _ in range(args.sweeps):
            for i, lib in enumerate(libs):
                times[i].append(sweep(lib, calls))
        for path, t in zip(paths, times):
            print(f"  rows {k:>3}  {os.path.basename(path)}: median {np.median(t):6.2f} ms, min {np.min(t):6.2f} ms"
                  + ("" if len(libs) == 1 else f"  (outputs bit-identical: {same})"))


if __name__ == "__main__":
    main()
