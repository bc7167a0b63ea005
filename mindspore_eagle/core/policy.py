"""Speculation policy: each step, plain decoding or a draft tree of one of the compiled budgets, by expected profit.

Pure numpy; never runs a model and never imports MindSpore. The decode round (serving/round.py) asks the policy three questions per step:

    1. ``want_draft()``          run the drafter at all? (before the drafter's context pass)
    2. ``want_expand(cands)``    after the context pass and each expansion: one more depth of the tree?
    3. ``choose(tree)``          verify the best ``m - 1`` drafted nodes with budget m, or decode plainly (m = 1)?
and after verification tells it what was accepted (``observe``), which calibrates the acceptance model online.

Legend: M = tree budget ceiling (``speculative.M``), m = budget of one step (1 = plain decode, else one of the
compiled budgets 2, 4, ..., M), D = D_max, K = top_k, L = accepted length of a step (accepted drafts + bonus).

Decision rule (renewal-reward / Dinkelbach): the long-run rate tokens / ms is maximised by choosing, every step, the
action with the largest expected *profit* ``E[L] - rho * cost_ms``, where rho is the rate being earned (tokens per
ms; here an EMA of the predicted rate of the steps taken, never below plain decoding's 1 / decode_ms). Plain
decoding earns ``1 - rho * decode_ms``; a tree of budget m earns ``E[L_m] - rho * (verify_ms[m] + host_ms)``;
one more expansion costs ``rho * draft_step_ms``; running the drafter at all costs ``rho * draft_ctx_ms``.

Expected accepted length (EAGLE-2, Li et al. 2024, §3: the drafter's confidence approximates acceptance): with
greedy verification every accepted node lies on one root path, so ``E[L] = 1 + sum_v P(v accepted)`` over the
drafted nodes v in the tree. ``P(v accepted)`` is the drafter's path probability ``exp(score_v)`` mapped through a
calibration table per depth and probability bin, learned online from what verification accepts (it starts as the
identity). The value of a node is capped by its parent's (a child cannot be accepted without its parent) and E[L]
by the tokens still to generate.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np

from mindspore_eagle.core.tree import DraftTree

PROB_EDGES = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0 + 1e-6])
CHILD_DEPTHS = 4


def compiled_budgets(M: int) -> list[int]:
    """Verification budgets the adaptive policy may use under the ceiling M: 2, 4, 8, ... below M, then M.

    Raises:
        ValueError: M < 2.
    """
    if M < 2:
        raise ValueError(f"speculative.M = {M} must be >= 2 to speculate")
    out, m = [], 2
    while m < M:
        out.append(m)
        m *= 2
    return out + [M]


@dataclass
class CostTable:
    """Measured wall cost of each call a step can make, in ms, on this machine and process (Engine.measure_costs).

    Fields:
        decode_ms: one teacher decode (k = 1 query row), plus the plain step's host work.
        verify_ms: {m: ms} one teacher verification of an m-token tree, for each compiled budget m.
        draft_ctx_ms: the drafter's context pass over one new (feature, token) pair.
        draft_step_ms: one drafter expansion step (K rows).
        host_ms: a speculative step's host work (tensorize, mask, accept, commit), added to verify_ms[m].
    """

    decode_ms: float
    verify_ms: dict
    draft_ctx_ms: float
    draft_step_ms: float
    host_ms: float = 0.0

    def __post_init__(self):
        self.verify_ms = {int(m): float(v) for m, v in self.verify_ms.items()}
        for name in ("decode_ms", "draft_ctx_ms", "draft_step_ms", "host_ms"):
            if not np.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"CostTable.{name} = {getattr(self, name)} must be a finite number >= 0 (ms)")
        if self.decode_ms <= 0 or not self.verify_ms or min(self.verify_ms.values()) <= 0:
            raise ValueError("CostTable needs decode_ms > 0 and verify_ms > 0 for at least one budget")

    def step_ms(self, m: int) -> float:
        """Cost of the verification part of a step of budget m (m = 1: a plain decode)."""
        return self.decode_ms if m == 1 else self.verify_ms[m] + self.host_ms

    def to_dict(self) -> dict:
        return {"decode_ms": self.decode_ms, "verify_ms": {str(m): v for m, v in sorted(self.verify_ms.items())},
                "draft_ctx_ms": self.draft_ctx_ms, "draft_step_ms": self.draft_step_ms, "host_ms": self.host_ms}

    def save(self, path: str) -> None:
        """Write the table as JSON to ``path`` atomically (temporary file, then rename); an unwritable path is
        skipped (the table is only a cache)."""
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f)
            os.replace(tmp, path)
        except OSError:
            pass

    @classmethod
    def load(cls, path: str, max_age_s: float, budgets=()) -> "CostTable | None":
        """The table saved at ``path`` if it is younger than ``max_age_s`` seconds, readable, and has a cost for
        every budget in ``budgets``; else None (measure again)."""
        try:
            if time.time() - os.path.getmtime(path) > max_age_s:
                return None
            with open(path, encoding="utf-8") as f:
                table = cls(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None
        return table if set(budgets) <= set(table.verify_ms) else None

    def describe(self) -> str:
        """One line per call, ms and multiple of a decode."""
        d = self.decode_ms
        rows = [f"decode           {d:7.1f} ms  1.00x"]
        rows += [f"verify m={m:<3d}     {v:7.1f} ms  {v / d:.2f}x" for m, v in sorted(self.verify_ms.items())]
        rows += [f"drafter context  {self.draft_ctx_ms:7.1f} ms  {self.draft_ctx_ms / d:.2f}x",
                 f"drafter step     {self.draft_step_ms:7.1f} ms  {self.draft_step_ms / d:.2f}x",
                 f"step host work   {self.host_ms:7.1f} ms  {self.host_ms / d:.2f}x"]
        return "\n".join(rows)


class AcceptanceModel:
    """P(draft node accepted | its depth, whether it is its parent's likeliest child, its drafter path
    probability), calibrated online.

    Bins: depth groups 1, 2, >= 3 x {likeliest child, other child} x the probability bins ``PROB_EDGES``. The rank
    matters: on 3,672 replayed positions the embedded drafter's likeliest depth-1 child at path probability
    0.1-0.2 was accepted 27 % of the time, while a less likely sibling of the same probability is accepted far less
    (docs/results.md, "2026-11-30, evening"). Each bin keeps decayed counts of verified nodes and of accepted ones; the
    estimate is ``(hits + w * prior) / (n + w)`` with the prior = the bin's mean drafter probability (identity
    calibration) and weight w = ``prior_weight``. Counts decay by ``decay`` per observed step, so the table
    follows a drafter whose reliability drifts (half-life ln 2 / (1 - decay) steps).
    """

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.999, depth_groups: int = 3):
        self.w, self.decay, self.G = float(prior_weight), float(decay), int(depth_groups)
        shape = (self.G, 2, len(PROB_EDGES) - 1)
        self.n, self.hits, self.psum = np.zeros(shape), np.zeros(shape), np.zeros(shape)

    def _index(self, scores, depth, best):
        prob = np.exp(np.minimum(np.asarray(scores, np.float64), 0.0))
        g = np.clip(np.asarray(depth, np.int64), 1, self.G) - 1
        r = 1 - np.asarray(best, np.int64)
        b = np.clip(np.searchsorted(PROB_EDGES, prob, side="right") - 1, 0, len(PROB_EDGES) - 2)
        return (g, r, b), prob

    def table(self) -> np.ndarray:
        """float64 [G, 2, bins]: calibrated acceptance probability per (depth group, likeliest/other, prob bin)."""
        centers = (PROB_EDGES[:-1] + np.minimum(PROB_EDGES[1:], 1.0)) / 2
        prior = np.where(self.n > 0, self.psum / np.maximum(self.n, 1e-12), centers)
        return (self.hits + self.w * prior) / (self.n + self.w)

    def predict(self, scores, depth, best) -> np.ndarray:
        """Calibrated acceptance probability float64 [n] of nodes with cumulative log-prob ``scores`` [n] at
        ``depth`` [n] (>= 1); ``best`` bool [n]: the node is its parent's likeliest child."""
        idx, _ = self._index(scores, depth, best)
        return self.table()[idx]

    def observe(self, scores, depth, best, accepted) -> None:
        """Add one step's verified drafted nodes (arrays as ``predict``, plus ``accepted`` bool [n])."""
        for a in (self.n, self.hits, self.psum):
            a *= self.decay
        idx, prob = self._index(scores, depth, best)
        np.add.at(self.n, idx, 1.0)
        np.add.at(self.hits, idx, np.asarray(accepted, np.float64))
        np.add.at(self.psum, idx, prob)

    def to_dict(self) -> dict:
        """Calibration table for reports: per (depth group, likeliest/other child, probability bin) the observed
        nodes, their mean drafter probability, the observed acceptance rate and the model's estimate."""
        est = self.table()
        rows = []
        for g, r, b in zip(*np.nonzero(self.n >= 0.5)):
            rows.append({"depth": int(g) + 1 if g + 1 < self.G else f">={self.G}",
                         "child": "likeliest" if r == 0 else "other",
                         "prob_lo": float(PROB_EDGES[b]), "prob_hi": float(min(PROB_EDGES[b + 1], 1.0)),
                         "nodes": float(self.n[g, r, b]), "drafter_prob": float(self.psum[g, r, b] / self.n[g, r, b]),
                         "accepted": float(self.hits[g, r, b] / self.n[g, r, b]), "estimate": float(est[g, r, b])})
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
    children are scaled down to sum to at most the node's own value. Requires parents before children (DraftTree
    from drafting.select_tree); ``tree.scores`` are cumulative log-probs.
    """
    n = len(tree)
    depth, _ = _tree_depth(tree)
    val = np.ones(n)
    if n > 1:
        val[1:] = model.predict(tree.scores[1:], depth[1:], likeliest_child(tree)[1:])
        kids: dict = {}
        for i in range(1, n):
            kids.setdefault(int(tree.parents[i]), []).append(i)
        for i in range(n):                                    # parents first: each cap uses the capped parent
            if i in kids:
                ks = kids[i]
                total = val[ks].sum()
                if total > val[i]:
                    val[ks] *= val[i] / total
    return val


def top_nodes(tree: DraftTree, m: int) -> DraftTree:
    """The root plus the best ``m - 1`` drafted nodes by score (ties: lower index first), parents relinked.

    A child's cumulative score never exceeds its parent's and ties favour the lower index (the parent), so the kept
    set is closed under parents (docs/design.md, "Tree expansion"). Returns ``tree`` itself when it has <= m nodes.
    """
    n = len(tree)
    if n <= m:
        return tree
    order = np.lexsort((np.arange(n - 1), -tree.scores[1:]))[: m - 1] + 1
    keep = np.concatenate([[0], np.sort(order)])
    new_index = np.full(n, -1, np.int64)
    new_index[keep] = np.arange(keep.size)
    parents = new_index[tree.parents[keep]]
    parents[0] = 0
    if (parents < 0).any():
        raise AssertionError("top_nodes kept a node without its parent")
    return DraftTree(tree.tokens[keep], parents, tree.scores[keep])


@dataclass
class Choice:
    """The policy's decision for one step: budget m (1 = plain decode), predicted accepted length, expected profit
    (predicted L minus rho times the verification's cost)."""
    m: int
    predicted_len: float
    profit: float


class FixedPolicy:
    """Today's behaviour: every step drafts the full tree (D - 1 expansions) and verifies budget M; plain decoding
    only where the cache has no room for M more tokens. Keeps an AcceptanceModel only to report calibration.

    Args:
        M: tree budget; D: max draft depth.
    """

    name = "fixed"

    def __init__(self, M: int, D: int, model: AcceptanceModel | None = None):
        self.M, self.D = int(M), int(D)
        self.model = model or AcceptanceModel()
        self.budgets = [self.M]
        self.costs = None

    def want_draft(self, max_m: int) -> bool:
        return max_m >= self.M

    def want_expand(self, tree: DraftTree, frontier_scores, depth: int, max_m: int, left: int) -> bool:
        return True

    def choose(self, tree: DraftTree, max_m: int, left: int) -> Choice:
        predicted = float(node_values(tree, self.model).sum()) if tree.scores is not None else 0.0
        return Choice(self.M, predicted, 0.0)

    def after_draft(self, chosen: Choice) -> None:
        pass

    def observe(self, tree: DraftTree | None, accepted_path, tokens: int, cost_ms: float) -> None:
        if tree is not None and len(tree) > 1 and tree.scores is not None:
            _observe_tree(self.model, tree, accepted_path)

    def report(self) -> dict:
        return {"policy": self.name, "calibration": self.model.to_dict()}


def _tree_depth(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """(depth int64 [n], has_child bool [n]) of a DraftTree whose parents precede children."""
    n = len(tree)
    depth = np.zeros(n, np.int64)
    has_child = np.zeros(n, bool)
    for i in range(1, n):
        depth[i] = depth[tree.parents[i]] + 1
        has_child[tree.parents[i]] = True
    return depth, has_child


def _observe_tree(model: AcceptanceModel, tree: DraftTree, accepted_path) -> np.ndarray:
    """Feed a verified tree's drafted nodes to ``model``; returns has_child bool [n]."""
    depth, has_child = _tree_depth(tree)
    acc = np.zeros(len(tree), bool)
    acc[np.asarray(accepted_path, np.int64)] = True
    model.observe(tree.scores[1:], depth[1:], likeliest_child(tree)[1:], acc[1:])
    return has_child


class RateGate:
    """Picks, step by step, the faster of two step kinds by measured tokens per millisecond (continuous batching,
    the decode round with N > 1 rows in serving/round.py: a batched tree verification of N x M rows against a
    batched decode of N rows).

    Each kind's rate is an exponential moving average (weight ``alpha``) of tokens / ms over its steps. The first
    ``warm`` steps of each kind are taken in turn; then the faster kind runs and the other is probed once every
    ``probe_every`` steps, so a change in the batch (size, context lengths, what the drafter gets right) moves the
    choice. The batch analogue of ``AdaptivePolicy``'s speculate-or-not gate: where verification stops being cheap
    as the batch grows, speculation steps aside (TensorRT-LLM turns speculation off past a batch size; here it is
    measured, not configured).

    Args:
        kinds: the two step kinds (first = preferred on a tie). alpha in (0, 1]. probe_every >= 2. warm >= 1.
    Raises:
        ValueError: a parameter out of range (names it).
    """

    def __init__(self, kinds=("tree", "plain"), alpha: float = 0.3, probe_every: int = 16, warm: int = 2):
        if len(kinds) != 2 or not 0 < alpha <= 1 or probe_every < 2 or warm < 1:
            raise ValueError(f"RateGate: need 2 kinds, alpha in (0, 1], probe_every >= 2, warm >= 1; got {kinds}, "
                             f"{alpha}, {probe_every}, {warm}")
        self.kinds, self.alpha, self.probe_every, self.warm = tuple(kinds), alpha, probe_every, warm
        self.rate = {k: None for k in self.kinds}
        self.count = {k: 0 for k in self.kinds}
        self.steps = 0

    def best(self) -> str:
        """The kind with the higher rate so far (the first kind while either is unmeasured or on a tie)."""
        a, b = self.kinds
        ra, rb = self.rate[a], self.rate[b]
        return b if ra is not None and rb is not None and rb > ra else a

    def choose(self) -> str:
        """The kind of the next step."""
        for k in self.kinds:
            if self.count[k] < self.warm:
                return k
        best = self.best()
        if self.steps % self.probe_every == self.probe_every - 1:
            return self.kinds[1] if best == self.kinds[0] else self.kinds[0]
        return best

    def observe(self, kind: str, tokens: int, ms: float) -> None:
        """Record a step of ``kind`` that emitted ``tokens`` tokens in ``ms`` milliseconds."""
        r = tokens / max(ms, 1e-6)
        old = self.rate[kind]
        self.rate[kind] = r if old is None else (1 - self.alpha) * old + self.alpha * r
        self.count[kind] += 1
        self.steps += 1

    def report(self) -> dict:
        """Rates (tokens / ms) and step counts per kind."""
        return {"rate_tok_per_ms": dict(self.rate), "steps": dict(self.count)}


class AdaptivePolicy:
    """Chooses, every step, plain decoding or a tree budget by expected profit (module docstring).

    Args:
        costs: CostTable measured on this machine (Engine.measure_costs).
        budgets: compiled verification budgets (``compiled_budgets(M)``), ascending.
        model: AcceptanceModel (kept across turns: the calibration carries over).
        rho_ema: EMA weight of the earned-rate estimate rho, per step.
        probe_every: while the drafter does not pay for its context pass (``want_draft``), it still runs every
            this many steps, so drafts that became useful (code, lists, repeated text) are noticed.
        explore: the drafter runs on the first this many steps regardless, so the calibration has data before the
            gate may close (the identity prior underrates an under-confident drafter such as the embedded one).
    Raises:
        ValueError: a budget has no verification cost in ``costs``.
    """

    name = "adaptive"

    def __init__(self, costs: CostTable, budgets, model: AcceptanceModel | None = None, rho_ema: float = 0.05,
                 probe_every: int = 8, explore: int = 64):
        self.costs, self.budgets = costs, sorted(int(m) for m in budgets)
        missing = [m for m in self.budgets if m not in costs.verify_ms]
        if missing:
            raise ValueError(f"CostTable has no verify cost for budgets {missing}")
        self.model = model or AcceptanceModel()
        self.rho_ema, self.probe_every, self.explore = float(rho_ema), int(probe_every), int(explore)
        self.drafted = 0
        self.rho = self.plain_rate
        self.gain = np.inf                         # EMA of the drafter's predicted advantage (tokens per step)
        self.skips = 0
        self.reach = np.zeros(CHILD_DEPTHS)        # decayed count: accepted path reached depth d with children
        self.cont = np.zeros(CHILD_DEPTHS)         # ... and went on to depth d + 1

    @property
    def plain_rate(self) -> float:
        """Tokens per ms of plain decoding."""
        return 1.0 / self.costs.decode_ms

    def child_rate(self, depth: int) -> float:
        """P(the accepted path goes past a node at ``depth`` | it reached it), observed (prior 0.4, weight 4)."""
        d = min(depth, CHILD_DEPTHS) - 1
        return float((self.cont[d] + 4 * 0.4) / (self.reach[d] + 4))

    # ---------------------------------------------------------------------- the three questions
    def want_draft(self, max_m: int) -> bool:
        """Run the drafter this step? ``max_m``: the largest budget the cache has room for (< 2: no tree fits).

        Value of information: after the context pass the policy can still decode plainly, so drafting is worth its
        cost when the expected advantage it enables, E[max(profit of the best tree - profit of plain decoding, 0)]
        (an EMA over the steps that drafted), exceeds rho * draft_ctx_ms. The teacher's own confidence in the root
        token did not predict acceptance on 3,672 replayed positions (docs/results.md, "2026-11-30, evening"), so there is no
        per-step feature here; a drafter that stops paying is probed every ``probe_every`` steps."""
        if max_m < 2:
            return False
        if self.drafted < self.explore or self.gain > self.rho * self.costs.draft_ctx_ms:
            return True
        self.skips += 1
        return self.skips % self.probe_every == 0

    def want_expand(self, tree: DraftTree, frontier_scores, depth: int, max_m: int, left: int) -> bool:
        """One more drafter expansion? ``tree``: the nodes drafted so far; ``frontier_scores``: cumulative
        log-probs of the K nodes at ``depth`` that would be expanded. Each frontier node's best child is valued
        at the node's calibrated value times ``child_rate(depth)``; expand when the best budget with those
        children, less the expansion's cost, beats the best budget without them."""
        if depth + 1 >= left:
            return False
        now = self.choose(tree, max_m, left)
        k = len(frontier_scores)
        par = self.model.predict(frontier_scores, np.full(k, depth), np.arange(k) == 0)
        ranked = np.sort(np.concatenate([self._ranked(tree), par * self.child_rate(depth)]))[::-1]
        gain = max([self._profit(ranked, m, left) for m in self.budgets if m <= max_m], default=-np.inf)
        return gain - self.rho * self.costs.draft_step_ms > now.profit

    def choose(self, tree: DraftTree, max_m: int, left: int) -> Choice:
        """Budget m for this step's verification (1 = decode plainly) given the drafted ``tree``; ``left``:
        tokens still to generate (caps the accepted length)."""
        ranked = self._ranked(tree)
        best = Choice(1, 1.0, 1.0 - self.rho * self.costs.decode_ms)
        for m in self.budgets:
            if m > max_m:
                break
            p = self._profit(ranked, m, left)
            if p > best.profit + 1e-12:
                best = Choice(m, p + self.rho * self.costs.step_ms(m), p)
        return best

    # ---------------------------------------------------------------------- bookkeeping
    def _ranked(self, tree: DraftTree) -> np.ndarray:
        """Calibrated node values in score order (the order top_nodes keeps them)."""
        if len(tree) < 2:
            return np.zeros(0)
        order = np.lexsort((np.arange(len(tree) - 1), -tree.scores[1:])) + 1
        return node_values(tree, self.model)[order]

    def _profit(self, ranked: np.ndarray, m: int, left: int) -> float:
        L = min(1.0 + float(np.sum(ranked[: m - 1])), float(max(left, 1)))
        return L - self.rho * self.costs.step_ms(m)

    def after_draft(self, chosen: Choice) -> None:
        """Fold the drafter's predicted advantage over plain decoding this step (>= 0) into the gate's EMA (weight
        0.02: a ~50-step memory; on the replay a 10-step memory closed the gate on noise and cost 1.5 % speed)."""
        self.drafted += 1
        adv = chosen.profit - (1.0 - self.rho * self.costs.decode_ms)
        self.gain = adv if not np.isfinite(self.gain) else 0.98 * self.gain + 0.02 * adv

    def observe(self, tree: DraftTree | None, accepted_path, tokens: int, cost_ms: float) -> None:
        """After a step: calibrate on the verified ``tree`` (None for a plain step) and its accepted node indices,
        and fold the step's rate (``tokens`` over its modelled ``cost_ms``) into rho."""
        if tree is not None and len(tree) > 1:
            has_child = _observe_tree(self.model, tree, accepted_path)
            path = np.asarray(accepted_path, np.int64)
            self.reach *= self.model.decay
            self.cont *= self.model.decay
            for j, node in enumerate(path[1:], start=1):       # accepted drafted nodes, depth j
                if has_child[node] and j <= CHILD_DEPTHS:
                    self.reach[j - 1] += 1
                    self.cont[j - 1] += j < len(path) - 1
        rate = tokens / max(cost_ms, 1e-6)
        self.rho = max(self.plain_rate, (1 - self.rho_ema) * self.rho + self.rho_ema * rate)

    def report(self) -> dict:
        """Cost table, earned rate rho and calibration table, for report.json."""
        return {"policy": self.name, "costs": self.costs.to_dict(), "rho_tokens_per_ms": self.rho,
                "child_rate": [self.child_rate(d) for d in range(1, CHILD_DEPTHS + 1)],
                "calibration": self.model.to_dict()}
