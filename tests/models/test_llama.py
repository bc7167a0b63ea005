"""models/llama.py on the CPU backend (the C++ kernels of kernels/cpu.py, cpu_kernels.cc):

- the teacher on the CPU backend against the portable backend (chunked prefill, decode, tree verification,
  commit, rollback; logits, features and the cache), eager and fused;
- the trunk as one DecoderStack kernel call equals the layers bit for bit, and refuses indices out of range;
- float16 weights: the teacher equals, bit for bit, the float32 teacher on the matrices rounded to float16;
- end to end: the logits of a tree's nodes in one verification equal, bit for bit, the logits of the same tokens
  decoded one at a time (the property that makes speculation exactly lossless on this backend).
"""
import mindspore as ms
import numpy as np
import pytest
from tiny_engines import TOL, rel, tiny_tree
from tiny_engines import round_matrices as _round_matrices

from mindspore_eagle.core.tree import DraftTree, tensorize
from mindspore_eagle.kernels import cpu

# Skipped only where no compiler exists (not Linux, no $CXX / g++); where one exists a failed build fails the tests.
pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C++ compiler here: the CPU kernels cannot build")


def runner(tiny, backend, mode, host=None):
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    cfg, tensors, _ = tiny
    net = LlamaModel(cfg, 32, 8, 128, ms.float32, attention=backend)
    net.load_hf_weights(tensors)
    assert net.backend.name == backend
    return TeacherRunner(net, 32, 8, 128, mode, 32, host=host)


@pytest.mark.parametrize("biases", [0, 1, 2])
@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_decoder_stack_is_the_layers_bit_for_bit(ms_runtime, tiny, biases, mode):
    """The cpu backend runs a teacher's trunk as one DecoderStack call (embedding rows, first norm, RoPE rows, cache
    rows, every layer); the same model with the stack off runs the graph's own gathers and index ops and one
    DecoderLayer node a layer. Both, through a chunked prefill (32 + 8 rows), decodes, a tree verification and its
    commit, a grouped two-sequence decode and a rollback: logits, aux features and every cache bit for bit, for
    models without biases (Llama), with q/k/v biases (Qwen2) and with q/k/v and o biases (openPangu)."""
    from tiny_engines import tiny_tree

    cfg, tensors, tok = tiny
    cfg = cfg.replace(qkv_bias=biases >= 1, o_bias=biases == 2)
    runners = []
    for stack in (True, False):
        r = runner((cfg, tensors, tok), "cpu", mode, host=False)          # graphs (or PyNative) both
        assert r.model.stack is not None
        if not stack:
            r.model.stack = None
        runners.append(r)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    sids = [[r.new_seq(), r.new_seq()] for r in runners]
    rng = np.random.default_rng(biases)
    calls = 0

    def both(fn):
        nonlocal calls
        a, b = (fn(r, s) for r, s in zip(runners, sids))
        for x, y in zip(a, b):
            assert np.array_equal(x, y)
        calls += 1
        return a

    last, _ = both(lambda r, s: r.prefill(s[0], ids[:40]))
    both(lambda r, s: r.prefill(s[1], ids[:9]))
    for _ in range(2):
        last, _ = both(lambda r, s: r.decode(s[0], int(np.argmax(last))))
    tt = tensorize(tiny_tree(rng, int(np.argmax(last)), 12, 4, cfg.vocab_size), 12, 4)
    both(lambda r, s: r.verify(s[0], tt))
    for r, s in zip(runners, sids):
        r.commit(s[0], max((row[row < 12] for row in tt.retrieve), key=len), 6)
    both(lambda r, s: r.decode_batch(s, [5, 7], 4, with_aux=True))
    both(lambda r, s: r.verify(s[1], tt))
    for r, s in zip(runners, sids):
        r.rollback(s[1])
    both(lambda r, s: r.decode(s[1], 11))
    assert calls == 8
    for (ka, va), (kb, vb) in zip(runners[0].model.caches(), runners[1].model.caches()):
        assert np.array_equal(ka.asnumpy(), kb.asnumpy()) and np.array_equal(va.asnumpy(), vb.asnumpy())
    assert runners[0].model.stack_spec.asnumpy().tolist() == [cfg.num_heads, cfg.num_kv_heads, biases,
                                                              cfg.num_layers, *cfg.aux_layers]


