"""Compiled graphs reused across processes, keyed by shape: a store of MindSpore compile-cache files.

MindSpore 2.9's compile cache (``enable_compile_cache`` + ``compile_cache_path``) names the file of a process's
n-th cache-enabled compile ``<path>/rank_0/graph_cache/compile_cache_<n>.mindir`` (a process-wide counter) and, when
that file exists, loads it for the n-th compile **whatever the graph's shapes are** (a file of other shapes runs
and fails in a CPU memcpy kernel; one whose bytes are damaged but still parse runs unchecked). What this module
relies on, observed on MindSpore 2.9.0 and checked by tests/kernels/test_graph_cache.py:

- the path is read at the process's first cache-enabled compile and kept; the counter counts cache-enabled compiles
  only (loaded or compiled; compiles with the cache off do not move it);
- a file that does not parse is compiled over (MindSpore logs an error and writes a fresh file);
- a loaded graph binds the Cell's *current* Parameters by name: weights are not in the file (~1 MB per graph of the
  135M teacher), so graphs are shared by checkpoints of one architecture;
- with ``MS_DEV_FORCE_USE_COMPILE_CACHE=1`` MindSpore skips its own check (a hash of the entry script and its
  imports), which this store replaces by a key per graph.

So :class:`GraphStore` keeps one file per key = (MindSpore version, device, the Cell's class sources, structure,
constants and Parameter shapes, the jitted method, the input shapes and dtypes), and every new input signature of a
:class:`~mindspore_eagle.kernels.runtime.CompiledFn` passes through :meth:`GraphStore.compile`:

- before the call, the process's private staging directory is emptied and, when the key is stored and its file
  passes the checks (sha256 of the bytes as stored; graph name, input shapes/dtypes and Parameter shapes read from
  the MindIR match the call and the Cell), the file is placed at the index of the next compile;
- after the call, a file MindSpore wrote is checked the same way and stored under the key; the index it was
  written at re-synchronises the counter (a compile outside CompiledFn cannot make a later one load a wrong file,
  because nothing but this call's own checked file is ever in the staging directory).

A stored file that fails a check is deleted and the graph compiled afresh (and stored again); a placed file that
MindSpore fails to load is deleted and the call compiled once more. Loading a graph takes ~0.3 s against 4-20 s to
compile one on the 2-core CPU.

Layout: ``$MSEAGLE_CACHE/graphs/ms-<MindSpore version>-<device>/{entry.py, entries/<key>.mindir,
entries/<key>.json, stage/<pid>/rank_0/graph_cache/}``; files are written to a temporary name and renamed, so
concurrent processes (batch shards) share the store safely. ``rm -rf $MSEAGLE_CACHE/graphs`` empties it.
"""
from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import os
import shutil
import threading
import time
import weakref
from pathlib import Path

FORMAT = 1
_PKG = Path(__file__).resolve().parent.parent          # mindspore_eagle/
_DTYPE_CODES = {"Float32": 1, "UInt8": 2, "Int8": 3, "UInt16": 4, "Int16": 5, "Int32": 6, "Int64": 7, "Bool": 9,
                "Float16": 10, "Float64": 11, "UInt32": 12, "UInt64": 13, "BFloat16": 16}
_active: GraphStore | None = None     # the store compiles go through now
_store: GraphStore | None = None      # the process's store: its staging directory is MindSpore's cache path
_holders = 0
_lock = threading.RLock()


def default_root() -> Path:
    """$MSEAGLE_CACHE/graphs (default ~/.cache/mindspore_eagle/graphs)."""
    from mindspore_eagle.config import cache_dir

    return cache_dir() / "graphs"


def active() -> GraphStore | None:
    """The store this process compiles through, or None."""
    return _active


