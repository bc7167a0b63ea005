"""CPU kernels of the teacher's forward: few fat calls per layer instead of ~37 graph ops, as MindSpore AOT ops.

Legend: k = rows of one call, K / N = input / output features, H = hidden, F = MLP width, nh / n_kv / hd = query
heads / KV heads / head dim, R = cache rows (n_kv x slots), S = attended slots, G = sequences in a grouped call.

The C++ source ``cpu_kernels.cc`` (beside this file) is compiled once per machine with the system's g++
(``-O3 -march=native -fopenmp``) into ``$MSEAGLE_CACHE/kernels/cpu-<hash>.so``, the hash covering the source,
the flags, the compiler's version and the CPU model, and each kernel is wrapped as ``ops.Custom(func_type="aot")``
(MindSpore runs it as one graph node on CPU, ~4 us of launch against ~5 us for a built-in op and ~37 built-in ops
per decoder layer). A decoder layer is two kernel calls:

    attn_block(x [k, H], h [k, Hin], wqkv [(nh + 2 n_kv) hd, Hin], wo [H, nh hd], cos [k, hd], sin_signed [k, hd],
        heads [2] i32, key_cache / value_cache [R, hd], write_rows [k n_kv] i32, read_rows [(G,) n_kv, S] i32,
        mask [k, S] f32 additive, eps [1][, bqkv[, bo]]) -> (y = x + attention(h) @ wo.T (+ bo), rms(y));
        writes the rows' K/V into the caches in place; Hin = H in a teacher layer, 2 H in the EAGLE-3 drafter's
        first layer (models/eagle3.py)                                                          (ref_attn_block)
    mlp_add_norm(h [k, H], w_gate_up [2F, H], w_down [H, F], resid [k, H], eps [1]) -> (y = resid +
        down(silu(gate) * up), rms(y))                                                         (ref_mlp_add_norm)

or both in one call, ``decoder_layer(attn_block's inputs..., w_gate_up, w_down) -> (y, rms(y))`` (the teacher's
layers: one graph node a layer instead of two; the same result bit for bit),

plus ``move_rows(src [P] i32, dst [P] i32, caches... [R, hd]) -> dummy [1]`` (a commit's cache moves in every
layer at once, in place; ref_move_rows), ``linear(x [k, K], w [N, K]) -> x @ w.T`` (the head; ref_linear),
``head_topk(K)(h [k, H], w [V, H], d2t [V] i32) -> (top_logp [k, K] f32, top_ids [k, K] i32)`` (a draft head's
log-softmax and its K best, ids + d2t; ref_head_topk), ``add_rms_norm(x, d, eps) -> (x + d, rms(x + d))`` (the
first layer's norm; ref_add_rms_norm) and ``paged_attention(q [k, nh, hd], key_cache,
value_cache, read_rows, mask, scale [1]) -> [k, nh hd]`` (the drafter's attention; ref_paged_attention). rms(y) =
y / sqrt(mean(y^2) + eps), unweighted (the norm weights are folded into the next matmul, models/llama.py);
attention hides a column whose mask is <= -1e4 and gives a row that sees nothing zeros.

The attention block writes the K/V cache Parameters in place, which MindSpore does not see: each cache is used by
that one call per graph, and graphs run one after another (``runtime.configure``'s blocking launch), so nothing
reads a cache out of order; a depend on a ScatterUpdate's output, the alternative, made MindSpore copy the whole
cache into every reader (docs/cpu_kernels.md).

All float32, except that the matrices (``w``, ``wqkv``, ``wo``, ``w_gate_up``, ``w_down``) may be float16: a half
widens to exactly one float as it is read, so the result equals the float32 call on the widened matrix, bit for bit
(``attention.CpuBackend``, a model's ``weight_dtype``). Each matrix may also be given packed, [N / 16, K, 16]
(:func:`pack`), which the matmuls read in the outer-product form (one FMA chain per output); the CPU backend packs
every matrix it can at load. Every output row is computed by the same float operations
whatever the other rows of the call (``cpu_kernels.cc``, "Batch invariance"), so a token's logits are bit-identical
in decode, tree verification and batched steps. Threads: ``set_threads(n)`` (the runtime's kernel thread count, ``runtime.configure``).

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
CXX_FLAGS = ("-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")
"""g++ flags of the build. -march=native: the library is built for the machine that runs it (AVX2 + FMA on
current x86-64); no -ffast-math and no implicit multiply-add fusion (-ffp-contract=off), so the float operations
written in the source are the ones executed, whatever the call shape (batch invariance; the source fuses
explicitly where it wants to)."""
MASK_HIDDEN = -1e4
"""Mask values at or below this hide a column in :func:`paged_attention` (the portable mask uses -1e9)."""

PANEL = 16
"""Rows of a packed matrix panel (``pack``; ``PANEL`` in ``cpu_kernels.cc``)."""

_lock = threading.Lock()
_built: dict = {}


class KernelBuildError(RuntimeError):
    """The CPU kernels cannot be built or loaded on this machine (message: one line, with the reason)."""


def _cache_dir() -> Path:
    from mindspore_eagle.config import cache_dir

    return cache_dir() / "kernels"


def _cpu_model() -> str:
    """The CPU's model name and instruction-set flags (first core of /proc/cpuinfo): part of the build's hash, so a
    library built with -march=native for one CPU is never loaded on another that shares the cache folder."""
    found: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "flags", "Features", "CPU part") and key not in found:
                found[key] = line
    except OSError:
        pass
    return "\n".join(found.values()) or platform.processor() or platform.machine()


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


def compiler() -> str | None:
    """Path of the C++ compiler the kernels are built with ($CXX, default g++) on Linux, or None (not Linux, or no
    such compiler on PATH): where this is not None the kernels must build, and the tests fail if they do not."""
    if platform.system() != "Linux":
        return None
    return shutil.which(os.environ.get("CXX") or "g++")


def _build() -> Path:
    if platform.system() != "Linux":
        raise KernelBuildError(f"CPU kernels need Linux (MindSpore AOT custom ops), this is {platform.system()}")
    name = os.environ.get("CXX") or "g++"
    cxx = compiler()
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
    """Threads the kernels use from now on (the kernels' own pool, ``cpu_kernels.cc``, "Threads"; the calling
    thread is one of them). Raises KernelBuildError when not built."""
    _built["threads"] = max(1, int(n))
    lib = ctypes.CDLL(str(library_path()))
    lib.SetThreads(ctypes.c_int(_built["threads"]))


SPIN_US = 50
"""Microseconds an idle kernel thread spins before it sleeps (the default of ``cpu_kernels.cc``): long enough for
the next kernel of a forward, short enough to leave the cores to MindSpore's ops and other libraries between
forwards (docs/cpu_kernels.md, "Threads")."""


def set_spin_us(us: int) -> int:
    """Set how long (microseconds, >= 0) an idle kernel thread spins before it sleeps; returns the value in force.
    Raises KernelBuildError when not built."""
    lib = ctypes.CDLL(str(library_path()))
    return int(lib.SetSpinMicros(ctypes.c_int(max(0, int(us)))))


KERNEL_NAMES = ("linear", "add_rms_norm", "paged_attention", "attn_block", "mlp_add_norm", "decoder_layer",
                "decoder_stack")
"""Names of :func:`kernel_stats` (``linear`` includes ``head_topk``)."""


def kernel_stats(reset: bool = False) -> dict:
    """{kernel: (ms spent inside it, calls)} since the last reset, for profiles (wall ms of the calls, all
    threads of one call counted once). Raises KernelBuildError when the kernels are not built."""
    lib = ctypes.CDLL(str(library_path()))
    buf = (ctypes.c_int64 * (2 * len(KERNEL_NAMES)))()
    lib.KernelStats(buf)
    if reset:
        lib.ResetKernelStats()
    return {n: (buf[2 * i] / 1e6, int(buf[2 * i + 1])) for i, n in enumerate(KERNEL_NAMES)}


def packable(shape) -> bool:
    """True when a matrix of ``shape`` [N, K] can be packed (N a positive multiple of ``PANEL``)."""
    return len(shape) == 2 and shape[0] > 0 and shape[0] % PANEL == 0


def pack(w: np.ndarray, inplace: bool = False) -> np.ndarray:
    """A matrix w [N, K] (float32 or float16) in the kernels' packed layout [N / 16, K, 16]: panel p holds rows
    16 p .. 16 p + 15 column by column (``out[p, i, j] = w[16 p + j, i]``), so a kernel streams 16 outputs' weights
    per reduction step (``cpu_kernels.cc``, "Packed matmul"; docs/cpu_kernels.md, "Packed matrices").

    Panel p occupies the bytes of rows 16 p .. 16 p + 15, so ``inplace=True`` rewrites w's own buffer (w must be
    C-contiguous and writable; the result is a view of it): a model being loaded never holds a matrix twice. In
    place runs in the kernels' ``PackInPlace`` (one panel at a time per thread) once the library is loaded, else
    in numpy, 64 panels at a time; both give the same bytes.
    Raises:
        ValueError: w is not 2-D, its row count is not a multiple of 16, or ``inplace`` and w is not C-contiguous
            and writable.
    """
    if not packable(w.shape):
        raise ValueError(f"pack: need a [N, K] matrix with N a multiple of {PANEL}, got shape {tuple(w.shape)}")
    n, k = w.shape
    panels = w.reshape(n // PANEL, PANEL, k)
    if not inplace:
        return np.ascontiguousarray(panels.transpose(0, 2, 1))
    if not (w.flags.c_contiguous and w.flags.writeable):
        raise ValueError("pack(inplace=True) needs a C-contiguous, writable matrix")
    if w.dtype in (np.float32, np.float16) and "path" in _built:     # the kernels' threads, when built
        lib = ctypes.CDLL(str(_built["path"]))
        if lib.PackInPlace(ctypes.c_void_p(w.ctypes.data), ctypes.c_int64(n), ctypes.c_int64(k),
                           ctypes.c_int(w.itemsize)) == 0:
            return w.reshape(n // PANEL, k, PANEL)
    flat = w.reshape(n // PANEL, PANEL * k)
    for p0 in range(0, n // PANEL, 64):
        block = panels[p0:p0 + 64].transpose(0, 2, 1).copy()       # 64 panels: the only extra memory
        flat[p0:p0 + 64] = block.reshape(block.shape[0], -1)
    return w.reshape(n // PANEL, k, PANEL)


def to_half(w: np.ndarray, packed: bool) -> np.ndarray:
    """A float32 matrix w [N, K] as a new float16 array, rounded to nearest even (the bytes of
    ``w.astype(np.float16)``), packed [N / 16, K, 16] as :func:`pack` lays it out when ``packed``, else [N, K].

    One pass over w in the kernels' ``ToHalf`` (their threads) once the library is loaded, else in numpy; both give
    the same bytes. The kernels' pass matters at load: numpy's conversion of the 0.5B teacher's 2.5 GB of float32
    took 3.9 s of a 10 s start on the 2-core VM (docs/cpu_kernels.md, "Half-float matrices").
    Raises:
        ValueError: w is not a 2-D float32 array, or ``packed`` and its row count is not a multiple of 16.
    """
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"to_half: need a 2-D float32 matrix, got {w.dtype} of shape {tuple(w.shape)}")
    if packed and not packable(w.shape):
        raise ValueError(f"to_half: packing needs N a multiple of {PANEL}, got shape {tuple(w.shape)}")
    n, k = w.shape
    out = np.empty((n // PANEL, k, PANEL) if packed else (n, k), np.float16)
    if "path" in _built:                                    # the kernels' threads, when built
        src = np.ascontiguousarray(w)
        lib = ctypes.CDLL(str(_built["path"]))
        if lib.ToHalf(ctypes.c_void_p(src.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(n),
                      ctypes.c_int64(k), ctypes.c_int(int(packed))) == 0:
            return out
    out[...] = pack(w) if packed else w
    return out


def unpack(w: np.ndarray) -> np.ndarray:
    """The [N, K] matrix of a packed [N / 16, K, 16] one (a 2-D matrix is returned as it is)."""
    if w.ndim == 2:
        return w
    p, k, j = w.shape
    return np.ascontiguousarray(w.transpose(0, 2, 1).reshape(p * j, k))


def matrix_rows(shape) -> int:
    """N of a kernel matrix argument's shape: [N, K] or packed [N / 16, K, 16]."""
    return shape[0] * shape[2] if len(shape) == 3 else shape[0]


