"""The speculative engine (serving/engine.py) on the tiny openPangu model: lossless greedy (random drafter and
high-acceptance oracle trees), fused == eager, exact sampling distribution, traces, bad inputs."""
import numpy as np
import pytest
from scipy import stats
from tiny_engines import PROMPTS, tiny_drafter_dir, tiny_engine
from tiny_pangu import causal_mask, exact_two_tokens, numpy_forward

from mindspore_eagle.core.trace import read_jsonl
from mindspore_eagle.core.tree import DraftTree
from mindspore_eagle.models.eagle3 import load_drafter
from mindspore_eagle.serving.batch_job import run_records


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_half_weights_stay_lossless_and_auto_halves_the_drafter_only(ms_runtime, tiny_dir, drafter_dir):
    """model.weight_dtype: auto holds the drafter's matrices in float16 and the teacher's in float32 on the CPU
    backend; float16 holds both, and speculative greedy output still equals teacher-only decoding of that teacher
    (speculation is exact against the teacher as loaded)."""
    import mindspore as ms

    from mindspore_eagle.config import load_config
    from mindspore_eagle.serving.pipeline import weight_dtypes

    assert weight_dtypes(load_config(None, [])) == (ms.float32, ms.float16)
    assert weight_dtypes(load_config(None, ["model.weight_dtype=float32"])) == (ms.float32, ms.float32)
    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "fused", ["model.weight_dtype=float16", "speculative.M=8",
                                                             "speculative.D_max=3", "speculative.top_k=3"])
    assert eng.teacher.model.layers[0].w_down.dtype == ms.float16 and eng.drafter.drafter.lm_head.dtype == ms.float16
    gen = cfg.generation
    gen.max_new_tokens = 16
    for p in PROMPTS:
        spec = eng.generate(p, gen, speculative=True)
        assert spec.token_ids == eng.generate(p, gen, speculative=False).token_ids, p
        assert len(spec.accept_lens) < len(spec.token_ids)            # trees were drafted and verified


@pytest.mark.slow
def test_fused_and_eager_identical(ms_runtime, tiny_dir, drafter_dir, tmp_path):
    results = {}
    for mode in ("fused", "eager"):
        eng, cfg = tiny_engine(tiny_dir, drafter_dir, mode,
                               ["speculative.M=12", "speculative.D_max=4", "speculative.top_k=3"])
        gen = cfg.generation
        gen.max_new_tokens = 20
        results[mode] = [(g.token_ids, g.accept_lens) for g in (eng.generate(p, gen) for p in PROMPTS)]
    assert results["fused"] == results["eager"]


@pytest.mark.slow
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


@pytest.mark.slow
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
    coverage = []
    for s in steps:
        phases = s.draft_ms + s.tensorize_ms + s.mask_ms + s.verify_ms + s.accept_ms + s.commit_ms
        assert phases <= s.total_ms * 1.0001  # the phase timers nest inside the step timer
        coverage.append(phases / s.total_ms)
        assert s.accept_len == len(s.accepted) >= 1
    # Which phases cover the step is pinned with a fake clock in tests/core/test_trace.py; on a real clock one
    # preempted step on a 2-core machine may leave >10 % of it between timers, so the median step is checked:
    # a phase left untimed (verify is ~half a step) would drop every step's coverage far below 0.8.
    assert np.median(coverage) >= 0.8, coverage


def test_bad_generation_inputs(ms_runtime, tiny_dir, drafter_dir):
    from mindspore_eagle.serving.engine import GenerationError

    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "eager")
    with pytest.raises(GenerationError, match="prompt is empty"):
        eng.generate("   ", cfg.generation)
    with pytest.raises(GenerationError, match="prompt is empty"):
        eng.generate_ids([], cfg.generation)
    with pytest.raises(GenerationError, match=r"exceeds cache.max_seq_len=256"):
        eng.generate_ids(list(range(5, 205)), cfg.generation)      # 200 + 128 new + M > 256