def activate(root=None, device: str = "CPU", holder=None) -> GraphStore | None:
    """Route every later compile of a :class:`~mindspore_eagle.kernels.runtime.CompiledFn` through a
    :class:`GraphStore` under ``root`` (default :func:`default_root`) while ``holder`` (e.g. the engine) lives
    (None: for the rest of the process); a store already active stays as it is (its root wins).

    Returns None (nothing changes) off CPU (the compile cache of Ascend / GPU backends writes more files and is
    unverified here) or when MindSpore's compile cache was switched on elsewhere in this process (its path and
    counter are then not ours).
    """
    global _active, _store, _holders
    if device != "CPU":
        return None
    with _lock:
        if _active is None:
            import mindspore as ms

            if _store is None:
                if ms.get_context("enable_compile_cache") or os.environ.get("MS_COMPILER_CACHE_ENABLE") == "1":
                    return None
                _store = GraphStore(Path(root) if root else default_root(), device)
                _store._switch_on()
            else:               # MindSpore keeps the staging path of its first cache-enabled compile: reuse it
                _store._use(Path(root) if root else default_root())
                ms.set_context(enable_compile_cache=True)
            _active = _store
        if holder is not None:
            _holders += 1
            weakref.finalize(holder, _release)
        return _active


def _release() -> None:
    global _holders
    with _lock:
        _holders -= 1
        if _holders <= 0:
            deactivate()


def deactivate() -> None:
    """Stop routing compiles through the store (MindSpore's compile cache off); a later :func:`activate` resumes
    with the same staging directory and counter."""
    global _active, _holders
    with _lock:
        if _active is None:
            return
        import mindspore as ms

        ms.set_context(enable_compile_cache=False)
        _active, _holders = None, 0


