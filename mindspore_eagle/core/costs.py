"""CostTable: the wall cost of each call a decode step can make, and the budgets it is kept for.

Pure numpy; never imports MindSpore. The speculation policy (core/policy.py) turns the table into expected tokens per
millisecond. Where the numbers come from: the table stored for this machine and configuration by an earlier run, else
:func:`prior_table` (ratios to a decode measured on the 2-core CPU); from then on :class:`RunningCosts` keeps it
current from the step times the engine records anyway (one running estimate per budget plus a machine-wide speed
factor), and the engine stores it again after every turn, so it is never measured up front and never stale.
``Engine.measure_costs`` still times every call on demand (``mindspore-eagle inspect costs``).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

# verification cost / decode cost by budget m, measured on the 2-core CPU with the 135M teacher (three stored tables,
# 2026-12-02, and README's forward timings: k = 8 rows 1.58x, k = 16 1.86x, k = 32 2.67x a decode, forward only);
# linear in between and beyond
PRIOR_VERIFY_RATIO = ((1, 1.0), (2, 1.08), (4, 1.22), (8, 1.42), (16, 1.6), (32, 2.5))
PRIOR_DRAFT_CTX_RATIO = 0.12     # drafter context pass / decode (measured 0.10 - 0.26)
PRIOR_DRAFT_STEP_RATIO = 0.15    # one drafter expansion / decode (measured 0.11 - 0.33)
PRIOR_DECODE_MS = 50.0           # a decode of the 135M teacher on 2 idle cores (README); rescaled at the first step


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
        measured: {m: ms} the medians behind decode_ms (m = 1) and verify_ms before :func:`cap_verify_costs`
            (``Engine.measure_costs``; empty for a table the policy learned or loaded): what the machine showed,
            where the fields above are what the policy uses.
    """

    decode_ms: float
    verify_ms: dict
    draft_ctx_ms: float
    draft_step_ms: float
    host_ms: float = 0.0
    measured: dict = field(default_factory=dict)

    def __post_init__(self):
        self.verify_ms = {int(m): float(v) for m, v in self.verify_ms.items()}
        self.measured = {int(m): float(v) for m, v in self.measured.items()}
        for name in ("decode_ms", "draft_ctx_ms", "draft_step_ms", "host_ms"):
            if not np.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"CostTable.{name} = {getattr(self, name)} must be a finite number >= 0 (ms)")
        if self.decode_ms <= 0 or not self.verify_ms or min(self.verify_ms.values()) <= 0:
            raise ValueError("CostTable needs decode_ms > 0 and verify_ms > 0 for at least one budget")

    def step_ms(self, m: int) -> float:
        """Cost of the verification part of a step of budget m (m = 1: a plain decode)."""
        return self.decode_ms if m == 1 else self.verify_ms[m] + self.host_ms

    def to_dict(self) -> dict:
        out = {"decode_ms": self.decode_ms, "verify_ms": {str(m): v for m, v in sorted(self.verify_ms.items())},
               "draft_ctx_ms": self.draft_ctx_ms, "draft_step_ms": self.draft_step_ms, "host_ms": self.host_ms}
        if self.measured:
            out["measured"] = {str(m): v for m, v in sorted(self.measured.items())}
        return out

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
    def load(cls, path: str, max_age_s: float | None = None, budgets=()) -> "CostTable | None":
        """The table saved at ``path`` if it is readable, younger than ``max_age_s`` seconds (None: any age) and
        has a cost for every budget in ``budgets``; else None."""
        try:
            if max_age_s is not None and time.time() - os.path.getmtime(path) > max_age_s:
                return None
            with open(path, encoding="utf-8") as f:
                table = cls(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None
        return table if set(budgets) <= set(table.verify_ms) else None

    def with_budgets(self, budgets) -> CostTable:
        """This table with a cost for every budget in ``budgets``: a missing one is interpolated from the prior
        ratios, scaled to the nearest budget the table has (or to its decode)."""
        have = sorted(self.verify_ms)
        verify = dict(self.verify_ms)
        for m in budgets:
            if m not in verify:
                ref = min(have, key=lambda h: abs(h - m)) if have else None
                base = verify[ref] / prior_verify_ratio(ref) if ref else self.decode_ms
                verify[int(m)] = base * prior_verify_ratio(m)
        return CostTable(self.decode_ms, verify, self.draft_ctx_ms, self.draft_step_ms, self.host_ms, self.measured)

    def describe(self) -> str:
        """One line per call, ms and multiple of a decode; beside them, where the table was measured, the median
        each verification showed before the cap (a capped budget's policy cost is lower than what it measured)."""
        d, meas = self.decode_ms, self.measured

        def seen(m):
            if m not in meas or 1 not in meas:
                return ""
            return f"   measured {meas[m]:7.1f} ms  {meas[m] / meas[1]:.2f}x"

        rows = [f"decode           {d:7.1f} ms  1.00x" + seen(1)]
        rows += [f"verify m={m:<3d}     {v:7.1f} ms  {v / d:.2f}x" + seen(m) for m, v in sorted(self.verify_ms.items())]
        rows += [f"drafter context  {self.draft_ctx_ms:7.1f} ms  {self.draft_ctx_ms / d:.2f}x",
                 f"drafter step     {self.draft_step_ms:7.1f} ms  {self.draft_step_ms / d:.2f}x",
                 f"step host work   {self.host_ms:7.1f} ms  {self.host_ms / d:.2f}x"]
        return "\n".join(rows)


def prior_verify_ratio(m: int) -> float:
    """Prior cost of verifying m tokens, in decodes (``PRIOR_VERIFY_RATIO``, linear in between and beyond)."""
    xs, ys = zip(*PRIOR_VERIFY_RATIO)
    if m <= xs[-1]:
        return float(np.interp(m, xs, ys))
    return ys[-1] + (m - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])