def rows(w: np.ndarray, ids) -> np.ndarray:
    """Rows ``ids`` of a matrix given [N, K] or packed [N / 16, K, 16] (``pack``) -> [len(ids), K] (numpy; the
    graph form is ``attention.CpuBackend.embed_rows``)."""
    ids = np.asarray(ids)
    return w[ids] if w.ndim == 2 else w[ids // PANEL, :, ids % PANEL]


def _custom(name: str, out_shape, out_dtype):
    from mindspore import ops

    return ops.Custom(f"{library_path()}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")


class CpuKernels:
    """The ``ops.Custom`` primitives of ``cpu_kernels.cc`` (one set per process; build on first construction).

    Shape inference is Python (graph compile time only); the calls are the module docstring's contracts
    (``attn_block[n]`` takes n bias inputs).
    Raises:
        KernelBuildError: the library cannot be built here.
    """

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            self = super().__new__(cls)
            self.linear = _custom("Linear", lambda x, w: [x[0], matrix_rows(w)], lambda x, w: x)
            self.add_rms_norm = _custom("AddRmsNorm", lambda x, d, e: (x, x), lambda x, d, e: (x, x))
            # attention block without bias, with a q/k/v bias (Qwen2), with q/k/v and o biases (openPangu, Llama)
            self.attn_block = tuple(_custom("AttnBlock", lambda x, *_: (x, x), lambda x, *_: (x, x)) for _ in range(3))
            self.mlp_add_norm = _custom("MlpAddNorm", lambda h, wgu, wd, r, e: (r, r),
                                        lambda h, wgu, wd, r, e: (r, r))
            # attn_block then mlp_add_norm in one call, with 0 / 1 / 2 biases as attn_block
            self.decoder_layer = tuple(_custom("DecoderLayer", lambda x, *_: (x, x), lambda x, *_: (x, x))
                                       for _ in range(3))
            self.paged_attention = _custom(
                "PagedAttention", lambda q, kc, vc, rows, mask, scale: [q[0], q[1] * q[2]],
                lambda q, kc, vc, rows, mask, scale: q)
            self._heads = {}
            self._moves = {}
            self._stacks = {}
            cls._instance = self
        return cls._instance

    def head_topk(self, K: int):
        """The ``head_topk`` primitive for K best (one per K: K is its output's width), made on first use."""
        if K not in self._heads:
            prim = _custom("HeadTopK", lambda h, w, d2t: ([h[0], K], [h[0], K]), lambda h, w, d2t: (h, d2t))
            prim.add_prim_attr("top_k", K)      # part of MindSpore's op cache key: the shape depends on it
            self._heads[K] = prim
        return self._heads[K]

    def decoder_stack(self, inputs: int):
        """The ``decoder_stack`` primitive for a call of ``inputs`` inputs (spec [7] i32 = (nh, n_kv, biases, L,
        a0, a1, a2), tokens, positions, slots, block_table, mask, embed, cos, sin, eps, then each layer's weights
        and caches -> (x [k, H], rms(x) [k, H], aux [k, 3H]); ``cpu_kernels.cc``, DecoderStack), made on first
        use: one per input count, so each primitive keeps one input signature."""
        if inputs not in self._stacks:
            prim = _custom("DecoderStack", lambda spec, tok, pos, slots, table, mask, emb, *_: (
                [tok[0], emb[1]], [tok[0], emb[1]], [tok[0], 3 * emb[1]]),
                lambda spec, tok, pos, slots, table, mask, emb, *_: (emb, emb, emb))
            prim.add_prim_attr("inputs", inputs)
            self._stacks[inputs] = prim
        return self._stacks[inputs]

    def move_rows(self, caches: int):
        """The ``move_rows`` primitive for ``caches`` caches (src [P] i32, dst [P] i32, caches... [R, D] f32 ->
        a dummy f32 [1]; every cache's rows src copied to dst in place, all read before any is written), made on
        first use: one per cache count, so each primitive keeps one input signature."""
        if caches not in self._moves:
            prim = _custom("MoveRows", lambda *shapes: [1], lambda *dtypes: dtypes[2])
            prim.add_prim_attr("caches", caches)
            self._moves[caches] = prim
        return self._moves[caches]


# ------------------------------------------------------------------------------------------ numpy references
def ref_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [k, K] @ w [N, K].T in float64, returned float32 [k, N] (w may be packed: ``pack``)."""
    return (x.astype(np.float64) @ unpack(w).astype(np.float64).T).astype(np.float32)


def ref_move_rows(caches, src, dst) -> list:
    """Copies of ``caches`` (each [R, D]) with rows ``src`` copied to rows ``dst``, all read before any is written
    (:meth:`CpuKernels.move_rows`)."""
    out = [c.copy() for c in caches]
    for c, o in zip(caches, out):
        o[np.asarray(dst)] = c[np.asarray(src)]
    return out


def ref_head_topk(h: np.ndarray, w: np.ndarray, d2t: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(top_logp float32 [k, K], top_ids int32 [k, K]) of :func:`head_topk`: log-softmax of h @ w.T in float64, the
    K largest by value descending then index ascending, ids + d2t[index]."""
    x = h.astype(np.float64) @ unpack(w).astype(np.float64).T
    m = x.max(-1, keepdims=True)
    lp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    idx = np.stack([np.lexsort((np.arange(x.shape[1]), -row))[:K] for row in x])
    return np.take_along_axis(lp, idx, -1).astype(np.float32), (idx + d2t[idx]).astype(np.int32)


def ref_add_rms_norm(x: np.ndarray, d: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(y = x + d, y / sqrt(mean(y^2, -1) + eps)), float32 [k, H] each (norm in float64)."""
    y = (x + d).astype(np.float32)
    y64 = y.astype(np.float64)
    return y, (y64 / np.sqrt((y64 * y64).mean(-1, keepdims=True) + eps)).astype(np.float32)


def ref_qkv_rope(x, wqkv, cos, sin_signed, nh: int, nkv: int, bqkv=None):
    """(q [k, nh, hd], key [k, n_kv, hd], value [k, n_kv, hd]) of x [k, H]: the projection (+ bias) in float64,
    NeoX RoPE on q and key (models/llama.py ``apply_rope``: x * cos + swap_halves(x) * sin_signed)."""
    k, hd = x.shape[0], cos.shape[-1]
    qkv = x.astype(np.float64) @ unpack(wqkv).astype(np.float64).T + (0.0 if bqkv is None else bqkv)
    heads = qkv.reshape(k, nh + 2 * nkv, hd)
    qk = heads[:, : nh + nkv]
    swapped = np.concatenate([qk[..., hd // 2:], qk[..., : hd // 2]], -1)
    rot = qk * cos[:, None] + swapped * sin_signed[:, None]
    return rot[:, :nh].astype(np.float32), rot[:, nh:].astype(np.float32), heads[:, nh + nkv:].astype(np.float32)


def ref_out_add_norm(ctx, wo, resid, eps: float, bo=None):
    """(y = resid + ctx @ wo.T (+ bo), y / sqrt(mean(y^2) + eps)) in float64, returned float32 [k, H] each."""
    y = resid.astype(np.float64) + ctx.astype(np.float64) @ unpack(wo).astype(np.float64).T
    y = y + (0.0 if bo is None else bo)
    return y.astype(np.float32), (y / np.sqrt((y * y).mean(-1, keepdims=True) + eps)).astype(np.float32)


def ref_mlp_add_norm(h, w_gate_up, w_down, resid, eps: float):
    """(y = resid + down(silu(gate) * up), rms(y)) in float64 for h [k, H], w_gate_up [2F, H] = [gate; up], w_down
    [H, F], returned float32 [k, H] each."""
    g, u = np.split(h.astype(np.float64) @ unpack(w_gate_up).astype(np.float64).T, 2, -1)
    y = resid.astype(np.float64) + (g / (1 + np.exp(-g)) * u) @ unpack(w_down).astype(np.float64).T
    return y.astype(np.float32), (y / np.sqrt((y * y).mean(-1, keepdims=True) + eps)).astype(np.float32)


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


def ref_attn_block(x, h, wqkv, wo, cos, sin_signed, nh: int, nkv: int, key_cache, value_cache, write_rows,
                   read_rows, mask, eps: float, bqkv=None, bo=None):
    """The attention block of :func:`attn_block` from the references: (y, rms(y), key_cache', value_cache')
    with the rows' K/V written at ``write_rows`` (copies; the inputs are not modified)."""
    q, key, value = ref_qkv_rope(h, wqkv, cos, sin_signed, nh, nkv, bqkv)
    kc, vc = key_cache.copy(), value_cache.copy()
    kc[write_rows] = key.reshape(-1, key.shape[-1])
    vc[write_rows] = value.reshape(-1, value.shape[-1])
    ctx = ref_paged_attention(q, kc, vc, read_rows, mask, 1.0)
    y, hn = ref_out_add_norm(ctx, wo, x, eps, bo)
    return y, hn, kc, vc