def test_decoder_stack_refuses_indices_out_of_range(ms_runtime, tiny):
    """A token id past the vocabulary, a position past the RoPE table or a block past the cache makes the stack
    call fail (kernel status 3) without writing a cache row."""
    cfg, tensors, tok = tiny
    r = runner(tiny, "cpu", "eager")
    m = r.model
    weights = ()
    for layer in m.layers:
        weights = weights + layer.stack_args()
    good = dict(tokens=[3, 4], positions=[0, 1], slots=[0, 1], table=[0] * 4)
    for field, value in (("tokens", [3, cfg.vocab_size]), ("positions", [0, 128]), ("table", [0, 0, 0, 40])):
        args = dict(good, **{field: value})
        before = [c.asnumpy().copy() for pair in m.caches() for c in pair]
        with pytest.raises(Exception):
            out = m.backend.decoder_stack(
                m.stack, m.stack_spec, *(ms.Tensor(np.asarray(args[f], np.int32)) for f in
                                         ("tokens", "positions", "slots", "table")),
                ms.Tensor(np.zeros((2, 32), np.float32)), m.embed, m.cos, m.sin, m.eps, weights)
            out[0].asnumpy()
        assert all(np.array_equal(c.asnumpy(), b) for c, b in zip((c for pair in m.caches() for c in pair), before))


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_cpu_backend_equals_portable(ms_runtime, tiny, mode):
    """Chunked prefill (32 + 8 rows: the 32-row chunk takes the kernel, as do decode and verify), decodes, a tree
    verification, commit of its longest path, rollback of a second one: logits, features and the committed cache
    of the CPU backend against the portable one."""
    cfg, _, tok = tiny
    rp, rc = runner(tiny, "portable", mode), runner(tiny, "cpu", mode)
    sp, sc = rp.new_seq(), rc.new_seq()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    rng = np.random.default_rng(0)
    worst = {}

    def both(name, fn):
        a, b = fn(rp, sp), fn(rc, sc)
        worst[name] = max(worst.get(name, 0.0), max(rel(y, x) for x, y in zip(a, b)))
        return a

    last, _ = both("prefill", lambda r, s: r.prefill(s, ids[:40]))
    for _ in range(3):
        last, _ = both("decode", lambda r, s: r.decode(s, int(np.argmax(last))))
    for stage in ("commit", "rollback"):
        tt = tensorize(tiny_tree(rng, int(np.argmax(last)), 12, 4, cfg.vocab_size), 12, 4)
        both("verify", lambda r, s: r.verify(s, tt))
        for r, s in ((rp, sp), (rc, sc)):
            if stage == "commit":
                r.commit(s, max((row[row < 12] for row in tt.retrieve), key=len), 6)
            else:
                r.rollback(s)
        token = int(rng.integers(3, cfg.vocab_size))
        last, _ = both("decode_after_" + stage, lambda r, s: r.decode(s, token))
    assert set(worst) == {"prefill", "decode", "verify", "decode_after_commit", "decode_after_rollback"}
    assert all(v < TOL for v in worst.values()), worst
    slots = rp.bm.slots(sp, np.arange(rp.length(sp)))
    for (kp, vp), (kc_, vc_) in zip(rp.model.caches(), rc.model.caches()):
        for a, b in ((kp, kc_), (vp, vc_)):
            a, b = a.asnumpy().reshape(cfg.num_kv_heads, -1, cfg.head_dim), b.asnumpy().reshape(
                cfg.num_kv_heads, -1, cfg.head_dim)
            assert rel(b[:, slots], a[:, slots]) < TOL


@pytest.mark.parametrize("chunk", [32, 64])
def test_half_weight_teacher_equals_float32_on_the_rounded_matrices(ms_runtime, tiny, chunk):
    """LlamaModel(weight_dtype=float16): prefill (a 40-token chunk over CPU_LINEAR_MAX_ROWS takes MatMul on the
    widened matrices at chunk 64), decodes and a tree verification give, bit for bit, the logits and features of the
    float32 model whose folded matrices are rounded to float16 (the embedding itself is float16-exact here, so the
    tied head's own half copy equals it); the matrices are stored as float16, the embedding as float32."""
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    cfg, tensors, tok = tiny
    tensors = dict(tensors)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].astype(np.float16).astype(np.float32)
    half = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu", weight_dtype=ms.float16)
    ref = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu")
    for net in (half, ref):
        net.load_hf_weights(tensors)
    _round_matrices(ref, {"wqkv", "wo", "w_gate_up", "w_down", "lm_head", "embed"})
    assert half.layers[0].wqkv.dtype == ms.float16 and half.head_weight().dtype == ms.float16
    assert half.embed.dtype == ms.float32
    rh, rr = (TeacherRunner(n, 32, 8, 128, "fused", chunk) for n in (half, ref))
    sh, sr = rh.new_seq(), rr.new_seq()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    a, b = rh.prefill(sh, ids[:40]), rr.prefill(sr, ids[:40])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    last = a[0]
    for _ in range(3):
        token = int(np.argmax(last))
        a, b = rh.decode(sh, token), rr.decode(sr, token)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        last = a[0]
    tt = tensorize(tiny_tree(np.random.default_rng(1), int(np.argmax(last)), 12, 4, cfg.vocab_size), 12, 4)
    assert all(np.array_equal(x, y) for x, y in zip(rh.verify(sh, tt), rr.verify(sr, tt)))
    full = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu")
    full.load_hf_weights(tensors)
    rf = TeacherRunner(full, 32, 8, 128, "fused", chunk)
    logits = rf.prefill(rf.new_seq(), ids[:40])[0]
    assert 0 < np.abs(logits - rh.prefill(rh.new_seq(), ids[:40])[0]).max() < 0.05 * np.abs(logits).max()


def test_tree_verification_is_bitwise_decode(ms_runtime, tiny):
    """Tokens t0 t1 t2 decoded one at a time give the same logits and features, bit for bit, as the same tokens
    verified as a root-to-leaf path of a tree whose other branches sit between them (mask columns skipped)."""
    cfg, _, tok = tiny
    r = runner(tiny, "cpu", "fused")
    ids = tok.encode("The quick brown fox jumps over the lazy dog")
    t = [11, 23, 37]
    a = r.new_seq()
    r.prefill(a, ids)
    one = [r.decode(a, x) for x in t]
    b = r.new_seq()
    r.prefill(b, ids)
    # root t0; children 5 and t1; t1's children 9 and t2: the path t0 -> t1 -> t2 is nodes 0, 2, 4
    tree = DraftTree([t[0], 5, t[1], 9, t[2]], [0, 0, 0, 2, 2])
    tt = tensorize(tree, 8, 4)
    path = [0, 2, 4]
    assert list(tt.tokens[path]) == t
    logits, aux = r.verify(b, tt)
    for i, node in enumerate(path):
        assert np.array_equal(logits[node], one[i][0]), f"token {i}"
        assert np.array_equal(aux[node], one[i][1][0])
    r.commit(b, np.array(path), 6)
    nxt = int(np.argmax(one[-1][0]))
    assert np.array_equal(r.decode(b, nxt)[0], r.decode(a, nxt)[0])      # the moved cache is the same too
