"""Speculative decoding on the tiny openPangu model: lossless greedy (random drafter and high-acceptance oracle
trees), fused == eager, exact sampling distribution, drafter checkpoints, traces."""
import json

import numpy as np
import pytest
from scipy import stats
from tiny_pangu import causal_mask, exact_two_tokens, numpy_forward

from mindspore_eagle.config import load_config
from mindspore_eagle.core.trace import read_jsonl
from mindspore_eagle.core.tree import DraftTree
from mindspore_eagle.models.eagle3 import (
    DrafterConfig,
    init_drafter_tensors,
    load_drafter,
    save_drafter,
    vocab_maps,
)


def tiny_drafter_dir(tmp_path, tcfg, seed=0, vd=96, layers=1):
    rng = np.random.default_rng(seed)
    used = np.sort(rng.choice(tcfg.vocab_size, vd, replace=False))
    dcfg = DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=tcfg.vocab_size, draft_vocab_size=vd,
                         target_hidden_size=tcfg.hidden_size, aux_layers=tcfg.aux_layers, num_hidden_layers=layers)
    t = init_drafter_tensors(dcfg, seed, used)
    t = {k: (v * 25 if k == "lm_head.weight" else v) for k, v in t.items()}   # spread draft logits
    for k in t:                                          # later layers: non-zero output projections (not identity)
        if k.startswith("layers.") and k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = (rng.normal(size=t[k].shape) * 0.2).astype(np.float32)
    d = tmp_path / f"drafter{seed}" if layers == 1 else tmp_path / f"drafter{seed}_l{layers}"
    save_drafter(str(d), dcfg, t)
    return d


def tiny_engine(tiny_dir, drafter_dir, mode, extra=()):
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = load_config(None, [f"model.teacher={tiny_dir}", f"model.drafter={drafter_dir}",
                             f"speculative.mode={mode}", "speculative.policy=fixed", "cache.block_size=8", "cache.max_seq_len=256",
                             "cache.num_blocks=64", "cache.prefill_chunk=16", *extra])
    return build_engine(cfg), cfg


PROMPTS = ["What is the capital of France?", "Write a short story about a robot.", "def add(a, b):"]


def oracle_builder(engine, ref_out, prompt_len, rng, D):
    """Replace drafting with trees that contain the teacher's true continuation at a random depth, mixed with
    wrong siblings in random order (exercises long accepted paths and multi-node commits)."""
    V = engine.teacher.model.cfg.vocab_size

    def build(dsid, root, first, M, D_, grow=None):
        sid = next(iter(engine.teacher.bm._seqs))
        done = engine.teacher.length(sid) - prompt_len + 1
        truth = ref_out[done:done + D]
        tokens, parents, depth = [root], [0], [0]
        node = 0
        for t in truth[: int(rng.integers(0, len(truth) + 1))]:
            wrong = [int(w) for w in rng.choice(V, 2, replace=False) if w != t][: int(rng.integers(0, 2))]
            kids = wrong + [int(t)]
            rng.shuffle(kids)
            for k in kids:
                if len(tokens) < M:
                    tokens.append(k), parents.append(node), depth.append(depth[node] + 1)
            if int(t) not in tokens[-len(kids):]:
                break
            node = len(tokens) - len(kids) + kids.index(int(t))
        return DraftTree(tokens, parents)

    return build


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny):
    return tiny_drafter_dir(tmp_path_factory.mktemp("drafter"), tiny[0])


@pytest.mark.parametrize("budget", [("12", "4", "3"), ("5", "4", "1"), ("32", "6", "4")])
def test_greedy_lossless_random_drafter(ms_runtime, tiny_dir, drafter_dir, budget):
    M, D, K = budget
    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "fused",
                           [f"speculative.M={M}", f"speculative.D_max={D}", f"speculative.top_k={K}"])
    gen = cfg.generation
    gen.max_new_tokens = 24
    for p in PROMPTS:
        base = eng.generate(p, gen, speculative=False)
        spec = eng.generate(p, gen, speculative=True)
        assert spec.token_ids == base.token_ids and spec.text == base.text
        assert sum(spec.accept_lens) >= len(spec.token_ids) - 1


@pytest.mark.parametrize("mode", ["fused", "eager"])
def test_greedy_lossless_high_acceptance(ms_runtime, tiny_dir, drafter_dir, mode):
    eng, cfg = tiny_engine(tiny_dir, drafter_dir, mode, ["speculative.M=10", "speculative.D_max=5"])
    gen = cfg.generation
    gen.max_new_tokens = 40
    rng = np.random.default_rng(0)
    for p in PROMPTS:
        ids = eng.encode_chat(p)
        base = eng.generate_ids(ids, gen, speculative=False)
        eng.drafter.build_tree = oracle_builder(eng, base.token_ids, len(ids), rng, 5)
        spec = eng.generate_ids(ids, gen, speculative=True)
        assert spec.token_ids == base.token_ids
        assert max(spec.accept_lens) >= 4 and np.mean(spec.accept_lens) > 1.5


