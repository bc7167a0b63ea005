"""Speculation policy: each step, plain decoding or a draft tree of one of the compiled budgets, by expected profit.

Pure numpy; never runs a model and never imports MindSpore. The cost table is core/costs.py, the acceptance model
core/calibration.py, the batched step-kind gate core/gate.py. The decode round (serving/round.py) asks the policy three questions per step:

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

from dataclasses import dataclass

import numpy as np

from mindspore_eagle.core.calibration import AcceptanceModel, node_values, observe_tree, select
from mindspore_eagle.core.costs import CostTable
from mindspore_eagle.core.tree import DraftTree

CHILD_DEPTHS = 4
PLAIN_EVERY = 64     # AdaptivePolicy.plain_every under a running cost table (its docstring: why, what it costs)


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

    def want_draft(self, max_m: int, fallback: DraftTree | None = None, left: int = 1 << 30) -> bool:
        return max_m >= self.M

    def want_expand(self, tree: DraftTree, frontier_scores, depth: int, max_m: int, left: int) -> bool:
        return True

    def choose(self, tree: DraftTree, max_m: int, left: int) -> Choice:
        if max_m < self.M:                        # no room for the budget: decode plainly
            return Choice(1, 1.0, 0.0)
        predicted = float(node_values(tree, self.model).sum()) if tree.scores is not None else 0.0
        return Choice(self.M, predicted, 0.0)

    def select(self, tree: DraftTree, m: int) -> DraftTree:
        """The root and the ``m - 1`` nodes a step of budget m verifies (``calibration.select``)."""
        return select(tree, m, self.model)

    def after_draft(self, chosen: Choice) -> None:
        pass

    def observe(self, tree: DraftTree | None, accepted_path, tokens: int, cost_ms: float) -> None:
        if tree is not None and len(tree) > 1 and tree.scores is not None:
            observe_tree(self.model, tree, accepted_path)

    def report(self) -> dict:
        return {"policy": self.name, "calibration": self.model.to_dict()}


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
        plain_every: a plain step (no drafting) at least every this many steps, so a cost table kept current from
            the steps taken (core.costs.RunningCosts) keeps observing a decode; 0: never forced (a table measured
            up front). Where trees always look cheaper, a decode is otherwise never taken, so never measured, and
            an estimate that came out too dear stays so (docs/design.md, "Measurements behind the design: A
            decode held dearer than a verification"). Each probe costs at most one step's speculative gain (~1/4
            of a step at 1.3x, so ~0.4 % of the time at 64).
    Raises:
        ValueError: a budget has no verification cost in ``costs``, or ``plain_every`` is 1 or negative.
    """

    name = "adaptive"

    def __init__(self, costs: CostTable, budgets, model: AcceptanceModel | None = None, rho_ema: float = 0.05,
                 probe_every: int = 8, explore: int = 64, plain_every: int = 0):
        self.costs, self.budgets = costs, sorted(int(m) for m in budgets)
        missing = [m for m in self.budgets if m not in costs.verify_ms]
        if missing:
            raise ValueError(f"CostTable has no verify cost for budgets {missing}")
        if plain_every < 0 or plain_every == 1:
            raise ValueError(f"AdaptivePolicy.plain_every = {plain_every} must be 0 (off) or >= 2 steps")
        self.plain_every = int(plain_every)
        self.since_plain = 0                       # steps since the last plain one
        self.plain_probes = 0
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

    @property
    def plain_due(self) -> bool:
        """This step is a plain probe (``plain_every`` steps without a plain one): no drafting, budget 1."""
        return self.plain_every > 0 and self.since_plain >= self.plain_every - 1

    # ---------------------------------------------------------------------- the three questions
    def want_draft(self, max_m: int, fallback: DraftTree | None = None, left: int = 1 << 30) -> bool:
        """Run the drafter this step? ``max_m``: the largest budget the cache has room for (< 2: no tree fits);
        ``fallback``: the tree the step can verify without the drafter (suffix candidates, core/suffix.py), whose
        own advantage over plain decoding is subtracted from what drafting is expected to add (so a long, well
        calibrated copy skips the drafter); ``left``: tokens still to generate.

        Value of information: after the context pass the policy can still decode plainly, so drafting is worth its
        cost when the expected advantage it enables, E[max(profit of the best tree - profit of plain decoding, 0)]
        (an EMA over the steps that drafted), exceeds rho * draft_ctx_ms. The teacher's own confidence in the root
        token did not predict acceptance on 3,672 replayed positions (docs/design.md, "Measurements behind the
        design: What the drafter's confidence is worth"), so there is no per-step feature here; a drafter that
        stops paying is probed every ``probe_every`` steps. False on a plain probe (``plain_due``)."""
        if max_m < 2 or self.plain_due:
            return False
        have = 0.0
        if fallback is not None and len(fallback) > 1:
            have = max(0.0, self.choose(fallback, max_m, left).profit - (1.0 - self.rho * self.costs.decode_ms))
        if self.drafted < self.explore or self.gain - have > self.rho * self.costs.draft_ctx_ms:
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
        tokens still to generate (caps the accepted length). Budget 1 on a plain probe (``plain_due``)."""
        best = Choice(1, 1.0, 1.0 - self.rho * self.costs.decode_ms)
        if self.plain_due:
            return best
        ranked = self._ranked(tree)
        for m in self.budgets:
            if m > max_m:
                break
            p = self._profit(ranked, m, left)
            if p > best.profit + 1e-12:
                best = Choice(m, p + self.rho * self.costs.step_ms(m), p)
        return best

    # ---------------------------------------------------------------------- bookkeeping
    def select(self, tree: DraftTree, m: int) -> DraftTree:
        """The root and the ``m - 1`` nodes that ``choose`` valued (:meth:`_ranked`'s order)."""
        return select(tree, m, self.model)

    def _ranked(self, tree: DraftTree) -> np.ndarray:
        """Calibrated node values in the order :meth:`select` keeps them: by score for a drafter's tree (its
        cumulative log-probs), by value for a tree with suffix nodes (core/suffix.py), whose frequency scores
        are not on the drafter's scale."""
        if len(tree) < 2:
            return np.zeros(0)
        values = node_values(tree, self.model)
        rank = tree.scores if tree.source is None else values
        order = np.lexsort((np.arange(len(tree) - 1), -rank[1:])) + 1
        return values[order]

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
        if tree is None or len(tree) < 2:
            self.plain_probes += self.plain_due
            self.since_plain = 0
        else:
            self.since_plain += 1
            has_child = observe_tree(self.model, tree, accepted_path)
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
                "plain_probes": self.plain_probes,
                "child_rate": [self.child_rate(d) for d in range(1, CHILD_DEPTHS + 1)],
                "calibration": self.model.to_dict()}

