"""Speculation policy (policy.py): cost-driven choices, online calibration, and the adaptive engine on the tiny
teacher (lossless greedy, exact sampling, speculates with an oracle drafter, not with a random one)."""
import numpy as np
import pytest
from scipy import stats
from tiny_pangu import causal_mask, exact_two_tokens, numpy_forward

from mindspore_eagle.core.calibration import (
    AcceptanceModel,
    likeliest_child,
    node_values,
    top_nodes,
)
from mindspore_eagle.core.costs import CostTable, compiled_budgets
from mindspore_eagle.core.policy import AdaptivePolicy, FixedPolicy
from mindspore_eagle.core.tree import DraftTree, tensorize, validate_tree
from mindspore_eagle.runners.drafter import select_tree

BUDGETS = compiled_budgets(16)


def costs(verify, decode=50.0, ctx=5.0, step=5.0, host=1.0):
    return CostTable(decode_ms=decode, verify_ms={m: verify(m) for m in BUDGETS}, draft_ctx_ms=ctx,
                     draft_step_ms=step, host_ms=host)


def chain_with_alternatives(p_main=0.9, depth=4, K=4):
    """A drafted tree: a confident chain (each step prob p_main) with K - 1 unlikely siblings per level."""
    scores, parents, tokens = [], [], []
    parent, cum = 0, 0.0
    for d in range(depth):
        first = len(scores) + 1
        for k in range(K):
            p = p_main if k == 0 else (1 - p_main) / K
            scores.append(cum + np.log(p))
            parents.append(parent)
            tokens.append(100 * d + k + 1)
        parent, cum = first, cum + np.log(p_main)
    return select_tree(7, np.array(scores, np.float32), np.array(tokens), np.array(parents), 1 + len(scores))


def test_compiled_budgets():
    assert compiled_budgets(16) == [2, 4, 8, 16] and compiled_budgets(12) == [2, 4, 8, 12]
    assert compiled_budgets(2) == [2]
    with pytest.raises(ValueError, match="speculative.M = 1"):
        compiled_budgets(1)


def test_top_nodes_keeps_parents_and_matches_select_tree():
    rng = np.random.default_rng(0)
    for _ in range(50):
        C = 20
        parents = np.concatenate([np.zeros(4, np.int64), rng.integers(1, 5, 16)])
        logp = np.log(rng.uniform(0.01, 1.0, C)).astype(np.float32)
        scores = logp.copy()
        scores[4:] += scores[parents[4:] - 1]
        full = select_tree(3, scores, np.arange(C) + 10, parents, C + 1)
        for m in (2, 4, 8, 12):
            a, b = top_nodes(full, m), select_tree(3, scores, np.arange(C) + 10, parents, m)
            assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)
            validate_tree(tensorize(a, m, 3), m, 3)


def test_node_values_siblings_exclusive_and_identity_prior():
    tree = chain_with_alternatives(0.9, depth=3)
    v = node_values(tree, AcceptanceModel())
    assert v[0] == 1.0
    for parent in range(len(tree)):          # children of one node are mutually exclusive
        kids = np.flatnonzero(tree.parents[1:] == parent) + 1
        assert v[kids].sum() <= v[parent] + 1e-12
    # identity prior: a lone child of drafter path probability 0.9 (bin 0.9-0.95) is valued at its bin's centre
    lone = DraftTree([5, 6, 7], [0, 0, 1], np.log([1.0, 0.9, 0.9 * 0.5]).astype(np.float32))
    w = node_values(lone, AcceptanceModel())
    assert w[1] == pytest.approx(0.925, abs=1e-9) and w[2] == pytest.approx(0.45, abs=1e-9)
    assert likeliest_child(tree).sum() == 3 and not likeliest_child(tree)[0]


def test_free_verification_chooses_the_deepest_tree():
    pol = AdaptivePolicy(costs(lambda m: 1e-3, ctx=0.0, step=0.0, host=0.0), BUDGETS)
    tree = chain_with_alternatives(0.9, depth=4)
    assert pol.want_draft(1024)
    assert pol.want_expand(tree, np.array([-0.1, -3, -3, -3]), 1, 1024, 100)
    assert pol.choose(tree, 1024, 100).m == 16
    assert pol.choose(tree, 9, 100).m == 8           # the cache has room for 9 tree tokens only
    assert pol.choose(tree, 1024, 100).predicted_len > 3