@pytest.mark.slow
def test_seeded_sampling_gives_the_same_text_on_every_path(ms_runtime, tiny_dir, drafter_dir):
    """Temperature 0.8, one (prompt, seed): the same tokens alone, after other turns have moved the policy's
    state, teacher-only (--baseline), and inside a speculative batch of 4 next to other prompts; another seed
    gives another text (the draws are keyed by (seed, position), core/accept.py)."""
    from tiny_engines import records

    from mindspore_eagle.serving.scheduler import BatchScheduler

    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "fused", ["speculative.M=8", "speculative.D_max=3",
                                                            "cache.num_blocks=160"])
    gen = cfg.generation
    gen.temperature, gen.max_new_tokens, gen.seed = 0.8, 24, 11
    p = "Name a random fruit and say why you like it."
    alone = eng.generate(p, gen)
    for q in PROMPTS:
        eng.generate(q, gen)
    again = eng.generate(p, gen)
    base = eng.generate(p, gen, speculative=False)
    assert alone.token_ids == again.token_ids == base.token_ids
    eng.drafter.build_tree = oracle_builder(eng, base.token_ids, len(eng.encode_chat(p)), np.random.default_rng(3), 3)
    oracle = eng.generate(p, gen)                 # trees holding the sampled text: long accepted paths
    del eng.drafter.build_tree
    assert oracle.token_ids == base.token_ids and max(oracle.accept_lens) >= 3
    recs = records([{"id": i, "prompt": q} for i, q in enumerate([PROMPTS[0], p, PROMPTS[1], p])])
    sched, ids = BatchScheduler(eng, gen, 4, speculative=True), {}
    run_records(sched, recs, lambda res: None, ids)
    assert ids[1] == ids[3] == [alone.token_ids]
    gen.seed = 12
    assert eng.generate(p, gen).token_ids != alone.token_ids


# ------------------------------------------------------------------ the cost table: stored, prior, running
def test_running_costs_follow_the_steps_and_scale_what_was_not_seen():
    """core.costs.RunningCosts: an entry's steps pull it from its starting value, which counts as PRIOR_WEIGHT steps
    (the n-th step moves it by 1 / (n + PRIOR_WEIGHT) of the log residual, then by ``rate``); entries not observed
    follow the machine's speed factor; a budget never costs as much as a larger one (at most the prior's ratio of
    it); one outlier step late on moves an entry by at most a factor 4 ** rate."""
    from types import SimpleNamespace

    from mindspore_eagle.core.costs import RunningCosts, prior_table, prior_verify_ratio

    t = prior_table([2, 4, 8])
    assert t.decode_ms == 50.0 and t.verify_ms[8] == 50.0 * prior_verify_ratio(8)
    run = RunningCosts(t)
    w = run.PRIOR_WEIGHT
    run.observe_step(SimpleNamespace(budget=1, total_ms=190.0, draft_ms=10.0, drafted=False, draft_ctx_ms=0.0,
                                     draft_expand_ms=0.0, expansions=0))   # a plain step (suffix drafting only)
    first = 50.0 * (180.0 / 50.0) ** (1 / (1 + w))                     # geometric: 1 of 1 + w "steps" observed
    assert np.isclose(t.decode_ms, first) and np.isclose(run.speed(), first / 50.0)
    assert np.isclose(t.verify_ms[4], first * prior_verify_ratio(4)) and np.isclose(t.draft_ctx_ms, first * 0.12)
    for _ in range(30):
        run.observe(1, 180.0)
    assert abs(t.decode_ms / 180.0 - 1) < 1e-2                         # many steps: the starting value fades
    # a first m = 4 step 30 % slower than m = 8's cost (1.6x its own starting value) leaves m = 4 below m = 8; with
    # the first step replacing the starting value it was capped at m = 8's cost, where the policy never picks it
    run.observe(8, 300.0), run.observe(2, 200.0)
    v8 = t.verify_ms[8]
    run.observe(4, 1.3 * v8)
    assert t.verify_ms[2] < t.verify_ms[4] < v8
    for _ in range(40):
        run.observe(8, 300.0)
    assert np.isclose(t.verify_ms[8], 300.0, rtol=1e-3) and np.isclose(t.decode_ms, 180.0, rtol=1e-2)
    assert t.verify_ms[8] / t.decode_ms > prior_verify_ratio(8)
    before = t.verify_ms[8]
    run.observe(8, 1e6)                                                   # a burst of load: clipped
    assert before < t.verify_ms[8] < before * 4 ** run.rate * 1.001
    run.observe(16, 100.0), run.observe(2, float("nan")), run.observe(2, -1.0)   # not tracked / not a cost
    assert run.counts == {1: 31, 2: 1, 4: 1, 8: 42}
    # steps of a smaller budget slower than a larger one's: held below the larger by the prior's ratio, not at it
    for _ in range(40):
        run.observe(2, 400.0)
    assert np.isclose(t.verify_ms[2], t.verify_ms[4] * prior_verify_ratio(2) / prior_verify_ratio(4))
    assert t.verify_ms[4] <= t.verify_ms[8] * prior_verify_ratio(4) / prior_verify_ratio(8) * (1 + 1e-9)


