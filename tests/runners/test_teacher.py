"""Teacher Cell vs the independent numpy reference (tests/tiny_pangu.py) on the tiny openPangu checkpoint:
prefill, decode with the paged cache, and a block of query tokens with an arbitrary mask; fused and eager."""
import mindspore as ms
import numpy as np
import pytest
from tiny_engines import make_target
from tiny_pangu import causal_mask, numpy_forward

TOL = 1e-4


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_prefill_and_decode_match_numpy(ms_runtime, tiny, mode):
    cfg, tensors, tok = tiny
    assert cfg.qkv_bias and cfg.o_bias and cfg.tie_word_embeddings       # openPangu: bias on q/k/v/o
    r = make_target(cfg, tensors, mode)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    assert len(ids) > 16                                                 # spans two prefill chunks of 16
    sid = r.new_seq()
    last, aux = r.prefill(sid, ids)
    ref_logits, ref_aux = numpy_forward(cfg, tensors, ids, np.arange(len(ids)), causal_mask(len(ids)))
    assert np.abs(last - ref_logits[-1]).max() < TOL
    assert np.abs(aux - ref_aux).max() < TOL
    seq = list(ids)
    for _ in range(4):
        nxt = int(np.argmax(last))
        seq.append(nxt)
        last, aux = r.decode(sid, nxt)
        ref_logits, ref_aux = numpy_forward(cfg, tensors, seq, np.arange(len(seq)), causal_mask(len(seq)))
        assert np.abs(last - ref_logits[-1]).max() < TOL
        assert np.abs(aux[0] - ref_aux[-1]).max() < TOL
    assert r.length(sid) == len(seq)
    r.free(sid)
    assert r.bm.free_blocks() == r.bm.num_blocks                       # pool accounting back to start


@pytest.mark.parametrize("mode,k", [("eager", 6), ("fused", 6), ("fused", 12), ("eager", 12), ("fused", 40)])
def test_query_block_with_arbitrary_mask(ms_runtime, tiny, mode, k):
    """k query tokens after a prefix, each seeing the prefix plus an arbitrary subset of earlier block tokens.

    k = 6 and 40 take the usual matmul form, k = 12 the weight-left one (pangu.WEIGHT_LEFT_ROWS)."""
    from mindspore_eagle.models.llama import WEIGHT_LEFT_ROWS

    assert (WEIGHT_LEFT_ROWS[0] <= k <= WEIGHT_LEFT_ROWS[1]) == (k == 12)
    cfg, tensors, _ = tiny
    r = make_target(cfg, tensors, mode)
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, cfg.vocab_size, size=9)
    block = rng.integers(3, cfg.vocab_size, size=k)
    sid = r.new_seq()
    r.prefill(sid, prefix)
    P = len(prefix)
    sub = np.tril(rng.random((k, k)) < 0.5, -1) | np.eye(k, dtype=bool)   # arbitrary, self always visible
    positions = P + rng.integers(0, 4, size=k)                             # arbitrary RoPE positions
    slots = r.bm.append(sid, k, k)
    mask = np.full((k, r.S), -1e9, np.float32)
    mask[:, :P] = 0
    mask[:, P:P + k] = np.where(sub, 0, -1e9)
    logits, aux = r._fwd(ms.Tensor(block.astype(np.int32)), ms.Tensor(positions.astype(np.int32)),
                         ms.Tensor(slots.astype(np.int32)), ms.Tensor(r.bm.block_table(sid)), ms.Tensor(mask),
                         ms.Tensor(np.arange(k, dtype=np.int32)))
    full = np.full((P + k, P + k), -np.inf)
    full[:P, :P] = causal_mask(P)
    full[P:, :P] = 0
    full[P:, P:] = np.where(sub, 0, -np.inf)
    ref_logits, ref_aux = numpy_forward(cfg, tensors, np.concatenate([prefix, block]),
                                        np.concatenate([np.arange(P), positions]), full)
    assert np.abs(logits.asnumpy() - ref_logits[P:]).max() < TOL
    assert np.abs(aux.asnumpy() - ref_aux[P:]).max() < TOL


def test_weight_shape_mismatch_names_tensor(ms_runtime, tiny):
    from mindspore_eagle.models.llama import LlamaModel

    cfg, tensors, _ = tiny
    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:, :-1]
    net = LlamaModel(cfg, 4, 8, 32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(128, 63\).*\(128, 64\)"):
        net.load_hf_weights(bad)


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [True, False])
def test_batched_calls_match_one_sequence_calls(ms_runtime, tiny, grouped):
    """decode_batch / verify_batch give every sequence the logits its own decode / verify gives (to float32
    rounding), in the grouped layout (a block table per sequence) and the concatenated one (one table, block-diagonal
    mask), with pad rows / pad groups and sequences of 3, 11 and 29 tokens (block size 8); verify_batch with trees of
    different budgets (4, 1, 3)."""
    from tiny_engines import tiny_tree

    from mindspore_eagle.core.tree import tensorize

    cfg, tensors, _ = tiny
    one, bat = make_target(cfg, tensors, "fused"), make_target(cfg, tensors, "fused")
    if not grouped:
        bat.model.backend.grouped = False
    assert bat._grouped is grouped
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (3, 11, 29)]
    s1 = [one.new_seq() for _ in prompts]
    s2 = [bat.new_seq() for _ in prompts]
    nxt = []
    for a, b, p in zip(s1, s2, prompts):
        la, _ = one.prefill(a, p)
        lb, _ = bat.prefill(b, p)
        nxt.append(int(np.argmax(la)))
    for _ in range(3):
        got, aux = bat.decode_batch(s2, nxt, rows=4, with_aux=True)
        assert got.shape == (3, cfg.vocab_size) and aux.shape[0] == 3
        for i, a in enumerate(s1):
            want, want_aux = one.decode(a, nxt[i])
            assert np.abs(got[i] - want).max() < 1e-4
            assert np.abs(aux[i] - want_aux[0]).max() < 1e-4
        nxt = [int(np.argmax(g)) for g in got]
    budgets = [4, 1, 3]                         # ragged: a sequence may verify its root alone
    trees = [tensorize(tiny_tree(rng, t, m, 3, cfg.vocab_size), m, 3) for t, m in zip(nxt, budgets)]
    got, aux = bat.verify_batch(s2, trees, rows=16)
    assert got.shape == (8, cfg.vocab_size) and aux.shape[0] == 8
    o = 0
    for i, (a, b, m) in enumerate(zip(s1, s2, budgets)):
        want, want_aux = one.verify(a, trees[i])
        assert np.abs(got[o:o + m] - want).max() < 1e-4
        assert np.abs(aux[o:o + m] - want_aux).max() < 1e-4
        o += m
        one.rollback(a), bat.rollback(b)
    assert [one.length(a) for a in s1] == [bat.length(b) for b in s2] == [n + 3 for n in (3, 11, 29)]
    with pytest.raises(ValueError, match="got 3 sequences, 3 trees, 8 tree rows"):
        bat.verify_batch(s2, trees, rows=7)
