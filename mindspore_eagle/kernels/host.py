"""The CPU kernels of ``cpu_kernels.cc`` called straight from the host on numpy arrays, without a MindSpore graph.

Legend as in ``cpu.py``: k = rows of one call, H = hidden, V = head rows, K = top-K, R = cache rows, S = attended
slots, G = sequences in a grouped call.

Each kernel is an ``extern "C"`` function with the calling convention of MindSpore's AOT custom ops,
``int f(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra)``
(inputs then outputs in ``params``); :class:`HostKernels` calls the very functions that ``cpu.CpuKernels`` wraps as
graph nodes, through ``ctypes`` (which releases the GIL for the call), on the same library file. A result is
therefore bit for bit the graph node's result for the same inputs. Why: a drafter call of 1-4 rows spends ~1.6 ms in
these kernels and ~0.8-1.6 ms more in MindSpore around them (graph launch, ~20 small ops, output copies), and
three such calls make one draft step (docs/cpu_kernels.md, "Host calls").

Arrays must be C-contiguous; dtypes are passed as numpy names (``float32``, ``float16``, ``int32``), which match
the strings the kernels read (``is_half``). Outputs are new arrays, except the K/V caches, which the attention
block writes in place (pass a view of the cache Parameter's storage: ``Parameter.asnumpy()`` on CPU).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from mindspore_eagle.kernels import cpu

_NAMES = ("Linear", "AddRmsNorm", "AttnBlock", "MlpAddNorm", "HeadTopK", "DecoderStack", "MoveRows")


class HostKernelError(RuntimeError):
    """A kernel refused its arguments (shape mismatch or a row index out of the cache); the message names it."""


class HostKernels:
    """ctypes entry points of the built kernel library (one per process; builds it on first use).

    Raises:
        cpu.KernelBuildError: the kernels cannot be built or loaded here.
    """

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            self = super().__new__(cls)
            lib = ctypes.CDLL(str(cpu.library_path()))
            self._fns = {}
            for name in _NAMES:
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p]
                self._fns[name] = fn
            self._dtype_names = {}
            cls._instance = self
        return cls._instance

    def call(self, name: str, *arrays: np.ndarray) -> None:
        """Run kernel ``name`` over ``arrays`` (its inputs then its outputs, every one C-contiguous).

        Raises:
            HostKernelError: an array is not C-contiguous, or the kernel returned a non-zero code.
        """
        PreparedCall(self, name, list(arrays))({})

    def prepared(self, name: str, arrays: list) -> PreparedCall:
        """A :class:`PreparedCall` of kernel ``name`` whose arguments that never change (the entries of ``arrays``
        that are not None: weights, caches) are marshalled once."""
        return PreparedCall(self, name, arrays)

    def _dtype_name(self, dtype) -> bytes:
        name = self._dtype_names.get(dtype)
        if name is None:
            name = self._dtype_names[dtype] = np.dtype(dtype).name.encode()
        return name

    # ------------------------------------------------------------------ the kernels (contracts: cpu.py)
    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x float32 [k, K] @ w [N, K].T (w float32 or float16, or packed: ``cpu.pack``) -> float32 [k, N]
        (``cpu.ref_linear``)."""
        y = np.empty((x.shape[0], cpu.matrix_rows(w.shape)), np.float32)
        self.call("Linear", x, w, y)
        return y

    def norm(self, x: np.ndarray, eps: np.ndarray) -> np.ndarray:
        """rms(x) float32 [k, H], unweighted: AddRmsNorm of a zero addend, as ``attention.CpuBackend.norm``."""
        y, h = np.empty_like(x), np.empty_like(x)
        self.call("AddRmsNorm", np.zeros_like(x), x, eps, y, h)
        return h

    def attn_block(self, x, h, wqkv, wo, cos, sin_signed, heads, key_cache, value_cache, write_rows, read_rows,
                   mask, eps) -> tuple[np.ndarray, np.ndarray]:
        """(y = x + attention(h) @ wo.T, rms(y)) float32 [k, H] each; writes the rows' K/V into ``key_cache`` /
        ``value_cache`` in place (``cpu.ref_attn_block``; arguments as ``cpu.py``'s ``attn_block``, no biases)."""
        y, hn = np.empty_like(x), np.empty_like(x)
        self.call("AttnBlock", x, h, wqkv, wo, cos, sin_signed, heads, key_cache, value_cache, write_rows, read_rows,
                  mask, eps, y, hn)
        return y, hn

    def mlp_add_norm(self, h, w_gate_up, w_down, resid, eps) -> tuple[np.ndarray, np.ndarray]:
        """(y = resid + down(silu(gate) * up), rms(y)) float32 [k, H] each (``cpu.ref_mlp_add_norm``)."""
        y, hn = np.empty_like(resid), np.empty_like(resid)
        self.call("MlpAddNorm", h, w_gate_up, w_down, resid, eps, y, hn)
        return y, hn

    def head_topk(self, h, w, d2t, K: int) -> tuple[np.ndarray, np.ndarray]:
        """(top_logp float32 [k, K], top_ids int32 [k, K]) of h float32 [k, H] against w [V, H] and d2t int32 [V]
        (``cpu.ref_head_topk``)."""
        lp, ids = np.empty((h.shape[0], K), np.float32), np.empty((h.shape[0], K), np.int32)
        self.call("HeadTopK", h, w, d2t, lp, ids)
        return lp, ids


