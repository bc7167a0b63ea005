"""models/llama_host.py: the teacher's calls on the host kernels equal its compiled graph's, bit for bit.

Two runners of the same tiny teacher, one on the host (``TeacherRunner(host=True)``) and one through the graphs
(``host=False``), take the same calls: chunked prefill (the host's chunks carry no padding rows), the prefill that
also returns hidden states, decodes, a tree verification and its commit (the host's ``MoveRows`` against the
graph's ``KVCompactor``), a grouped batched decode and a batched verification, a rollback. Logits, hidden states,
features and every cache row must be identical. Then: the views follow a reload of the weights, the calls that
cannot run as one stack call are refused, and a bad index writes nothing.
"""
import mindspore as ms
import numpy as np
import pytest
from tiny_engines import tiny_tree

from mindspore_eagle.core.tree import tensorize
from mindspore_eagle.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C++ compiler here: the CPU kernels cannot build")


def make_runner(tiny, host: bool, mode: str = "fused"):
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    cfg, tensors, _ = tiny
    net = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu")
    net.load_hf_weights(tensors)
    return TeacherRunner(net, 32, 8, 128, mode, 32, host=host)


def caches(runner):
    return [c.asnumpy().copy() for pair in runner.model.caches() for c in pair]


def test_host_calls_equal_the_graphs_bit_for_bit(ms_runtime, tiny):
    cfg, _, tok = tiny
    host, graph = make_runner(tiny, True), make_runner(tiny, False)
    assert host.host is not None and graph.host is None and host.on_host(1) and host.on_host(64)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    sids = [(host.new_seq(), graph.new_seq()) for _ in range(3)]
    rng = np.random.default_rng(0)
    checked = []

    def both(name, fn):
        a, b = fn(host, sids[0][0], sids[1][0], sids[2][0]), fn(graph, sids[0][1], sids[1][1], sids[2][1])
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)), name
        checked.append(name)
        return a

    last = both("prefill", lambda r, s, s1, s2: r.prefill(s, ids[:45]))[0]     # a 32-row chunk, then 13 rows
    both("prefill_with_hidden", lambda r, s, s1, s2: r.prefill_with_hidden(s1, ids[:20]))
    both("prefill_hidden", lambda r, s, s1, s2: r.prefill(s2, ids[:7], hidden=True))
    for _ in range(2):
        last = both("decode", lambda r, s, s1, s2: r.decode(s, int(np.argmax(last))))[0]
    tt = tensorize(tiny_tree(rng, int(np.argmax(last)), 12, 4, cfg.vocab_size), 12, 4)
    both("verify", lambda r, s, s1, s2: r.verify(s, tt))
    path = max((row[row < 12] for row in tt.retrieve), key=len)
    for r, s in ((host, sids[0][0]), (graph, sids[0][1])):
        r.commit(s, path, 6)
    assert len(path) > 2                  # a path off the chain: the commit moved rows
    both("decode_after_commit", lambda r, s, s1, s2: r.decode(s, 9))
    both("decode_batch", lambda r, s, s1, s2: r.decode_batch([s, s1, s2], [5, 7, 11], 4, with_aux=True))
    both("verify_batch", lambda r, s, s1, s2: r.verify_batch([s, s1], [tt, tt], 24))
    for r, s, s1 in ((host, sids[0][0], sids[1][0]), (graph, sids[0][1], sids[1][1])):
        r.rollback(s), r.rollback(s1)
    both("decode_after_rollback", lambda r, s, s1, s2: r.decode(s1, 13))
    assert len(checked) == 10
    live = np.ones((cfg.num_kv_heads, 33, 8), bool)      # [head, block, slot]: 32 blocks + the pad block
    live[:, 32] = False                                   # padding rows write garbage there (none on the host)
    for a, b in zip(caches(host), caches(graph)):
        assert np.array_equal(a[live.reshape(-1)], b[live.reshape(-1)])
    assert host.compiles == 0 and graph.compiles > 0        # the host made every call without a graph


def test_host_views_follow_a_reload(ms_runtime, tiny):
    """After ``load_hf_weights`` (new storage) the host reads the new weights, not the old arrays."""
    cfg, tensors, tok = tiny
    r = make_runner(tiny, True)
    ids = tok.encode("Hello there")
    s = r.new_seq()
    before, _ = r.prefill(s, ids)
    r.free(s)
    scaled = dict(tensors)
    scaled["model.norm.weight"] = tensors["model.norm.weight"] * 2.0
    r.model.load_hf_weights(scaled)
    s = r.new_seq()
    after, _ = r.prefill(s, ids)
    assert not np.array_equal(before, after)
    ref = make_runner((cfg, scaled, tok), False)
    s2 = ref.new_seq()
    assert np.array_equal(after, ref.prefill(s2, ids)[0])


def test_host_refuses_what_it_cannot_run(ms_runtime, tiny):
    from mindspore_eagle.kernels.host import HostKernelError
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.models.llama_host import HostTeacher

    cfg, tensors, _ = tiny
    portable = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="portable")
    with pytest.raises(ValueError, match="cpu attention backend"):
        HostTeacher(portable)
    r = make_runner(tiny, True)
    h = r.host
    with pytest.raises(ValueError, match="method must be one of"):
        h.run("logits", [3], [0], [0], [0] * 16, np.zeros((1, 128), np.float32), [0])
    before = caches(r)
    table = np.full(16, r.bm.pad_block, np.int32)
    mask = np.zeros((2, 128), np.float32)
    for tokens, positions, tbl in (([3, cfg.vocab_size], [0, 1], table), ([3, 4], [0, 128], table),
                                   ([3, 4], [0, 1], np.full(16, 40, np.int32))):
        with pytest.raises(HostKernelError, match="DecoderStack refused"):
            h.run("construct", tokens, positions, [0, 1], tbl, mask, [0])
    with pytest.raises(HostKernelError, match="MoveRows refused"):
        h.move([0], [10_000])
    assert all(np.array_equal(a, b) for a, b in zip(before, caches(r)))
    assert make_runner(tiny, None, "eager").host is None and make_runner(tiny, None).host is not None