def test_expensive_verification_decodes_plainly_and_stops_drafting():
    pol = AdaptivePolicy(costs(lambda m: 500.0 + m), BUDGETS, explore=0)
    tree = chain_with_alternatives(0.99, depth=4)
    ch = pol.choose(tree, 1024, 100)
    assert ch.m == 1 and ch.predicted_len == 1.0
    assert pol.want_draft(1024)                       # nothing known yet: draft
    pol.after_draft(ch)
    # the drafter's advantage is now below the cost of its context pass: it runs only on probes
    ran = [pol.want_draft(1024) for _ in range(32)]
    assert sum(ran) == 32 // pol.probe_every and ran[pol.probe_every - 1]
    assert not pol.want_draft(1)                      # no room for a tree at all
    explorer = AdaptivePolicy(costs(lambda m: 500.0 + m), BUDGETS, explore=3)
    for _ in range(3):
        assert explorer.want_draft(1024)
        explorer.after_draft(ch)
    assert not explorer.want_draft(1024)


def test_remaining_tokens_cap_the_tree():
    pol = AdaptivePolicy(costs(lambda m: 50.0 + 2 * m), BUDGETS)
    tree = chain_with_alternatives(0.99, depth=4)
    assert pol.choose(tree, 1024, 100).m > 2
    assert pol.choose(tree, 1024, 1).m == 1           # one token left: nothing to speculate
    assert not pol.want_expand(tree, np.array([-0.01] * 4), 1, 1024, 2)


def test_calibration_converges_on_a_synthetic_acceptance_process():
    """Nodes are accepted with probability 0.5 * p (an over-confident drafter): the table learns 0.5 * p."""
    rng = np.random.default_rng(1)
    model = AcceptanceModel(decay=1.0)
    for _ in range(3000):
        p = rng.uniform(0.0, 1.0, 64)
        depth = rng.integers(1, 4, 64)
        model.observe(np.log(p), depth, rng.uniform(size=64) < 0.5, rng.uniform(size=64) < 0.5 * p)
    for q in (0.15, 0.45, 0.75, 0.97):
        for d in (1, 2, 3):
            for best in (True, False):
                assert model.predict(np.log([q]), np.array([d]), np.array([best]))[0] == pytest.approx(0.5 * q, abs=0.04)
    rows = model.to_dict()["bins"]
    assert len(rows) == 78 and all(abs(r["accepted"] - 0.5 * r["drafter_prob"]) < 0.04 for r in rows)


def test_child_rate_and_rho_follow_observations():
    pol = AdaptivePolicy(costs(lambda m: 60.0), BUDGETS)
    tree = chain_with_alternatives(0.9, depth=3)         # nodes 1 (depth 1), 5 (depth 2), 9 (depth 3) chain
    for _ in range(200):
        pol.observe(tree, [0, 1, 5], 3, 60.0)            # depth 1 always continues, depth 2 never
    assert pol.child_rate(1) > 0.95 and pol.child_rate(2) < 0.05
    assert pol.rho == pytest.approx(3 / 60.0, rel=1e-3)
    for _ in range(400):
        pol.observe(None, [0], 1, 500.0)                 # slow plain steps: rho never falls below plain decoding
    assert pol.rho == pytest.approx(pol.plain_rate)


def test_fixed_policy_is_todays_behaviour():
    pol = FixedPolicy(8, 3)
    tree = chain_with_alternatives(0.5, depth=3)
    assert pol.want_draft(8) and not pol.want_draft(7)
    assert pol.want_expand(tree, np.zeros(4), 2, 8, 1) and pol.choose(tree, 8, 1).m == 8


def test_cost_table_rejects_bad_values():
    with pytest.raises(ValueError, match="CostTable.draft_ctx_ms"):
        CostTable(decode_ms=50.0, verify_ms={2: 60.0}, draft_ctx_ms=-1.0, draft_step_ms=1.0)
    with pytest.raises(ValueError, match="no verify cost for budgets \\[4\\]"):
        AdaptivePolicy(CostTable(decode_ms=50.0, verify_ms={2: 60.0}, draft_ctx_ms=1.0, draft_step_ms=1.0), [2, 4])


# ------------------------------------------------------------------------------ the engine, tiny teacher --
PROMPTS = ["What is the capital of France?", "def add(a, b):"]


