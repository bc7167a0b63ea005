"""Draft vocabulary: the Vd most frequent target tokens on loss-masked positions (E ``scandata``; SF
``process_token_dict_to_mappings``; docs/design.md, "Vocabulary map").

Legend: V = teacher vocab, Vd = draft vocab.

Counts come from the loss-masked positions of the training samples: the data tokens (as E does) and, when
given, the teacher's argmax tokens at those positions (what the drafter must predict at inference; a position
whose teacher argmax is outside the draft vocabulary is masked out of the loss and counts as a miss). The top
Vd ids by count (ties: smaller id first) are kept; if fewer than Vd ids occur, zero-count ids 0, 1, 2, ... not yet
chosen pad the set (as SF). The set is sorted ascending; ``d2t`` / ``t2d`` come from ``models.eagle3.vocab_maps``
(d2t holds offsets: identity is zeros).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindspore_eagle.models.eagle3 import vocab_maps


@dataclass
class DraftVocab:
    """used int64 [Vd] sorted; d2t int64 [Vd] offsets; t2d bool [V]; mass_data / mass_teacher: covered fraction
    of the counted data tokens / teacher-argmax tokens (nan when not counted); distinct: ids seen."""
    used: np.ndarray
    d2t: np.ndarray
    t2d: np.ndarray
    mass_data: float
    mass_teacher: float
    distinct: int

    def report(self) -> str:
        return (f"Vd={len(self.used)}: covers {self.mass_data:.4f} of loss-masked data tokens, "
                f"{self.mass_teacher:.4f} of teacher-argmax tokens ({self.distinct} distinct ids seen)")


def count_tokens(pairs, vocab_size: int) -> np.ndarray:
    """int64 [V] counts of ``ids[mask == 1]`` over ``pairs`` = iterable of (ids int [n], mask {0,1} [n])."""
    counts = np.zeros(vocab_size, np.int64)
    for ids, mask in pairs:
        ids = np.asarray(ids)[np.asarray(mask).astype(bool)]
        np.add.at(counts, ids, 1)
    return counts


def select_vocab(counts: np.ndarray, vd: int) -> np.ndarray:
    """Sorted int64 [vd] ids: the vd largest counts (ties by smaller id), padded with unused ids 0, 1, ...

    Raises:
        ValueError: vd < 1 or vd > V.
    """
    V = len(counts)
    if not 1 <= vd <= V:
        raise ValueError(f"draft vocab size must be in [1, {V}], got {vd}")
    order = np.lexsort((np.arange(V), -counts))      # count descending, id ascending
    seen = order[counts[order] > 0][:vd]
    if len(seen) < vd:
        rest = np.setdiff1d(np.arange(V), seen)[: vd - len(seen)]
        seen = np.concatenate([seen, rest])
    return np.sort(seen).astype(np.int64)


def build_vocab(data_pairs, vocab_size: int, vd: int, teacher_pairs=None) -> DraftVocab:
    """Draft vocabulary from data tokens (+ teacher argmax tokens if ``teacher_pairs`` is given), both counted
    on loss-masked positions; see the module docstring."""
    cd = count_tokens(data_pairs, vocab_size)
    ct = count_tokens(teacher_pairs, vocab_size) if teacher_pairs is not None else np.zeros_like(cd)
    used = select_vocab(cd + ct, vd)
    maps = vocab_maps(used, vocab_size)
    frac = lambda c: float(c[used].sum() / c.sum()) if c.sum() else float("nan")  # noqa: E731
    return DraftVocab(used, maps["d2t"], maps["t2d"], frac(cd), frac(ct) if teacher_pairs is not None
                      else float("nan"), int(((cd + ct) > 0).sum()))
