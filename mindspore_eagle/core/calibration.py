"""Calibrated acceptance: P(a draft node is accepted) from its depth, rank and drafter probability, learned online.

Pure numpy; never imports MindSpore. Also the tree helpers the policy values trees with: the likeliest child of
each node, every node's calibrated value (siblings exclusive, a child capped by its parent) and the root plus the
best m - 1 nodes (``top_nodes``), which is what a step of budget m verifies.
"""
from __future__ import annotations

import numpy as np

from mindspore_eagle.core.tree import SOURCES, DraftTree

PROB_EDGES = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0 + 1e-6])


class AcceptanceModel:
    """P(draft node accepted | who proposed it, its depth, whether it is its parent's likeliest child, its path
    probability), calibrated online.

    Bins: source (drafter, suffix, both: ``core.tree.SOURCES``) x depth groups 1, 2, >= 3 x {likeliest child, other
    child} x the probability bins ``PROB_EDGES``. Each source has its own table because their probabilities mean
    different things: the drafter's is a softmax, a suffix node's is the share of earlier occurrences that went on
    that way (core/suffix.py), over-confident after a single occurrence. The rank
    matters: on 3,672 replayed positions the embedded drafter's likeliest depth-1 child at path probability
    0.1-0.2 was accepted 27 % of the time, while a less likely sibling of the same probability is accepted far less
    (docs/design.md, "Measurements behind the design: What the drafter's confidence is worth"). Each bin keeps
    decayed counts of verified nodes and of accepted ones; the estimate is ``(hits + w * prior) / (n + w)`` with the prior = the bin's mean drafter probability (identity
    calibration) and weight w = ``prior_weight``. Counts decay by ``decay`` per observed step, so the table
    follows a drafter whose reliability drifts (half-life ln 2 / (1 - decay) steps).
    """

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.999, depth_groups: int = 3):
        self.w, self.decay, self.G = float(prior_weight), float(decay), int(depth_groups)
        shape = (len(SOURCES), self.G, 2, len(PROB_EDGES) - 1)
        self.n, self.hits, self.psum = np.zeros(shape), np.zeros(shape), np.zeros(shape)

    def _index(self, scores, depth, best, source=None):
        prob = np.exp(np.minimum(np.asarray(scores, np.float64), 0.0))
        g = np.clip(np.asarray(depth, np.int64), 1, self.G) - 1
        r = 1 - np.asarray(best, np.int64)
        b = np.clip(np.searchsorted(PROB_EDGES, prob, side="right") - 1, 0, len(PROB_EDGES) - 2)
        src = np.zeros_like(g) if source is None else np.asarray(source, np.int64)
        return (src, g, r, b), prob

    def table(self) -> np.ndarray:
        """float64 [sources, G, 2, bins]: calibrated acceptance probability per (source, depth group,
        likeliest/other, prob bin)."""
        centers = (PROB_EDGES[:-1] + np.minimum(PROB_EDGES[1:], 1.0)) / 2
        prior = np.where(self.n > 0, self.psum / np.maximum(self.n, 1e-12), centers)
        return (self.hits + self.w * prior) / (self.n + self.w)

    def predict(self, scores, depth, best, source=None) -> np.ndarray:
        """Calibrated acceptance probability float64 [n] of nodes with cumulative log-prob ``scores`` [n] at
        ``depth`` [n] (>= 1); ``best`` bool [n]: the node is its parent's likeliest child; ``source`` int [n]
        (``core.tree.SOURCE_*``, None = all drafter)."""
        idx, _ = self._index(scores, depth, best, source)
        return self.table()[idx]

    def observe(self, scores, depth, best, accepted, source=None) -> None:
        """Add one step's verified drafted nodes (arrays as ``predict``, plus ``accepted`` bool [n])."""
        for a in (self.n, self.hits, self.psum):
            a *= self.decay
        idx, prob = self._index(scores, depth, best, source)
        np.add.at(self.n, idx, 1.0)
        np.add.at(self.hits, idx, np.asarray(accepted, np.float64))
        np.add.at(self.psum, idx, prob)

    def to_dict(self) -> dict:
        """Calibration table for reports: per (source, depth group, likeliest/other child, probability bin) the
        observed nodes, their mean proposed probability, the observed acceptance rate and the model's estimate."""
        est = self.table()
        rows = []
        for s, g, r, b in zip(*np.nonzero(self.n >= 0.5)):
            i = (s, g, r, b)
            rows.append({"source": SOURCES[s], "depth": int(g) + 1 if g + 1 < self.G else f">={self.G}",
                         "child": "likeliest" if r == 0 else "other",
                         "prob_lo": float(PROB_EDGES[b]), "prob_hi": float(min(PROB_EDGES[b + 1], 1.0)),
                         "nodes": float(self.n[i]), "drafter_prob": float(self.psum[i] / self.n[i]),
                         "accepted": float(self.hits[i] / self.n[i]), "estimate": float(est[i])})
        return {"bins": rows}