def test_two_layer_drafter_lossless_and_fused_equals_eager(ms_runtime, tiny_dir, tiny, tmp_path):
    """A 2-layer drafter (its own KV cache per layer, vLLM multi-layer layout) drafts through the same engine:
    greedy output equals teacher-only decoding, fused and eager draft the same trees, and those trees differ from
    the 1-layer drafter's with the same layer-0 weights (the second layer is used)."""
    two = tiny_drafter_dir(tmp_path, tiny[0], seed=6, layers=2)
    one = tiny_drafter_dir(tmp_path, tiny[0], seed=6)
    assert load_drafter(str(two))[0].num_hidden_layers == 2
    trees = {}
    for name, d, mode in (("two_fused", two, "fused"), ("two_eager", two, "eager"), ("one_fused", one, "fused")):
        eng, cfg = tiny_engine(tiny_dir, d, mode, ["speculative.M=12", "speculative.D_max=4", "speculative.top_k=3"])
        gen = cfg.generation
        gen.max_new_tokens = 12
        trees[name] = []
        build = eng.drafter.build_tree

        def spy(*a, **kw):
            tree = build(*a, **kw)
            trees[name].append((tree.tokens.tolist(), tree.parents.tolist()))
            return tree

        eng.drafter.build_tree = spy
        for p in PROMPTS:
            spec = eng.generate(p, gen, speculative=True)
            assert spec.token_ids == eng.generate(p, gen, speculative=False).token_ids, (name, p)
    assert len(trees["two_fused"]) >= 3 * 6 and all(len(t[0]) == 12 for t in trees["two_fused"])
    assert trees["two_fused"] == trees["two_eager"]
    assert trees["two_fused"] != trees["one_fused"]


def test_fused_and_eager_identical(ms_runtime, tiny_dir, drafter_dir, tmp_path):
    results = {}
    for mode in ("fused", "eager"):
        eng, cfg = tiny_engine(tiny_dir, drafter_dir, mode,
                               ["speculative.M=12", "speculative.D_max=4", "speculative.top_k=3"])
        gen = cfg.generation
        gen.max_new_tokens = 20
        results[mode] = [(g.token_ids, g.accept_lens) for g in (eng.generate(p, gen) for p in PROMPTS)]
    assert results["fused"] == results["eager"]


