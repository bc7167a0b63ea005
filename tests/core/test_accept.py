"""core/accept.py: greedy acceptance on constructed argmax arrays, warping, and exactness of rejection sampling
and of seeded sampling by coupling (same emission law, same text as teacher-only sampling with the seed).

Exactness is shown two ways: (1) an independent exact-probability version of the acceptance rule (Fractions)
proves that the first emitted token is distributed as p at the root, and that the 2-token joint equals the
teacher's joint; (2) the implementation's empirical output distribution over whole emissions matches that exact
distribution (chi-square with a fixed seed).
"""
from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_strategies import BUDGETS, draft_trees, ref_children  # noqa: E402

from mindspore_eagle.core.accept import (  # noqa: E402
    VerifyResult,
    accept_coupled,
    accept_greedy,
    accept_sampling,
    keyed_draw,
    keyed_uniforms,
    warp_probs,
)
from mindspore_eagle.core.tree import DraftTree, chain_tree, merge_trees, tensorize  # noqa: E402


def _check(res: VerifyResult, path, tokens):
    assert res.path.dtype == np.int32 and res.tokens.dtype == np.int64
    np.testing.assert_array_equal(res.path, path)
    np.testing.assert_array_equal(res.tokens, tokens)
    assert res.accept_len == len(path) == len(tokens)
    assert res.bonus == tokens[-1]


def _argmax(M, values: dict, fill=99):
    am = np.full(M, fill, dtype=np.int64)
    for k, v in values.items():
        am[k] = v
    return am


# --------------------------------------------------------------------------------------------- greedy

CHAIN = tensorize(chain_tree([5, 7, 9, 11]), 4, 3)


def test_greedy_full_accept_plus_bonus():
    _check(accept_greedy(CHAIN, [7, 9, 11, 42]), [0, 1, 2, 3], [7, 9, 11, 42])


def test_greedy_early_mismatch():
    _check(accept_greedy(CHAIN, [7, 3, 11, 42]), [0, 1], [7, 3])


def test_greedy_first_draft_rejected():
    _check(accept_greedy(CHAIN, [6, 9, 11, 42]), [0], [6])


def test_greedy_no_draft():
    tt = tensorize(DraftTree([5], [0]), 4, 3)
    _check(accept_greedy(tt, [8, 1, 2, 3]), [0], [8])


def test_greedy_second_branch_longer():
    # 0 -> 1 (tok 3, leaf); 0 -> 2 (tok 4) -> 3 (tok 5) -> 4 (tok 6)
    tt = tensorize(DraftTree([1, 3, 4, 5, 6], [0, 0, 0, 2, 3]), 8, 3)
    _check(accept_greedy(tt, _argmax(8, {0: 4, 2: 5, 3: 6, 4: 9})), [0, 2, 3, 4], [4, 5, 6, 9])
    _check(accept_greedy(tt, _argmax(8, {0: 3, 1: 8})), [0, 1], [3, 8])


def test_greedy_shared_prefix_picks_longer_row():
    # 0 -> 1 (tok 3) -> {2 (tok 7, leaf), 3 (tok 8) -> 4 (tok 9)}; rows: leaf 2 (row 0), leaf 4 (row 1)
    tt = tensorize(DraftTree([1, 3, 7, 8, 9], [0, 0, 1, 1, 3]), 8, 3)
    _check(accept_greedy(tt, _argmax(8, {0: 3, 1: 8, 3: 9, 4: 1})), [0, 1, 3, 4], [3, 8, 9, 1])
    _check(accept_greedy(tt, _argmax(8, {0: 3, 1: 7, 2: 0})), [0, 1, 2], [3, 7, 0])


def test_greedy_tie_goes_to_lowest_row_and_pads_ignored():
    tt = tensorize(DraftTree([1, 3, 7, 8], [0, 0, 1, 1]), 8, 3)
    res = accept_greedy(tt, _argmax(8, {0: 3, 1: 5, 4: 3, 5: 3, 6: 3, 7: 3}))
    _check(res, [0, 1], [3, 5])


@pytest.mark.parametrize("bad, words", [
    (np.zeros(3, dtype=np.int64), "shape [M=4]"),
    (np.zeros(4, dtype=np.float32), "integer"),
    (np.array([-1, 0, 0, 0]), ">= 0"),
])
def test_greedy_rejects_bad_argmax(bad, words):
    with pytest.raises(ValueError) as err:
        accept_greedy(CHAIN, bad)
    assert words in str(err.value)