def prior_table(budgets, decode_ms: float = PRIOR_DECODE_MS) -> CostTable:
    """The cost table assumed before anything was measured on this machine: the prior ratios times ``decode_ms``
    (only ratios matter to the policy until :class:`RunningCosts` has seen a step)."""
    return CostTable(decode_ms=decode_ms, verify_ms={int(m): decode_ms * prior_verify_ratio(m) for m in budgets},
                     draft_ctx_ms=decode_ms * PRIOR_DRAFT_CTX_RATIO, draft_step_ms=decode_ms * PRIOR_DRAFT_STEP_RATIO)


def cap_verify_costs(verify_ms: dict) -> dict:
    """Verification costs made strictly increasing in the budget: each budget's cost is capped by every larger
    budget's times the prior's ratio of the two (``prior_verify_ratio(m) / prior_verify_ratio(m')`` < 1).

    A cap at equality is absorbing for the policy: a budget held at a larger one's cost is never chosen (the larger
    one offers more nodes for the same cost), so never observed again (:class:`RunningCosts`, docs/design.md,
    "Measurements behind the design: A budget capped at a larger one's cost"). Budget 1 is a plain decode
    (``prior_verify_ratio(1)`` = 1): a decode is held below the smallest verification by the prior's ratio, as
    :class:`RunningCosts` and ``Engine.measure_costs`` pass it.

    Args:
        verify_ms: {budget m: cost in ms} (m >= 1; any units, only ratios are used).
    Returns:
        {m: float capped cost}, the same keys.
    """
    ms_ = sorted(verify_ms, reverse=True)
    capped = {}
    for i, m in enumerate(ms_):
        v = float(verify_ms[m])
        if i == 0:
            capped[m] = v
        else:
            bigger = ms_[i - 1]
            capped[m] = min(v, capped[bigger] * prior_verify_ratio(m) / prior_verify_ratio(bigger))
    return capped


