#!/usr/bin/env python3
"""Time of the CPU attention kernel (``PagedAttention``) alone, for one or two builds of the kernel library.

    python scripts/bench_attention.py [LIB.so [OTHER.so]] [--rows 16] [--heads 9] [--kv-heads 2] [--context 256]

k query rows (a tree's, causal among themselves) over a cached context of --context tokens, head size 64, one
call per layer over 30 layers with caches of their own (a 135M teacher's shape by default: 9 heads, 3 KV heads).
Two libraries (e.g. this checkout's build, ``cpu.library_path()``, and an older worktree's from
``$MSEAGLE_CACHE/kernels/``) run in one process, alternated sweep by sweep so that a machine's drift hits both;
their outputs are compared bit for bit first. Prints the median and minimum ms per 30-layer sweep. Not a test.
"""
import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYERS, HD = 30, 64


def layer_call(rng, k, nh, nkv, ctx):
    """One layer's PagedAttention arguments (kernels/cpu.py, PagedAttention contract), as ctypes arrays."""
    S, R = ctx + k, ctx + k + 64
    q = rng.normal(size=(k, nh, HD)).astype(np.float32)
    kc, vc = (rng.normal(size=(nkv * R, HD)).astype(np.float32) for _ in range(2))
    rows = np.stack([h * R + np.arange(S) for h in range(nkv)]).astype(np.int32)
    mask = np.zeros((k, S), np.float32)
    mask[:, ctx:] = np.where(np.tril(np.ones((k, k), bool)), 0, -1e9)
    arrs = [q, kc, vc, rows, mask, np.array([HD ** -0.5], np.float32), np.zeros((k, nh * HD), np.float32)]
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrs]
    return dict(arrs=arrs, shapes=shapes,
                params=(ctypes.c_void_p * 7)(*[a.ctypes.data for a in arrs]),
                ndims=(ctypes.c_int * 7)(*[a.ndim for a in arrs]),
                shp=(ctypes.POINTER(ctypes.c_int64) * 7)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                           for s in shapes]),
                dtypes=(ctypes.c_char_p * 7)(b"float32", b"float32", b"float32", b"int32", b"float32", b"float32",
                                             b"float32"))


def sweep(lib, layers) -> float:
    t0 = time.perf_counter()
    for c in layers:
        if lib.PagedAttention(7, c["params"], c["ndims"], c["shp"], c["dtypes"], None, None) != 0:
            raise SystemExit("PagedAttention returned an error")
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("libs", nargs="*", help="kernel libraries (default: this checkout's build)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--sweeps", type=int, default=30)
    args = p.parse_args()
    from mindspore_eagle.kernels import cpu, runtime

    runtime.configure()
    paths = args.libs or [str(cpu.library_path())]
    libs = [ctypes.CDLL(x) for x in paths]
    for lib in libs:
        lib.SetThreads(runtime.kernel_threads())
    rng = np.random.default_rng(0)
    layers = [layer_call(rng, args.rows, args.heads, args.kv_heads, args.context) for _ in range(LAYERS)]
    outs = []
    for lib in libs:
        sweep(lib, layers)
        outs.append(np.concatenate([c["arrs"][6].copy() for c in layers]))
    if len(outs) == 2:
        print(f"outputs bit-identical: {np.array_equal(outs[0], outs[1])}")
    times = [[] for _ in libs]
    for _ in range(args.sweeps):
        for i, lib in enumerate(libs):
            times[i].append(sweep(lib, layers))
    print(f"{args.rows} rows, {args.heads} heads / {args.kv_heads} KV heads, hd {HD}, context {args.context}, "
          f"{LAYERS} layers:")
    for path, t in zip(paths, times):
        print(f"  {os.path.basename(path)}: median {np.median(t):.2f} ms, min {np.min(t):.2f} ms per sweep")


if __name__ == "__main__":
    main()