def _engine(tiny_dir, drafter, verify_ms, extra=()):
    from tiny_engines import tiny_engine

    eng, cfg = tiny_engine(tiny_dir, drafter, "fused", ["speculative.policy=adaptive", "speculative.M=8",
                                                        "speculative.D_max=4", "speculative.top_k=2", *extra])
    eng.costs = CostTable(decode_ms=50.0, verify_ms={m: verify_ms(m) for m in eng.verify_budgets()},
                          draft_ctx_ms=5.0, draft_step_ms=5.0, host_ms=1.0)
    return eng, cfg


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny):
    from tiny_engines import tiny_drafter_dir

    return tiny_drafter_dir(tmp_path_factory.mktemp("drafter"), tiny[0])


@pytest.mark.slow
def test_adaptive_random_drafter_rarely_speculates_and_is_lossless(ms_runtime, tiny_dir, drafter_dir):
    eng, cfg = _engine(tiny_dir, drafter_dir, lambda m: 60.0 + 5 * m)
    assert eng.verify_budgets() == [2, 4, 8]
    gen = cfg.generation
    gen.max_new_tokens = 60
    steps = []
    for p in PROMPTS + ["Tell me about the sea."]:
        base = eng.generate(p, gen, speculative=False)
        spec = eng.generate(p, gen, speculative=True)
        assert spec.token_ids == base.token_ids
        steps += spec.steps
    share = np.mean([s.budget > 1 for s in steps])
    assert share < 0.3, share
    assert np.mean([s.budget > 1 for s in steps[-30:]]) < 0.1            # once calibrated: plain decoding
    assert np.mean([s.drafted for s in steps[-30:]]) < 0.3                 # and the drafter mostly idle
    assert sum(s.accept_len for s in steps) == sum(len(eng.generate(p, gen, False).token_ids)
                                                   for p in PROMPTS + ["Tell me about the sea."]) - 3


def _oracle(eng, ref, prompt_len, rng, wrong_conf=0.3):
    """Scored trees holding the teacher's true continuation (drafter prob 0.95 each) beside wrong siblings."""
    V = eng.teacher.model.cfg.vocab_size

    def build(dsid, root, first, M, D, grow=None):
        sid = next(iter(eng.teacher.bm._seqs))
        done = eng.teacher.length(sid) - prompt_len + 1
        truth = ref[done:done + D]
        tokens, parents, scores = [root], [0], [0.0]
        node = 0
        for d, t in enumerate(truth):
            if grow is not None and d > 0 and not grow(DraftTree(tokens, parents, scores), np.array([scores[node]]),
                                                     d):
                break
            for tok, p in ((int(t), 0.95), (int((t + 1 + rng.integers(V - 1)) % V), wrong_conf)):
                if len(tokens) < M:
                    tokens.append(tok), parents.append(node), scores.append(scores[node] + np.log(p))
            if tokens[-2] != int(t):
                break
            node = len(tokens) - 2
        return DraftTree(tokens, parents, np.array(scores, np.float32))

    return build


@pytest.mark.slow
def test_adaptive_oracle_drafter_speculates_nearly_always(ms_runtime, tiny_dir, drafter_dir):
    eng, cfg = _engine(tiny_dir, drafter_dir, lambda m: 55.0 + 2 * m)
    gen = cfg.generation
    gen.max_new_tokens = 40
    rng = np.random.default_rng(0)
    steps = []
    for p in PROMPTS:
        ids = eng.encode_chat(p)
        base = eng.generate_ids(ids, gen, speculative=False)
        eng.drafter.build_tree = _oracle(eng, base.token_ids, len(ids), rng)
        spec = eng.generate_ids(ids, gen, speculative=True)
        assert spec.token_ids == base.token_ids
        steps += spec.steps
    assert np.mean([s.budget > 1 for s in steps]) > 0.9
    assert np.mean([s.accept_len for s in steps if s.budget > 1]) > 3.0
    # with verification this cheap the policy grows the tree to D_max and verifies more than a chain
    assert max(s.n_nodes for s in steps) >= 5