class RunningCosts:
    """Keeps a CostTable current, in place, from the steps a turn runs (the policy holding the table sees it).

    Each observation is one step of budget m (1 = plain decode) and its cost without drafting (``total_ms -
    draft_ms`` of a core.trace.StepTrace: the forward plus the step's host work, which is what ``step_ms(m)``
    models). Per entry (decode, each budget), in log space:

    - an entry observed in this process is a running estimate of its own steps: the n-th observation moves it by
      ``max(rate, 1 / (n + PRIOR_WEIGHT))`` of the residual (clipped to a factor 4 each way): its starting value
      counts as PRIOR_WEIGHT steps, so the first step of a budget, often its slowest (a burst of load), does not
      replace it outright;
    - an entry not observed yet is its starting value (stored table or prior) times the machine's speed factor,
      the count-weighted geometric mean of observed / starting value over the observed entries (other processes,
      frequency: the whole machine is slower or faster than when the table was stored);
    - a verification's cost is capped by every larger budget's times the prior's ratio of the two
      (``prior_verify_ratio(m) / prior_verify_ratio(m')``, < 1): a smaller tree never costs more than a larger one,
      and a budget whose own steps were slow (a burst of load) stays strictly cheaper than the larger ones, so the
      policy keeps choosing it where its nodes suffice and its estimate keeps learning (:func:`cap_verify_costs`).
      A cap at equality was absorbing: a budget held at a larger one's cost is never chosen again, so never
      observed again (in a 240-turn run, stopped at turn 138, m = 2 verified ~310 trees per 20 turns over the
      first 60 turns and 0-13 per 20 turns after turn 80, while on the same machine a 4-row forward costs ~0.9x an
      8-row one: docs/design.md, "Measurements behind the design: A budget capped at a larger one's cost"). The
      ratio assumes verification cost grows with m at least as the prior's curve does; where it is flatter (a fused
      accelerator kernel), the cap makes a small budget look slightly cheaper than it is, never dearer;
    - a decode is capped the same way below the smallest verification (budget 1 in the chain). A decode inferred
      from the speed factor alone can come out dearer than the verifications actually observed (the prior's flat
      verification ratios, 1.08 / 1.6 decodes for m = 2 / 16 where the machine's were 1.2 / 2.8, made the speed
      factor, so the inferred decode, ~35 % too high); the policy then decodes plainly almost never, so decode's
      estimate is almost never observed again (4 plain steps in 240 turns: docs/design.md, "Measurements behind
      the design: A decode held dearer than a verification"). ``AdaptivePolicy(plain_every=...)`` keeps it observed.

    The drafter's two costs are running estimates of their own, by the same rule, from the steps that ran the
    drafter (:meth:`observe_draft`: a step's context pass, and its tree expansion divided by the expansion calls it
    made); until observed they follow the speed factor. They do not enter the speed factor: the drafter's cost can
    change without the teacher's (drafter calls on the host instead of a graph cost ~0.5x: docs/cpu_kernels.md,
    "Host calls"), and a prior that assumed otherwise made the policy draft too little.

    Args:
        table: the CostTable to update (the budgets it holds are the ones tracked). rate: floor of an entry's
            weight per observation (a memory of ~1 / rate steps).
    """

    CLIP = float(np.log(4.0))
    PRIOR_WEIGHT = 2

    def __init__(self, table: CostTable, rate: float = 0.15):
        self.table, self.rate = table, float(rate)
        self.start = {1: table.decode_ms, **{m: v + table.host_ms for m, v in table.verify_ms.items()}}
        self.start_draft = {"ctx": table.draft_ctx_ms, "step": table.draft_step_ms}
        self.log_est: dict = {}
        self.counts: dict = {}
        self.draft_log: dict = {}
        self.draft_counts: dict = {}

    @property
    def observed(self) -> int:
        """Steps observed so far."""
        return sum(self.counts.values())

    def speed(self) -> float:
        """The speed factor: count-weighted geometric mean of estimate / starting value over observed entries
        (each entry's weight capped at 32 steps); 1.0 before any observation."""
        if not self.counts:
            return 1.0
        w = {m: min(n, 32) for m, n in self.counts.items()}
        return float(np.exp(sum(w[m] * (self.log_est[m] - np.log(self.start[m])) for m in w) / sum(w.values())))

    def observe(self, budget: int, cost_ms: float) -> None:
        """Fold one step of budget ``budget`` (1 = plain decode) that cost ``cost_ms`` (no drafting) into the
        table; a budget the table does not hold, or a non-finite or non-positive cost, is ignored."""
        m = int(budget)
        if not (np.isfinite(cost_ms) and cost_ms > 0) or m not in self.start:
            return
        self._fold(self.log_est, self.counts, m, self.start[m] * self.speed(), cost_ms)

    def _fold(self, log_est: dict, counts: dict, key, start: float, cost_ms: float) -> None:
        """One observation of entry ``key`` (starting value ``start``, used when it has no estimate yet; the
        observation itself when ``start`` is not positive) in log space, then the table rewritten."""
        n = counts.get(key, 0) + 1
        now = log_est.get(key, float(np.log(start if start > 0 else cost_ms)))
        r = float(np.clip(np.log(cost_ms) - now, -self.CLIP, self.CLIP))
        log_est[key] = now + max(self.rate, 1.0 / (n + self.PRIOR_WEIGHT)) * r
        counts[key] = n
        self._write()

    def observe_draft(self, which: str, cost_ms: float) -> None:
        """Fold one drafter call's cost into the table: ``which`` = "ctx" (a context pass) or "step" (one
        expansion call); a non-finite or non-positive cost is ignored.

        Raises:
            ValueError: ``which`` is neither.
        """
        if which not in self.start_draft:
            raise ValueError(f"observe_draft: which must be 'ctx' or 'step', got {which!r}")
        if not (np.isfinite(cost_ms) and cost_ms > 0):
            return
        self._fold(self.draft_log, self.draft_counts, which, self.start_draft[which] * self.speed(), cost_ms)

    def observe_step(self, step) -> None:
        """:meth:`observe` a core.trace.StepTrace (its budget, ``total_ms - draft_ms``) and, when it ran the
        drafter, :meth:`observe_draft` its context pass and its expansion calls (``draft_expand_ms / expansions``)."""
        self.observe(step.budget or 1, step.total_ms - step.draft_ms)
        if step.drafted and step.draft_ctx_ms > 0:
            self.observe_draft("ctx", step.draft_ctx_ms)
            if step.expansions > 0:
                self.observe_draft("step", step.draft_expand_ms / step.expansions)

    def _write(self) -> None:
        t, f = self.table, self.speed()
        est = {m: float(np.exp(self.log_est[m])) if m in self.log_est else v * f for m, v in self.start.items()}
        capped = cap_verify_costs({m: est[m] for m in (1, *t.verify_ms)})
        t.decode_ms = capped.pop(1)
        t.verify_ms = {m: max(1e-6, capped[m] - t.host_ms) for m in sorted(capped)}
        draft = {k: float(np.exp(self.draft_log[k])) if k in self.draft_log else v * f
                 for k, v in self.start_draft.items()}
        t.draft_ctx_ms, t.draft_step_ms = draft["ctx"], draft["step"]