def _greedy_reference(tree: DraftTree, am):
    """Follow the (unique, since sibling tokens are distinct) child whose token is the argmax."""
    n, node, path = len(tree), 0, [0]
    while True:
        nxt = [c for c in ref_children(tree.parents, n, node) if tree.tokens[c] == am[node]]
        if not nxt:
            return path, [int(tree.tokens[c]) for c in path[1:]] + [int(am[node])]
        node = nxt[0]
        path.append(node)


def _onehot(am, V):
    p = np.zeros((am.size, V))
    p[np.arange(am.size), am] = 1.0
    return p


@pytest.mark.parametrize("M, D", BUDGETS)
def test_greedy_random_trees_match_reference_and_onehot_sampling(M, D):
    @settings(max_examples=120, deadline=None, derandomize=True)
    @given(tree=draft_trees(M, D, vocab=3), seed=st.integers(0, 2**32 - 1))
    def run(tree, seed):
        tt = tensorize(tree, M, D)
        rng = np.random.default_rng(seed)
        am = rng.integers(0, 4, size=M)  # small vocab: long accepted paths are common
        path, tokens = _greedy_reference(tree, am)
        res = accept_greedy(tt, am)
        _check(res, path, tokens)
        assert 1 <= res.accept_len <= D + 1
        # a one-hot target makes rejection sampling deterministic and equal to greedy
        _check(accept_sampling(tt, _onehot(am, max(8, int(tree.tokens.max()) + 1)), rng), path, tokens)

    run()


# -------------------------------------------------------------------------------------------- warping


def test_warp_temperature_only():
    logits = np.array([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    p = warp_probs(logits, temperature=0.7)
    e = np.exp(logits.astype(np.float64) / 0.7)
    np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), rtol=1e-12)
    assert p.dtype == np.float64
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)


def test_warp_top_k():
    p = warp_probs([1.0, 3.0, 2.0, 0.0], temperature=1.0, top_k=2)
    e = np.exp([3.0, 2.0])
    np.testing.assert_allclose(p, [0, e[0] / e.sum(), e[1] / e.sum(), 0], rtol=1e-12)
    np.testing.assert_allclose(warp_probs([1.0, 3.0], 1.0, top_k=5), warp_probs([1.0, 3.0], 1.0))


def test_warp_top_p():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(warp_probs(logits, 1.0, top_p=0.7), [0.625, 0.375, 0, 0], rtol=1e-12)
    np.testing.assert_allclose(warp_probs(logits, 1.0, top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
                               rtol=1e-12)
    np.testing.assert_allclose(warp_probs(logits, 1.0, top_p=0.01), [1, 0, 0, 0])
    np.testing.assert_allclose(warp_probs(logits, 1.0, top_p=1.0), [0.5, 0.3, 0.15, 0.05], rtol=1e-12)
    np.testing.assert_allclose(warp_probs(logits, 1.0, top_p=0.85, top_k=1), [1, 0, 0, 0])


def test_warp_top_k_then_top_p_on_the_renormalised_mass():
    """HF / vLLM / SGLang order. p = [0.5, 0.3, 0.15, 0.05], top_k 2, top_p 0.6, by hand: top-k keeps
    [0.5, 0.3] -> renormalised [0.625, 0.375]; mass before the second token is 0.625 >= 0.6, so top-p keeps the
    first alone -> [1, 0, 0, 0]. (Top-p first would keep [0.5, 0.3]: mass before the second is 0.5 < 0.6, giving
    [0.625, 0.375, 0, 0].)"""
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(warp_probs(logits, 1.0, top_p=0.6, top_k=2), [1, 0, 0, 0])
    # top_k 3, top_p 0.9: [0.5, 0.3, 0.15] / 0.95; masses before: 0, 0.526, 0.842 < 0.9 -> all three kept
    np.testing.assert_allclose(warp_probs(logits, 1.0, top_p=0.9, top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
                               rtol=1e-12)


def test_warp_batch_shape_and_neg_inf():
    logits = np.random.default_rng(0).normal(size=(2, 3, 7))
    logits[0, 0, 3] = -np.inf
    p = warp_probs(logits, 1.3, top_p=0.9, top_k=4)
    assert p.shape == (2, 3, 7)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)
    assert p[0, 0, 3] == 0.0
    assert ((p > 0).sum(-1) <= 4).all()


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"), (dict(temperature=1.0, top_k=-1), "top_k"),
    (dict(temperature=1.0, top_k=2.5), "top_k"),
])
def test_warp_rejects_bad_settings(kwargs, words):
    with pytest.raises(ValueError) as err:
        warp_probs([0.0, 1.0], **kwargs)
    assert words in str(err.value)


