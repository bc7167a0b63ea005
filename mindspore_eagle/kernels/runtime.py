"""Process-wide MindSpore runtime settings and the fused (jit) / eager (PyNative) switch.

MindSpore's CPU defaults (25 kernel threads, 5 dispatch threads) oversubscribe a small machine: PyNative
decode of the 135M teacher takes 2.8 s/token with them and ~0.3 s/token with ``threads_num(2)`` +
``launch_blocking()`` (docs/design.md, "MindSpore runtime settings on CPU"). ``configure()`` applies those settings
once, before the first kernel runs.

Execution modes (one process can hold both, so fused and eager can be compared token for token):
- ``fused``: the Cell's ``construct`` wrapped with ``mindspore.jit`` (a compiled static graph per input
  shape; GRAPH_MODE semantics inside the jitted call).
- ``eager``: plain PyNative calls, op by op, for debugging; the engine adds invariant checks each step.
"""
from __future__ import annotations

import os
import time
import warnings

_CONFIGURED = False
_THREADS = [os.cpu_count() or 1]
MODES = ("fused", "eager")


def configure(threads: int | None = None, device_target: str = "CPU", device_id: int = 0) -> None:
    """Set MindSpore's device, kernel threads and blocking launch once per process.

    Args:
        threads: kernel threads; default ``min(os.cpu_count(), 8)`` or env ``MSEAGLE_THREADS``.
        device_target: "CPU", "GPU" or "Ascend".
        device_id: device index for GPU / Ascend.
    Raises:
        ValueError: device_target is not one of CPU/GPU/Ascend.
    """
    global _CONFIGURED
    if _CONFIGURED:
        return
    if device_target not in ("CPU", "GPU", "Ascend"):
        raise ValueError(f"context.device_target must be one of CPU, GPU, Ascend, got {device_target!r}")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import mindspore as ms

    ms.set_device(device_target, device_id)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if device_target == "CPU":
        n = int(os.environ.get("MSEAGLE_THREADS", 0)) or min(os.cpu_count() or 1, 8)
        if threads:
            n = threads
        ms.device_context.cpu.op_tuning.threads_num(n)
        _THREADS[0] = n
        ms.runtime.dispatch_threads_num(1)
        ms.runtime.launch_blocking()
    _CONFIGURED = True


