"""Contract tests of the Ascend fused-kernel path on CPU.

``attention.FusedBackend`` (MindFormers cache layout [NB + 1, B, n_kv, hd], ReshapeAndCache by slot mapping,
PagedAttention with the tree mask, context_lens and q_seq_lens) is run with numpy models of the kernels' documented
semantics (tests/ascend_reference.py) in place of the Ascend ops, and compared with the portable path:
- the teacher's logits and features for chunked prefill, decode, tree verification, commit (non-contiguous paths
  moved by the fused ``move``) and rollback, float32 and float16;
- the cache content in the documented layout: slot s of KV head h at ``cache[s // B, s % B, h]``;
- PagedAttention serves calls of at most 16 rows (decode, tree, drafter expansion), FlashAttention larger ones
  (prefill chunks, drafter context pass), the second prefill chunk seeing the first through the cache;
- every index handed to a kernel is in range and every shape is static per bucket (checked inside the kernels);
- the whole speculative engine (drafter and teacher both on the fused path) is token-identical to teacher-only
  greedy on the portable path;
- each contract fails on a wrong kernel: a transposed cache layout, an inverted mask convention, an off-by-one
  slot (``test_contract_detects_wrong_kernel``).
"""
import mindspore as ms
import numpy as np
import pytest
from ascend_reference import MUTATIONS, KernelContractError, ReferenceKernels
from tiny_engines import tiny_tree

from mindspore_eagle.core.tree import tensorize
from mindspore_eagle.kernels.attention import (
    FusedBackend,
    PortableBackend,
    select_backend,
)
from mindspore_eagle.kernels.kv import slot_view

NB, B, S, CHUNK = 32, 8, 128, 32


def runner(cfg, tensors, backend, dtype):
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    net = LlamaModel(cfg, NB, B, S, dtype, attention=backend)
    net.load_hf_weights(tensors)
    return TeacherRunner(net, NB, B, S, "eager", CHUNK)


