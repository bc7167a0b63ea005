"""Draft trees as fixed-shape arrays: DraftTree -> TreeTensors, invariant checks, verification attention bias.

Pure numpy; never imports MindSpore (docs/architecture.md, "core/ (numpy only)").

Letters: M = tree budget (nodes verified per step, root included); D = D_max, the maximum depth of a draft node
(root depth 0, deepest draft depth D); n = nodes actually in the tree, 1 <= n <= M; P = number of root-to-leaf
paths (= leaves); S = context slots of the verification attention (prefix + M).

Pad convention (docs/design.md, "Tree tensors and padding"): the pad index is ``M`` (one past the last node); no array
ever holds a negative index. E (SafeAILab/EAGLE ``cnets.topK_genrate``) pads ``retrieve_indices`` with -1 and relies on
wrap-around; here every row of ``retrieve`` is right-padded with ``M`` and has width D + 2, so there is always at
least one trailing pad. Rows ``n..M-1`` are inert pad rows: token ``pad_token``, depth 0, parent M, mask only on
their own diagonal, valid False.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEG_BIAS = np.float32(-1e9)  # additive attention bias of a masked column; finite so no row softmax sees NaN
INT32_MAX = np.iinfo(np.int32).max

SOURCE_DRAFTER, SOURCE_SUFFIX, SOURCE_BOTH = 0, 1, 2   # who proposed a node (DraftTree.source)
SOURCES = ("drafter", "suffix", "both")

INVARIANTS = (
    "shapes",
    "index_range",
    "parents_precede_children",
    "depth_is_ancestor_count",
    "mask_is_ancestor_closure",
    "retrieve_paths",
    "unique_sibling_tokens",
    "pad_rows_inert",
)


class TreeInvariantError(ValueError):
    """A TreeTensors breaks one named invariant (one of ``INVARIANTS``).

    Attributes:
        invariant: the invariant's name, e.g. "mask_is_ancestor_closure".
        node: the offending node index (int), or None when the violation is not tied to one node.
        detail: human-readable description of what was found.
    """

    def __init__(self, invariant: str, node: int | None, detail: str):
        self.invariant = invariant
        self.node = node
        self.detail = detail
        super().__init__(f"tree invariant {invariant!r} violated at node {node}: {detail}")


@dataclass
class DraftTree:
    """A draft tree as produced by drafting (docs/design.md, "Tree expansion"): node 0 is the root token r.

    Fields (coerced to numpy in ``__post_init__``; ranges are checked by ``tensorize``):
        tokens: int64 [n], teacher-vocabulary token ids, tokens[0] = root.
        parents: int64 [n], parents[0] = 0 (root), parents[i] < i for i >= 1.
        scores: float32 [n] or None, cumulative draft log-probs (informational only).
        source: int8 [n] or None (= all SOURCE_DRAFTER): who proposed each node, SOURCE_DRAFTER (the EAGLE-3
            drafter), SOURCE_SUFFIX (core/suffix.py) or SOURCE_BOTH (:func:`merge_trees`); the root's entry is
            meaningless.
    Raises:
        ValueError: tokens / parents / scores / source are not 1-D arrays of one common length.
    """

    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int64 [n]
    scores: np.ndarray | None = None  # float32 [n] or None
    source: np.ndarray | None = None  # int8 [n] or None

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        self.parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        if self.tokens.shape != self.parents.shape:
            raise ValueError(f"tree.parents has length {self.parents.size}, must equal len(tree.tokens) = "
                             f"{self.tokens.size}")
        if self.scores is not None:
            self.scores = np.asarray(self.scores, dtype=np.float32).reshape(-1)
            if self.scores.shape != self.tokens.shape:
                raise ValueError(f"tree.scores has length {self.scores.size}, must equal len(tree.tokens) = "
                                 f"{self.tokens.size}")
        if self.source is not None:
            self.source = np.asarray(self.source, dtype=np.int8).reshape(-1)
            if self.source.shape != self.tokens.shape:
                raise ValueError(f"tree.source has length {self.source.size}, must equal len(tree.tokens) = "
                                 f"{self.tokens.size}")

    def sources(self) -> np.ndarray:
        """int8 [n]: ``source``, or all SOURCE_DRAFTER when it is None."""
        return self.source if self.source is not None else np.zeros(len(self), np.int8)

    def __len__(self) -> int:
        return int(self.tokens.size)


@dataclass
class TreeTensors:
    """Fixed-shape tensors of one draft tree for budget (M, D); shapes never depend on the tree's size.

    Built by ``tensorize``; checked by ``validate_tree``. Pad index = M.
    """

    tokens: np.ndarray  # int32 [M]; node tokens, pad rows hold pad_token
    depth: np.ndarray  # int32 [M]; number of ancestors (root 0), pad rows 0
    mask: np.ndarray  # bool [M, M]; row i True at i and its ancestors; pad rows True only at (i, i)
    parent: np.ndarray  # int32 [M]; root -> 0, pad rows -> M
    retrieve: np.ndarray  # int32 [M, D + 2]; row p = root-to-leaf path of the p-th leaf, right-padded with M
    valid: np.ndarray  # bool [M]; True for the n real nodes (a prefix)
    n_nodes: int  # n, number of real nodes, 1 <= n <= M
    n_paths: int  # P, number of leaves = used rows of retrieve, 1 <= P <= n

    @property
    def budget(self) -> int:
        """M, the tree budget (root included)."""
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        """D, the maximum draft depth the retrieve width allows."""
        return int(self.retrieve.shape[1]) - 2


def chain_tree(tokens) -> DraftTree:
    """A chain DraftTree: tokens[0] is the root and node i's parent is i - 1 (VL-style chain drafting).

    Args:
        tokens: int sequence [n], n >= 1.
    Returns:
        DraftTree with parents [0, 0, 1, ..., n - 2].
    Raises:
        ValueError: tokens is empty.
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if tokens.size < 1:
        raise ValueError("chain_tree tokens must hold at least the root (length >= 1), got length 0")
    parents = np.maximum(np.arange(tokens.size, dtype=np.int64) - 1, 0)
    return DraftTree(tokens, parents)