def test_running_costs_learn_the_drafter_costs_from_its_calls():
    """The drafter's context-pass and expansion costs are running estimates of their own (the n-th observation moves
    the log estimate by 1 / (n + PRIOR_WEIGHT) of the residual from the speed-scaled prior), fed by the steps that
    ran the drafter (expansion = draft_expand_ms / expansions); they leave the speed factor alone, and a step
    without the drafter, or without an expansion, moves nothing, or only the context pass."""
    from mindspore_eagle.core.costs import PRIOR_DRAFT_CTX_RATIO, PRIOR_DRAFT_STEP_RATIO, RunningCosts, prior_table
    from mindspore_eagle.core.trace import StepTrace

    t = prior_table([2, 4, 8])
    run = RunningCosts(t)
    w = run.PRIOR_WEIGHT
    for _ in range(40):
        run.observe(1, 25.0)
    f = run.speed()
    ctx0, step0 = 50.0 * PRIOR_DRAFT_CTX_RATIO * f, 50.0 * PRIOR_DRAFT_STEP_RATIO * f
    assert np.isclose(t.draft_ctx_ms, ctx0) and np.isclose(t.draft_step_ms, step0)
    tree = dict(step=0, accept_len=2, budget=4, drafted=True, draft_ms=4.2, total_ms=45.0)
    ref = RunningCosts(prior_table([2, 4, 8]))                          # the same teacher steps, no drafter
    for _ in range(40):
        ref.observe(1, 25.0)
    ref.observe(4, 45.0 - 4.2)
    run.observe_step(StepTrace(**tree, draft_ctx_ms=1.0, draft_expand_ms=3.0, expansions=2))
    assert np.isclose(run.speed(), ref.speed()) and run.speed() != f  # drafter costs leave the speed factor
    ctx0, step0 = ctx0 / f * run.speed(), step0 / f * run.speed()     # the starting values at the first draft
    assert np.isclose(t.draft_ctx_ms, ctx0 * (1.0 / ctx0) ** (1 / (1 + w)))
    assert np.isclose(t.draft_step_ms, step0 * (1.5 / step0) ** (1 / (1 + w)))
    run.observe_step(StepTrace(**{**tree, "drafted": False}, draft_ctx_ms=5.0, draft_expand_ms=9.0, expansions=3))
    run.observe_step(StepTrace(**tree, draft_ctx_ms=1.0, draft_expand_ms=0.1, expansions=0))
    assert run.draft_counts == {"ctx": 2, "step": 1}
    for _ in range(60):
        run.observe_step(StepTrace(**tree, draft_ctx_ms=1.0, draft_expand_ms=3.0, expansions=2))
    assert np.isclose(t.draft_ctx_ms, 1.0, rtol=1e-3) and np.isclose(t.draft_step_ms, 1.5, rtol=1e-3)
    assert np.isclose(t.decode_ms, 25.0, rtol=1e-2)                    # the teacher's estimates did not move
    with pytest.raises(ValueError, match="which must be 'ctx' or 'step'"):
        run.observe_draft("head", 1.0)


