"""Acceptance rules for tree verification: pure functions of the teacher's outputs and a TreeTensors.

Pure numpy; never runs a model and never imports MindSpore (docs/architecture.md, "core/ (numpy only)").

Letters: M = tree budget (root included), n = real nodes, V = teacher vocabulary, a = accepted draft tokens.
Node i's teacher row (argmax or probs row i) is the teacher's prediction for the token *after* node i, i.e.
conditioned on the root-to-i path (docs/design.md, "Verification and acceptance"). Accept length counts the bonus token:
accept_len = a + 1 tokens emitted per teacher forward (docs/design.md, "Accepted length").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindspore_eagle.core.tree import TreeTensors


@dataclass
class VerifyResult:
    """Outcome of one verification step (docs/design.md, "Commit").

    ``path`` are the node indices to commit to the KV cache (root plus accepted drafts); ``tokens`` are the tokens
    emitted this step (accepted drafts then the bonus); the bonus becomes the next root and is not yet in the KV.
    """

    path: np.ndarray  # int32 [a + 1]; node indices, path[0] = 0 (root)
    accept_len: int  # a + 1 = accepted draft tokens + bonus
    tokens: np.ndarray  # int64 [a + 1]; tokens of path[1:], then the bonus
    bonus: int  # teacher token after path[-1]


def _result(tt: TreeTensors, path, bonus: int) -> VerifyResult:
    path = np.asarray(path, dtype=np.int32)
    tokens = np.append(tt.tokens[path[1:]].astype(np.int64), np.int64(bonus))
    return VerifyResult(path=path, accept_len=int(path.size), tokens=tokens, bonus=int(bonus))


def accept_greedy(tt: TreeTensors, target_argmax) -> VerifyResult:
    """Greedy (temperature 0) acceptance: the longest tree path whose drafts equal the teacher argmax.

    Draft node j is accepted iff its parent is accepted and tokens[j] == target_argmax[parent[j]] (root always
    accepted). Among retrieve rows, the one with the longest accepted prefix wins; ties go to the lowest row
    (first argmax), as E ``utils.py evaluate_posterior`` greedy branch (docs/design.md, "Verification and acceptance").
    Bonus = target_argmax[last accepted node].
    Args:
        tt: TreeTensors for budget M.
        target_argmax: int [M], teacher argmax after each node (pad rows ignored).
    Returns:
        VerifyResult with accept_len = accepted drafts + 1.
    Raises:
        ValueError: target_argmax is not an integer array of shape [M] with values >= 0.
    """
    M, n = tt.budget, tt.n_nodes
    am = np.asarray(target_argmax)
    if am.shape != (M,) or not np.issubdtype(am.dtype, np.integer):
        raise ValueError(f"target_argmax must be an integer array of shape [M={M}], got {am.dtype} {am.shape}")
    if (am[:n] < 0).any():
        raise ValueError(f"target_argmax values must be >= 0, got min {am[:n].min()}")
    match = np.zeros(M + 1, dtype=bool)  # index M (pad) never matches
    match[0] = True
    match[1:n] = tt.tokens[1:n] == am[tt.parent[1:n]]
    accepted_prefix = np.cumprod(match[tt.retrieve], axis=1).sum(axis=1)  # [M]; nodes incl. root; unused rows 0
    best = int(np.argmax(accepted_prefix))
    path = tt.retrieve[best, : accepted_prefix[best]]
    return _result(tt, path, int(am[path[-1]]))


def _check_positive(name: str, value, low_open: float, high: float | None = None) -> None:
    ok = np.isfinite(value) and value > low_open and (high is None or value <= high)
    if not ok:
        rng = f"({low_open}, {high}]" if high is not None else f"({low_open}, inf)"
        raise ValueError(f"{name} = {value!r} must be in {rng}")


def warp_probs(logits, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """Sampling distribution after temperature, top-k and top-p warping, in that order (HF's warper list
    ``TopKLogitsWarper`` then ``TopPLogitsWarper``; vLLM and SGLang apply top-k, then top-p on the renormalised
    top-k mass).

    Divide by temperature, then top-k (keep tokens whose logit is >= the k-th largest), then top-p (keep the
    smallest set of most likely tokens whose renormalised mass reaches top_p; the most likely token is always
    kept). Removed tokens get probability exactly 0.
    Args:
        logits: float [..., V]; entries finite or -inf (at least one finite per row).
        temperature: in (0, inf). top_p: in (0, 1], 1 = off. top_k: int >= 0, 0 = off.
    Returns:
        float64 [..., V], each row sums to 1.
    Raises:
        ValueError naming the field and its range: bad temperature / top_p / top_k, NaN or +inf logits,
        a row with no finite logit.
    """
    _check_positive("temperature", temperature, 0.0)
    _check_positive("top_p", top_p, 0.0, 1.0)
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k = {top_k!r} must be an int in [0, inf) (0 = off)")
    x = np.array(logits, dtype=np.float64)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {x.shape}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits entries must be finite or -inf (no NaN / +inf)")
    if not np.isfinite(x).any(axis=-1).all():
        raise ValueError("every logits row must have at least one finite entry")
    x /= temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = np.partition(x, V - top_k, axis=-1)[..., V - top_k: V - top_k + 1]
        x[x < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-x, axis=-1, kind="stable")
        p_sorted = _softmax(np.take_along_axis(x, order, axis=-1))
        mass_before = np.cumsum(p_sorted, axis=-1) - p_sorted
        mass_before[..., 0] = 0.0  # the most likely token is always kept
        remove = np.empty_like(mass_before, dtype=bool)
        np.put_along_axis(remove, order, mass_before >= top_p, axis=-1)
        x[remove] = -np.inf
    return _softmax(x)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 arrays (Steele, Lea and Flood, OOPSLA 2014), wrapping mod 2**64."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix_key(seed: int, positions) -> np.ndarray:
    """uint64 [k]: SplitMix64(SplitMix64(seed) xor position), the key of each (seed, position)."""
    key = _splitmix64(np.asarray([seed % (1 << 64)], np.uint64))
    return _splitmix64(np.asarray(positions, np.int64).astype(np.uint64) ^ key)


_TOKEN_IDS: dict = {}


def keyed_uniforms(seed: int, positions, V: int) -> np.ndarray:
    """The uniform of every (position, token id): u = (SplitMix64(key(seed, position) xor token) + 1/2) / 2**64
    at 53 bits, a pure function of (seed, position, token id) in the open interval (0, 1).

    Args:
        seed: int in [0, 2**64). positions: int [k] absolute positions (the token's index in the sequence, prompt
            included). V: vocabulary size.
    Returns:
        float64 [k, V].
    """
    ids = _TOKEN_IDS.get(V)
    if ids is None:
        ids = _TOKEN_IDS.setdefault(V, np.arange(V, dtype=np.uint64))
    z = _splitmix64(_mix_key(seed, positions)[:, None] ^ ids[None, :])
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def keyed_draw(probs, seed: int, positions) -> np.ndarray:
    """Seeded draws by an exponential race keyed by (seed, position, token id): at each position the token
    ``argmax_t log p_t - log(-log u_t)`` over the tokens with p_t > 0 (Gumbel-max; equivalently the first of
    independent exponential clocks of rates p_t), with u_t = :func:`keyed_uniforms`.

    The token is distributed exactly as p (the Gumbel-max theorem). Since each token has its own noise, a small
    change of p changes the draw only where two tokens' keyed scores nearly tie, as greedy decoding changes only
    at a near-tie of the top-2 logits (an inverse-CDF draw with one uniform per position moves every CDF
    boundary instead). vLLM's model runner v2 and SGLang's deterministic mode key Gumbel noise by (seed,
    position, token) in the same way (docs/design.md, "Verification and acceptance").
    Args:
        probs: float [k, V] (or [V]), rows non-negative with positive sum (need not be normalised).
        seed: the sequence's seed. positions: int [k] (or a scalar for [V]) absolute positions.
    Returns:
        int64 [k] token ids (a scalar int64 array for [V] input).
    """
    p = np.asarray(probs, np.float64)
    one = p.ndim == 1
    p2 = p[None] if one else p
    pos = np.atleast_1d(np.asarray(positions, np.int64))
    u = keyed_uniforms(seed, pos, p2.shape[-1])
    with np.errstate(divide="ignore"):
        score = np.log(p2) - np.log(-np.log(u))
    score[p2 <= 0] = -np.inf
    out = np.argmax(score, axis=-1).astype(np.int64)
    return out[0] if one else out


def sample_token(logits, gen, pos: int) -> int:
    """The token at output position ``pos`` after a plain (non-tree) step: argmax at ``gen.temperature == 0``,
    else the keyed draw (:func:`keyed_draw` with ``gen.seed``) from ``warp_probs(logits, gen.temperature,
    gen.top_p, gen.top_k)``.

    Args:
        logits: float [V] teacher logits of the last position. gen: GenerationConfig. pos: the index of the token
            to draw in the sequence (= tokens before it, prompt included).
    Returns:
        token id (int).
    """
    if gen.temperature == 0:
        return int(np.argmax(logits))
    p = warp_probs(np.asarray(logits)[None], gen.temperature, gen.top_p, gen.top_k)
    return int(keyed_draw(p, gen.seed, [pos])[0])


def token_logprobs(logits, tokens, top_n: int) -> list:
    """Log-probabilities of ``tokens`` under the teacher: log-softmax of each raw logits row (before temperature,
    top-k and top-p, as vLLM's default ``raw_logprobs``), in float64 from the float32 logits, with the ``top_n``
    most likely tokens of the row (value descending, then id ascending).

    Args:
        logits: float [k, V], row j the teacher's logits for the position of ``tokens[j]``. tokens: int [k].
        top_n: int >= 0.
    Returns:
        list of k tuples (token id, logprob, [(id, logprob)] * top_n), plain Python ints and floats.
    """
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    lp = x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))
    out = []
    for row, t in zip(lp, np.asarray(tokens).reshape(-1)):
        top = []
        if top_n > 0:
            n = min(top_n, row.size)
            cand = np.flatnonzero(row >= np.partition(row, row.size - n)[row.size - n])   # ties at the edge too
            order = sorted(cand.tolist(), key=lambda i: (-row[i], i))[:n]
            top = [(int(i), float(row[i])) for i in order]
        out.append((int(t), float(row[int(t)]), top))
    return out


def accept_coupled(tt: TreeTensors, probs, seed: int, first_pos: int) -> VerifyResult:
    """Seeded sampling acceptance by coupling: accept a draft token exactly when it equals the teacher's own keyed
    draw at that position.

    Node i's teacher sample is ``keyed_draw(probs[i], seed, first_pos + depth_i)`` (the token after node i); the
    accepted path is the longest root path whose drafts equal their parents' samples, and the bonus is the sample
    after its last node, so the emitted tokens are exactly those teacher-only sampling with the same seed emits
    (:func:`sample_token` at the same positions), whatever the tree. Each emitted token is distributed exactly as
    the teacher's (warped) distribution, since its position's keyed noise is used once on the path actually taken
    (nodes at one depth share their noise, and only one of them is on the path). With a
    deterministic draft (q = 1) a node's children are accepted with total probability sum_c p(c), the same as
    multi-candidate rejection sampling (:func:`accept_sampling`), so coupling costs no accepted length
    (tests/core/test_accept.py measures both).
    The walk draws only at the nodes of the accepted path (the draw at a node decides which of its children, if
    any, is accepted; siblings carry distinct tokens), so a step costs L_k draws whatever the tree's size; it
    equals ``accept_greedy`` over every node's draw (tests/core/test_accept.py).
    Args:
        tt: TreeTensors for budget M. probs: float [M, V] warped teacher distributions (pad rows ignored), or a
            callable ``i -> float [V]`` giving node i's row (computed only for the nodes the walk reaches).
        seed: the sequence's seed. first_pos: position of the token after the root (committed length + 1).
    Returns:
        VerifyResult with accept_len = accepted drafts + 1.
    Raises:
        ValueError: probs has the wrong shape or invalid rows, or a draft token is >= V.
    """
    n = tt.n_nodes
    if callable(probs):
        row = probs
    else:
        p = _check_probs(tt, probs)
        row = p.__getitem__
    parent, tokens = tt.parent[:n], tt.tokens[:n]
    node, path = 0, [0]
    while True:                  # draws along the accepted path only: L_k draws, not one per node
        p_node = np.asarray(row(node), np.float64)
        if not np.isfinite(p_node).all() or (p_node < 0).any() or p_node.sum() <= 0:
            raise ValueError(f"probs row {node} must be finite, >= 0, with positive sum")
        if node == 0 and (tokens[1:] >= p_node.size).any():
            raise ValueError(f"draft tokens must be in [0, V={p_node.size}), got max {tokens[1:].max()}")
        draw = int(keyed_draw(p_node, seed, first_pos + int(tt.depth[node])))
        kids = np.flatnonzero((parent[1:] == node) & (tokens[1:] == draw)) + 1   # siblings are distinct tokens
        if kids.size == 0:
            return _result(tt, path, draw)
        node = int(kids[0])
        path.append(node)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sample(residual: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from an unnormalised non-negative vector by inverse CDF; never a zero-mass index."""
    cdf = np.cumsum(residual)
    idx = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return idx if idx < residual.size else int(np.flatnonzero(residual)[-1])


def _check_probs(tt: TreeTensors, probs) -> np.ndarray:
    M, n = tt.budget, tt.n_nodes
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != M or p.shape[1] < 1:
        raise ValueError(f"probs must have shape [M={M}, V], got {p.shape}")
    rows = p[:n]
    if not np.isfinite(rows).all() or (rows < 0).any() or (rows.sum(axis=1) <= 0).any():
        raise ValueError("probs rows of real nodes must be finite, >= 0, with positive sum")
    if (tt.tokens[1:n] >= p.shape[1]).any():
        raise ValueError(f"draft tokens must be in [0, V={p.shape[1]}), got max {tt.tokens[1:n].max()}")
    return p


def accept_sampling(tt: TreeTensors, probs, rng: np.random.Generator) -> VerifyResult:
    """Exact multi-candidate rejection sampling with a deterministic draft (q = 1), SpecInfer-style: the reference
    law :func:`accept_coupled` (what the decode round runs) is tested against; it needs a random stream whose
    consumption depends on the tree, so its text is not reproducible across paths.

    Walk from the root. At the current node take its teacher distribution p (probs row, renormalised) as the
    residual r. Try the node's children in node-index order (siblings carry distinct tokens): accept child x with
    probability r(x) / sum(r); on rejection set r(x) = 0 and continue. If a child is accepted, move to it;
    if every child is rejected, or the node is a leaf, draw the bonus from r / sum(r). Each emitted token is thus
    distributed exactly as p (E ``utils.py evaluate_posterior`` sampling branch; SG
    ``tree_speculative_sampling_target_only``; docs/design.md, "Verification and acceptance"). E tries siblings in
    lexicographic retrieve order, which is node-index order.
    Args:
        tt: TreeTensors for budget M.
        probs: float [M, V] teacher distributions after warping (``warp_probs``); rows of real nodes must be
            non-negative with positive sum (they are renormalised); pad rows are ignored.
        rng: numpy Generator; draws one uniform per tried child plus one for the bonus.
    Returns:
        VerifyResult; path = root plus accepted drafts, tokens = their tokens then the bonus.
    Raises:
        ValueError: probs has the wrong shape or invalid rows, or a draft token is >= V.
    """
    p = _check_probs(tt, probs)
    n = tt.n_nodes
    node, path = 0, [0]
    while True:
        residual = p[node].copy()
        kids = np.flatnonzero(tt.parent[1:n] == node) + 1
        for kid in kids:
            x = tt.tokens[kid]
            if rng.random() * residual.sum() < residual[x]:
                break
            residual[x] = 0.0
        else:
            return _result(tt, path, _sample(residual, rng))
        node = int(kid)
        path.append(node)