class RowCosts:
    """Wall ms of one batched teacher forward of R query rows, ``a + b R + c R^2`` (b, c >= 0), learned online
    (continuous batching: what a tree row costs, for :func:`~mindspore_eagle.core.policy.allot_rows`).

    A CPU forward is flat while it is bound by reading the weights and grows faster than linearly once it is bound
    by arithmetic (on the 2-core AVX2 VM: ~22 ms at 1-2 rows, ~50 at 16, ~73 at 32, ~140 at 64, ~340 at 128:
    docs/performance.md, "Continuous batching"); a straight line fitted across both regimes underestimated a 25-row step by a third, so
    the fit is quadratic. Least squares over the observed (rows, ms) pairs, each weighted ``decay`` ** (steps since
    it was seen) (a memory of about 1 / (1 - decay) steps), plus three pseudo-observations of weight
    ``prior_weight`` that never decay: at the first observation's R0, R0 + 16 and R0 + 32 rows, as dear as
    :func:`prior_verify_ratio` says relative to R0. Batches of different sizes (every plain step has R = the live
    sequences) and trees of different sizes pin the curve down; until they do, the prior holds it. A fit that
    bends down (c < 0) or starts downhill (b < 0) falls back to a + c R^2, then to the straight line, then to a
    flat cost.

    Args:
        decay: weight kept per later observation, in (0, 1]. prior_weight: weight of each pseudo-observation, > 0.
    Raises:
        ValueError: a parameter out of range (names it).
    """

    def __init__(self, decay: float = 0.98, prior_weight: float = 2.0):
        if not 0 < decay <= 1 or prior_weight <= 0:
            raise ValueError(f"RowCosts: decay must be in (0, 1] and prior_weight > 0, got {decay}, {prior_weight}")
        self.decay, self.prior_weight = float(decay), float(prior_weight)
        self.xtx, self.xty = np.zeros((3, 3)), np.zeros(3)          # decayed normal equations in (1, R, R^2)
        self.prior_xtx, self.prior_xty = np.zeros((3, 3)), np.zeros(3)
        self.observed = 0

    @staticmethod
    def _x(rows: float) -> np.ndarray:
        return np.array([1.0, rows, rows * rows])

    def observe(self, rows: int, ms: float) -> None:
        """One forward of ``rows`` rows (>= 1) that took ``ms`` ms; a non-finite or non-positive time is ignored."""
        if not (np.isfinite(ms) and ms > 0) or rows < 1:
            return
        if self.observed == 0:
            for extra in (0, 16, 32):
                x = self._x(rows + extra)
                y = ms * prior_verify_ratio(rows + extra) / prior_verify_ratio(rows)
                self.prior_xtx += self.prior_weight * np.outer(x, x)
                self.prior_xty += self.prior_weight * x * y
        x = self._x(rows)
        self.xtx = self.xtx * self.decay + np.outer(x, x)
        self.xty = self.xty * self.decay + x * ms
        self.observed += 1

    def fit(self) -> tuple[float, float, float]:
        """(a ms, b ms a row, c ms a row squared); zeros before any observation."""
        if self.observed == 0:
            return 0.0, 0.0, 0.0
        A, y = self.xtx + self.prior_xtx, self.xty + self.prior_xty
        for terms in ((0, 1, 2), (0, 2), (0, 1)):       # quadratic, a + c R^2, a straight line; else flat
            t = np.array(terms)
            try:
                coef = np.linalg.solve(A[np.ix_(t, t)], y[t])
            except np.linalg.LinAlgError:
                continue
            if (coef[1:] >= 0).all():
                out = np.zeros(3)
                out[t] = coef
                return float(max(out[0], 0.0)), float(out[1]), float(out[2])
        return float(y[0] / max(A[0, 0], 1e-12)), 0.0, 0.0

    def ms(self, rows) -> np.ndarray:
        """Predicted ms of forwards of ``rows`` rows (int or int array)."""
        a, b, c = self.fit()
        r = np.asarray(rows, np.float64)
        return a + b * r + c * r * r


__all__ = ["CostTable", "RowCosts", "RunningCosts", "cap_verify_costs", "compiled_budgets", "prior_table", "prior_verify_ratio"]