def kernel_threads() -> int:
    """Kernel threads of this process on CPU (set by :func:`configure`; before it, ``os.cpu_count()``)."""
    return _THREADS[0]


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is "fused" or "eager"; raise ValueError naming the field otherwise."""
    if mode not in MODES:
        raise ValueError(f"speculative.mode must be one of {MODES}, got {mode!r}")
    return mode


_compile_listener = None
_stats = {"compiles": 0, "loads": 0, "compile_ms": 0.0, "load_ms": 0.0}


def set_compile_listener(fn) -> None:
    """Call ``fn(event: str, name: str, signature: tuple, ms: float)`` around the first call of every new input
    signature of a fused :class:`CompiledFn` (None = stop): ``event`` is "compiling" or "loading" (from the graph
    store, :mod:`~mindspore_eagle.kernels.graph_cache`) just before the call (ms = 0), then "compiled" or "loaded"
    with the wall ms of that call, or "failed" when the call raised. The CLI prints progress lines from it, so the
    seconds spent are never silent. Several threads may compile at once (a server's warm-up and a request), so a
    listener pairs the events of one compile by (name, signature).
    """
    global _compile_listener
    _compile_listener = fn


def graph_stats() -> dict:
    """Process-wide counts: {"compiles", "loads", "compile_ms", "load_ms"} of every fused CompiledFn so far."""
    return dict(_stats)


def _notify(event: str, name: str, sig: tuple, ms_: float = 0.0) -> None:
    if _compile_listener is not None:
        _compile_listener(event, name, sig, ms_)


class CompiledFn:
    """A Cell method run either jitted (fused) or eagerly, counting the graphs it compiles and loads.

    The first call of each new (shape, dtype) input signature makes a graph: through the graph store when one is
    active (``graph_cache.activate``: loaded from disk when stored, else compiled and stored), else compiled.

    Attributes:
        compiles: graphs compiled in this process (seconds each on a 2-core CPU; docs/design.md, "Static shapes
            on CPU"). loads: graphs loaded from the graph store instead (~0.3 s each).
        compile_ms: wall ms of the calls that compiled or loaded a graph (that work plus the one execution).
    """

    def __init__(self, fn, mode: str):
        import mindspore as ms

        self.mode = check_mode(mode)
        self._raw = fn
        self._fn = ms.jit(fn) if mode == "fused" else fn
        self._seen: set = set()
        self._runs: dict = {}          # input signature -> a direct run of its graph (graph_runner), or None
        self.compiles = self.loads = 0
        self.compile_ms = 0.0
        self.name = getattr(fn, "__qualname__", None) or f"{type(fn).__name__}.construct"

    def __call__(self, *args):
        if self.mode == "fused":
            sig = tuple((tuple(a.shape), str(a.dtype)) for a in args)
            run = self._runs.get(sig)
            if run is not None:
                return run(args)
            if sig not in self._seen:
                out = self._first_call(sig, args)
                self._runs[sig] = graph_runner(self._raw, args)
                return out
        return self._fn(*args)

    def _first_call(self, sig: tuple, args: tuple):
        from mindspore_eagle.kernels import graph_cache

        store = graph_cache.active()
        t0 = time.perf_counter()
        try:
            if store is None:
                _notify("compiling", self.name, sig)
                out, kind = self._fn(*args), "compiled"
            else:
                out, kind = store.compile(self._raw, sig, lambda: self._fn(*args),
                                          lambda loading: _notify("loading" if loading else "compiling", self.name, sig))
        except BaseException:
            _notify("failed", self.name, sig, (time.perf_counter() - t0) * 1e3)
            raise
        self._seen.add(sig)
        ms_ = (time.perf_counter() - t0) * 1e3
        self.compile_ms += ms_
        if kind == "loaded":
            self.loads += 1
            _stats["loads"] += 1
            _stats["load_ms"] += ms_
        else:
            self.compiles += 1
            _stats["compiles"] += 1
            _stats["compile_ms"] += ms_
        _notify(kind, self.name, sig, ms_)
        return out


def graph_runner(fn, args):
    """A function ``run(args) -> outputs`` that launches the graph ``mindspore.jit(fn)`` compiled for the input
    signature of ``args`` straight through MindSpore's graph executor, or None where that cannot be done.

    ``mindspore.jit``'s wrapper does per call what a compiled signature no longer needs: binds the arguments
    against the function's signature, checks them, makes a new executor object, rebuilds the graph's cache key
    and launches through PyNative's ``grad_jit``: ~0.6 ms a call on the 2-core CPU (docs/cpu_kernels.md, "Host
    work around a forward"). The run made here is the one ``_JitExecutor`` itself makes for inference
    (``_predict``: the graph executor called with the run arguments and the phase); the phase is the one the
    first call compiled (taken from MindSpore's compile cache, never compiled again: None if it is not there).
    MindSpore 2.9's private ``mindspore.graph.api`` names are used; where they are missing, or autograd is on,
    the answer is None and the caller keeps ``mindspore.jit``.
    """
    import mindspore as ms

    try:
        from mindspore.graph.api import _get_args_for_run, _JitExecutor, _pynative_executor, ms_compile_cache
    except ImportError:                       # another MindSpore: keep mindspore.jit
        return None
    obj = fn if isinstance(fn, ms.nn.Cell) else getattr(fn, "__self__", None)
    func = fn.construct.__func__ if isinstance(fn, ms.nn.Cell) else getattr(fn, "__func__", None)
    if func is None or not isinstance(obj, ms.nn.Cell) or _pynative_executor.requires_grad():
        return None
    try:
        ex = _JitExecutor(func, 0, None, obj, None, 0, "")
        known = set(ms_compile_cache)
        phase = ex.compile(func.__name__, *args)
    except Exception:                         # noqa: BLE001  (any failure: keep mindspore.jit)
        return None
    if phase not in known:                    # not the graph the first call made: keep mindspore.jit
        return None
    # this graph's own flags: ``_generate_run_args`` would read the Cell's, which the last compile of any of its
    # methods sets (a drafter's context pass and expansion step have different arities)
    executor, modified, flags = ex._graph_executor, ex.sequence_modified, ex._mutable_flags
    if flags is None or len(flags) != len(args):
        return None

    def run(call_args):
        return executor(tuple(_get_args_for_run(ex, call_args, {}, flags, modified)), phase)

    return run