def test_cap_verify_costs_matches_a_brute_force_cap():
    """core.costs.cap_verify_costs (the policy's running table and Engine.measure_costs share it): every budget's
    cost is the minimum of its own and each larger budget's capped cost scaled by the prior's ratio, checked
    against that definition evaluated directly; a table already increasing by more than the ratios is kept."""
    from mindspore_eagle.core.costs import cap_verify_costs, prior_verify_ratio

    rng = np.random.default_rng(0)
    for _ in range(50):
        ms_ = [1, 2, 4, 8, 16][: rng.integers(1, 6)]
        raw = {m: float(rng.uniform(10, 100)) for m in ms_}
        got = cap_verify_costs(raw)
        want = {}
        for m in sorted(ms_, reverse=True):           # the definition, larger budgets first
            want[m] = min([raw[m]] + [want[b] * prior_verify_ratio(m) / prior_verify_ratio(b) for b in want])
        assert got.keys() == raw.keys() and all(np.isclose(got[m], want[m]) for m in ms_)
        assert all(got[a] < got[b] for a, b in zip(ms_, ms_[1:]))            # strictly increasing in m
    steep = {m: 10.0 * prior_verify_ratio(m) ** 2 for m in (2, 4, 8, 16)}
    assert cap_verify_costs(steep) == steep


def test_running_costs_hold_an_inferred_decode_below_the_smallest_verification():
    """The 240-turn trap (docs/design.md, "Measurements behind the design: A decode held dearer than a
    verification"): verifications observed at that machine's ratios (1.2 / 2.8 decodes of 22.6 ms at m = 2 / 16,
    1.5 / 1.85 between them: steeper than the prior's), decode never observed: the speed factor alone would infer
    decode dearer than a 2-token verification; the table holds it below by the prior's ratio, and a decode's own
    steps then pull it to its cost."""
    from mindspore_eagle.core.costs import RunningCosts, prior_table, prior_verify_ratio

    t = prior_table([2, 4, 8, 16])
    run = RunningCosts(t)
    decode = 22.6
    for _ in range(20):
        for m, ratio in ((2, 1.2), (4, 1.5), (8, 1.85), (16, 2.8)):
            run.observe(m, decode * ratio)
    assert run.start[1] * run.speed() > t.verify_ms[2]                 # the trap: inferred decode > a verification
    assert np.isclose(t.decode_ms, t.verify_ms[2] / prior_verify_ratio(2))
    for _ in range(30):
        run.observe(1, decode)
    assert np.isclose(t.decode_ms, decode, rtol=1e-2) and t.decode_ms < t.verify_ms[2]


@pytest.mark.slow
def test_adaptive_engine_measures_nothing_up_front_and_keeps_its_table(ms_runtime, tiny_dir, drafter_dir, tmp_path,
                                                                        capsys):
    """No cost table is measured before the first token: the policy starts from the prior, the turn's steps update
    it (steps that made a graph are left out) and it is stored; a second engine starts from the stored table,
    which holds every budget. A table given to the engine stays as given."""
    from mindspore_eagle.core.costs import CostTable
    from mindspore_eagle.core.policy import PLAIN_EVERY

    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "fused", ["speculative.policy=adaptive", "speculative.M=8",
                                                            "speculative.D_max=3"])
    eng.cost_file = str(tmp_path / "costs.json")
    gen = cfg.generation
    gen.max_new_tokens = 16
    calls = []
    eng.measure_costs = lambda *a, **k: calls.append(1)
    g = eng.generate(PROMPTS[0], gen)
    assert calls == [] and "measured" not in capsys.readouterr().err
    assert g.token_ids == eng.generate(PROMPTS[0], gen, speculative=False).token_ids
    run = eng.running_costs
    assert 0 < run.observed <= len(g.steps)
    saved = CostTable.load(eng.cost_file, budgets=[2, 4, 8])
    assert saved is not None and saved.to_dict() == eng.policy.costs.to_dict()
    assert saved.decode_ms != 50.0                                      # the prior's decode was replaced
    eng2, _ = tiny_engine(tiny_dir, drafter_dir, "fused", ["speculative.policy=adaptive", "speculative.M=8",
                                                           "speculative.D_max=3"])
    eng2.cost_file = eng.cost_file
    assert eng2.policy.costs.to_dict() == saved.to_dict() and eng2.running_costs.observed == 0
    fixed = CostTable(decode_ms=50.0, verify_ms={2: 55.0, 4: 60.0, 8: 70.0}, draft_ctx_ms=5.0, draft_step_ms=5.0)
    eng3, _ = tiny_engine(tiny_dir, drafter_dir, "fused", ["speculative.policy=adaptive", "speculative.M=8",
                                                           "speculative.D_max=3"])
    eng3.costs = fixed
    assert eng3.policy.costs is fixed and eng3.running_costs is None
    # a table kept from the steps keeps observing a decode (plain probes); a table given stays as given
    assert eng.policy.plain_every == eng2.policy.plain_every == PLAIN_EVERY and eng3.policy.plain_every == 0