def test_sampling_follows_teacher_distribution(ms_runtime, tiny_dir, drafter_dir, tiny):
    """Joint of the first two sampled tokens (the second goes through the tree rejection rule) matches the exact
    teacher distribution (temperature 0.8, top_k 3), chi-square at significance 0.001, fixed seeds."""
    tcfg, tensors, _ = tiny
    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "fused", ["speculative.M=8", "speculative.D_max=2"])
    gen = cfg.generation
    gen.temperature, gen.top_k, gen.max_new_tokens = 0.8, 3, 2
    ids = eng.encode_chat("Tell me a story.")
    n = len(ids)
    exact = exact_two_tokens(tcfg, tensors, ids, 0.8, 3)
    rng = np.random.default_rng(7)

    def build(dsid, root, first, M, D, grow=None):   # root's children: the likely tokens, shuffled, plus a wrong one
        l, _ = numpy_forward(tcfg, tensors, ids + [root], np.arange(n + 1), causal_mask(n + 1))
        kids = list(np.argsort(-l[-1])[:3])
        rng.shuffle(kids)
        kids = [int(k) for k in kids[: int(rng.integers(1, 4))]] + [int(np.argsort(-l[-1])[10])]
        return DraftTree([root] + kids, [0] * (len(kids) + 1))

    eng.drafter.build_tree = build
    counts = {}
    N = 400
    for seed in range(N):
        gen.seed = seed
        g = eng.generate_ids(ids, gen)
        key = tuple(g.token_ids[:2])
        assert key in exact, key
        counts[key] = counts.get(key, 0) + 1
    keys = sorted(exact)
    obs = np.array([counts.get(k, 0) for k in keys])
    exp = np.array([exact[k] for k in keys]) * N
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_drafter_checkpoint_roundtrip_and_reference_layout(ms_runtime, tmp_path, tiny):
    tcfg = tiny[0]
    d = tiny_drafter_dir(tmp_path, tcfg, seed=3, vd=50)
    cfg, t = load_drafter(str(d))
    assert cfg.draft_vocab_size == 50 and cfg.aux_layers == tuple(tcfg.aux_layers)
    cfg2, t2 = load_drafter(str(d))
    save_drafter(str(tmp_path / "again"), cfg2, t2)
    _, t3 = load_drafter(str(tmp_path / "again"))
    for k in t:
        assert np.array_equal(t[k], t3[k]), k
    # a checkpoint written with the EAGLE-3 reference names (vLLM-style "layers.0." too) and a non-trivial d2t
    import mindspore as ms
    from safetensors.numpy import save_file

    from mindspore_eagle.models.eagle3 import Eagle3Drafter

    used = np.array([3, 17, 40, 41, 99, 120, 250, 300])
    ref = {k.replace("midlayer.", "layers.0."): v.astype(np.float16) for k, v in t.items() if k not in ("d2t", "t2d")}
    ref["lm_head.weight"] = np.zeros((8, tcfg.hidden_size), np.float16)
    ref.update({k: v for k, v in vocab_maps(used, tcfg.vocab_size).items()})
    cfg_json = json.loads((d / "config.json").read_text())
    cfg_json["draft_vocab_size"] = 8
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(cfg_json))
    save_file(ref, str(ref_dir / "model.safetensors"))
    rcfg, rt = load_drafter(str(ref_dir))
    assert np.array_equal(rt["d2t"] + np.arange(8), used)
    rt["norm.weight"] = np.ones_like(rt["norm.weight"])
    for j in range(8):                                   # make draft id j the argmax: must map to used[j]
        rt["lm_head.weight"] = np.zeros_like(rt["lm_head.weight"])
        rt["lm_head.weight"][j] = 1.0
        embed = ms.Parameter(ms.Tensor(np.ones((tcfg.vocab_size, tcfg.hidden_size), np.float32)), name="e")
        cell = Eagle3Drafter(rcfg, embed, 2, 4, 8, 32)
        cell.load_tensors(rt)
        h = ms.Tensor(np.ones((1, tcfg.hidden_size), np.float32))
        mask = np.full((1, 32), -1e9, np.float32)
        mask[0, 0] = 0
        _, ids, _ = cell(h, ms.Tensor(np.array([5], np.int32)), ms.Tensor(np.array([0], np.int32)),
                         ms.Tensor(np.array([0], np.int32)), ms.Tensor(np.arange(4, dtype=np.int32)),
                         ms.Tensor(mask))
        assert int(ids.asnumpy()[0, 0]) == used[j]


def test_bad_drafter_checkpoints(tmp_path, tiny):
    from mindspore_eagle.models.eagle3 import DrafterCheckpointError
    from mindspore_eagle.serving.pipeline import check_drafter_fits

    tcfg = tiny[0]
    with pytest.raises(DrafterCheckpointError, match="no config.json"):
        load_drafter(str(tmp_path / "missing"))
    d = tiny_drafter_dir(tmp_path, tcfg, seed=5, vd=20)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    with pytest.raises(DrafterCheckpointError, match="unreadable"):
        load_drafter(str(d))
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(DrafterCheckpointError, match="pickle"):
        load_drafter(str(d))
    cfg_json = json.loads((tiny_drafter_dir(tmp_path, tcfg, seed=6).joinpath("config.json")).read_text())
    for name, layers in (("zero_layers", 0), ("two_layers", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg_json | {"num_hidden_layers": layers}))
        (tmp_path / name / "model.safetensors").write_bytes((tmp_path / "drafter6" / "model.safetensors").read_bytes())
    with pytest.raises(DrafterCheckpointError, match="num_hidden_layers must be >= 1, got 0"):
        load_drafter(str(tmp_path / "zero_layers"))
    with pytest.raises(DrafterCheckpointError, match="missing tensor layers.1."):   # config 2 layers, tensors 1
        load_drafter(str(tmp_path / "two_layers"))
    bad = DrafterConfig(hidden_size=32, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=tcfg.vocab_size, draft_vocab_size=8, target_hidden_size=32)
    with pytest.raises(DrafterCheckpointError, match="hidden_size = 32 does not fit the teacher"):
        check_drafter_fits(bad, tcfg)


def test_traces_parse_and_phases_add_up(ms_runtime, tiny_dir, drafter_dir, tmp_path):
    trace = tmp_path / "t.jsonl"
    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "fused", [f"speculative.trace={trace}"])
    gen = cfg.generation
    gen.max_new_tokens = 16
    g = eng.generate(PROMPTS[0], gen)
    eng.trace.close()
    records = read_jsonl(trace)
    steps = [r for r in records if r.kind == "step"]
    turns = [r for r in records if r.kind == "turn"]
    assert len(steps) == len(g.steps) > 0 and len(turns) == 1
    assert turns[0].new_tokens == len(g.token_ids)
    for s in steps:
        phases = s.draft_ms + s.tensorize_ms + s.mask_ms + s.verify_ms + s.accept_ms + s.commit_ms
        assert phases <= s.total_ms * 1.0001 and phases >= 0.9 * s.total_ms
        assert s.accept_len == len(s.accepted) >= 1