def likeliest_child(tree: DraftTree) -> np.ndarray:
    """bool [n]: node i (>= 1) has the highest score among its siblings in ``tree`` (ties: lower index); root
    False."""
    n = len(tree)
    out = np.zeros(n, bool)
    best: dict = {}
    for i in range(1, n):
        p = int(tree.parents[i])
        if p not in best or tree.scores[i] > tree.scores[best[p]]:
            best[p] = i
    out[list(best.values())] = True
    return out


def node_values(tree: DraftTree, model: AcceptanceModel) -> np.ndarray:
    """Calibrated P(accepted) float64 [n] of every node of ``tree`` (root = 1).

    Siblings are mutually exclusive (at most one child of a node matches the teacher), so the values of a node's
    children are scaled down to sum to at most the node's own value; no child's value exceeds its parent's (exactly,
    so an ordering by value keeps parents before children). Requires parents before children (DraftTree
    from drafting.select_tree); ``tree.scores`` are cumulative log-probs.
    """
    n = len(tree)
    depth, _ = tree_depth(tree)
    val = np.ones(n)
    if n > 1:
        val[1:] = model.predict(tree.scores[1:], depth[1:], likeliest_child(tree)[1:], tree.sources()[1:])
        kids: dict = {}
        for i in range(1, n):
            kids.setdefault(int(tree.parents[i]), []).append(i)
        for i in range(n):                                    # parents first: each cap uses the capped parent
            if i in kids:
                ks = kids[i]
                total = val[ks].sum()
                if total > val[i]:
                    val[ks] *= val[i] / total
        for i in range(1, n):       # exactly: x * (v / x) can round above v, and top_nodes relies on child <= parent
            val[i] = min(val[i], val[tree.parents[i]])
    return val


def top_nodes(tree: DraftTree, m: int, values: np.ndarray | None = None) -> DraftTree:
    """The root plus the best ``m - 1`` drafted nodes by ``values`` (float [n], e.g. :func:`node_values`; default
    the scores), ties to the lower index, parents relinked.

    A child's cumulative score, and its capped calibrated value, never exceeds its parent's, and ties favour the
    lower index (the parent), so the kept set is closed under parents (docs/design.md, "Tree expansion"). Returns
    ``tree`` itself when it has <= m nodes.

    Raises:
        AssertionError: a kept node's parent was not kept (``values`` grew from a parent to its child).
    """
    n = len(tree)
    if n <= m:
        return tree
    rank = tree.scores if values is None else np.asarray(values)
    order = np.lexsort((np.arange(n - 1), -rank[1:]))[: m - 1] + 1
    keep = np.concatenate([[0], np.sort(order)])
    new_index = np.full(n, -1, np.int64)
    new_index[keep] = np.arange(keep.size)
    parents = new_index[tree.parents[keep]]
    parents[0] = 0
    if (parents < 0).any():
        raise AssertionError("top_nodes kept a node without its parent")
    return DraftTree(tree.tokens[keep], parents, tree.scores[keep],
                     None if tree.source is None else tree.source[keep])


def select(tree: DraftTree, m: int, model: AcceptanceModel) -> DraftTree:
    """The root and the ``m - 1`` nodes a step of budget m verifies: by score for a drafter's tree (``source``
    None: its cumulative log-probs), by calibrated value (:func:`node_values`) for a tree with suffix candidates,
    whose frequency scores are not on the drafter's scale."""
    return top_nodes(tree, m, node_values(tree, model) if tree.source is not None else None)


def tree_depth(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """(depth int64 [n], has_child bool [n]) of a DraftTree whose parents precede children."""
    n = len(tree)
    depth = np.zeros(n, np.int64)
    has_child = np.zeros(n, bool)
    for i in range(1, n):
        depth[i] = depth[tree.parents[i]] + 1
        has_child[tree.parents[i]] = True
    return depth, has_child


def observe_tree(model: AcceptanceModel, tree: DraftTree, accepted_path) -> np.ndarray:
    """Feed a verified tree's drafted nodes to ``model``; returns has_child bool [n]."""
    depth, has_child = tree_depth(tree)
    acc = np.zeros(len(tree), bool)
    acc[np.asarray(accepted_path, np.int64)] = True
    model.observe(tree.scores[1:], depth[1:], likeliest_child(tree)[1:], acc[1:], tree.sources()[1:])
    return has_child


__all__ = ["AcceptanceModel", "PROB_EDGES", "likeliest_child", "node_values", "observe_tree", "select", "top_nodes",
           "tree_depth"]
