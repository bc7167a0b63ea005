"""kernels/graph_cache.py: the cache key and directory of compiled graphs on disk."""
from mindspore_eagle.config import load_config

# the settings runners/test_warmup.py compiles with
TINY = ["cache.block_size=8", "cache.max_seq_len=512", "cache.num_blocks=64", "cache.prefill_chunk=16",
        "speculative.M=8", "speculative.D_max=3", "speculative.top_k=2", "model.drafter=random", "speculative.policy=fixed",
        "generation.max_new_tokens=6"]


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