def test_drafter_window_truncation_masks_old_context(ms_runtime, tiny_dir, drafter_dir):
    """With speculative.window = W the drafter's queries see only the last W context pairs (paper Table 3);
    the teacher is unchanged, so the output stays identical."""
    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "eager", ["speculative.window=8", "speculative.D_max=3"])
    seen = []
    orig_run, orig_ctx = eng.drafter._run, eng.drafter._ctx

    def spy_run(sid, h, tokens, positions, slots, mask):          # tree expansion steps
        seen.append((np.asarray(positions).copy(), mask.copy()))
        return orig_run(sid, h, tokens, positions, slots, mask)

    def spy_ctx(aux, tokens, positions, slots, table, mask, pick):  # context passes
        seen.append((positions.asnumpy().copy(), mask.asnumpy().copy()))
        return orig_ctx(aux, tokens, positions, slots, table, mask, pick)

    spy_ctx.compiles, spy_ctx.compile_ms = 0, 0.0                   # eager mode: nothing compiles
    eng.drafter._run, eng.drafter._ctx = spy_run, spy_ctx
    gen = cfg.generation
    gen.max_new_tokens = 6
    g = eng.generate(PROMPTS[1], gen)
    assert g.token_ids == eng.generate(PROMPTS[1], gen, speculative=False).token_ids
    for positions, mask in seen:
        visible = mask > -1
        ctx_cols = visible.sum(axis=1)
        assert ctx_cols.max() <= 8 + 3 * 4        # at most W context pairs (+ tree ancestors in tree steps)
    first_pos, first_mask = seen[0]               # context pass over the whole prompt
    row = int(np.argmax(first_pos))
    assert np.flatnonzero(first_mask[row] > -1).tolist() == list(range(first_pos[row] - 7, first_pos[row] + 1))


def test_bad_generation_inputs(ms_runtime, tiny_dir, drafter_dir):
    from mindspore_eagle.serving.engine import GenerationError

    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "eager")
    with pytest.raises(GenerationError, match="prompt is empty"):
        eng.generate("   ", cfg.generation)
    with pytest.raises(GenerationError, match="prompt is empty"):
        eng.generate_ids([], cfg.generation)
    with pytest.raises(GenerationError, match=r"exceeds cache.max_seq_len=256"):
        eng.generate_ids(list(range(5, 205)), cfg.generation)      # 200 + 128 new + M > 256


def test_draft_batch_equals_per_sequence_drafting(ms_runtime, tiny, tiny_dir, tmp_path):
    """DrafterRunner.draft_batch (context passes and expansion steps batched across sequences, each group over its
    own block table, one pad group) gives every sequence the tree that extend + build_tree give it alone: same
    tokens and parents, scores to float32 rounding; a long context pass (> BATCH_EXTEND_MAX pairs) runs alone."""
    from mindspore_eagle.runners.drafter import BATCH_EXTEND_MAX

    d = tiny_drafter_dir(tmp_path, tiny[0])
    one, _ = tiny_engine(tiny_dir, d, "fused", ["speculative.M=8", "speculative.D_max=4"])
    bat, _ = tiny_engine(tiny_dir, d, "fused", ["speculative.M=8", "speculative.D_max=4"])
    assert bat.drafter.grouped
    rng = np.random.default_rng(3)
    H3 = 3 * tiny[0].hidden_size
    s1 = [one.drafter.new_seq() for _ in range(3)]
    s2 = [bat.drafter.new_seq() for _ in range(3)]
    for rnd, lens in enumerate(((5, BATCH_EXTEND_MAX + 9, 1), (1, 3, 2), (4, 1, 16))):
        pending = [(rng.standard_normal((m, H3)).astype(np.float32), rng.integers(3, 200, size=m)) for m in lens]
        roots = [int(x) for x in rng.integers(3, 200, size=3)]
        want = [one.drafter.build_tree(sid, r, one.drafter.extend(sid, a, t), 8, 4)
                for sid, (a, t), r in zip(s1, pending, roots)]
        got = bat.drafter.draft_batch(s2, pending, roots, 8, 4, groups=4)
        for w, g in zip(want, got):
            assert list(g.tokens) == list(w.tokens) and list(g.parents) == list(w.parents), rnd
            assert np.abs(np.asarray(g.scores) - np.asarray(w.scores)).max() < 1e-4
        assert [bat.drafter.bm.length(x) for x in s2] == [one.drafter.bm.length(x) for x in s1]
    with pytest.raises(ValueError, match="groups"):
        bat.drafter.draft_batch(s2, pending, roots, 8, 4, groups=2)
