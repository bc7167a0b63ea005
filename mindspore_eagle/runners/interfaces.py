"""What the decode round needs of a teacher runner and a drafter runner, declared as Protocols.

``serving/round.py`` is written against these two interfaces, not against the MindSpore classes: any object with
these methods can be advanced by the round (``runners.teacher.TeacherRunner`` and ``runners.drafter.DrafterRunner``
on CPU and Ascend; tests use small numpy stand-ins). Pure Python: importing this module never loads MindSpore.

Legend: n = committed tokens of a sequence, k = query rows of a call, m = tree budget, N = rows of a batched call,
V = vocabulary, H = teacher hidden size (captured features are 3H wide), K = drafter top_k, D = D_max.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from mindspore_eagle.core.tree import DraftTree, TreeTensors


class TeacherRunnerLike(Protocol):
    """Fixed-shape calls of the teacher over its paged KV cache (``runners.teacher.TeacherRunner``)."""

    S: int  # slots one sequence can address (cache.max_seq_len)

    def new_seq(self) -> int:
        """Open an empty sequence; returns its id."""

    def free(self, sid: int) -> None:
        """Release the sequence's blocks."""

    def length(self, sid: int) -> int:
        """Committed tokens n of the sequence."""

    def prefill(self, sid: int, ids) -> tuple[np.ndarray, np.ndarray]:
        """Append the prompt ids int [T]; returns (logits float32 [V] of the last token, aux float32 [T, 3H])."""

    def decode(self, sid: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        """Append one token; returns (logits float32 [V], aux float32 [1, 3H])."""

    def decode_batch(self, sids, tokens, rows: int, width_step: int = 512, with_aux: bool = False,
                     with_hidden: bool = False):
        """Append one token to each of n <= N sequences in one forward; returns logits float32 [n, V] (plus aux
        float32 [n, 3H] with ``with_aux``; (logits, hidden float32 [n, H], aux) with ``with_hidden``)."""

    def verify(self, sid: int, tt: TreeTensors, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One forward over a tree of budget m after the prefix (opens a branch); returns (logits float32 [m, V],
        aux float32 [m, 3H]). Follow with :meth:`commit`."""

    def verify_mask(self, sid: int, tt: TreeTensors) -> np.ndarray:
        """float32 [m, w] additive attention bias of the tree after the prefix."""

    def verify_batch(self, sids, trees, rows: int, width_step: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """One forward over n trees of budgets m_i (sum(m_i) <= rows) in sequence order; returns (logits float32
        [sum m_i, V], aux float32 [sum m_i, 3H]). Follow with :meth:`commit` for each sequence."""

    def on_host(self, rows: int) -> bool:
        """True when a call of ``rows`` query rows needs no compiled graph (any row count costs no compile)."""

    def commit(self, sid: int, path, width: int) -> None:
        """Keep the accepted tree nodes ``path`` int [L] (root first) after the prefix; drop the rest."""


class DrafterRunnerLike(Protocol):
    """The EAGLE-3 drafter's context pass and tree expansion over its own cache (``runners.drafter.DrafterRunner``)."""

    max_positions: int  # positions the drafter was trained for (max_position_embeddings)

    def new_seq(self) -> int:
        """Open an empty drafter sequence; returns its id."""

    def free(self, sid: int) -> None:
        """Release the drafter sequence's blocks."""

    def extend(self, sid: int, aux: np.ndarray, next_tokens: np.ndarray):
        """Append context pairs (aux float32 [k, 3H], next tokens int [k]); returns the last pair's (top log-probs
        float32 [K], top ids int64 [K], hidden handle) for :meth:`build_tree`."""

    def build_tree(self, sid: int, root: int, first, M: int, D: int, grow=None) -> DraftTree:
        """Expand the EAGLE-2 dynamic tree from ``first``: at most M nodes, depth <= D; ``grow(tree, frontier
        scores, depth) -> bool`` may stop the expansion early."""

    def draft_batch(self, sids, pending, roots, M: int, D: int, groups: int) -> list:
        """Context pass and tree expansion of n <= ``groups`` sequences, batched across them; returns n DraftTrees."""


__all__ = ["DrafterRunnerLike", "TeacherRunnerLike"]