def cache_diff(rp, rf, sid, n_kv):
    """Max |portable - fused| over the committed slots of ``sid``, K and V of every layer, fused read in the
    documented layout cache[s // B, s % B, h]."""
    slots = rp.bm.slots(sid, np.arange(rp.length(sid)))
    assert np.array_equal(slots, rf.bm.slots(sid, np.arange(rf.length(sid))))
    worst = 0.0
    for (kp, vp), (kf, vf) in zip(rp.model.caches(), rf.model.caches()):
        for p, f in ((kp, kf), (vp, vf)):
            a = slot_view(p.asnumpy().astype(np.float32), n_kv)[slots]
            fa = f.asnumpy().astype(np.float32)
            b = fa[slots // B, slots % B]
            worst = max(worst, float(np.abs(a - b).max()))
    return worst


def longest_path(tt):
    rows = [r[r < tt.budget] for r in tt.retrieve]
    return max(rows, key=len)


def contract_diffs(tiny, kernels, dtype=ms.float32, seed=0):
    """Run the same call sequence on the portable and the fused path; max |difference| / max |portable| per
    stage (logits and features; for the cache, absolute).

    Stages: prefill (2 chunks) logits / aux, 3 decodes, verify of a random tree (M = 12, D = 4), commit of its
    longest path, decode, a second verify + rollback, decode, and the cache content after each commit.
    """
    cfg, tensors, tok = tiny
    rp = runner(cfg, tensors, "portable", dtype)
    rf = runner(cfg, tensors, FusedBackend(NB, B, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim, dtype, 1.0,
                                           kernels), dtype)
    assert isinstance(rp.model.backend, PortableBackend)
    assert rf.model.layers[0].key_cache.shape == (NB + 1, B, cfg.num_kv_heads, cfg.head_dim)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    ids = ids[:40]                # chunk 1: 32 rows (FlashAttention), chunk 2: 8 rows in bucket 16 (PagedAttention)
    rng = np.random.default_rng(seed)
    out = {}

    def both(name, fn):
        a, b = fn(rp), fn(rf)
        rel = max(float(np.abs(x - y).max() / np.abs(x).max()) for x, y in zip(a, b))
        out[name] = max(out.get(name, 0.0), rel)
        return a

    sp, sf = rp.new_seq(), rf.new_seq()
    sid = {id(rp): sp, id(rf): sf}
    last, _ = both("prefill", lambda r: r.prefill(sid[id(r)], ids))
    for _ in range(3):
        last, _ = both("decode", lambda r: r.decode(sid[id(r)], int(np.argmax(last))))
    for stage in ("commit", "rollback"):
        tree = tiny_tree(rng, int(np.argmax(last)), 12, 4, cfg.vocab_size)
        tt = tensorize(tree, 12, 4)
        both("verify", lambda r: r.verify(sid[id(r)], tt))
        if stage == "commit":
            path = longest_path(tt)
            for r in (rp, rf):
                r.commit(sid[id(r)], path, 6)
            out["cache"] = cache_diff(rp, rf, sp, cfg.num_kv_heads)
        else:
            for r in (rp, rf):
                r.rollback(sid[id(r)])
        token = int(rng.integers(3, cfg.vocab_size))
        last, _ = both("decode_after_" + stage, lambda r: r.decode(sid[id(r)], token))
    out["cache"] = max(out["cache"], cache_diff(rp, rf, sp, cfg.num_kv_heads))
    return out


TOL = {ms.float32: 1e-5, ms.float16: 1e-2}     # relative; float16: a few half ulps after 4 layers


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16], ids=["float32", "float16"])
def test_fused_path_equals_portable(ms_runtime, tiny, dtype):
    calls = []
    # float16: every call also passes MindSpore's own shape / type inference of the real primitive (CPU has the
    # inference, not the kernel); float32 is semantics only (ReshapeAndCache's type check refuses float32 keys).
    diffs = contract_diffs(tiny, ReferenceKernels.factory(None, calls, infer_check=dtype != ms.float32), dtype)
    assert set(diffs) == {"prefill", "decode", "verify", "decode_after_commit", "decode_after_rollback", "cache"}
    tol = TOL[dtype]
    assert all(v < tol for v in diffs.values()), diffs
    # static shapes per bucket: every call with the same query rows handed the same shapes
    seen = {}
    for op, shapes in calls:
        key = (op, shapes.get("query", shapes.get("key")))
        seen.setdefault(key, set()).add(tuple(sorted(shapes.items())))
    assert all(len(v) == 1 for v in seen.values()), seen
    rows = {op: sorted({k[1][1] if op == "flash_attention" else k[1][0] for k in seen if k[0] == op})
            for op in ("reshape_and_cache", "paged_attention", "flash_attention")}
    dec = 1 if dtype == ms.float32 else 2          # half-precision decode carries a padding row (target.decode)
    assert rows == {"reshape_and_cache": [dec, 6, 12, 16, 32],  # decode, commit move (D + 2), verify M, chunks
                    "paged_attention": [dec, 12, 16], "flash_attention": [32]}, rows


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_contract_detects_wrong_kernel(ms_runtime, tiny, mutation):
    """The same contract on a deliberately wrong kernel: some stage must differ beyond tolerance (or a kernel
    must refuse its inputs), else the contract test above could not fail."""
    try:
        diffs = contract_diffs(tiny, ReferenceKernels.factory(mutation), ms.float32)
    except KernelContractError:
        return
    bad = {k: v for k, v in diffs.items() if not v < TOL[ms.float32]}
    assert bad, f"{mutation} went undetected: {diffs}"


def test_kernels_refuse_out_of_range_indices(ms_runtime):
    """A -1 slot (MindFormers' padding) or a block id past the pad block is refused by the reference kernels."""
    kern = ReferenceKernels(2, 1.0, 1)
    kc = ms.Parameter(ms.Tensor(np.zeros((3, 4, 1, 8), np.float32)), name="kc")
    vc = ms.Parameter(ms.Tensor(np.zeros((3, 4, 1, 8), np.float32)), name="vc")
    kv = ms.Tensor(np.ones((2, 8), np.float32))
    with pytest.raises(KernelContractError, match="slot_mapping outside"):
        kern.reshape_and_cache(kv, kv, kc, vc, ms.Tensor(np.array([0, -1], np.int32)))
    q = ms.Tensor(np.ones((2, 2, 8), np.float32))
    mask = ms.Tensor(np.zeros((2, 8), np.float32))
    one = ms.Tensor(np.array([2], np.int32))
    with pytest.raises(KernelContractError, match="block_tables outside"):
        kern.paged_attention(q, kc, vc, ms.Tensor(np.array([[0, 3]], np.int32)), one, None, None, mask, one)
    kern.paged_attention(q, kc, vc, ms.Tensor(np.array([[0, 2]], np.int32)), one, None, None, mask, one)