class PreparedCall:
    """One kernel call whose ctypes argument arrays are built once: a call of the teacher's DecoderStack has ~200
    arguments, and marshalling them all per call cost ~0.8 ms (numpy ``ctypes`` objects and shape arrays); here the
    fixed ones are marshalled at construction and a call sets only the others (:meth:`__call__`).

    Args:
        kernels: the :class:`HostKernels`. name: the kernel. arrays: every argument in order (inputs, then
            outputs); None marks one given per call. The fixed arrays are kept referenced (their memory must live).
    Raises:
        HostKernelError: a fixed array is not C-contiguous.
    """

    def __init__(self, kernels: HostKernels, name: str, arrays: list):
        n = len(arrays)
        self.name, self.kernels, self.fn = name, kernels, kernels._fns[name]
        self.n = n
        self.ptrs, self.ndims = (ctypes.c_void_p * n)(), (ctypes.c_int * n)()
        self.shapes, self.dtypes = (ctypes.POINTER(ctypes.c_int64) * n)(), (ctypes.c_char_p * n)()
        self.arrays = list(arrays)
        self._keep = [None] * n
        self._lock = threading.Lock()          # the argument arrays are shared: one call at a time
        for i, a in enumerate(arrays):
            if a is not None:
                self._set(i, a)

    def _set(self, i: int, a: np.ndarray) -> None:
        if not a.flags.c_contiguous:
            raise HostKernelError(f"{self.name}: argument {i} is not C-contiguous")
        self.ptrs[i] = a.__array_interface__["data"][0]
        self.ndims[i] = a.ndim
        shape = (ctypes.c_int64 * max(1, a.ndim))(*a.shape)
        self._keep[i] = shape
        self.shapes[i] = shape
        self.dtypes[i] = self.kernels._dtype_name(a.dtype)
        self.arrays[i] = a

    def __call__(self, given: dict) -> None:
        """Run the kernel with the per-call arguments ``given`` {index: C-contiguous array} (every None slot of
        the construction, and any fixed one to replace).
        Raises:
            HostKernelError: an array is not C-contiguous, or the kernel returned a non-zero code."""
        with self._lock:
            for i, a in given.items():
                self._set(i, a)
            rc = self.fn(self.n, self.ptrs, self.ndims, self.shapes, self.dtypes, None, None)
        if rc:
            raise HostKernelError(f"{self.name} refused its arguments (code {rc}): shapes "
                                  f"{[tuple(a.shape) for a in self.arrays][:20]}")
