"""core/suffix.py and the two-source trees: the suffix index against a brute-force matcher, proposals against a
brute-force continuation count, merged trees against the union of both trees' paths, per-source calibration."""
from __future__ import annotations

import numpy as np
import pytest

from mindspore_eagle.core.calibration import AcceptanceModel, node_values, top_nodes
from mindspore_eagle.core.suffix import SuffixIndex, propose
from mindspore_eagle.core.tree import (
    SOURCE_BOTH,
    SOURCE_DRAFTER,
    SOURCE_SUFFIX,
    DraftTree,
    merge_trees,
    tensorize,
    validate_tree,
)


def brute_match(docs: dict, keys: dict, context, lo: int, hi: int, exclude=None, limit=32):
    """Longest k in [lo, hi] with an earlier occurrence of context[-k:] followed by a token; occurrences newest
    first (later document, then later position), at most ``limit``."""
    ctx = list(context)
    for k in range(min(hi, len(ctx)), lo - 1, -1):
        occ = [(d, e) for d, text in docs.items() for e in range(k, len(text))
               if text[e - k:e] == ctx[-k:] and (exclude is None or keys[d] != exclude)]
        if occ:
            return k, sorted(occ, reverse=True)[:limit]
    return 0, []


def random_docs(rng, n_docs, vocab, length):
    return [[int(t) for t in rng.integers(0, vocab, rng.integers(1, length))] for _ in range(n_docs)]


@pytest.mark.parametrize("seed", range(6))
def test_match_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = 3 + seed                                  # small vocabularies: many repeats and long matches
    idx = SuffixIndex(max_match=5, min_match=2)
    docs, keys = {}, {}
    for j, text in enumerate(random_docs(rng, 5, vocab, 60)):
        key = j % 2
        half = len(text) // 2                         # built in two extends: incremental = all at once
        d = idx.add(text[:half], key=key)
        idx.extend(d, text[half:])
        docs[d], keys[d] = text, key
    for _ in range(40):
        ctx = [int(t) for t in rng.integers(0, vocab, rng.integers(1, 9))]
        for exclude in (None, 0, 1):
            assert idx.match(ctx, exclude, limit=7) == brute_match(docs, keys, ctx, 2, 5, exclude, 7)


def test_own_text_matches_only_earlier_occurrences():
    """A sequence's own index: the context's latest run is its own end (nothing follows), so only earlier ones
    count; a run seen once before proposes what followed it."""
    idx = SuffixIndex(max_match=4, min_match=2)
    d = idx.add([5, 6, 7, 8, 1, 5, 6])
    assert idx.match(idx.docs[d]) == (2, [(d, 2)])
    assert idx.continuations([(d, 2)], 3) == [[7, 8, 1]]
    assert idx.match([9, 9]) == (0, [])


def test_drop_and_token_bound_forget_the_oldest_documents():
    rng = np.random.default_rng(7)
    idx = SuffixIndex(max_match=4, min_match=2, max_tokens=100)
    docs, keys = {}, {}
    for text in random_docs(rng, 12, 4, 30):
        d = idx.add(text)
        docs[d], keys[d] = text, None
        while sum(len(docs[k]) for k in docs) > 100 and len(docs) > 1:
            del docs[min(docs)]
    assert list(idx.docs) == sorted(docs) and idx.tokens == sum(map(len, docs.values())) <= 100
    for _ in range(30):
        ctx = [int(t) for t in rng.integers(0, 4, 5)]
        assert idx.match(ctx) == brute_match(docs, keys, ctx, 2, 4)
    for d in list(docs):
        idx.drop(d)
    assert idx.tokens == 0 and all(not t for t in idx._ends)            # nothing left behind
    with pytest.raises(KeyError):
        idx.extend(0, [1])


def test_index_sizes_are_checked():
    with pytest.raises(ValueError, match="min_match"):
        SuffixIndex(max_match=2, min_match=3)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixIndex(max_tokens=-1)


def paths(tree: DraftTree) -> dict:
    """{root-to-node token path (excluding the root): node index} of a tree whose parents precede children."""
    out, p = {}, [()] * len(tree)
    for i in range(1, len(tree)):
        p[i] = p[int(tree.parents[i])] + (int(tree.tokens[i]),)
        out[p[i]] = i
    return out


@pytest.mark.parametrize("seed", range(5))
def test_proposal_counts_continuations(seed):
    """Every node's score is log(share of the matched occurrences whose continuation starts with its path); the
    tree passes every tensor invariant; the kept nodes are the likeliest, parents included."""
    rng = np.random.default_rng(100 + seed)
    own = SuffixIndex(max_match=4)
    text = [int(t) for t in rng.integers(0, 3, 80)]
    d = own.add(text)
    other = SuffixIndex(max_match=4)
    other.add([int(t) for t in rng.integers(0, 3, 80)], key="other")
    D, M = 3, 8
    prop = propose(text[-1], [(own, text, None), (other, text, None)], D, M)
    k_own, occ_own = own.match(text)
    k_other, occ_other = other.match(text)
    assert prop.match_len == max(k_own, k_other)
    conts = ([text[e:e + D] for _, e in occ_own] if k_own == prop.match_len else []) + \
            ([other.docs[dd][e:e + D] for dd, e in occ_other] if k_other == prop.match_len else [])
    assert prop.occurrences == len(conts)
    tree = prop.tree
    assert int(tree.tokens[0]) == text[-1] and 1 < len(tree) <= M and (tree.source[1:] == SOURCE_SUFFIX).all()
    validate_tree(tensorize(tree, M, D), M, D)
    counts = {}
    for c in conts:
        for j in range(1, len(c) + 1):
            counts[tuple(c[:j])] = counts.get(tuple(c[:j]), 0) + 1
    got = paths(tree)
    for path, i in got.items():
        assert np.isclose(tree.scores[i], np.log(counts[path] / len(conts)), atol=1e-6)
    worst_kept = min(counts[p] for p in got)
    assert all(counts[p] <= worst_kept for p in counts if p not in got)     # nothing likelier was left out