def merge_trees(drafted: DraftTree, suffix: DraftTree | None) -> DraftTree:
    """One tree from two sources (docs/design.md, "Suffix candidates"): the drafter's tree with the suffix tree's
    nodes added, a node both propose kept once (SOURCE_BOTH, the larger of its two scores).

    Both trees must share the root token and list parents before children, with cumulative scores that never grow
    from a parent to its child; the merged tree keeps all three properties (a suffix node's merged parent is a
    suffix or shared node, whose score is at least the suffix parent's), so :func:`top_nodes` on it keeps a
    parent-closed set. Nodes of ``drafted`` keep their indices; new suffix nodes follow, parents first.

    Args:
        drafted: DraftTree with scores (its ``source`` as given, default SOURCE_DRAFTER).
        suffix: DraftTree with scores (every node counted as SOURCE_SUFFIX), or None (returns ``drafted`` with
            its source filled in).
    Returns:
        DraftTree with tokens, parents, scores float32 and source int8, of at most len(drafted) + len(suffix) - 1
        nodes; may exceed the budget M: the policy's selection (top_nodes) cuts it.
    Raises:
        ValueError: the roots differ or a tree has no scores.
    """
    if drafted.scores is None or (suffix is not None and suffix.scores is None):
        raise ValueError("merge_trees: both trees need scores (cumulative log-probs)")
    src = drafted.sources().copy()
    if suffix is None or len(suffix) < 2:
        return DraftTree(drafted.tokens, drafted.parents, drafted.scores, src)
    if int(suffix.tokens[0]) != int(drafted.tokens[0]):
        raise ValueError(f"merge_trees: roots differ (drafter {int(drafted.tokens[0])}, suffix "
                         f"{int(suffix.tokens[0])})")
    tokens, parents = list(drafted.tokens), list(drafted.parents)
    scores = list(drafted.scores)
    src = list(src)
    child = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(drafted.parents[1:], drafted.tokens[1:]), start=1)}
    where = np.zeros(len(suffix), np.int64)             # suffix node -> merged node (root -> root)
    for j in range(1, len(suffix)):
        par, tok, sc = int(where[suffix.parents[j]]), int(suffix.tokens[j]), float(suffix.scores[j])
        i = child.get((par, tok))
        if i is None:
            i = len(tokens)
            child[(par, tok)] = i
            tokens.append(tok)
            parents.append(par)
            scores.append(sc)
            src.append(SOURCE_SUFFIX)
        elif src[i] != SOURCE_SUFFIX:
            src[i] = SOURCE_BOTH
            scores[i] = max(scores[i], sc)
        where[j] = i
    return DraftTree(np.asarray(tokens), np.asarray(parents), np.asarray(scores, np.float32), np.asarray(src))


