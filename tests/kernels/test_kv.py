"""Paged cache, branch / commit / rollback, and tree verification equivalence on the tiny openPangu model."""
import numpy as np
import pytest
from tiny_engines import make_target, tiny_tree
from tiny_pangu import causal_mask, numpy_forward

from mindspore_eagle.core.tree import tensorize, tree_attention_bias
from mindspore_eagle.kernels.kv import BlockManager, CacheExhaustedError, slot_view

TOL = 1e-4


def cache_rows(runner, sid, start, stop):
    """K and V of logical positions [start, stop) of every layer, as numpy [L, 2, n, n_kv, hd]."""
    slots = runner.bm.slots(sid, np.arange(start, stop))
    out = []
    for kc, vc in runner.model.caches():
        n_kv = runner.model.cfg.num_kv_heads
        flat_k, flat_v = slot_view(kc.asnumpy(), n_kv), slot_view(vc.asnumpy(), n_kv)   # [slots, n_kv, hd]
        out.append(np.stack([flat_k[slots], flat_v[slots]]))
    return np.stack(out)


# ---------------------------------------------------------------- host bookkeeping (no model)
def test_block_manager_accounting_and_contract():
    bm = BlockManager(num_blocks=6, block_size=4, max_seq_len=16)
    a, b = bm.new_seq(), bm.new_seq()
    slots = bm.append(a, 5, 8)                       # 5 real rows, 3 pad rows
    assert slots.shape == (8,) and slots.min() >= 0
    assert np.all(slots[5:] // 4 == bm.pad_block)    # padding goes to the pad block, never -1
    bm.advance(a, 5)
    table = bm.block_table(a)
    assert table.shape == (4,) and table.min() >= 0 and table.max() <= bm.pad_block
    assert list(table[2:]) == [bm.pad_block] * 2
    bm.branch(a, 6)                                  # 5 + 6 = 11 tokens -> 3 blocks
    assert bm.free_blocks() == 3
    bm.rollback(a)
    assert bm.free_blocks() == 4
    bm.append(b, 16, 16)
    bm.advance(b, 16)
    free_before = bm.free_blocks()
    with pytest.raises(CacheExhaustedError, match="max_seq_len"):
        bm.branch(b, 1)
    with pytest.raises(CacheExhaustedError, match="pool exhausted"):
        bm.append(a, 11, 11)                         # needs 2 more blocks, 0 free
    assert bm.free_blocks() == free_before           # nothing was allocated by the failed calls
    bm.free(a), bm.free(b)
    assert bm.free_blocks() == 6


def test_commit_plan_rejects_bad_paths():
    bm = BlockManager(8, 4, 32)
    s = bm.new_seq()
    with pytest.raises(ValueError, match="without an open branch"):
        bm.commit_plan(s, [0], 4)
    bm.branch(s, 8)
    for bad in ([0, 2, 1], [0, 9], [0, 1, 2, 3, 4]):
        with pytest.raises(ValueError):
            bm.commit_plan(s, bad, 4)
    src, dst = bm.commit_plan(s, [0, 3, 5], 4)
    assert src.shape == dst.shape == (4,) and src.min() >= 0 and dst.min() >= 0


# ---------------------------------------------------------------- with the tiny teacher
@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_tree_verify_equals_sequential_paths(ms_runtime, tiny, mode):
    """Per node, tree-verification logits equal the logits of the root-to-node path decoded in order."""
    cfg, tensors, _ = tiny
    r = make_target(cfg, tensors, mode)
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, cfg.vocab_size, size=13)
    M, D = 12, 4
    sid = r.new_seq()
    r.prefill(sid, prefix)
    for trial in range(3):
        tt = tensorize(tiny_tree(rng, int(rng.integers(3, cfg.vocab_size)), M, D, cfg.vocab_size), M, D)
        logits, aux = r.verify(sid, tt, tree_attention_bias(tt, len(prefix), r.S))
        for node in range(tt.n_nodes):
            path = [node]
            while path[-1] != 0:
                path.append(int(tt.parent[path[-1]]))
            seq = np.concatenate([prefix, tt.tokens[path[::-1]]])
            ref, ref_aux = numpy_forward(cfg, tensors, seq, np.arange(len(seq)), causal_mask(len(seq)))
            assert np.abs(logits[node] - ref[-1]).max() < TOL, (trial, node)
            assert np.abs(aux[node] - ref_aux[-1]).max() < TOL
        r.rollback(sid)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_commit_equals_sequential_decoding(ms_runtime, tiny, mode):
    cfg, tensors, _ = tiny
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, cfg.vocab_size, size=10)
    M, D = 10, 4
    r = make_target(cfg, tensors, mode)
    ref = make_target(cfg, tensors, mode)
    sid, rsid = r.new_seq(), ref.new_seq()
    r.prefill(sid, prefix)
    ref.prefill(rsid, prefix)
    before = cache_rows(r, sid, 0, len(prefix))
    # rollback leaves the prefix bit-identical
    tt = tensorize(tiny_tree(rng, 5, M, D, cfg.vocab_size), M, D)
    r.verify(sid, tt)
    r.rollback(sid)
    assert np.array_equal(cache_rows(r, sid, 0, len(prefix)), before)
    assert r.length(sid) == len(prefix)
    # commit the deepest root-to-leaf path of a fresh tree
    while True:
        tree = tiny_tree(rng, 7, M, D, cfg.vocab_size)
        tt = tensorize(tree, M, D)
        if tt.depth.max() >= 2:
            break
    r.verify(sid, tt)
    leaf = int(np.argmax(tt.depth))
    path = [leaf]
    while path[-1] != 0:
        path.append(int(tt.parent[path[-1]]))
    path = path[::-1]
    r.commit(sid, path, D + 2)
    for t in tt.tokens[path]:
        ref.decode(rsid, int(t))
    n = len(prefix) + len(path)
    assert r.length(sid) == ref.length(rsid) == n
    got, want = cache_rows(r, sid, 0, n), cache_rows(ref, rsid, 0, n)
    assert np.abs(got - want).max() < 1e-5
    l1, _ = r.decode(sid, 11)
    l2, _ = ref.decode(rsid, 11)
    assert np.abs(l1 - l2).max() < 1e-5
    r.free(sid), ref.free(rsid)
    assert r.bm.free_blocks() == r.bm.num_blocks and ref.bm.free_blocks() == ref.bm.num_blocks


def test_attention_inputs_contract(ms_runtime, tiny):
    """What the attention kernel receives: fixed shapes, no -1, every slot and block id in range."""
    cfg, tensors, _ = tiny
    r = make_target(cfg, tensors, "eager")
    seen = []
    orig = r._call

    def spy(fn, sid, tokens, positions, slots, mask, out_rows):
        seen.append((np.asarray(slots).copy(), r.bm.block_table(sid).copy(), np.asarray(mask).shape))
        return orig(fn, sid, tokens, positions, slots, mask, out_rows)

    r._call = spy
    rng = np.random.default_rng(4)
    sid = r.new_seq()
    r.prefill(sid, rng.integers(3, cfg.vocab_size, size=21))
    r.decode(sid, 5)
    tt = tensorize(tiny_tree(rng, 4, 8, 3, cfg.vocab_size), 8, 3)
    r.verify(sid, tt)
    r.commit(sid, [0], 5)
    limit = (r.bm.num_blocks + 1) * r.B
    for slots, table, mshape in seen:
        assert slots.min() >= 0 and slots.max() < limit
        assert table.shape == (r.S // r.B,) and table.min() >= 0 and table.max() <= r.bm.num_blocks
        assert mshape[1] == r.S