def test_no_match_no_tree():
    idx = SuffixIndex()
    idx.add([1, 2, 3])
    prop = propose(3, [(idx, [1, 2, 3], None)], 3, 8)
    assert prop.tree is None and prop.match_len == 0


def random_tree(rng, root, n, vocab, D):
    """A drafter-like tree: parents first, cumulative log-prob scores (a child below its parent)."""
    tokens, parents, scores, depth = [root], [0], [0.0], [0]
    for i in range(1, n):
        cand = [j for j in range(i) if depth[j] < D]
        p = int(rng.choice(cand))
        used = {tokens[c] for c in range(1, i) if parents[c] == p}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            break
        tokens.append(int(rng.choice(free)))
        parents.append(p)
        scores.append(scores[p] + float(np.log(rng.uniform(0.05, 1.0))))
        depth.append(depth[p] + 1)
    return DraftTree(np.asarray(tokens), np.asarray(parents), np.asarray(scores, np.float32))


@pytest.mark.parametrize("seed", range(8))
def test_merged_tree_is_the_union_of_both(seed):
    """Every path of either tree appears once; a path of both is SOURCE_BOTH with the larger score; the merged tree
    and every top-m cut of it by calibrated value pass the tensor invariants (parents kept)."""
    rng = np.random.default_rng(seed)
    D, vocab = 3, 4
    a, b = random_tree(rng, 9, 12, vocab, D), random_tree(rng, 9, 10, vocab, D)
    merged = merge_trees(a, b)
    pa, pb, pm = paths(a), paths(b), paths(merged)
    assert set(pm) == set(pa) | set(pb) and len(pm) == len(merged) - 1
    for path, i in pm.items():
        want = SOURCE_BOTH if path in pa and path in pb else SOURCE_DRAFTER if path in pa else SOURCE_SUFFIX
        assert merged.source[i] == want
        assert merged.scores[i] == max(a.scores[pa[path]] if path in pa else -np.inf,
                                       b.scores[pb[path]] if path in pb else -np.inf)
    assert (merged.tokens[:len(a)] == a.tokens).all()                 # the drafter's nodes keep their indices
    model = AcceptanceModel()
    model.observe(np.zeros(40), np.ones(40), np.ones(40, bool), np.arange(40) % 4 == 0,
                  np.full(40, SOURCE_SUFFIX))                      # suffix nodes: calibrated down to ~0.25
    for m in (2, 4, 8, 16):
        cut = top_nodes(merged, m, node_values(merged, model))
        validate_tree(tensorize(cut, m, D), m, D)
        assert set(paths(cut)) <= set(pm)


def test_merge_checks_roots():
    t = DraftTree(np.asarray([1, 2]), np.asarray([0, 0]), np.asarray([0, -1.0]))
    with pytest.raises(ValueError, match="roots differ"):
        merge_trees(t, DraftTree(np.asarray([3, 2]), np.asarray([0, 0]), np.asarray([0, -1.0])))
    assert (merge_trees(t, None).source == SOURCE_DRAFTER).all()


def test_each_source_is_calibrated_on_its_own():
    """Suffix nodes of frequency 1.0 accepted 30 % of the time are predicted near 0.3; the drafter's bins of the same
    probability keep their prior."""
    model = AcceptanceModel()
    n = 400
    acc = np.random.default_rng(0).random(n) < 0.3
    model.observe(np.zeros(n), np.ones(n), np.ones(n, bool), acc, np.full(n, SOURCE_SUFFIX))
    got = model.predict([0.0, 0.0], [1, 1], [True, True], [SOURCE_SUFFIX, SOURCE_DRAFTER])
    assert abs(got[0] - acc.mean()) < 0.03 and got[1] > 0.95
    rows = model.to_dict()["bins"]
    assert [r["source"] for r in rows] == ["suffix"]


@pytest.mark.parametrize("seed", range(4))
def test_cut_by_value_never_drops_a_parent(seed):
    """Calibrated values of random merged trees under a trained model: no child above its parent, bit for bit
    (a scaled child rounded 1 ulp above its parent once made top_nodes keep a child without its parent in a
    server run), and every cut keeps parents."""
    rng = np.random.default_rng(50 + seed)
    model = AcceptanceModel()
    for _ in range(30):
        k = 30
        model.observe(rng.uniform(-3, 0, k), rng.integers(1, 5, k), rng.random(k) < 0.5, rng.random(k) < 0.4,
                      rng.integers(0, 3, k))
    for _ in range(200):
        merged = merge_trees(random_tree(rng, 5, 14, 5, 4), random_tree(rng, 5, 10, 3, 4))
        values = node_values(merged, model)
        assert (values[1:] <= values[merged.parents[1:]]).all()
        for m in (2, 3, 5, 8, 16):
            cut = top_nodes(merged, m, values)
            validate_tree(tensorize(cut, m, 4), m, 4)