def allot_rows(values: list, step_ms, max_rows: int, max_per_seq: int) -> np.ndarray:
    """The batch analogue of :meth:`AdaptivePolicy.choose`: how many draft nodes of each sequence one batched
    verification holds, for the most expected tokens per ms of the whole step.

    Sequence i verifies its root plus its ``counts[i]`` best nodes (budget 1 + counts[i]; 0 = its pending token
    alone, as a plain step). Expected tokens of the step = n + the sum of the kept nodes' values (``E[L] = 1 +
    sum_v P(v accepted)`` per sequence: module docstring); its cost ``step_ms(n + sum(counts))``. The kept nodes are
    a prefix of all sequences' values in descending order (ties: lower sequence, then lower position): the prefix
    with the highest (expected tokens) / ms, the shortest on a tie. A node is worth its row only where its value
    exceeds the row's marginal cost times the rate the step already earns: on a 2-core CPU one more row of a 16-row
    forward costs ~2-3 ms against ~3 ms a token (docs/performance.md, "Continuous batching"), so only nodes likely
    to be accepted are verified under load, while one sequence alone takes most of its tree.

    Args:
        values: n float arrays; values[i] = calibrated P(accepted) of sequence i's drafted nodes (root excluded),
            each node's value at most its parent's (``core.calibration.node_values``), any order; empty = nothing
            drafted.
        step_ms: callable(int array of row counts) -> predicted ms of a forward of that many rows (e.g.
            ``core.costs.RowCosts.ms``).
        max_rows: the most rows the forward may hold (>= n). max_per_seq: the most rows of one sequence (>= 1).
    Returns:
        counts int64 [n].
    Raises:
        ValueError: max_rows < n or max_per_seq < 1.
    """
    n = len(values)
    if max_rows < n or max_per_seq < 1:
        raise ValueError(f"allot_rows: need max_rows >= {n} sequences and max_per_seq >= 1, got {max_rows}, "
                         f"{max_per_seq}")
    counts = np.zeros(n, np.int64)
    per = [np.sort(np.asarray(v, np.float64))[::-1][: max_per_seq - 1] for v in values]
    vals = np.concatenate([p for p in per] + [np.zeros(0)])
    if vals.size == 0 or max_rows == n:
        return counts
    seq = np.concatenate([np.full(len(p), i, np.int64) for i, p in enumerate(per)])
    pos = np.concatenate([np.arange(len(p)) for p in per])
    order = np.lexsort((pos, seq, -vals))[: max_rows - n]
    gain = n + np.concatenate([[0.0], np.cumsum(vals[order])])
    rate = gain / np.maximum(np.asarray(step_ms(n + np.arange(order.size + 1)), np.float64), 1e-9)
    best = int(np.argmax(rate))                      # first maximum: the fewest rows on a tie
    np.add.at(counts, seq[order[:best]], 1)
    return counts