def test_warp_rejects_bad_logits():
    with pytest.raises(ValueError, match="NaN"):
        warp_probs([0.0, np.nan], 1.0)
    with pytest.raises(ValueError, match="finite entry"):
        warp_probs([[0.0, 1.0], [-np.inf, -np.inf]], 1.0)


# ---------------------------------------------------------------------- sampling: exact reference


def exact_emissions(tree: DraftTree, probs, node=0) -> dict:
    """Exact distribution {emitted token tuple: Fraction} of one round started at ``node``.

    Independent restatement of the rule: try children in index order, accept x with r(x)/sum(r), else zero it;
    the bonus is drawn from the residual. probs[i] is a list of Fractions.
    """
    n = len(tree)
    residual, reach, out = list(probs[node]), Fraction(1), Counter()
    for c in ref_children(tree.parents, n, node):
        if reach == 0:  # an earlier sibling was accepted with probability 1
            break
        x = int(tree.tokens[c])
        total = sum(residual)
        acc = residual[x] / total
        if acc:
            for seq, pr in exact_emissions(tree, probs, c).items():
                out[(x,) + seq] += reach * acc * pr
        reach *= 1 - acc
        residual[x] = Fraction(0)
    total = sum(residual)
    if reach:
        for v, r in enumerate(residual):
            if r:
                out[(v,)] += reach * r / total
    return out


def _random_dist(rng, V) -> list:
    """Random rational distribution over V tokens; each entry is 0 with probability 1/6."""
    w = rng.integers(0, 6, size=V)
    w[rng.integers(0, V)] += 1
    return [Fraction(int(k), int(w.sum())) for k in w]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tree=draft_trees(8, 3, vocab=4), seed=st.integers(0, 2**32 - 1))
def test_exact_first_token_is_distributed_as_root_p(tree, seed):
    rng = np.random.default_rng(seed)
    V = max(4, int(tree.tokens.max()) + 1)
    probs = [_random_dist(rng, V) for _ in range(len(tree))]
    first = Counter()
    for seq, pr in exact_emissions(tree, probs).items():
        first[seq[0]] += pr
    assert sum(first.values()) == 1
    assert all(first[v] == probs[0][v] for v in range(V))


def _teacher(prefix: tuple, V: int) -> list:
    """A deterministic context-dependent teacher over V tokens with rational probabilities (some zeros)."""
    rng = np.random.default_rng(abs(hash(prefix)) % (2**32))
    return _random_dist(rng, V)


@pytest.mark.parametrize("tree", [
    DraftTree([0, 1, 2, 0, 2, 1], [0, 0, 0, 1, 1, 2]),
    DraftTree([0, 0, 1, 2, 0], [0, 0, 0, 0, 3]),
    chain_tree([2, 1, 0]),
    DraftTree([1], [0]),
])
def test_exact_two_token_joint_equals_teacher_joint(tree):
    V, n = 3, len(tree)
    ctx = (9,)  # the committed context before the root's successor
    paths = [tuple(int(tree.tokens[j]) for j in _path(tree, i)[1:]) for i in range(n)]
    probs = [_teacher(ctx + p, V) for p in paths]
    joint = Counter()
    for seq, pr in exact_emissions(tree, probs).items():
        if len(seq) >= 2:
            joint[seq[:2]] += pr
        else:  # the round ended after one token; the next round's first token is exact (test above)
            for v, q in enumerate(_teacher(ctx + seq, V)):
                joint[(seq[0], v)] += pr * q
    for x1 in range(V):
        for x2 in range(V):
            assert joint[(x1, x2)] == probs[0][x1] * _teacher(ctx + (x1,), V)[x2]


def _path(tree, node):
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


# ------------------------------------------------------------- sampling: implementation vs exact


