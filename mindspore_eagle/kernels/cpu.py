"""CPU kernels of the teacher's forward: few fat calls per layer instead of ~37 graph ops, as MindSpore AOT ops.

Legend: k = rows of one call, K / N = input / output features, H = hidden, F = MLP width, nh / n_kv / hd = query
heads / KV heads / head dim, R = cache rows (n_kv x slots), S = attended slots, G = sequences in a grouped call.

The C++ source ``cpu_kernels.cc`` (beside this file) is compiled once per machine with the system's g++
(``-O3 -march=native -fopenmp``) into ``$MSEAGLE_CACHE/kernels/cpu-<hash>.so``, the hash covering the source,
the flags, the compiler's version and the CPU model, and each kernel is wrapped as ``ops.Custom(func_type="aot")``
(MindSpore runs it as one graph node on CPU, ~4 us of launch against ~5 us for a built-in op and ~37 built-in ops
per decoder layer). The kernels, their contracts and the numpy references they are tested against:

    linear(x [k, K], w [N, K]) -> [k, N]                                  = x @ w.T          (ref_linear)
    add_rms_norm(x [k, H], d [k, H]) -> (y = x + d, y / rms(y))                               (ref_add_rms_norm)
    rope_qkv(qkv [k, (nh + 2 n_kv) hd], cos [k, hd], sin_signed [k, hd]) -> q [k, nh, hd], key [k, n_kv, hd]
        rotated (NeoX), value [k, n_kv, hd]                                                   (ref_rope_qkv)
    swiglu(gu [k, 2F]) -> silu(gate) * up [k, F]                                              (ref_swiglu)
    paged_attention(q [k, nh, hd], key_cache / value_cache [R, hd], read_rows [(G,) n_kv, S] i32,
        mask [k, S] f32 additive, scale) -> [k, nh hd]; mask <= -1e4 hides a column            (ref_paged_attention)

All float32. Every output row is computed by the same float operations whatever the other rows of the call
(``cpu_kernels.cc``, "Batch invariance"), so a token's logits are bit-identical in decode, tree verification and
batched steps. Threads: ``set_threads(n)`` (the runtime's kernel thread count, ``runtime.configure``).

:func:`status` says whether the kernels can run here and, if not, why in one line (no g++, a compile error, a
platform other than Linux); the ``auto`` backend then stays portable (``attention.select_backend``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
CXX_FLAGS = ("-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
"""g++ flags of the build. -march=native: the library is built for the machine that runs it (AVX2 + FMA on
current x86-64); no -ffast-math and no implicit multiply-add fusion (-ffp-contract=off), so the float operations
written in the source are the ones executed, whatever the call shape (batch invariance; the source fuses
explicitly where it wants to)."""
MASK_HIDDEN = -1e4
"""Mask values at or below this hide a column in :func:`paged_attention` (the portable mask uses -1e9)."""

_lock = threading.Lock()
_built: dict = {}


class KernelBuildError(RuntimeError):
    """The CPU kernels cannot be built or loaded on this machine (message: one line, with the reason)."""


def _cache_dir() -> Path:
    from mindspore_eagle.config import cache_dir

    return cache_dir() / "kernels"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path() -> Path:
    """Path of the built shared library, building it on first use (atomic rename: concurrent builds are safe).

    Raises:
        KernelBuildError: not Linux, no compiler ($CXX, default g++) on PATH, or the compile failed (the first
            line of the compiler's error).
    """
    with _lock:
        if "path" in _built:
            return _built["path"]
        if "error" in _built:
            raise KernelBuildError(_built["error"])
        try:
            _built["path"] = _build()
        except KernelBuildError as e:
            _built["error"] = str(e)
            raise
        return _built["path"]


def _build() -> Path:
    if platform.system() != "Linux":
        raise KernelBuildError(f"CPU kernels need Linux (MindSpore AOT custom ops), this is {platform.system()}")
    name = os.environ.get("CXX") or "g++"
    cxx = shutil.which(name)
    if cxx is None:
        raise KernelBuildError(f"CPU kernels need a C++ compiler: {name} not found on PATH")
    src = SOURCE.read_bytes()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"CPU kernels: {cxx} --version failed: {e}") from None
    tag = hashlib.sha256(src + repr((CXX_FLAGS, version, _cpu_model())).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *CXX_FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
            raise KernelBuildError(f"CPU kernels failed to compile ({cxx}): {first}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def status() -> tuple[bool, str]:
    """(True, library path) when the kernels are built and loadable here, else (False, one-line reason)."""
    try:
        path = library_path()
        set_threads(_built.get("threads", 1))
        return True, str(path)
    except (KernelBuildError, OSError) as e:
        return False, str(e).splitlines()[0]


def set_threads(n: int) -> None:
    """Threads the kernels use from now on (OpenMP, inside each call). Raises KernelBuildError when not built."""
    _built["threads"] = max(1, int(n))
    lib = ctypes.CDLL(str(library_path()))
    lib.SetThreads(ctypes.c_int(_built["threads"]))


KERNEL_NAMES = ("linear", "add_rms_norm", "rope_qkv", "swiglu", "paged_attention")


def kernel_stats(reset: bool = False) -> dict:
    """{kernel: (ms spent inside it, calls)} since the last reset, for profiles (wall ms of the calls, all
    threads of one call counted once). Raises KernelBuildError when the kernels are not built."""
    lib = ctypes.CDLL(str(library_path()))
    buf = (ctypes.c_int64 * (2 * len(KERNEL_NAMES)))()
    lib.KernelStats(buf)
    if reset:
        lib.ResetKernelStats()
    return {n: (buf[2 * i] / 1e6, int(buf[2 * i + 1])) for i, n in enumerate(KERNEL_NAMES)}


def _custom(name: str, out_shape, out_dtype):
    from mindspore import ops

    return ops.Custom(f"{library_path()}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")


class CpuKernels:
    """The ``ops.Custom`` primitives of ``cpu_kernels.cc`` (one set per process; build on first construction).

    Shape inference is Python (graph compile time only); the calls are the module docstring's contracts
    (RopeQKV's output shapes depend on the head split: :func:`rope_qkv_op` makes one per geometry).
    Raises:
        KernelBuildError: the library cannot be built here.
    """

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            self = super().__new__(cls)
            self.linear = _custom("Linear", lambda x, w: [x[0], w[0]], lambda x, w: x)
            self.add_rms_norm = _custom("AddRmsNorm", lambda x, d, e: (x, x), lambda x, d, e: (x, x))
            self.swiglu = _custom("SwiGLU", lambda gu: [gu[0], gu[1] // 2], lambda gu: gu)
            self.paged_attention = _custom(
                "PagedAttention", lambda q, kc, vc, rows, mask, scale: [q[0], q[1] * q[2]],
                lambda q, kc, vc, rows, mask, scale: q)
            cls._instance = self
        return cls._instance


def rope_qkv_op(nh: int, nkv: int, hd: int):
    """A RopeQKV primitive for one head geometry (shape inference needs nh / n_kv, which the kernel reads from its
    int32 ``heads`` input)."""
    return _custom("RopeQKV", lambda qkv, c, s, h: ([qkv[0], nh, hd], [qkv[0], nkv, hd], [qkv[0], nkv, hd]),
                   lambda qkv, c, s, h: (qkv, qkv, qkv))


# ------------------------------------------------------------------------------------------ numpy references
def ref_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [k, K] @ w [N, K].T in float64, returned float32 [k, N]."""
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


def ref_add_rms_norm(x: np.ndarray, d: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(y = x + d, y / sqrt(mean(y^2, -1) + eps)), float32 [k, H] each (norm in float64)."""
    y = (x + d).astype(np.float32)
    y64 = y.astype(np.float64)
    return y, (y64 / np.sqrt((y64 * y64).mean(-1, keepdims=True) + eps)).astype(np.float32)


def ref_rope_qkv(qkv: np.ndarray, cos: np.ndarray, sin_signed: np.ndarray, nh: int, nkv: int):
    """(q [k, nh, hd], key [k, n_kv, hd], value [k, n_kv, hd]): NeoX RoPE on q and key (models/llama.py
    ``apply_rope``: x * cos + swap_halves(x) * sin_signed), value unchanged."""
    k, hd = qkv.shape[0], cos.shape[-1]
    heads = qkv.reshape(k, nh + 2 * nkv, hd)
    qk = heads[:, : nh + nkv]
    swapped = np.concatenate([qk[..., hd // 2:], qk[..., : hd // 2]], -1)
    rot = qk * cos[:, None] + swapped * sin_signed[:, None]
    return rot[:, :nh], rot[:, nh:], heads[:, nh + nkv:]


def ref_swiglu(gu: np.ndarray) -> np.ndarray:
    """silu(gate) * up for gu [k, 2F] = [gate | up] -> [k, F] (float64 inside)."""
    g, u = np.split(gu.astype(np.float64), 2, -1)
    return (g / (1 + np.exp(-g)) * u).astype(np.float32)


def ref_paged_attention(q, key_cache, value_cache, read_rows, mask, scale) -> np.ndarray:
    """The attention of :func:`paged_attention` in float64: q [k, nh, hd], caches [R, hd], read_rows
    [(G,) n_kv, S], mask [k, S] (<= MASK_HIDDEN hidden) -> [k, nh hd] float32 (zeros for a row with no visible
    column)."""
    k, nh, hd = q.shape
    rows = read_rows if read_rows.ndim == 3 else read_rows[None]
    G, nkv, S = rows.shape
    out = np.zeros((k, nh, hd))
    for r in range(k):
        g = r // (k // G)
        vis = mask[r] > MASK_HIDDEN
        if not vis.any():
            continue
        for h in range(nh):
            idx = rows[g, h // (nh // nkv)][vis]
            s = key_cache[idx].astype(np.float64) @ q[r, h].astype(np.float64) * scale + mask[r][vis]
            p = np.exp(s - s.max())
            out[r, h] = p @ value_cache[idx].astype(np.float64) / p.sum()
    return out.reshape(k, nh * hd).astype(np.float32)