def test_measured_costs_keep_the_medians_behind_the_capped_table(ms_runtime, tiny_dir, drafter_dir):
    """Engine.measure_costs (``inspect costs``) returns the policy's capped table and, beside it, the medians it
    measured: one per budget and the decode, each at least its capped cost, equal where no cap applied (the largest
    budget always); describe() prints both, and the medians survive to_dict / load."""
    from mindspore_eagle.core.costs import CostTable, cap_verify_costs

    eng, _ = tiny_engine(tiny_dir, drafter_dir, "fused", ["speculative.M=8", "speculative.D_max=3"])
    t = eng.measure_costs(context=32, repeat=2)
    budgets = eng.verify_budgets()
    assert set(t.measured) == {1, *budgets} and set(t.verify_ms) == set(budgets)
    assert min(t.measured.values()) > 0
    capped = cap_verify_costs(t.measured)
    assert capped == {1: t.decode_ms, **t.verify_ms}
    assert all(t.measured[m] >= capped[m] for m in capped) and t.verify_ms[max(budgets)] == t.measured[max(budgets)]
    text = t.describe()
    assert text.count("measured") == 1 + len(budgets) and f"{t.measured[max(budgets)]:7.1f} ms" in text
    assert CostTable(**t.to_dict()).measured == t.measured
    assert "measured" not in CostTable(**{k: v for k, v in t.to_dict().items() if k != "measured"}).describe()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_under_speculation_equal_teacher_only_bit_for_bit(ms_runtime, tiny, tiny_dir, tmp_path, temperature):
    """generation.logprobs: every emitted token's log-probability and its top alternatives, the same to the last
    bit with and without speculation (float32 CPU kernels: a token's logits are the same in a tree), and equal
    to a log-softmax of the teacher's own logits for the first token."""
    import dataclasses

    from tiny_engines import tiny_drafter_dir, tiny_engine

    from mindspore_eagle.core.accept import token_logprobs

    eng, cfg = tiny_engine(tiny_dir, tiny_drafter_dir(tmp_path, tiny[0]), "fused",
                           ["speculative.M=4", "speculative.D_max=2", "speculative.top_k=2",
                            "speculative.method=hybrid"])            # suffix copies get accepted on the tiny teacher
    gen = dataclasses.replace(cfg.generation, max_new_tokens=40, temperature=temperature, seed=7, logprobs=3)
    ids = eng.encode_chat("Tell me about the sea.")
    spec = eng.generate_ids(ids, gen, speculative=True)
    plain = eng.generate_ids(ids, gen, speculative=False)
    assert spec.token_ids == plain.token_ids and any(st.accept_len > 1 for st in spec.steps)
    assert spec.logprobs == plain.logprobs and [e[0] for e in spec.logprobs] == spec.token_ids
    assert all(len(top) == 3 and top[0][1] >= top[-1][1] for _, _, top in spec.logprobs)
    sid = eng.teacher.new_seq()
    logits, _ = eng.teacher.prefill(sid, ids)
    eng.teacher.free(sid)
    assert spec.logprobs[0] == token_logprobs(np.asarray(logits)[None], [spec.token_ids[0]], 3)[0]
    off = eng.generate_ids(ids, dataclasses.replace(gen, logprobs=None), speculative=True)
    assert off.logprobs == [] and off.token_ids == spec.token_ids