@pytest.mark.slow
def test_adaptive_near_the_end_of_the_cache(ms_runtime, tiny_dir, drafter_dir):
    """prompt + max_new_tokens == max_seq_len: the engine decodes plainly where a tree no longer fits."""
    eng, cfg = _engine(tiny_dir, drafter_dir, lambda m: 1e-3)
    gen = cfg.generation
    ids = eng.encode_chat(PROMPTS[0])
    gen.max_new_tokens = eng.teacher.S - len(ids)
    gen.stop = []
    base = eng.generate_ids(ids, gen, speculative=False)
    rng = np.random.default_rng(3)
    eng.drafter.build_tree = _oracle(eng, base.token_ids, len(ids), rng)
    spec = eng.generate_ids(ids, gen, speculative=True)
    assert spec.token_ids == base.token_ids
    if base.stop_reason == "length":
        assert spec.steps[-1].budget <= 2 and any(s.budget > 2 for s in spec.steps)


@pytest.mark.slow
def test_adaptive_sampling_stays_exact(ms_runtime, tiny_dir, drafter_dir, tiny):
    """Chi-square of the first two sampled tokens against the exact warped teacher distribution, under the
    adaptive policy with a drafter that is sometimes confident (speculates) and sometimes not (decodes)."""
    tcfg, tensors, _ = tiny
    eng, cfg = _engine(tiny_dir, drafter_dir, lambda m: 55.0, ["generation.temperature=0.8",
                                                               "generation.top_k=3"])
    gen = cfg.generation
    gen.max_new_tokens = 3
    ids = eng.encode_chat(PROMPTS[0])
    n = len(ids)
    exact = exact_two_tokens(tcfg, tensors, ids, 0.8, 3)
    rng = np.random.default_rng(7)

    def build(dsid, root, first, M, D, grow=None):   # confident: the 3 likely tokens; else 3 impossible ones
        l, _ = numpy_forward(tcfg, tensors, ids + [root], np.arange(n + 1), causal_mask(n + 1))
        confident = rng.uniform() < 0.5
        kids = [int(k) for k in np.argsort(-l[-1])[:3]]
        if not confident:
            kids = [int(k) for k in np.argsort(-l[-1])[10:13]]
        rng.shuffle(kids)
        conf = [0.9, 0.05, 0.02] if confident else [0.02, 0.01, 0.01]
        return DraftTree([root] + kids, [0] * 4, np.log([1.0] + conf).astype(np.float32))

    eng.drafter.build_tree = build
    counts, budgets = {}, []
    N = 400
    for seed in range(N):
        gen.seed = seed
        g = eng.generate_ids(ids, gen)
        key = tuple(g.token_ids[:2])
        assert key in exact, key
        counts[key] = counts.get(key, 0) + 1
        budgets += [s.budget for s in g.steps]
    assert 0.15 < np.mean([b > 1 for b in budgets]) < 0.85    # both kinds of step happened
    keys = sorted(exact)
    obs = np.array([counts.get(k, 0) for k in keys])
    exp = np.array([exact[k] for k in keys]) * N
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_policy_key_is_checked():
    from mindspore_eagle.config import ConfigError, load_config

    assert load_config(None, ["speculative.policy=adaptive"]).speculative.policy == "adaptive"
    assert load_config(None).speculative.policy == "adaptive"
    with pytest.raises(ConfigError, match="speculative.policy = 'smart': must be 'fixed' or 'adaptive'"):
        load_config(None, ["speculative.policy=smart"])


def test_cost_table_reused_from_file_whatever_its_age(ms_runtime, tiny_dir, drafter_dir, tmp_path):
    """A CostTable stored in the engine's cost_file is what the next engine starts from, however old (it is kept
    current by every turn, serving/engine.py); the table is never measured up front."""
    import os

    from mindspore_eagle.serving.engine import Engine

    eng, _ = _engine(tiny_dir, drafter_dir, lambda m: 60.0)
    path = tmp_path / "costs.json"
    eng.costs.save(str(path))
    old = os.path.getmtime(path) - 30 * 24 * 3600
    os.utime(path, (old, old))
    again = Engine(eng.teacher, eng.tokenizer, eng.eos, eng.drafter, eng.spec, cost_file=str(path))
    again.measure_costs = lambda *a, **k: pytest.fail("measured")
    assert again.policy.costs.to_dict() == eng.costs.to_dict() and again.running_costs.observed == 0
    path.write_text("{not json")
    prior = Engine(eng.teacher, eng.tokenizer, eng.eos, eng.drafter, eng.spec, cost_file=str(path))
    prior.measure_costs = lambda *a, **k: pytest.fail("measured")
    assert prior.policy.costs.decode_ms == 50.0                      # unreadable: the prior (core.costs)