@pytest.mark.slow
def test_speculative_engine_on_fused_path_is_lossless(ms_runtime, tiny_dir, tiny, tmp_path, monkeypatch):
    """float16, teacher and drafter both on the fused path (reference kernels with MindSpore's inference check),
    eager: greedy speculative output equals teacher-only greedy on the same path and on the portable path."""
    from tiny_engines import PROMPTS, tiny_drafter_dir, tiny_engine

    from mindspore_eagle.kernels import attention

    d = tiny_drafter_dir(tmp_path, tiny[0])
    extra = ["model.dtype=float16", "speculative.M=10", "speculative.D_max=4", "speculative.top_k=3",
             "cache.prefill_chunk=32"]
    ref, cfg = tiny_engine(tiny_dir, d, "eager", extra)
    assert isinstance(ref.teacher.model.backend, PortableBackend)
    gen = cfg.generation
    gen.max_new_tokens = 16
    portable = [ref.generate(p, gen, speculative=False).token_ids for p in PROMPTS[:2]]
    calls = []
    monkeypatch.setenv("MSEAGLE_ATTENTION", "fused")
    monkeypatch.setattr(attention, "AscendKernels", ReferenceKernels.factory(None, calls, infer_check=True))
    assert select_backend() == "fused"
    eng, _ = tiny_engine(tiny_dir, d, "eager", extra)
    assert isinstance(eng.teacher.model.backend, FusedBackend) and isinstance(eng.drafter.drafter.backend,
                                                                              FusedBackend)
    for p, want in zip(PROMPTS[:2], portable):
        base = eng.generate(p, gen, speculative=False)
        spec = eng.generate(p, gen, speculative=True)
        assert spec.token_ids == base.token_ids == want
        assert len(spec.steps) > 0
    assert any(s[1]["query"][0] == 10 for s in calls if s[0] == "paged_attention")     # tree verification ran
    assert any(s[1]["query"][1] == 32 for s in calls if s[0] == "flash_attention")     # prefill / context pass


def test_real_inference_refuses_docstring_key_layout(ms_runtime):
    """MindSpore's own inference of ReshapeAndCache (run on CPU, where the kernel is missing) refuses the
    docstring's [T, n_kv, hd] key for T slots and float32 keys: the infer check is able to fail."""
    kern = ReferenceKernels(2, 1.0, 2, infer_check=True)
    kc = ms.Parameter(ms.Tensor(np.zeros((3, 4, 2, 8), np.float16)), name="kc")
    vc = ms.Parameter(ms.Tensor(np.zeros((3, 4, 2, 8), np.float16)), name="vc")
    slots = ms.Tensor(np.array([1, 5], np.int32))
    with pytest.raises(KernelContractError, match="num_tokens of slot mapping and key must be the same"):
        kern.reshape_and_cache(ms.Tensor(np.ones((2, 2, 8), np.float16)), ms.Tensor(np.ones((2, 2, 8), np.float16)),
                               kc, vc, slots)
    with pytest.raises(KernelContractError, match="Float16"):
        kern.reshape_and_cache(ms.Tensor(np.ones((2, 16), np.float32)), ms.Tensor(np.ones((2, 16), np.float32)),
                               kc, vc, slots)
    kern.reshape_and_cache(ms.Tensor(np.ones((2, 16), np.float16)), ms.Tensor(np.ones((2, 16), np.float16)),
                           kc, vc, slots)
    assert np.array_equal(kc.asnumpy().reshape(-1, 16)[[1, 5]], np.ones((2, 16)))


