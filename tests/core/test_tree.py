"""tree.py: golden tensorizer output, property tests over random trees, one corruption test per invariant."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_strategies import BUDGETS, draft_trees, ref_depth, ref_leaves, ref_path  # noqa: E402

from mindspore_eagle.core.tree import (  # noqa: E402
    INVARIANTS,
    NEG_BIAS,
    DraftTree,
    TreeInvariantError,
    chain_tree,
    tensorize,
    tree_attention_bias,
    validate_tree,
)

# Golden tree (M=8, D=3): 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5}. Leaves 2, 4, 5.
GOLDEN = DraftTree(tokens=[10, 11, 12, 13, 14, 15], parents=[0, 0, 0, 1, 1, 3])
GM, GD = 8, 3


def golden():
    return tensorize(GOLDEN, GM, GD, pad_token=0)


def test_golden_arrays():
    tt = golden()
    P = GM
    np.testing.assert_array_equal(tt.tokens, [10, 11, 12, 13, 14, 15, 0, 0])
    np.testing.assert_array_equal(tt.depth, [0, 1, 1, 2, 2, 3, 0, 0])
    np.testing.assert_array_equal(tt.parent, [0, 0, 0, 1, 1, 3, P, P])
    np.testing.assert_array_equal(tt.valid, [1, 1, 1, 1, 1, 1, 0, 0])
    expect_mask = np.array([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1],
    ], dtype=bool)
    np.testing.assert_array_equal(tt.mask, expect_mask)
    expect_retrieve = np.full((GM, GD + 2), P)
    expect_retrieve[0, :2] = [0, 2]
    expect_retrieve[1, :3] = [0, 1, 4]
    expect_retrieve[2, :4] = [0, 1, 3, 5]
    np.testing.assert_array_equal(tt.retrieve, expect_retrieve)
    assert (tt.n_nodes, tt.n_paths, tt.budget, tt.max_depth) == (6, 3, 8, 3)
    for name, dtype in [("tokens", np.int32), ("depth", np.int32), ("parent", np.int32),
                        ("retrieve", np.int32), ("mask", np.bool_), ("valid", np.bool_)]:
        assert getattr(tt, name).dtype == dtype, name
    validate_tree(tt, GM, GD, pad_token=0)


def test_golden_attention_bias():
    tt = golden()
    bias = tree_attention_bias(tt, prefix_len=2, S=12)
    assert bias.dtype == np.float32 and bias.shape == (8, 12)
    vis = np.zeros((8, 12), dtype=bool)
    vis[:6, :2] = True
    vis[:, 2:10] = tt.mask
    np.testing.assert_array_equal(bias, np.where(vis, np.float32(0), NEG_BIAS))
    assert (bias[6] == 0).sum() == 1 and bias[6, 2 + 6] == 0
    assert np.isfinite(bias).all()


def test_attention_bias_rejects_prefix_out_of_range():
    tt = golden()
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention_bias(tt, prefix_len=5, S=12)
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention_bias(tt, prefix_len=-1, S=12)
    assert tree_attention_bias(tt, prefix_len=4, S=12).shape == (8, 12)


def test_chain_tree_and_root_only():
    tt = tensorize(chain_tree([5, 6, 7, 8]), 4, 3)
    np.testing.assert_array_equal(tt.retrieve[0], [0, 1, 2, 3, 4])
    assert (tt.retrieve[1:] == 4).all() and tt.n_paths == 1
    np.testing.assert_array_equal(tt.mask, np.tril(np.ones((4, 4), dtype=bool)))
    root = tensorize(chain_tree([9]), 1, 0)
    np.testing.assert_array_equal(root.retrieve, [[0, 1]])
    np.testing.assert_array_equal(root.mask, [[True]])
    root3 = tensorize(DraftTree([9], [0]), 3, 2, pad_token=7)
    np.testing.assert_array_equal(root3.tokens, [9, 7, 7])
    np.testing.assert_array_equal(root3.parent, [0, 3, 3])
    validate_tree(root3, 3, 2, pad_token=7)
    with pytest.raises(ValueError, match="chain_tree"):
        chain_tree([])


@pytest.mark.parametrize("tree, M, D, pad, words", [
    (DraftTree([1, 2, 3], [0, 0, 1]), 2, 3, 0, ["n_nodes", "[1, M=2]"]),
    (DraftTree([], []), 4, 3, 0, ["n_nodes", "[1, M=4]"]),
    (DraftTree([1, 2, 3, 4], [0, 0, 1, 2]), 8, 2, 0, ["depth", "D=2"]),
    (DraftTree([1, 2, 3], [0, 2, 0]), 8, 3, 0, ["tree.parents[1]", "[0, 1)"]),
    (DraftTree([1, 2, 3], [0, 0, -1]), 8, 3, 0, ["tree.parents[2]", "[0, 2)"]),
    (DraftTree([1, 2, 3], [1, 0, 0]), 8, 3, 0, ["tree.parents[0]", "must be 0"]),
    (DraftTree([1, 2, 2], [0, 0, 0]), 8, 3, 0, ["tree.tokens[2]", "distinct"]),
    (DraftTree([1, -2], [0, 0]), 8, 3, 0, ["tree.tokens[1]", "[0, "]),
    (DraftTree([1, 2], [0, 0]), 8, 3, -1, ["pad_token", "[0, "]),
    (DraftTree([1, 2], [0, 0]), 0, 3, 0, ["M", ">= 1"]),
    (DraftTree([1, 2], [0, 0]), 8, -1, 0, ["D", ">= 0"]),
])
def test_tensorize_rejects(tree, M, D, pad, words):
    with pytest.raises(ValueError) as err:
        tensorize(tree, M, D, pad_token=pad)
    for w in words:
        assert w in str(err.value)


def test_draft_tree_rejects_length_mismatch():
    with pytest.raises(ValueError, match="tree.parents"):
        DraftTree([1, 2], [0])
    with pytest.raises(ValueError, match="tree.scores"):
        DraftTree([1, 2], [0, 0], scores=[0.0])


def test_same_tokens_in_different_subtrees_are_allowed():
    tt = tensorize(DraftTree([1, 2, 3, 4, 4], [0, 0, 0, 1, 2]), 8, 2)
    validate_tree(tt, 8, 2)


# ------------------------------------------------------------------------------------ property tests

EXAMPLES = {(2, 1): 60, (8, 3): 700, (16, 4): 600, (32, 6): 500, (64, 8): 350}


def _check_against_reference(tree: DraftTree, tt, M: int, D: int):
    n = len(tree)
    assert tt.tokens.shape == (M,) and tt.depth.shape == (M,) and tt.parent.shape == (M,)
    assert tt.mask.shape == (M, M) and tt.retrieve.shape == (M, D + 2) and tt.valid.shape == (M,)
    for arr in (tt.parent, tt.retrieve):
        assert arr.min() >= 0 and arr.max() <= M
    assert (tt.retrieve[:, -1] == M).all()
    np.testing.assert_array_equal(tt.depth[:n], ref_depth(tree.parents, n))
    leaves = ref_leaves(tree.parents, n)
    assert tt.n_paths == len(leaves)
    for row, leaf in enumerate(leaves):
        path = ref_path(tree.parents, leaf)
        np.testing.assert_array_equal(tt.retrieve[row], path + [M] * (D + 2 - len(path)))
    for i in range(n):
        np.testing.assert_array_equal(np.flatnonzero(tt.mask[i]), ref_path(tree.parents, i))


def _check_bias(tt, M):
    prefix = 3
    bias = tree_attention_bias(tt, prefix, S=prefix + M + 2)
    visible = bias == 0
    assert visible.any(axis=1).all()  # every softmax row is well defined
    assert (visible[:, :prefix] == tt.valid[:, None]).all()
    assert not visible[:, prefix + M:].any()
    assert (visible[:, prefix: prefix + M] == tt.mask).all()


@pytest.mark.parametrize("M, D", BUDGETS)
def test_random_trees_hold_all_invariants(M, D):
    @settings(max_examples=EXAMPLES[(M, D)], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(tree=draft_trees(M, D), pad=st.integers(0, 5))
    def run(tree, pad):
        tt = tensorize(tree, M, D, pad_token=pad)
        validate_tree(tt, M, D, pad_token=pad)
        _check_against_reference(tree, tt, M, D)
        _check_bias(tt, M)

    run()


@pytest.mark.parametrize("M, D", [(8, 3), (32, 6)])
def test_random_trees_too_deep_or_duplicated_are_rejected(M, D):
    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(tree=draft_trees(M, D), which=st.sampled_from(["deep", "dup"]))
    def run(tree, which):
        n = len(tree)
        depth = ref_depth(tree.parents, n)
        if which == "deep":  # hang a chain under the deepest node (a leaf) until it reaches depth D + 1
            deepest = int(np.argmax(depth))
            k = D + 1 - depth[deepest]
            parents = list(tree.parents) + [deepest] + list(range(n, n + k - 1))
            tokens = list(tree.tokens) + [0] * k
            with pytest.raises(ValueError, match=f"depth of node {n + k - 1} = {D + 1}"):
                tensorize(DraftTree(tokens, parents), n + k, D)
        else:
            twins = DraftTree(list(tree.tokens) + [7, 7], list(tree.parents) + [0, 0])
            with pytest.raises(ValueError, match="distinct"):
                tensorize(twins, n + 2, D)

    run()


# ------------------------------------------------------------------- one corruption per invariant


def _set(field, index, value):
    def corrupt(tt):
        arr = getattr(tt, field).copy()
        arr[index] = value
        setattr(tt, field, arr)
    return corrupt


def _attr(field, value):
    def corrupt(tt):
        setattr(tt, field, value(getattr(tt, field)) if callable(value) else value)
    return corrupt


P = GM  # pad index of the golden tree
CORRUPTIONS = [
    ("shapes", None, _attr("retrieve", lambda r: r[:, :-1])),
    ("shapes", None, _attr("tokens", lambda t: t.astype(np.int64))),
    ("shapes", None, _attr("mask", lambda m: m.astype(np.int32))),
    ("shapes", None, _attr("n_nodes", 6.0)),
    ("index_range", 3, _set("parent", 3, P + 1)),
    ("index_range", None, _set("retrieve", (1, 4), -1)),
    ("index_range", 2, _set("tokens", 2, -5)),
    ("index_range", None, _attr("n_nodes", P + 1)),
    ("index_range", None, _attr("n_paths", 0)),
    ("parents_precede_children", 3, _set("parent", 3, 4)),
    ("parents_precede_children", 0, _set("parent", 0, 1)),
    ("depth_is_ancestor_count", 4, _set("depth", 4, 3)),
    ("depth_is_ancestor_count", 0, _set("depth", 0, 1)),
    ("mask_is_ancestor_closure", 5, _set("mask", (5, 1), False)),
    ("mask_is_ancestor_closure", 2, _set("mask", (2, 1), True)),
    ("mask_is_ancestor_closure", 1, _set("mask", (1, 6), True)),
    ("retrieve_paths", 2, _set("retrieve", [0, 1], [[0, 1, 4, P, P], [0, 2, P, P, P]])),
    ("retrieve_paths", 5, _set("retrieve", 2, [0, 1, P, 5, P])),
    ("retrieve_paths", 5, _set("retrieve", 2, [0, 1, 5, P, P])),
    ("retrieve_paths", None, _set("retrieve", 5, [0, P, P, P, P])),
    ("retrieve_paths", None, _attr("n_paths", 2)),
    ("unique_sibling_tokens", 2, _set("tokens", 2, 11)),
    ("unique_sibling_tokens", 4, _set("tokens", 4, 13)),
    ("pad_rows_inert", 6, _set("valid", 6, True)),
    ("pad_rows_inert", 7, _set("depth", 7, 1)),
    ("pad_rows_inert", 6, _set("parent", 6, 0)),
    ("pad_rows_inert", 6, _set("mask", (6, 0), True)),
    ("pad_rows_inert", 7, _set("mask", (7, 7), False)),
    ("pad_rows_inert", 7, _set("tokens", 7, 3)),
]


@pytest.mark.parametrize("invariant, node, corrupt", CORRUPTIONS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CORRUPTIONS)])
def test_validate_rejects_corruption(invariant, node, corrupt):
    tt = golden()
    validate_tree(tt, GM, GD, pad_token=0)
    corrupt(tt)
    with pytest.raises(TreeInvariantError) as err:
        validate_tree(tt, GM, GD, pad_token=0)
    assert err.value.invariant == invariant
    assert err.value.node == node
    assert invariant in str(err.value) and f"node {node}" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_every_invariant_has_a_corruption_test():
    assert {c[0] for c in CORRUPTIONS} == set(INVARIANTS)


def test_pad_token_only_checked_when_given():
    tt = golden()
    _set("tokens", 7, 3)(tt)
    validate_tree(tt, GM, GD)  # pad token unknown: not checked


def test_validate_checks_budget_against_arrays():
    with pytest.raises(TreeInvariantError) as err:
        validate_tree(golden(), GM, GD + 1)
    assert err.value.invariant == "shapes"
    with pytest.raises(TreeInvariantError) as err:
        validate_tree(golden(), GM + 1, GD)
    assert err.value.invariant == "shapes"