def test_rate_gate_picks_the_faster_kind_and_probes_the_other():
    """Warm-up takes each kind twice; then the faster one runs, the other after every probe_every - 1 steps; when the
    rates swap, the choice follows within a few probes."""
    from mindspore_eagle.core.gate import RateGate

    g = RateGate(("tree", "plain"), alpha=0.5, probe_every=4, warm=2, probe_share=1.0)
    rates = {"tree": 1.0, "plain": 2.0}              # tokens per ms
    kinds = []
    for _ in range(24):
        k = g.choose()
        kinds.append(k)
        g.observe(k, 10, 10 / rates[k])
    assert kinds[:4] == ["tree", "tree", "plain", "plain"]
    assert kinds[4:].count("tree") == 5 and all(k == "tree" for k in kinds[5::4])   # probes only
    assert g.best() == "plain" and abs(g.rate["plain"] - 2.0) < 1e-9
    rates = {"tree": 3.0, "plain": 2.0}              # the drafter starts paying: trees win after a probe or two
    for _ in range(12):
        k = g.choose()
        g.observe(k, 10, 10 / rates[k])
    assert g.best() == "tree" and g.report()["steps"]["tree"] >= 7
    with pytest.raises(ValueError, match="probe_every >= 2"):
        RateGate(probe_every=1)
    with pytest.raises(ValueError, match="probe_share in"):
        RateGate(probe_share=0.0)


def test_rate_gate_probes_a_slow_kind_within_its_time_share():
    """A tree step that costs ten plain steps and loses: probed so that it takes about probe_share of the time;
    a gate seeded from another skips its warm-up and keeps the choice."""
    from mindspore_eagle.core.gate import RateGate

    g = RateGate(("tree", "plain"), probe_every=4, warm=2, probe_share=0.05)
    ms = {"tree": 1000.0, "plain": 100.0}            # tree: 16 x 1.5 tokens per 1000 ms; plain: 16 per 100 ms
    tokens = {"tree": 24, "plain": 16}
    spent = {"tree": 0.0, "plain": 0.0}
    for _ in range(2000):
        k = g.choose()
        g.observe(k, tokens[k], ms[k])
        spent[k] += ms[k]
    share = spent["tree"] / (spent["tree"] + spent["plain"])
    assert 0.03 < share < 0.07 and g.best() == "plain"
    fresh = RateGate(("tree", "plain"), probe_every=4, warm=2, probe_share=0.05)
    fresh.seed_from(g)
    assert [fresh.choose() for _ in range(3)] == ["plain"] * 3


def test_rate_gate_paces_probes_by_what_they_really_cost():
    """A tree step of 200 ms that pays 800 ms more of backlog each time it follows plain steps (``extra_ms``): its
    rate is judged on 200 ms (24 tokens: slower than plain's 16 per 100 ms), and probing it, backlog included,
    stays within probe_share of the time."""
    from mindspore_eagle.core.gate import RateGate

    g = RateGate(("tree", "plain"), probe_every=4, warm=2, probe_share=0.05)
    spent, last = {"tree": 0.0, "plain": 0.0}, None
    for _ in range(3000):
        k = g.choose()
        extra = 800.0 if k == "tree" and last == "plain" else 0.0
        ms = 200.0 if k == "tree" else 100.0
        g.observe(k, 24 if k == "tree" else 16, ms, extra)
        spent[k] += ms + extra
        last = k
    assert abs(g.rate["tree"] - 24 / 200) < 1e-9 and g.best() == "plain"
    share = spent["tree"] / (spent["tree"] + spent["plain"])
    assert 0.03 < share < 0.07, share


