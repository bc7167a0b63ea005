"""Compiled graphs reused across processes: MindSpore's compile cache, keyed and ordered so that it is safe.

MindSpore 2.9 saves the graphs of ``mindspore.jit`` functions when ``enable_compile_cache`` is on (context or
``MS_COMPILER_CACHE_ENABLE=1``), as ``<compile_cache_path>/rank_0/graph_cache/compile_cache_<n>.mindir``, where n
counts the graphs compiled by the process, and a later process loads file n for its n-th compile **whatever that
graph's shapes are**. Measured here: a cache written by a 37-token prompt, then a 400-token prompt (whose first
graph is another prefill bucket) loaded the wrong graph and failed inside a CPU memcpy kernel. Two more catches:
the path is read once per process (at its first compile), and with ``python -m mindspore_eagle`` MindSpore's
scan of the entry script's imports fails (``ImportError: no package specified for '.cli.main'``).

So the cache is used only around :func:`~mindspore_eagle.runners.warmup.warmup` in ``full`` mode, which compiles every
graph in one fixed order, and is switched off right after it (a graph compiled later is never saved, so it can
never be loaded in another's place). Its directory is keyed by everything that changes those graphs: MindSpore's
version, this package's model/runner sources, the checkpoint files (path, size, mtime), the cache geometry and the
tree budgets; the key is also the one "dependency file" MindSpore hashes. A cache that fails to load is deleted
and the warm-up compiles afresh.

Layout: ``$MSEAGLE_CACHE/graphs/<key hash>/{key.py, complete.json, rank_0/graph_cache/*.mindir}``; a process
that builds a cache writes ``<key hash>.tmp<pid>`` and renames it into place once complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

_SOURCES = ("kernels/runtime.py", "kernels/kv.py", "kernels/attention.py", "runners/teacher.py",
            "runners/drafter.py", "runners/shapes.py", "runners/warmup.py", "core/tree.py", "models/llama.py",
            "models/eagle3.py")
_active: "GraphCache | None" = None


def _file_ids(path: str) -> list:
    """[(name, size, mtime_ns)] of a checkpoint file or of the files of a checkpoint directory."""
    p = Path(path)
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p] if p.is_file() else []
    return [(str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in files]


def cache_key(cfg, budgets, teacher_path: str, drafter_path: str | None) -> dict:
    """Everything the warm-up's graphs depend on, as a JSON-able dict.

    Args:
        cfg: Config. budgets: verify budgets (ints). teacher_path / drafter_path: checkpoint locations (a file
            or a directory; None or a non-path spec like "random" is keyed by name).
    """
    import mindspore as ms

    here = Path(__file__).parent.parent
    src = hashlib.sha256(b"".join((here / f).read_bytes() for f in _SOURCES)).hexdigest()
    sp = cfg.speculative
    return {"mindspore": ms.__version__, "sources": src, "device": cfg.context.device_target,
            "dtype": cfg.model.dtype, "cache": dict(vars(cfg.cache)), "M": sp.M, "D_max": sp.D_max,
            "top_k": sp.top_k, "budgets": list(budgets), "max_batch": cfg.batch.max_batch,
            "teacher": _file_ids(teacher_path) or teacher_path,
            "drafter": (_file_ids(drafter_path) or drafter_path) if drafter_path else None}


def default_root() -> Path:
    """$MSEAGLE_CACHE/graphs (default ~/.cache/mindspore_eagle/graphs)."""
    from mindspore_eagle.config import cache_dir

    return cache_dir() / "graphs"


class GraphCache:
    """One keyed cache directory. Use :meth:`open` before the first compile of the process, :meth:`close` after
    the full warm-up.

    Args:
        root: parent directory (e.g. :func:`default_root`). key: dict from :func:`cache_key`.
    Attributes:
        dir: root / sha256(key)[:16]. complete: a previous full warm-up with this key finished and saved.
    """

    def __init__(self, root, key: dict):
        text = json.dumps(key, sort_keys=True)
        self.key_text = text
        self.dir = Path(root) / hashlib.sha256(text.encode()).hexdigest()[:16]
        self.work = self.dir          # where MindSpore reads / writes while open (a private copy when writing)
        self.opened = False

    @property
    def complete(self) -> bool:
        try:
            done = json.loads((self.dir / "complete.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return done.get("key") == self.key_text and bool(list(self.dir.glob("rank_*/graph_cache/*.mindir")))

    def open(self) -> bool:
        """Switch MindSpore's compile cache on, in :attr:`dir`. Returns False (and does nothing) when a graph has
        already been compiled in this process with the cache off, or another cache is open (the path is read at
        the first compile only)."""
        global _active
        import mindspore as ms
        import mindspore.graph.api as api

        if _active is not None or api.ms_compile_cache:
            return False
        # a complete cache is only read; a new one is written into a private directory and renamed into place
        # when complete, so concurrent processes (batch shards) never read a half-written graph
        self.work = self.dir if self.complete else self.dir.with_name(f"{self.dir.name}.tmp{os.getpid()}")
        shutil.rmtree(self.work, ignore_errors=True) if self.work != self.dir else None
        self.work.mkdir(parents=True, exist_ok=True)
        keyfile = self.work / "key.py"
        keyfile.write_text("# mindspore_eagle graph cache key (hashed by MindSpore as the entry script)\n# "
                           + self.key_text + "\n", encoding="utf-8")
        # MindSpore hashes the entry script and its imports to invalidate the cache; the real entry point is
        # `python -m mindspore_eagle` or a console script, whose relative imports its scanner cannot resolve.
        api.entry_script_path = str(keyfile)
        ms.set_context(enable_compile_cache=True, compile_cache_path=str(self.work))
        self.opened, _active = True, self
        return True

    def close(self, ok: bool, compiles: int = 0) -> None:
        """Switch the compile cache off; when ``ok`` record the directory as complete (``compiles`` graphs)."""
        global _active
        import mindspore as ms

        if not self.opened:
            return
        ms.set_context(enable_compile_cache=False)
        self.opened, _active = False, None
        if not ok or self.work == self.dir:
            return
        (self.work / "complete.json").write_text(json.dumps({"key": self.key_text, "compiles": compiles}),
                                                 encoding="utf-8")
        if self.complete:                     # another process finished first: keep its copy
            shutil.rmtree(self.work, ignore_errors=True)
            return
        shutil.rmtree(self.dir, ignore_errors=True)       # an incomplete or damaged one
        try:
            os.rename(self.work, self.dir)
        except OSError:                       # lost a race to another writer
            shutil.rmtree(self.work, ignore_errors=True)

    def discard(self) -> None:
        """Switch the cache off and delete the directory (stale or corrupt files)."""
        self.close(False)
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["GraphCache", "cache_key", "default_root"]
