"""Tree-aligned training metric: per-depth top-k coverage of the teacher's argmax and the L_k it implies.

Legend: S = ttt_length, D = tree depth (drafted tokens on a root-to-leaf path), k = top-k width, N = positions.

**Coverage.** At TTT step s (tree depth d = s + 1: step 0 is the context pass that drafts depth 1), over the
loss-masked positions of held-out samples, ``cov_k[s]`` = the share whose teacher argmax (the token greedy
verification accepts) is among the k largest draft logits (draft ids mapped to teacher ids through d2t; a
teacher argmax outside the draft vocabulary is always a miss). ``cov_1`` is the trainer's top-1 accuracy.
Step s conditions on the drafter's **own** previous hidden outputs (as at inference) but on the **true** tokens
of the sample (at inference: the drafted ones). On replies written by the teacher itself (greedy) the true
tokens are the teacher's argmax, i.e. exactly the tokens of an accepted path, so cov_k[s] estimates the
acceptance at depth s + 1 given that the path above it was accepted; on other text it is an approximation.

**Implied mean accepted length** (tokens per verification step, bonus token included, the convention of
engine.mean_accept_len; docs/design.md, "Accepted length"). With a_d = P(depth d accepted | depths 1..d-1 accepted), the
number of accepted drafts A satisfies P(A >= d) = prod_{j<=d} a_j, hence

    E[L] = 1 + E[A] = 1 + sum_{d=1}^{D} prod_{j=1}^{d} a_j.

With a constant a_d = alpha this is (1 - alpha^(D+1)) / (1 - alpha), Eq. (1) of Leviathan et al. 2023 ("Fast
Inference from Transformers via Speculative Decoding", §3.4); the per-depth form is the same telescoping sum.
* chain of depth D (top-1 at every depth): a_d = cov_1[d-1].
* top-k tree (every node on the accepted path has its top-k children drafted, up to depth D; k + k^2 + ... +
  k^D nodes): greedy verification accepts depth d iff the teacher argmax is among those k children, so
  a_d = cov_k[d-1]. A budget-M tree of the engine drafts fewer nodes (M - 1 < k + ... + k^D for M <= 8, k = 4,
  D = 3), so this is an upper bound for it and ``L_chain`` a lower bound for a tree that contains the chain.
Both treat the per-depth coverages as the conditional acceptances (independence across depths beyond what
TTT's conditioning on the true prefix gives); easy positions tend to be easy at every depth, so the product
of marginals is a conservative estimate.
"""
from __future__ import annotations

import numpy as np

KS = (1, 2, 4)


def topk_ids(logits: np.ndarray, d2t: np.ndarray, kmax: int) -> np.ndarray:
    """Teacher ids of the ``kmax`` largest draft logits, best first (numpy reference of ``TTTDrafter.eval_topk``).

    Args:
        logits float [..., Vd]; d2t int [Vd] offsets (teacher id = draft id + d2t[draft id]); kmax in 1..Vd.
    Returns:
        int64 [..., kmax]; ties go to the smaller draft id (stable sort).
    Raises:
        ValueError: kmax outside 1..Vd or d2t not of length Vd.
    """
    vd = logits.shape[-1]
    if not 1 <= kmax <= vd or len(d2t) != vd:
        raise ValueError(f"topk_ids: kmax must be in 1..{vd} and d2t of length {vd}")
    idx = np.argsort(-np.asarray(logits, np.float64), axis=-1, kind="stable")[..., :kmax]
    return idx + np.asarray(d2t, np.int64)[idx]


def coverage_counts(topk: np.ndarray, target: np.ndarray, mask: np.ndarray, ks=KS) -> tuple[np.ndarray, int]:
    """Hits of the teacher argmax in the top-k draft ids, for each k of ``ks``, over masked positions.

    Args:
        topk int [..., kmax] (teacher ids, best first); target int [...] teacher argmax ids; mask {0,1} [...]
        (loss-masked positions); ks: increasing k values, each <= kmax.
    Returns:
        (hits int64 [len(ks)], count int = positions with mask 1); hits are non-decreasing in k.
    Raises:
        ValueError: shapes disagree or a k is outside 1..kmax.
    """
    topk, target, mask = np.asarray(topk), np.asarray(target), np.asarray(mask).astype(bool)
    if topk.shape[:-1] != target.shape or target.shape != mask.shape:
        raise ValueError(f"coverage_counts: shapes {topk.shape} / {target.shape} / {mask.shape} disagree")
    if any(not 1 <= k <= topk.shape[-1] for k in ks) or list(ks) != sorted(ks):
        raise ValueError(f"coverage_counts: ks {tuple(ks)} must increase within 1..{topk.shape[-1]}")
    match = topk == target[..., None]                     # [..., kmax]; ids in a top-k list are distinct
    hits = np.array([int((match[..., :k].any(-1) & mask).sum()) for k in ks], np.int64)
    assert np.all(np.diff(hits) >= 0)
    return hits, int(mask.sum())


def implied_accept_length(acc) -> float:
    """1 + sum_{d=1}^{D} prod_{j<=d} acc[j-1]: mean accepted length (bonus included) for per-depth conditional
    acceptances ``acc`` [D] in [0, 1] (module docstring). Raises ValueError for values outside [0, 1]."""
    a = np.asarray(acc, np.float64)
    if a.ndim != 1 or np.any((a < 0) | (a > 1)):
        raise ValueError("implied_accept_length: acc must be a 1-D array of values in [0, 1]")
    return float(1.0 + np.cumprod(a).sum())


def coverage_report(hits: np.ndarray, counts: np.ndarray, ks=KS, depths=(1, 2, 3)) -> dict:
    """Per-depth coverage and implied L_k from accumulated counts.

    Args:
        hits int [S, len(ks)] per TTT step; counts int [S] masked positions per step; ks as in hits; depths:
        tree depths D (<= S) for which to report the implied L_k.
    Returns:
        {"cov": {"k1": [S floats], ...}, "positions": [S ints],
         "L_implied": {"D3": {"k1": float, "k2": ..., ...}, ...}} (k1 = chain, kK = top-K tree; 4 decimals).
    """
    hits, counts = np.asarray(hits, np.float64), np.asarray(counts, np.float64)
    cov = hits / np.maximum(counts, 1)[:, None]                # [S, len(ks)]
    out = {"cov": {f"k{k}": cov[:, i].round(4).tolist() for i, k in enumerate(ks)},
           "positions": counts.astype(int).tolist(), "L_implied": {}}
    for D in depths:
        if D <= len(counts):
            out["L_implied"][f"D{D}"] = {f"k{k}": round(implied_accept_length(cov[:D, i]), 4)
                                         for i, k in enumerate(ks)}
    return out