def _check_budget(M: int, D: int) -> None:
    if not isinstance(M, (int, np.integer)) or M < 1:
        raise ValueError(f"tree budget M must be an int >= 1, got {M!r}")
    if not isinstance(D, (int, np.integer)) or D < 0:
        raise ValueError(f"max draft depth D must be an int >= 0, got {D!r}")


def _check_draft_tree(tree: DraftTree, M: int, D: int) -> np.ndarray:
    """Reject trees tensorize cannot represent; return depth int64 [n]."""
    n = len(tree)
    if not 1 <= n <= M:
        raise ValueError(f"tree n_nodes = {n} must be in [1, M={M}]")
    bad = np.flatnonzero((tree.tokens < 0) | (tree.tokens > INT32_MAX))
    if bad.size:
        raise ValueError(f"tree.tokens[{bad[0]}] = {tree.tokens[bad[0]]} must be in [0, {INT32_MAX}]")
    if tree.parents[0] != 0:
        raise ValueError(f"tree.parents[0] = {tree.parents[0]} must be 0 (the root is its own parent)")
    idx = np.arange(n)
    bad = np.flatnonzero((idx >= 1) & ((tree.parents < 0) | (tree.parents >= idx)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"tree.parents[{i}] = {tree.parents[i]} must be in [0, {i}) (parents precede children)")
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depth[i] = depth[tree.parents[i]] + 1
    if depth.max() > D:
        i = int(np.argmax(depth))
        raise ValueError(f"tree depth of node {i} = {depth[i]} must be in [0, D={D}]")
    seen: dict[tuple[int, int], int] = {}
    for i in range(1, n):
        key = (int(tree.parents[i]), int(tree.tokens[i]))
        if key in seen:
            raise ValueError(f"tree.tokens[{i}] = {key[1]} duplicates sibling node {seen[key]} under parent "
                             f"{key[0]}; sibling tokens must be distinct")
        seen[key] = i
    return depth


def _ancestor_mask(parents: np.ndarray, n: int) -> np.ndarray:
    """bool [n, n]: row i True at i and its ancestors (each row is its parent's row plus itself)."""
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def _leaves(parents: np.ndarray, n: int) -> np.ndarray:
    """int64 [P]: nodes that are nobody's parent, ascending."""
    is_parent = np.zeros(n, dtype=bool)
    is_parent[parents[1:n]] = True
    return np.flatnonzero(~is_parent)


def _retrieve(mask: np.ndarray, leaves: np.ndarray, M: int, D: int) -> np.ndarray:
    """int32 [M, D + 2]: row p = ancestors of leaves[p] ascending (= the root-to-leaf path), padded with M."""
    out = np.full((M, D + 2), M, dtype=np.int32)
    for row, leaf in enumerate(leaves):
        path = np.flatnonzero(mask[leaf])  # ancestors have smaller indices, so ascending = root first
        out[row, : path.size] = path
    return out


def tensorize(tree: DraftTree, M: int, D: int, pad_token: int = 0) -> TreeTensors:
    """Turn a DraftTree into fixed-shape TreeTensors for budget (M, D) (docs/design.md, "Tree tensors and padding"; pad
    = M).

    Args:
        tree: DraftTree with n nodes.
        M: tree budget incl. root (int >= 1). D: max draft depth (int >= 0).
        pad_token: token id written in pad rows, in [0, 2**31 - 1].
    Returns:
        TreeTensors (tokens int32 [M], depth int32 [M], mask bool [M, M], parent int32 [M],
        retrieve int32 [M, D + 2], valid bool [M], n_nodes, n_paths). Retrieve rows are in leaf-index order.
    Raises:
        ValueError naming the field and allowed range: n > M or n < 1, a token outside [0, 2**31 - 1],
        parents[0] != 0, a parent not preceding its child, a node deeper than D, duplicate sibling tokens,
        bad M / D / pad_token.
    """
    _check_budget(M, D)
    if not 0 <= pad_token <= INT32_MAX:
        raise ValueError(f"pad_token = {pad_token} must be in [0, {INT32_MAX}]")
    depth_n = _check_draft_tree(tree, M, D)
    n = len(tree)
    mask_n = _ancestor_mask(tree.parents, n)
    leaves = _leaves(tree.parents, n)

    tokens = np.full(M, pad_token, dtype=np.int32)
    tokens[:n] = tree.tokens
    depth = np.zeros(M, dtype=np.int32)
    depth[:n] = depth_n
    parent = np.full(M, M, dtype=np.int32)
    parent[:n] = tree.parents
    mask = np.eye(M, dtype=bool)
    mask[:n, :n] = mask_n
    valid = np.arange(M) < n
    return TreeTensors(tokens=tokens, depth=depth, mask=mask, parent=parent,
                       retrieve=_retrieve(mask, leaves, M, D), valid=valid,
                       n_nodes=n, n_paths=int(leaves.size))


# ---------------------------------------------------------------------------------------------- validation


def _fail(invariant: str, node, detail: str):
    raise TreeInvariantError(invariant, None if node is None else int(node), detail)


def _check_shapes(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    want = {"tokens": ((M,), np.int32), "depth": ((M,), np.int32), "mask": ((M, M), np.bool_),
            "parent": ((M,), np.int32), "retrieve": ((M, D + 2), np.int32), "valid": ((M,), np.bool_)}
    for name, (shape, dtype) in want.items():
        arr = getattr(tt, name)
        if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != dtype:
            got = (getattr(arr, "shape", None), getattr(arr, "dtype", type(arr).__name__))
            _fail("shapes", None, f"{name} must be {np.dtype(dtype).name} {list(shape)}, got {got}")
    for name in ("n_nodes", "n_paths"):
        if not isinstance(getattr(tt, name), (int, np.integer)):
            _fail("shapes", None, f"{name} must be an int, got {type(getattr(tt, name)).__name__}")


def _check_index_range(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    if not 1 <= tt.n_nodes <= M:
        _fail("index_range", None, f"n_nodes = {tt.n_nodes} must be in [1, M={M}]")
    if not 1 <= tt.n_paths <= tt.n_nodes:
        _fail("index_range", None, f"n_paths = {tt.n_paths} must be in [1, n_nodes={tt.n_nodes}]")
    for name in ("parent", "retrieve"):
        arr = getattr(tt, name)
        bad = np.argwhere((arr < 0) | (arr > M))
        if bad.size:
            node = bad[0][0] if name == "parent" else None
            _fail("index_range", node, f"{name}{bad[0].tolist()} = {arr[tuple(bad[0])]} must be in [0, M={M}]")
    bad = np.flatnonzero(tt.tokens < 0)
    if bad.size:
        _fail("index_range", bad[0], f"tokens[{bad[0]}] = {tt.tokens[bad[0]]} must be >= 0")


def _check_parents(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    if tt.parent[0] != 0:
        _fail("parents_precede_children", 0, f"root parent = {tt.parent[0]} must be 0")
    idx = np.arange(tt.n_nodes)
    bad = np.flatnonzero((idx >= 1) & (tt.parent[: tt.n_nodes] >= idx))
    if bad.size:
        _fail("parents_precede_children", bad[0], f"parent = {tt.parent[bad[0]]} must be < {bad[0]}")


def _check_depth(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    n = tt.n_nodes
    expect = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        expect[i] = expect[tt.parent[i]] + 1
    bad = np.flatnonzero(tt.depth[:n] != expect)
    if bad.size:
        _fail("depth_is_ancestor_count", bad[0], f"depth = {tt.depth[bad[0]]}, ancestors = {expect[bad[0]]}")
    if expect.max() > D:
        _fail("depth_is_ancestor_count", np.argmax(expect), f"depth {expect.max()} must be in [0, D={D}]")


def _check_mask(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    n = tt.n_nodes
    expect = np.zeros((n, M), dtype=bool)
    expect[:, :n] = _ancestor_mask(tt.parent, n)
    bad = np.argwhere(tt.mask[:n] != expect)
    if bad.size:
        i, j = bad[0]
        _fail("mask_is_ancestor_closure", i, f"mask[{i}, {j}] = {tt.mask[i, j]}, ancestor closure says "
                                             f"{expect[i, j]}")


def _check_retrieve(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    n = tt.n_nodes
    leaves = _leaves(tt.parent, n)
    if tt.n_paths != leaves.size:
        _fail("retrieve_paths", None, f"n_paths = {tt.n_paths} but the tree has {leaves.size} leaves")
    expect = _retrieve(_ancestor_mask(tt.parent, n), leaves, M, D)
    for row in range(M):
        if not np.array_equal(tt.retrieve[row], expect[row]):
            what = (f"row {row} = {tt.retrieve[row].tolist()} must be the path to leaf {leaves[row]} then pads M"
                    if row < leaves.size else f"unused row {row} = {tt.retrieve[row].tolist()} must be all M")
            _fail("retrieve_paths", leaves[row] if row < leaves.size else None, what)


def _check_siblings(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    seen: dict[tuple[int, int], int] = {}
    for i in range(1, tt.n_nodes):
        key = (int(tt.parent[i]), int(tt.tokens[i]))
        if key in seen:
            _fail("unique_sibling_tokens", i, f"token {key[1]} repeats sibling {seen[key]} under parent {key[0]}")
        seen[key] = i


def _check_pad_rows(tt: TreeTensors, M: int, D: int, pad_token) -> None:
    n = tt.n_nodes
    bad = np.flatnonzero(tt.valid != (np.arange(M) < n))
    if bad.size:
        _fail("pad_rows_inert", bad[0], f"valid = {tt.valid[bad[0]]} but n_nodes = {n}")
    pad_eye = np.eye(M, dtype=bool)[n:]
    checks = (("depth", tt.depth[n:] != 0, "0"), ("parent", tt.parent[n:] != M, f"M={M}"),
              ("mask row", (tt.mask[n:] != pad_eye).any(axis=1), "True only on the diagonal"))
    if pad_token is not None:
        checks += (("token", tt.tokens[n:] != pad_token, f"pad_token={pad_token}"),)
    for name, wrong, want in checks:
        bad = np.flatnonzero(wrong)
        if bad.size:
            _fail("pad_rows_inert", n + bad[0], f"pad row {name} must be {want}")


_CHECKS = (_check_shapes, _check_index_range, _check_parents, _check_depth, _check_mask, _check_retrieve,
           _check_siblings, _check_pad_rows)


def validate_tree(tt: TreeTensors, M: int, D: int, pad_token: int | None = None) -> None:
    """Check every TreeTensors invariant, in the order of ``INVARIANTS``; return None when all hold.

    Invariants (one named check each): shapes/dtypes fixed for (M, D); every index (parent, retrieve) in
    [0, M] and tokens >= 0; parents precede children; depth == number of ancestors (<= D); mask == ancestor
    closure incl. self; retrieve rows are root-to-leaf paths padded only at their end, one per leaf, in leaf
    order, unused rows all M; no duplicate sibling tokens; pad rows inert (and hold ``pad_token`` if given).
    Args:
        tt: TreeTensors to check. M, D: the budget it must conform to.
        pad_token: when not None, pad rows must hold this token.
    Raises:
        TreeInvariantError: the first violated invariant, with ``invariant`` and ``node`` set.
    """
    _check_budget(M, D)
    for check in _CHECKS:
        check(tt, M, D, pad_token)


def tree_attention_bias(tt: TreeTensors, prefix_len: int, S: int) -> np.ndarray:
    """Additive attention bias for the verification forward (docs/design.md, "Verification and acceptance").

    Column c < prefix_len (the committed context) is visible to every valid row; column prefix_len + j is visible
    to row i iff mask[i, j]; pad rows see only their own column prefix_len + i, so every row has one visible
    column and its softmax is well defined. Columns >= prefix_len + M are masked.
    Args:
        tt: TreeTensors for budget M. prefix_len: committed context length. S: number of key slots.
    Returns:
        float32 [M, S], 0 where visible and NEG_BIAS (-1e9) where masked.
    Raises:
        ValueError: prefix_len outside [0, S - M].
    """
    M = tt.budget
    if not 0 <= prefix_len <= S - M:
        raise ValueError(f"prefix_len = {prefix_len} must be in [0, S - M = {S - M}] (S={S}, M={M})")
    bias = np.full((M, S), NEG_BIAS, dtype=np.float32)
    bias[tt.valid, :prefix_len] = 0.0
    bias[:, prefix_len: prefix_len + M] = np.where(tt.mask, np.float32(0.0), NEG_BIAS)
    return bias