class GraphStore:
    """Compiled graphs on disk, one per (Cell, method, input signature) key (module docstring).

    Args:
        root: parent directory; the store lives in ``root/ms-<version>-<device>``. device: MindSpore device target.
    Attributes:
        dir: the store's directory. stats: {"loaded", "compiled", "stored", "rejected"} counts of this process.
    """

    def __init__(self, root, device: str = "CPU"):
        import mindspore as ms

        self.version, self.device = ms.__version__, device
        self.dir = Path(root) / f"ms-{self.version}-{device}"
        self.entries = self.dir / "entries"
        self.stage = self.dir / "stage" / str(os.getpid())
        self.graphs = self.stage / "rank_0" / "graph_cache"
        self.next = 0                       # index MindSpore gives the next cache-enabled compile
        self.stats = {"loaded": 0, "compiled": 0, "stored": 0, "rejected": 0}
        self._fingerprints = weakref.WeakKeyDictionary()    # Cell -> cell_fingerprint (never keeps a Cell alive)

    # ------------------------------------------------------------------ process setup
    def _switch_on(self) -> None:
        import mindspore as ms
        from mindspore.graph import api

        self.entries.mkdir(parents=True, exist_ok=True)
        self._clean_stale_stages()
        shutil.rmtree(self.stage, ignore_errors=True)
        self.graphs.mkdir(parents=True, exist_ok=True)
        entry = self.dir / "entry.py"
        if not entry.is_file():
            _atomic_write(entry, b"# mindspore_eagle graph store: MindSpore's entry-script scan reads this file\n")
        # MindSpore scans the entry script and its imports on every cache-enabled compile (and cannot resolve the
        # relative imports of `python -m mindspore_eagle`); the store keys graphs itself, so the scan gets one file
        api.entry_script_path = str(entry)
        os.environ["MS_DEV_FORCE_USE_COMPILE_CACHE"] = "1"
        ms.set_context(enable_compile_cache=True, compile_cache_path=str(self.stage))
        atexit.register(shutil.rmtree, self.stage, True)

    def _use(self, root: Path) -> None:
        """Keep graphs under another root from now on (the staging directory stays where MindSpore writes)."""
        self.dir = Path(root) / f"ms-{self.version}-{self.device}"
        self.entries = self.dir / "entries"
        self.entries.mkdir(parents=True, exist_ok=True)

    def _clean_stale_stages(self) -> None:
        for d in (self.dir / "stage").glob("*") if (self.dir / "stage").is_dir() else []:
            try:
                os.kill(int(d.name), 0)
            except ProcessLookupError:
                shutil.rmtree(d, ignore_errors=True)
            except (ValueError, PermissionError, OSError):
                pass

    # ------------------------------------------------------------------ keys
    def key(self, fn, sig) -> tuple[str, dict]:
        """(hex key, key dict) of ``fn`` (a bound Cell method or a Cell) called with input signature ``sig``
        (((shape), dtype str), ...), as :class:`~mindspore_eagle.kernels.runtime.CompiledFn` records it."""
        cell, method = _cell_of(fn)
        fp = self._fingerprints.get(cell)
        if fp is None:
            fp = self._fingerprints[cell] = cell_fingerprint(cell)
        key = {"format": FORMAT, "mindspore": self.version, "device": self.device, "cell": type(cell).__qualname__,
               "method": method, "fingerprint": fp, "inputs": [[list(s), d] for s, d in sig]}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32], key

    def contains(self, fn, sig) -> bool:
        """A file is stored for this call (not checked: :meth:`compile` checks before using it)."""
        k, _ = self.key(fn, sig)
        return (self.entries / f"{k}.json").is_file()

    # ------------------------------------------------------------------ the compile
    def compile(self, fn, sig, call, on_start=None) -> tuple:
        """Run ``call()`` (the first call of ``fn`` with input signature ``sig``) with the stored graph placed for
        it, or compile it and store the result. ``on_start(loading: bool)`` is called just before.

        Returns:
            (call's result, "loaded" | "compiled").
        """
        from mindspore.graph import api

        k, key = self.key(fn, sig)
        cell, _ = _cell_of(fn)
        with _lock:
            placed = self._place(k, key, cell, sig)
            if on_start is not None:
                on_start(placed is not None)
            phases = len(api.ms_compile_cache)
            try:
                out = call()
            except Exception:
                self._clear_stage()             # the index MindSpore used is passed either way
                if placed is None:
                    raise
                self._reject(k, "MindSpore could not load it")
                return self.compile(fn, sig, call)
            if len(api.ms_compile_cache) == phases:  # MindSpore had this graph in memory: no compile, no index
                for f in self.graphs.glob("compile_cache_*.mindir"):
                    f.unlink(missing_ok=True)
                return out, "loaded"
            kind = self._settle(k, key, cell, sig, placed)
        return out, kind

    def _clear_stage(self) -> None:
        """Remove every graph file from the staging directory; a file a compile outside CompiledFn left at
        index i moves the counter past i."""
        self.graphs.mkdir(parents=True, exist_ok=True)
        for f in self.graphs.glob("compile_cache_*.mindir"):
            idx = _index(f)
            if idx is not None and idx >= self.next:
                self.next = idx + 1
            f.unlink(missing_ok=True)

    def _place(self, k: str, key: dict, cell, sig):
        """Copy the stored graph of key ``k`` to the next index when it passes the checks; returns its
        (inode, mtime_ns) or None."""
        self._clear_stage()
        meta_path, graph_path = self.entries / f"{k}.json", self.entries / f"{k}.mindir"
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            data = graph_path.read_bytes()
        except (OSError, ValueError):
            self._reject(k, "unreadable")
            return None
        problem = None
        if meta.get("key") != key:
            problem = "stored under another key"
        elif hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            problem = "bytes changed since it was stored"
        else:
            problem = check_graph(data, cell, key["method"], sig)
        if problem:
            self._reject(k, problem)
            return None
        dst = self.graphs / f"compile_cache_{self.next}.mindir"
        _atomic_write(dst, data)
        st = dst.stat()
        return st.st_ino, st.st_mtime_ns

    def _settle(self, k: str, key: dict, cell, sig, placed) -> str:
        """After the call: "loaded" (the placed file was used) or "compiled" (a file was written: checked and
        stored); moves the counter to what MindSpore did and empties the staging directory."""
        files = {}
        for f in self.graphs.glob("compile_cache_*.mindir"):
            idx = _index(f)
            if idx is not None:
                st = f.stat()
                files[idx] = (f, (st.st_ino, st.st_mtime_ns))
        written = {i: f for i, (f, ident) in files.items() if not (i == self.next and ident == placed)}
        kind = "compiled"
        if not written:
            if placed is not None and self.next in files:
                kind = "loaded"
                self.next += 1
        elif len(written) == 1:
            (i, (f, _)), = ((i, files[i]) for i in written)
            self._keep(k, key, cell, sig, f.read_bytes())
            self.next = i + 1
        else:                                   # more than one graph from one call: keep none of them
            self.next = max(written) + 1
        for f, _ in files.values():
            f.unlink(missing_ok=True)
        self.stats[kind] += 1
        return kind

    def _keep(self, k: str, key: dict, cell, sig, data: bytes) -> None:
        if check_graph(data, cell, key["method"], sig):
            return                              # not this call's graph (a compile we did not see): never stored
        meta = {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "created": time.time()}
        try:
            self.entries.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.entries / f"{k}.mindir", data)
            _atomic_write(self.entries / f"{k}.json", json.dumps(meta, sort_keys=True).encode())
            self.stats["stored"] += 1
        except OSError:
            pass                                 # a read-only or full disk: the graph is still used in-process

    def _reject(self, k: str, why: str) -> None:
        self.stats["rejected"] += 1
        for suffix in (".json", ".mindir"):
            (self.entries / f"{k}{suffix}").unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- helpers --
