"""Time one CPU kernel alone over a teacher's layers, for one or more builds of the kernel library.

    python -m mindspore_eagle.bench.micro.kernels attention [LIB.so ...] [--rows 16] [--heads 9] [--kv-heads 3] [--context 256]
    python -m mindspore_eagle.bench.micro.kernels matmul [LIB.so ...] [--rows 1,8,16,32] [--layers 30] [--shapes NxK,...]

attention: ``PagedAttention`` for k query rows (a tree's, causal among themselves) over a cached context, head size
64, one call per layer with caches of its own (default: the 135M teacher's 9 heads / 3 KV heads; the 0.5B
teacher's are 14 / 2).
matmul: the packed ``Linear`` ([N / 16, K, 16] panels) on the q/k/v, o, gate/up and down matrices of the 135M
teacher's layers (960 x 576, 576 x 576, 3072 x 576, 576 x 1536: 405 MB of float32 at 30 layers, so the weights
stream from memory as in a forward), for each row count; ``--shapes`` names other [N, K] matrices (the 0.5B
teacher's: ``--shapes 1152x896,896x896,9728x896,896x4864 --layers 24``).
Libraries (default: this checkout's build, ``cpu.library_path()``; older builds lie in ``$MSEAGLE_CACHE/kernels/``)
run in one process, alternated sweep by sweep so that a machine's drift hits all; their outputs are compared bit
for bit first. Prints the median and minimum ms per sweep of all layers. Not a test.
"""
import argparse
import ctypes
import os
import time

import numpy as np

HD = 64
MATMUL_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
DTYPES = {np.dtype(np.float32): b"float32", np.dtype(np.int32): b"int32"}


class AotCall:
    """One call of an AOT kernel entry (``Name(nparam, params, ndims, shapes, dtypes, stream, extra)``,
    cpu_kernels.cc) on numpy arrays: inputs then outputs, kept alive with the call."""

    def __init__(self, name: str, *arrays):
        self.name, self.arrays = name, arrays
        n = len(arrays)
        self._shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
        self.args = (n, (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
                     (ctypes.c_int * n)(*[a.ndim for a in arrays]),
                     (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                           for s in self._shapes]),
                     (ctypes.c_char_p * n)(*[DTYPES[a.dtype] for a in arrays]), None, None)

    def __call__(self, lib) -> None:
        if getattr(lib, self.name)(*self.args) != 0:
            raise SystemExit(f"{self.name} returned an error")


def attention_calls(rng, k, nh, nkv, ctx, layers):
    out = []
    for _ in range(layers):
        S, R = ctx + k, ctx + k + 64
        rows = np.stack([h * R + np.arange(S) for h in range(nkv)]).astype(np.int32)
        mask = np.zeros((k, S), np.float32)
        mask[:, ctx:] = np.where(np.tril(np.ones((k, k), bool)), 0, -1e9)
        out.append(AotCall("PagedAttention", rng.standard_normal((k, nh, HD), dtype=np.float32),
                           rng.standard_normal((nkv * R, HD), dtype=np.float32),
                           rng.standard_normal((nkv * R, HD), dtype=np.float32), rows, mask,
                           np.array([HD ** -0.5], np.float32), np.zeros((k, nh * HD), np.float32)))
    return out


def compare(libs, paths, calls, sweeps, label) -> None:
    """Run ``calls`` once per library (outputs compared), then ``sweeps`` alternated sweeps; print the times."""
    outs = []
    for lib in libs:
        for c in calls:
            c(lib)
        outs.append(np.concatenate([c.arrays[-1].ravel() for c in calls]))
    same = all(np.array_equal(outs[0], o) for o in outs[1:])
    times = [[] for _ in libs]
    for _ in range(sweeps):
        for i, lib in enumerate(libs):
            t0 = time.perf_counter()
            for c in calls:
                c(lib)
            times[i].append((time.perf_counter() - t0) * 1e3)
    for path, t in zip(paths, times):
        print(f"  {label}  {os.path.basename(path)}: median {np.median(t):7.2f} ms, min {np.min(t):7.2f} ms"
              + ("" if len(libs) == 1 else f"  (outputs bit-identical: {same})"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", choices=("attention", "matmul"))
    p.add_argument("libs", nargs="*", help="kernel libraries (default: this checkout's build)")
    p.add_argument("--rows", default=None, help="query rows: attention one count (16), matmul a list (1,8,16,32)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--sweeps", type=int, default=15)
    p.add_argument("--shapes", default=None, help="matmul: [N, K] matrices of a layer, NxK comma-separated "
                                                  "(N a multiple of 16; default: the 135M teacher's)")
    args = p.parse_args()
    from mindspore_eagle.kernels import cpu, runtime

    runtime.configure()
    paths = args.libs or [str(cpu.library_path())]
    libs = [ctypes.CDLL(x) for x in paths]
    for lib in libs:
        lib.SetThreads(runtime.kernel_threads())
    rng = np.random.default_rng(0)
    if args.kernel == "attention":
        k = int(args.rows or 16)
        print(f"attention: {k} rows, {args.heads} heads / {args.kv_heads} KV heads, hd {HD}, context {args.context}, "
              f"{args.layers} layers")
        compare(libs, paths, attention_calls(rng, k, args.heads, args.kv_heads, args.context, args.layers),
                args.sweeps, f"rows {k:>3}")
        return
    shapes = MATMUL_SHAPES
    if args.shapes:
        try:
            shapes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(","))
        except ValueError:
            shapes = ((),)
        if any(len(s) != 2 or s[0] % 16 or min(s) < 1 for s in shapes):
            raise SystemExit(f"--shapes: need NxK pairs with N a multiple of 16, got {args.shapes!r}")
    mats = [rng.standard_normal((n // 16, kk, 16), dtype=np.float32) for n, kk in shapes * args.layers]
    print(f"packed matmul: {args.layers} layers, {sum(m.nbytes for m in mats) / 2**20:.0f} MB of float32 matrices")
    for k in [int(v) for v in (args.rows or "1,8,16,32").split(",")]:
        calls = [AotCall("Linear", rng.standard_normal((k, m.shape[1]), dtype=np.float32), m,
                         np.zeros((k, m.shape[0] * 16), np.float32)) for m in mats]
        compare(libs, paths, calls, args.sweeps, f"rows {k:>3}")


if __name__ == "__main__":
    main()
