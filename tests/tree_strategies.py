"""Hypothesis strategies and slow reference implementations shared by core/test_tree.py and core/test_accept.py."""
from __future__ import annotations

from hypothesis import strategies as st

from mindspore_eagle.core.tree import DraftTree

BUDGETS = [(2, 1), (8, 3), (16, 4), (32, 6), (64, 8)]


@st.composite
def draft_trees(draw, M: int, D: int, vocab: int = 6):
    """A random valid DraftTree for budget (M, D): distinct sibling tokens, depth <= D, parents before children.

    Small draws shrink toward chains (parent = the newest eligible node) and small tokens.
    """
    n = draw(st.integers(1, M)) if D > 0 else 1
    raw_parent = draw(st.lists(st.integers(0, 1 << 16), min_size=n - 1, max_size=n - 1))
    raw_token = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    parents, depth, tokens = [0], [0], [raw_token[0]]
    used: dict[int, set] = {0: set()}
    for i in range(1, n):
        eligible = [j for j in range(i) if depth[j] < D]
        p = eligible[-1 - raw_parent[i - 1] % len(eligible)]
        tok = raw_token[i]
        while tok in used[p]:
            tok += 1
        used[p].add(tok)
        used[i] = set()
        parents.append(p)
        depth.append(depth[p] + 1)
        tokens.append(tok)
    return DraftTree(tokens, parents)


def ref_depth(parents, n):
    """Depth by walking up to the root."""
    out = []
    for i in range(n):
        d, j = 0, i
        while j != 0:
            j, d = int(parents[j]), d + 1
        out.append(d)
    return out


def ref_path(parents, node):
    """Root-to-node path by walking up the parents."""
    path = [int(node)]
    while path[-1] != 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def ref_leaves(parents, n):
    """Nodes that are nobody's parent."""
    parent_set = {int(parents[i]) for i in range(1, n)}
    return [i for i in range(n) if i not in parent_set]


def ref_children(parents, n, node):
    """Children of node in index order."""
    return [i for i in range(1, n) if int(parents[i]) == node]