def _cell_of(fn):
    """(Cell, method name) of a bound Cell method or a Cell."""
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        return owner, fn.__name__
    return fn, "construct"


def _index(path: Path):
    try:
        return int(path.stem.rsplit("_", 1)[1])
    except (IndexError, ValueError):
        return None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _source_digest(files) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.encode())
        try:
            h.update(Path(f).read_bytes())
        except OSError:
            pass
    return h.hexdigest()


def cell_fingerprint(cell) -> dict:
    """What a Cell's graphs depend on besides the input shapes, as a JSON-able dict: the sources of this
    package's classes it is built from, every Parameter's name, shape and dtype (weights are bound at load,
    never stored), and every other attribute of it, its sub-cells and the plain objects they hold (numbers,
    strings, dtypes, configs, primitives and their attributes, constant tensors by content)."""
    from mindspore import nn

    base = set(vars(nn.Cell()).keys())          # MindSpore's own bookkeeping (create time, ids, hooks, ...)
    files: set = set()
    seen: dict = {}

    def src(obj):
        try:
            f = inspect.getsourcefile(type(obj))
        except (TypeError, OSError):
            return
        if f and Path(f).resolve().is_relative_to(_PKG):
            files.add(str(Path(f).resolve().relative_to(_PKG)))

    def fp(v, depth=0):
        import mindspore as ms
        import numpy as np

        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (tuple, list)):
            return [fp(x, depth) for x in v]
        if isinstance(v, dict):
            return {str(k): fp(x, depth) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
        if isinstance(v, ms.Parameter):
            return ["param", v.name, list(v.shape), str(v.dtype)]
        if isinstance(v, (ms.Tensor, np.ndarray)):
            arr = v.asnumpy() if isinstance(v, ms.Tensor) else v
            return ["tensor", str(arr.dtype), list(arr.shape), hashlib.sha256(np.ascontiguousarray(arr)).hexdigest()]
        if isinstance(v, ms.dtype.Type):
            return ["dtype", str(v)]
        if isinstance(v, ms.ops.Primitive):
            return ["prim", type(v).__name__, fp(dict(v.attrs), depth)]
        if id(v) in seen:
            return ["ref", seen[id(v)]]
        if not hasattr(v, "__dict__") or inspect.ismodule(v) or inspect.isroutine(v) or depth > 8:
            return ["object", getattr(v, "__qualname__", type(v).__qualname__)]
        seen[id(v)] = len(seen)
        src(v)
        attrs = {k: x for k, x in vars(v).items() if not (isinstance(v, nn.Cell) and k in base)}
        if isinstance(v, nn.Cell):
            attrs.update(_params=dict(v._params), _cells=dict(v._cells), _primitives=dict(v._primitives))
        return [type(v).__qualname__, {k: fp(x, depth + 1) for k, x in sorted(attrs.items())}]

    tree = fp(cell)
    params = [[n, list(p.shape), str(p.dtype)] for n, p in cell.parameters_dict().items()]
    return {"tree": hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest(),
            "params": hashlib.sha256(json.dumps(params).encode()).hexdigest(),
            "sources": _source_digest(str(_PKG / f) for f in files | {"models/llama.py", "models/eagle3.py",
                                                                       "kernels/attention.py", "kernels/kv.py"})}


# ------------------------------------------------------------------------------------------- MindIR check --
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, i
        shift += 7


def _fields(buf: bytes, lo: int = 0, hi: int | None = None):
    """(field number, wire type, value) of a protobuf message: value is an int (varint / fixed) or (start, end)
    of a length-delimited field."""
    i, hi = lo, len(buf) if hi is None else hi
    while i < hi:
        tag, i = _varint(buf, i)
        num, wt = tag >> 3, tag & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = (i, i + n), i + n
        elif wt == 1:
            v, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wt == 5:
            v, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"protobuf wire type {wt}")
        if i > hi:
            raise ValueError("truncated protobuf field")
        yield num, wt, v