def _chi_square_ok(counts: Counter, expected: dict, N: int) -> tuple:
    """Pearson chi-square of counts vs N * expected, pooling cells with expected count < 5; (ok, stat, df)."""
    cells = sorted(expected, key=lambda k: -expected[k])
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in cells:
        e = N * float(expected[k])
        if e >= 5:
            obs.append(counts[k])
            exp.append(e)
        else:
            pool_o, pool_e = pool_o + counts[k], pool_e + e
    assert sum(v for k, v in counts.items() if k not in expected) == 0, "impossible emission observed"
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs, exp = np.array(obs, dtype=float), np.array(exp)
    stat, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    if df == 0:
        return True, stat, df
    try:
        from scipy.stats import chi2
        return chi2.sf(stat, df) > 1e-4, stat, df
    except ImportError:  # Wilson-Hilferty upper 1e-4 quantile (z = 3.719)
        crit = df * (1 - 2 / (9 * df) + 3.719 * np.sqrt(2 / (9 * df))) ** 3
        return stat < crit, stat, df


def _sampling_case(case: int, rng) -> tuple:
    """(DraftTree, TreeTensors at M 8 / D 3, exact probs per node as Fractions, float probs [8, 4] with NaN pad rows)
    of one of the seven sampling test trees, with random rational distributions over V = 4 tokens."""
    M, D, V = 8, 3, 4
    tree = [DraftTree([0, 1, 2, 3, 0, 1, 2], [0, 0, 0, 0, 1, 1, 4]),
            DraftTree([0, 1, 2, 0, 2, 1], [0, 0, 0, 1, 1, 2]),
            chain_tree([3, 2, 1, 0]),
            DraftTree([2], [0]),
            DraftTree([0, 3, 1, 0, 2], [0, 0, 1, 2, 1]),
            DraftTree([1, 0, 1, 2, 3, 3], [0, 0, 0, 0, 0, 1]),
            # a hybrid tree (speculative.method hybrid): a drafter's tree merged with a suffix chain 1 -> 3 -> 2
            merge_trees(DraftTree([0, 1, 2, 3], [0, 0, 0, 1], [0, -0.5, -1.0, -1.2]),
                        DraftTree([0, 1, 3, 2], [0, 0, 1, 2], [0, -0.1, -0.2, -0.3]))][case]
    probs_f = [_random_dist(rng, V) for _ in range(len(tree))]
    probs = np.full((M, V), np.nan)  # pad rows must never be read
    probs[: len(tree)] = np.array(probs_f, dtype=float)
    return tree, tensorize(tree, M, D), probs_f, probs


@pytest.mark.parametrize("case", range(7))
def test_sampling_implementation_matches_exact_distribution(case):
    rng = np.random.default_rng(1000 + case)
    tree, tt, probs_f, probs = _sampling_case(case, rng)
    expected = exact_emissions(tree, probs_f)
    N = 20000
    counts = Counter(tuple(accept_sampling(tt, probs, rng).tokens.tolist()) for _ in range(N))
    ok, stat, df = _chi_square_ok(counts, expected, N)
    assert ok, f"chi-square {stat:.1f} on {df} df"
    first = Counter()
    for seq, c in counts.items():
        first[seq[0]] += c
    ok, stat, df = _chi_square_ok(first, dict(enumerate(probs_f[0])), N)
    assert ok, f"first token chi-square {stat:.1f} on {df} df"


def test_sampling_result_is_consistent_and_seeded():
    tree = DraftTree([0, 1, 2, 0, 2, 1], [0, 0, 0, 1, 1, 2])
    tt = tensorize(tree, 8, 3)
    probs = np.full((8, 5), 0.2)
    a = [accept_sampling(tt, probs, np.random.default_rng(7)) for _ in range(2)]
    np.testing.assert_array_equal(a[0].tokens, a[1].tokens)
    rng = np.random.default_rng(3)
    for _ in range(200):
        res = accept_sampling(tt, probs, rng)
        np.testing.assert_array_equal(res.tokens[:-1], tt.tokens[res.path[1:]])
        assert all(tt.parent[res.path[k + 1]] == res.path[k] for k in range(res.accept_len - 1))