def test_backend_selection(monkeypatch, capsys):
    from mindspore_eagle.kernels import attention, cpu

    monkeypatch.delenv("MSEAGLE_ATTENTION", raising=False)
    on_ascend = ms.get_context("device_target") == "Ascend"
    assert select_backend() == ("fused" if on_ascend else "portable")
    built = cpu.compiler() is not None                            # where a compiler exists the kernels build
    assert cpu.status()[0] == built, cpu.status()[1]
    assert select_backend("auto", ms.float32) == ("cpu" if built and not on_ascend else "portable")
    with pytest.raises(ValueError, match=r"^attention backend = 'fused' needs model\.dtype float16 or bfloat16"):
        select_backend("fused", ms.float32)
    with pytest.raises(ValueError, match=r"^attention backend = 'cpu' needs model\.dtype float32"):
        select_backend("cpu", ms.float16)
    assert select_backend("fused") == "fused"
    monkeypatch.setenv("MSEAGLE_ATTENTION", "portable")
    assert select_backend() == "portable"
    assert select_backend("auto", ms.float32) == "portable"
    with pytest.raises(ValueError, match=r"^attention backend = 'flash': must be auto, portable, fused or cpu$"):
        select_backend("flash")
    # no compiler here: auto falls back to portable with one line on stderr, once; an explicit cpu is an error
    monkeypatch.delenv("MSEAGLE_ATTENTION")
    monkeypatch.setattr(cpu, "status", lambda: (False, "CPU kernels need a C++ compiler: g++ not found on PATH"))
    monkeypatch.setattr(attention, "_cpu_note", [])
    capsys.readouterr()
    if not on_ascend:
        assert select_backend("auto", ms.float32) == "portable"
        assert select_backend("auto", ms.float32) == "portable"
        assert capsys.readouterr().err == ("[mindspore_eagle] CPU kernels need a C++ compiler: g++ not found on PATH; "
                                           "using the portable backend (slower)\n")
    with pytest.raises(ValueError, match=r"^attention backend = 'cpu' is not available here: CPU kernels need a C\+\+"):
        select_backend("cpu", ms.float32)


def test_fused_graphs_compile_up_to_kernel_selection(ms_runtime, tiny, monkeypatch):
    """GRAPH_MODE with the real Ascend primitives on CPU: every fused graph (prefill chunk through
    FlashAttention, decode and tree verification through PagedAttention, commit through ReshapeAndCache, a drafter
    step) gets through parsing and MindSpore's whole-graph type / shape inference and stops only at kernel
    selection, which has no CPU kernel for these ops."""
    from mindspore_eagle.models.eagle3 import (
        DrafterConfig,
        Eagle3Drafter,
        init_drafter_tensors,
    )
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    cfg, tensors, _ = tiny
    net = LlamaModel(cfg, NB, B, S, ms.float16, attention="fused")
    net.load_hf_weights(tensors)
    r = TeacherRunner(net, NB, B, S, "fused", CHUNK)
    sid = r.new_seq()
    tt = tensorize(tiny_tree(np.random.default_rng(0), 5, 12, 4, cfg.vocab_size), 12, 4)
    not_on_cpu = r"Unsupported op \[(ReshapeAndCache|PagedAttention|FlashAttentionScore)\] on CPU"
    calls = [lambda: r.prefill(sid, list(range(3, 30))), lambda: r.prefill(sid, list(range(3, 10))),
             lambda: r.decode(sid, 5), lambda: r.verify(sid, tt),
             lambda: (r.bm.branch(sid, 12), r.commit(sid, np.array([0, 2]), 6))]
    for call in calls:
        with pytest.raises(RuntimeError, match=not_on_cpu):
            call()
        r.bm.rollback(sid)
    dcfg = DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=cfg.vocab_size, draft_vocab_size=64,
                         target_hidden_size=cfg.hidden_size, aux_layers=cfg.aux_layers)
    cell = Eagle3Drafter(dcfg, net.embed, 3, NB, B, S, attention="fused")
    cell.load_tensors(init_drafter_tensors(dcfg))
    step = ms.jit(cell.construct)
    k = 3
    args = (ms.Tensor(np.zeros((k, cfg.hidden_size), np.float16)), ms.Tensor(np.arange(k, dtype=np.int32)),
            ms.Tensor(np.arange(k, dtype=np.int32)), ms.Tensor(np.arange(k, dtype=np.int32)),
            ms.Tensor(np.full(S // B, NB, np.int32)), ms.Tensor(np.zeros((k, S), np.float32)))
    with pytest.raises(RuntimeError, match=not_on_cpu):
        step(*args)