def test_plain_probe_keeps_a_decode_observed():
    """AdaptivePolicy(plain_every=n): where every tree looks profitable, the n-th step after a plain one is plain
    (no drafting, budget 1, even with a suffix tree at hand); a plain step the policy chose itself restarts the
    count; plain_every = 0 never forces one."""
    tree = chain_with_alternatives(0.99, depth=4)
    cheap = costs(lambda m: 1e-3, ctx=0.0, step=0.0, host=0.0)
    pol = AdaptivePolicy(cheap, BUDGETS, plain_every=8)
    kinds = []
    for _ in range(40):
        if pol.want_draft(1024, tree, 100):
            ch = pol.choose(tree, 1024, 100)
            pol.after_draft(ch)
        else:
            ch = pol.choose(tree, 1024, 100)       # the suffix fallback alone: still plain on a probe
        kinds.append(ch.m)
        pol.observe(None if ch.m == 1 else tree, [0] if ch.m == 1 else [0, 1], 1 if ch.m == 1 else 2, 1.0)
    assert [i for i, m in enumerate(kinds) if m == 1] == [7, 15, 23, 31, 39]
    assert all(m == 16 for m in kinds if m != 1) and pol.plain_probes == 5
    assert pol.report()["plain_probes"] == 5
    # a plain step taken for its own reasons (no room for a tree) restarts the count
    pol.observe(tree, [0, 1], 2, 1.0)
    pol.observe(None, [0], 1, 1.0)
    assert pol.since_plain == 0 and not pol.plain_due and pol.plain_probes == 5
    never = AdaptivePolicy(cheap, BUDGETS)
    for _ in range(200):
        assert never.want_draft(1024) and never.choose(tree, 1024, 100).m == 16
        never.observe(tree, [0, 1], 2, 1.0)
    for bad in (1, -3):
        with pytest.raises(ValueError, match="plain_every"):
            AdaptivePolicy(cheap, BUDGETS, plain_every=bad)


def _rate(values, counts, step_ms):
    taken = sum(np.sort(v)[::-1][:c].sum() for v, c in zip(values, counts))
    return (len(values) + taken) / step_ms(len(values) + sum(counts))


def test_allot_rows_equals_the_best_subset_by_brute_force():
    """Every subset of nodes (each sequence's kept nodes its best ones, under the caps) against allot_rows: its
    rate (expected tokens / ms) is the best of all, under linear costs from free to dear rows."""
    import itertools

    from mindspore_eagle.core.policy import allot_rows

    rng = np.random.default_rng(3)
    for trial in range(60):
        n = int(rng.integers(1, 4))
        values = [np.sort(rng.random(int(rng.integers(0, 5))))[::-1] for _ in range(n)]
        a, b = float(rng.uniform(5, 30)), float(rng.choice([0.0, 0.5, 2.0, 8.0, 40.0]))
        max_per_seq, max_rows = int(rng.integers(1, 6)), n + int(rng.integers(0, 10))
        step_ms = lambda r, a=a, b=b: a + b * np.asarray(r, np.float64)  # noqa: E731
        got = allot_rows(values, step_ms, max_rows, max_per_seq)
        assert got.shape == (n,) and (got >= 0).all() and got.sum() <= max_rows - n
        assert all(c <= min(len(v), max_per_seq - 1) for c, v in zip(got, values))
        best = max(_rate(values, c, step_ms) for c in itertools.product(
            *[range(min(len(v), max_per_seq - 1) + 1) for v in values]) if sum(c) <= max_rows - n)
        assert _rate(values, got, step_ms) == pytest.approx(best, rel=1e-12), trial


def test_allot_rows_free_rows_take_everything_dear_rows_nothing():
    from mindspore_eagle.core.policy import allot_rows

    values = [np.array([0.9, 0.5, 0.1]), np.array([]), np.array([0.3])]
    assert allot_rows(values, lambda r: 10.0 + 0 * np.asarray(r), 99, 16).tolist() == [3, 0, 1]
    assert allot_rows(values, lambda r: 10.0 * np.asarray(r), 99, 16).tolist() == [0, 0, 0]
    # a row costs 2 ms on a 3-row step of 10 ms (3.3 ms a token): only nodes worth more than ~0.6 token pay
    assert allot_rows(values, lambda r: 4.0 + 2.0 * np.asarray(r), 99, 16).tolist() == [1, 0, 0]
    assert allot_rows(values, lambda r: 10.0 + 0 * np.asarray(r), 4, 16).tolist() == [1, 0, 0]   # row cap
    assert allot_rows(values, lambda r: 10.0 + 0 * np.asarray(r), 99, 2).tolist() == [1, 0, 1]   # per-sequence cap
    with pytest.raises(ValueError, match="max_rows >= 3"):
        allot_rows(values, lambda r: r, 2, 4)
