"""kernels/graph_cache.py: the cache key and directory of compiled graphs on disk, and what the warm-up does with
a cache that fails to load."""
import json
import os
import shutil
from types import SimpleNamespace

from mindspore_eagle.config import load_config

# the settings runners/test_warmup.py compiles with
TINY = ["cache.block_size=8", "cache.max_seq_len=512", "cache.num_blocks=64", "cache.prefill_chunk=16",
        "speculative.M=8", "speculative.D_max=3", "speculative.top_k=2", "model.drafter=random",
        "speculative.policy=fixed", "generation.max_new_tokens=6"]


def _cfg(tiny_dir, extra=()):
    return load_config(None, [f"model.teacher={tiny_dir}", *TINY, *extra])


def test_cache_key_changes_with_what_shapes_the_graphs(tiny_dir):
    from mindspore_eagle.kernels.graph_cache import GraphCache, cache_key

    a = cache_key(_cfg(tiny_dir), [8], str(tiny_dir), "random")
    assert a == cache_key(_cfg(tiny_dir), [8], str(tiny_dir), "random")
    for extra, budgets in ((["speculative.M=16"], [16]), (["cache.max_seq_len=256"], [8]), ([], [8, 16])):
        b = cache_key(_cfg(tiny_dir, extra), budgets, str(tiny_dir), "random")
        assert GraphCache("/r", a).dir != GraphCache("/r", b).dir
    assert a["teacher"] and all(len(f) == 3 for f in a["teacher"])   # (file, size, mtime) of every checkpoint file


def test_cache_key_follows_the_checkpoint_files(tmp_path, tiny_dir):
    """A checkpoint file that changes (size or mtime), a new file, or another drafter gives another directory;
    a non-path drafter spec is keyed by its name."""
    from mindspore_eagle.kernels.graph_cache import GraphCache, cache_key

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_dir, teacher)
    cfg = _cfg(teacher)
    first = cache_key(cfg, [8], str(teacher), "random")
    assert first["drafter"] == "random" and first["teacher"][0][0].startswith(str(teacher))
    weights = teacher / "model.safetensors"
    assert weights.is_file()
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))            # touched: same bytes, new mtime
    touched = cache_key(cfg, [8], str(teacher), "random")
    (teacher / "extra.txt").write_text("x")                                     # one more file in the directory
    extra = cache_key(cfg, [8], str(teacher), "random")
    other = cache_key(cfg, [8], str(teacher), "none")
    dirs = {GraphCache(tmp_path, k).dir for k in (first, touched, extra, other)}
    assert len(dirs) == 4 and all(d.parent == tmp_path and len(d.name) == 16 for d in dirs)
    assert GraphCache(tmp_path, dict(first)).dir == GraphCache(tmp_path, first).dir


def test_default_root_is_under_mseagle_cache(tmp_path, monkeypatch):
    from mindspore_eagle.kernels.graph_cache import default_root

    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    assert default_root() == tmp_path / "graphs"


def test_complete_needs_its_own_key_and_a_graph(tmp_path):
    from mindspore_eagle.kernels.graph_cache import GraphCache

    cache = GraphCache(tmp_path, {"k": 1})
    assert not cache.complete                                                  # nothing on disk
    graphs = cache.dir / "rank_0" / "graph_cache"
    graphs.mkdir(parents=True)
    (cache.dir / "complete.json").write_text(json.dumps({"key": cache.key_text, "compiles": 1}))
    assert not cache.complete                                                  # no graph file
    (graphs / "compile_cache_0.mindir").write_bytes(b"graph")
    assert cache.complete
    (cache.dir / "complete.json").write_text(json.dumps({"key": GraphCache(tmp_path, {"k": 2}).key_text}))
    assert not cache.complete                                                  # written under another key
    (cache.dir / "complete.json").write_text("{not json")
    assert not cache.complete


def test_discard_removes_the_cache_and_close_of_an_unopened_cache_does_nothing(tmp_path):
    from mindspore_eagle.kernels.graph_cache import GraphCache

    cache = GraphCache(tmp_path, {"k": 1})
    (cache.dir / "rank_0").mkdir(parents=True)
    cache.close(True, 5)                                                       # never opened: nothing written
    assert not (cache.dir / "complete.json").exists() and cache.dir.is_dir()
    cache.discard()
    assert not cache.dir.exists() and list(tmp_path.iterdir()) == []


def test_a_cache_that_fails_to_load_is_discarded_and_the_warmup_compiles(tmp_path, tiny_dir, monkeypatch):
    """serving.pipeline.prepare: when the warm-up fails on a complete cache (a damaged graph file), the cache
    directory is deleted, the warm-up runs again without it and the result names no cache."""
    from mindspore_eagle.kernels import graph_cache as gcache
    from mindspore_eagle.runners import warmup as wu
    from mindspore_eagle.serving import pipeline

    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    cfg = _cfg(tiny_dir)
    key = gcache.cache_key(cfg, [8], str(tiny_dir), "random")
    cache_dir = gcache.GraphCache(gcache.default_root(), key).dir
    (cache_dir / "rank_0" / "graph_cache").mkdir(parents=True)
    (cache_dir / "rank_0" / "graph_cache" / "compile_cache_0.mindir").write_bytes(b"not a graph")
    (cache_dir / "complete.json").write_text(json.dumps({"key": json.dumps(key, sort_keys=True), "compiles": 1}))

    def fake_open(self):          # what open() does for a complete cache, without switching MindSpore's cache on
        self.work, self.opened = self.dir, True
        return True

    calls = []

    def fake_warmup(engine, gen, mode, log, drafters, budgets, max_batch):
        calls.append(mode)
        if len(calls) == 1:
            raise RuntimeError("damaged graph")
        return {"mode": mode, "seconds": 0.0, "compiles": 3}

    monkeypatch.setattr(gcache.GraphCache, "open", fake_open)
    monkeypatch.setattr(gcache.GraphCache, "close", lambda self, ok, compiles=0: setattr(self, "opened", False))
    monkeypatch.setattr(wu, "warmup", fake_warmup)
    engine = SimpleNamespace(teacher=SimpleNamespace(mode="fused"), verify_budgets=lambda: [8])
    lines = []
    out = pipeline.prepare(engine, cfg, cfg.generation, "full", lines.append)
    assert calls == ["full", "full"] and out["graph_cache"] is None and out["compiles"] == 3
    assert not cache_dir.exists()
    assert lines[0] == f"warm-up: loading all graphs ({cache_dir})"
    assert lines[1] == f"warm-up: graph cache {cache_dir} unusable (RuntimeError); removed, compiling"