def test_sampling_edge_cases():
    tree = DraftTree([0, 1, 2], [0, 0, 0])
    tt = tensorize(tree, 4, 2)
    rng = np.random.default_rng(0)
    sure = np.array([[0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=float)
    _check(accept_sampling(tt, sure, rng), [0, 2], [2, 0])
    never = np.array([[0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=float)
    for _ in range(50):
        _check(accept_sampling(tt, never, rng), [0], [3])
    unnormalised = sure * 3.0
    _check(accept_sampling(tt, unnormalised, rng), [0, 2], [2, 0])


@pytest.mark.parametrize("probs, words", [
    (np.full((3, 4), 0.25), "shape [M=4, V]"),
    (np.array([[1, -1, 1, 0]] * 4, dtype=float), ">= 0"),
    (np.zeros((4, 4)), "positive sum"),
    (np.full((4, 2), 0.5), "V=2"),
])
def test_sampling_rejects_bad_probs(probs, words):
    tt = tensorize(DraftTree([0, 1, 2], [0, 0, 0]), 4, 2)
    with pytest.raises(ValueError) as err:
        accept_sampling(tt, probs, np.random.default_rng(0))
    assert words in str(err.value)


class ScriptedRng:
    """Stands in for np.random.Generator: ``random()`` returns the scripted uniforms in order."""

    def __init__(self, *u):
        self.u = list(u)

    def random(self):
        return self.u.pop(0)


@pytest.mark.parametrize("uniforms, path, tokens", [
    ((0.2, 0.0, 0.5), [0, 1, 3], [1, 0, 3]),  # 0.2 < p(1) = 0.25: node 1, then its child 3, then bonus
    ((0.3, 0.3, 0.5), [0, 2], [2, 1]),  # node 1 rejected; residual p(2) = 0.25 / 0.75 > 0.3: node 2 accepted
    ((0.3, 0.34, 0.999), [0], [0]),  # both rejected; residual is all on token 0
])
def test_sampling_thresholds_and_sibling_order(uniforms, path, tokens):
    # 0 -> 1 (tok 1) -> 3 (tok 0); 0 -> 2 (tok 2). Children are tried in node-index order.
    tt = tensorize(DraftTree([9, 1, 2, 0], [0, 0, 0, 1]), 4, 2)
    probs = np.array([[0.5, 0.25, 0.25, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]], dtype=float)
    rng = ScriptedRng(*uniforms)
    _check(accept_sampling(tt, probs, rng), path, tokens)
    assert rng.u == []  # one uniform per tried child plus one for the bonus


# ------------------------------------------------------------- seeded sampling by coupling


def test_splitmix64_is_the_published_generator():
    """SplitMix64 (Steele, Lea and Flood 2014; Vigna's reference splitmix64.c): from state 0 the first three
    outputs are 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, and from state 12345 the first is
    0x22118258A9D111A0. ``_splitmix64(x)`` is the output after the state x advanced once."""
    from mindspore_eagle.core.accept import _GOLDEN, _splitmix64

    states = np.array([0, int(_GOLDEN), (2 * int(_GOLDEN)) % 2 ** 64, 12345], np.uint64)
    assert [int(v) for v in _splitmix64(states)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F,
                                                     0x22118258A9D111A0]


def test_keyed_uniforms_are_a_pure_function_of_seed_position_and_token():
    from scipy import stats

    u = keyed_uniforms(7, np.arange(50), 1000)
    assert u.shape == (50, 1000) and ((u > 0) & (u < 1)).all() and stats.kstest(u.ravel(), "uniform").pvalue > 1e-3
    np.testing.assert_array_equal(keyed_uniforms(7, [3, 9], 1000), u[[3, 9]])
    np.testing.assert_array_equal(keyed_uniforms(7, [3], 10)[0], u[3, :10])       # a token's u ignores V
    assert u[3, 5] != keyed_uniforms(8, [3], 1000)[0, 5] and u[3, 5] != u[4, 5] and u[3, 5] != u[3, 6]
    assert keyed_uniforms(2 ** 64 - 1, [0], 4).shape == (1, 4)
    v = keyed_uniforms(8, np.arange(50), 1000)                   # another seed: uncorrelated draws
    assert abs(np.corrcoef(u.ravel(), v.ravel())[0, 1]) < 0.02


def test_keyed_draw_follows_p_and_never_draws_a_zero_mass_token():
    p = np.array([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    N = 20000
    draws = keyed_draw(np.tile(p, (N, 1)), 3, np.arange(N))
    counts = Counter(draws.tolist())
    assert set(counts) <= {1, 3, 4}
    ok, stat, df = _chi_square_ok(counts, {1: 0.25, 3: 0.5, 4: 0.25}, N)
    assert ok, f"chi-square {stat:.1f} on {df} df"
    assert keyed_draw(p * 3, 3, 17) == keyed_draw(p, 3, 17)      # unnormalised mass: the same draw
    assert keyed_draw(np.array([0.0, 0.0, 1.0]), 9, 4) == 2


def _inverse_cdf_draws(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The draw this project made before keyed races: one uniform per position, inverse CDF."""
    cdf = np.cumsum(p, axis=-1)
    return np.array([int(np.searchsorted(c, x * c[-1], side="right")) for c, x in zip(cdf, u)])


def test_keyed_draw_survives_logit_noise_where_the_inverse_cdf_does_not():
    """Logits perturbed by a relative 1e-6 (half-precision kernels round by row count): at most 1 in 10,000 keyed
    draws changes; the inverse-CDF draw with one uniform per position changes far more often on the same
    logits (this is what made seeded sampling depend on the batch in float16)."""
    rng = np.random.default_rng(0)
    V, N, chunk = 2048, 20000, 1000
    changed = changed_cdf = 0
    for c in range(N // chunk):
        logits = rng.normal(0, 3, size=(chunk, V))
        noisy = logits * (1 + 1e-6 * rng.standard_normal(logits.shape))
        p, q = warp_probs(logits, 1.0), warp_probs(noisy, 1.0)
        pos = np.arange(c * chunk, (c + 1) * chunk)
        changed += int((keyed_draw(p, 11, pos) != keyed_draw(q, 11, pos)).sum())
        u = rng.random(chunk)
        changed_cdf += int((_inverse_cdf_draws(p, u) != _inverse_cdf_draws(q, u)).sum())
    assert changed <= N // 10000, changed
    assert changed_cdf > 10 * max(changed, 1), (changed, changed_cdf)


@pytest.mark.parametrize("case", range(7))
def test_coupled_sampling_matches_the_exact_distribution_of_rejection_sampling(case):
    """Over 20,000 seeds, the emissions of accept_coupled follow exactly the law of multi-candidate rejection
    sampling (``exact_emissions``): the same first-token distribution p, the same accepted lengths."""
    tree, tt, probs_f, probs = _sampling_case(case, np.random.default_rng(2000 + case))
    expected = exact_emissions(tree, probs_f)
    N = 20000
    counts = Counter(tuple(accept_coupled(tt, probs, seed, 17).tokens.tolist()) for seed in range(N))
    ok, stat, df = _chi_square_ok(counts, expected, N)
    assert ok, f"chi-square {stat:.1f} on {df} df"
    lens = Counter(len(k) for k in counts.elements())
    exp_len: dict = {}
    for k, f in expected.items():
        exp_len[len(k)] = exp_len.get(len(k), 0) + f
    ok, stat, df = _chi_square_ok(lens, exp_len, N)
    assert ok, f"accepted length chi-square {stat:.1f} on {df} df"


def _teacher_probs(prefix: tuple, V: int = 6) -> np.ndarray:
    """A stand-in teacher: a fixed pseudo-random distribution per prefix (some zero entries)."""
    r = np.random.default_rng(abs(hash(prefix)) % (2 ** 32))
    w = r.integers(0, 4, size=V).astype(float)
    w[r.integers(0, V)] += 1.0
    return w / w.sum()


def test_coupled_speculation_emits_what_teacher_only_sampling_emits_with_the_seed():
    """Whatever tree is drafted (random trees, some holding the teacher's own draws), the tokens accept_coupled
    emits are the next tokens of teacher-only sampling with the same seed (keyed_draw at the token's position)."""
    rng = np.random.default_rng(5)
    V, M, D, prompt = 6, 8, 3, (1, 2, 3)
    for seed in range(40):
        ref, seq = [], list(prompt)
        for t in range(24):                                   # teacher-only: token at position len(seq)
            seq.append(int(keyed_draw(_teacher_probs(tuple(seq)), seed, len(seq))))
            ref.append(seq[-1])
        out, seq = [], list(prompt[:-1])
        root = prompt[-1]
        while len(out) < 10:
            tokens, parents = [root], [0]
            truth = ref[len(out):len(out) + D]
            node = 0
            for d in range(D):                                # a chain, sometimes the truth, and random siblings
                cand = {int(truth[d]) if d < len(truth) and rng.random() < 0.7 else int(rng.integers(0, V))}
                cand |= {int(x) for x in rng.integers(0, V, size=int(rng.integers(0, 2)))}
                kids = sorted(cand)[: M - len(tokens)]
                if not kids:
                    break
                base = len(tokens)
                tokens += kids
                parents += [node] * len(kids)
                node = base + int(rng.integers(0, len(kids)))
            tree = DraftTree(tokens, parents)
            tt = tensorize(tree, M, D)
            probs = np.zeros((M, V))
            for i in range(len(tree)):
                path, j = [], i
                while j:
                    path.append(tokens[j])
                    j = parents[j]
                probs[i] = _teacher_probs(tuple(seq + [root] + path[::-1]))
            res = accept_coupled(tt, probs, seed, len(seq) + 1)
            out += res.tokens.tolist()
            seq += [root] + [tokens[j] for j in res.path[1:].tolist()]
            root = int(res.tokens[-1])
        assert out == ref[: len(out)], f"seed {seed}"


# ------------------------------------------------------------------------------------------- logprobs
def test_token_logprobs_against_a_direct_log_softmax():
    from mindspore_eagle.core.accept import token_logprobs

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 4, size=(3, 50)).astype(np.float32)
    logits[1, [7, 9]] = logits[1].max() + 1.0                       # a tie for first place: ids ascending
    tokens = [4, 9, 49]
    got = token_logprobs(logits, tokens, 3)
    x = logits.astype(np.float64)
    ref = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    for j, (tid, lp, top) in enumerate(got):
        assert tid == tokens[j] and lp == pytest.approx(ref[j, tokens[j]], abs=1e-12)
        order = sorted(range(50), key=lambda i: (-ref[j, i], i))[:3]
        assert [i for i, _ in top] == order
        assert [v for _, v in top] == pytest.approx([ref[j, i] for i in order], abs=1e-12)
    assert [i for i, _ in got[1][2][:2]] == [7, 9]
    assert token_logprobs(logits[:1], [0], 0)[0][2] == []
    assert len(token_logprobs(logits[:1], [0], 80)[0][2]) == 50                # at most V alternatives


@settings(max_examples=60, deadline=None)
@given(tree=draft_trees(16, 4, vocab=3), seed=st.integers(0, 2 ** 32 - 1), first_pos=st.integers(0, 500))
def test_coupled_walk_equals_greedy_acceptance_over_every_nodes_draw(tree, seed, first_pos):
    """accept_coupled draws only along the accepted path; the result equals accept_greedy over the draws of every
    node (the definition), and a callable row source gives the same as the array."""
    M, D = 16, 4
    tt = tensorize(tree, M, D)
    V = int(tt.tokens[: tt.n_nodes].max()) + 2
    rng = np.random.default_rng(seed % 1000)
    probs = rng.dirichlet(np.full(V, 0.3), size=M)
    n = tt.n_nodes
    draws = np.zeros(M, np.int64)
    draws[:n] = keyed_draw(probs[:n], seed, first_pos + tt.depth[:n].astype(np.int64))
    want = accept_greedy(tt, draws)
    got = accept_coupled(tt, probs, seed, first_pos)
    _check(got, want.path, want.tokens)
    _check(accept_coupled(tt, lambda i: probs[i], seed, first_pos), want.path, want.tokens)


def test_coupled_walk_checks_the_rows_it_reaches():
    tt = tensorize(DraftTree([0, 1, 2], [0, 0, 1]), 4, 3)
    good = np.full(4, 0.25)
    with pytest.raises(ValueError, match="probs row 0 must be finite"):
        accept_coupled(tt, lambda i: np.array([np.nan, 1.0, 1.0, 1.0]), 1, 0)
    with pytest.raises(ValueError, match="probs row 0 must be finite"):
        accept_coupled(tt, lambda i: np.zeros(4), 1, 0)
    with pytest.raises(ValueError, match=r"draft tokens must be in \[0, V=2\)"):
        accept_coupled(tt, lambda i: np.ones(2), 1, 0)
    assert accept_coupled(tt, lambda i: good, 1, 0).accept_len >= 1