def _tensor(buf: bytes, span) -> tuple[str, list, int]:
    """(name, dims, data_type) of a MindIR TensorProto."""
    name, dims, dtype = "", [], 0
    for num, wt, v in _fields(buf, *span):
        if num == 1 and wt == 0:
            dims.append(v)
        elif num == 1 and wt == 2:                        # packed dims
            i, end = v
            while i < end:
                d, i = _varint(buf, i)
                dims.append(d)
        elif num == 2:
            dtype = v
        elif num == 7 and wt == 2:
            name = buf[v[0]:v[1]].decode("utf-8", "replace")
    return name, dims, dtype


def read_graph(data: bytes) -> dict:
    """The parts of a MindIR file (``ModelProto``) that identify a graph: {"name", "inputs": [(dims, dtype code)],
    "params": {name: dims}}, without parsing its nodes (MindSpore's pure-Python protobuf takes ~0.4 s per file).

    Raises:
        ValueError: not a MindIR ModelProto.
    """
    graph = None
    for num, wt, v in _fields(data):
        if num == 7 and wt == 2:
            graph = v
    if graph is None:
        raise ValueError("no graph in the MindIR file")
    out = {"name": "", "inputs": [], "params": {}}
    for num, wt, v in _fields(data, *graph):
        if wt != 2:
            continue
        if num == 2:
            out["name"] = data[v[0]:v[1]].decode("utf-8", "replace")
        elif num == 3:
            name, dims, _ = _tensor(data, v)
            out["params"][name.rsplit(":", 1)[-1]] = dims
        elif num == 5:
            tensors = [_tensor(data, t) for n, w, t in _fields(data, *v) if n == 2 and w == 2]
            out["inputs"].append((tensors[0][1], tensors[0][2]) if tensors else ([], 0))
    return out


def check_graph(data: bytes, cell, method: str, sig) -> str | None:
    """None when the MindIR ``data`` is the graph of ``cell.method`` for input signature ``sig`` (graph name,
    input shapes and dtypes, Parameter names and shapes); else what differs."""
    try:
        g = read_graph(data)
    except (ValueError, IndexError):
        return "not a MindIR graph"
    # MindSpore names a Cell's construct graph "<n>_<module>_<Class>_construct_<m>", another method's "<n>_<method>_<m>"
    if f"_{method}_" not in g["name"] or (method == "construct" and f"_{type(cell).__name__}_" not in g["name"]):
        return f"graph {g['name']!r} is not {type(cell).__name__}.{method}"
    inputs = [(list(s), _DTYPE_CODES.get(d, -1)) for s, d in sig]
    if [(list(d), t) for d, t in g["inputs"]] != inputs:
        return f"inputs {g['inputs']} are not {inputs}"
    params = {n: list(p.shape) for n, p in cell.parameters_dict().items()}
    for name, dims in g["params"].items():
        if params.get(name) != list(dims):
            return f"parameter {name} {dims} is not the Cell's {params.get(name)}"
    return None


__all__ = ["GraphStore", "activate", "active", "cell_fingerprint", "check_graph", "deactivate", "default_root",
           "read_graph"]
