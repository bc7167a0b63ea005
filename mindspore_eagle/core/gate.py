"""RateGate: the fastest of several step kinds by measured tokens per millisecond (batched speculation: drafter
trees, copies alone, or none).

Pure Python; never imports MindSpore.
"""
from __future__ import annotations


class RateGate:
    """Picks, step by step, the fastest of two or more step kinds by measured tokens per millisecond (continuous
    batching, the decode round with N > 1 rows in serving/round.py: steps that run the drafter, steps that verify
    copies of earlier text alone, plain batched decodes).

    Each kind's rate is an exponential moving average (weight ``alpha``) of tokens / ms over its steps. The first
    ``warm`` steps of each kind are taken in turn; then the fastest kind runs and each other one is probed, so a
    change in the batch (size, context lengths, what the drafter gets right) moves the choice. A probe comes after
    at least ``probe_every`` steps and once the time spent since that kind last ran is at least its last step's
    time / its share (``probe_share`` split over the kinds that are not the best), so probing slow kinds costs at
    most about ``probe_share`` of the time (a batched tree step of N x M rows can cost ten plain steps on a CPU:
    probing it every 16 steps cost 40 % of the serving rate). The batch analogue of ``AdaptivePolicy``'s
    speculate-or-not gate: where verification stops being cheap as the batch grows, speculation steps aside
    (TensorRT-LLM turns speculation off past a batch size; here it is measured, not configured).

    Args:
        kinds: two or more step kinds (earlier = preferred on a tie). alpha in (0, 1]. probe_every >= 2. warm >= 1.
        probe_share in (0, 1]: the share of time probing may take, split evenly over the kinds that are not the
            best (1.0: probe every ``probe_every`` steps).
    Raises:
        ValueError: a parameter out of range (names it).
    """

    def __init__(self, kinds=("tree", "plain"), alpha: float = 0.3, probe_every: int = 16, warm: int = 2,
                 probe_share: float = 0.05):
        if len(set(kinds)) < 2 or len(set(kinds)) != len(kinds) or not 0 < alpha <= 1 or probe_every < 2 or \
                warm < 1 or not 0 < probe_share <= 1:
            raise ValueError(f"RateGate: need 2 or more distinct kinds, alpha in (0, 1], probe_every >= 2, warm >= 1, "
                             f"probe_share in (0, 1]; got {kinds}, {alpha}, {probe_every}, {warm}, {probe_share}")
        self.kinds, self.alpha, self.probe_every, self.warm = tuple(kinds), alpha, probe_every, warm
        self.probe_share = float(probe_share)
        self.rate = {k: None for k in self.kinds}
        self.count = {k: 0 for k in self.kinds}
        self.last_ms = {k: 0.0 for k in self.kinds}      # wall ms of each kind's latest step
        self.since = {k: (0, 0.0) for k in self.kinds}   # (steps, ms) taken since each kind last ran
        self.steps = 0

    def seed_from(self, other: "RateGate") -> None:
        """Start from ``other``'s measurements (rates, latest step times; counts up to ``warm``), so a new gate
        (a batch size not seen yet, :class:`~mindspore_eagle.serving.scheduler.SizeGates`) skips its warm-up."""
        for k in self.kinds:
            if other.rate.get(k) is not None:
                self.rate[k], self.last_ms[k] = other.rate[k], other.last_ms[k]
                self.count[k] = min(other.count[k], self.warm)

    def best(self) -> str:
        """The kind with the highest rate so far (the earliest kind while any is unmeasured, or on a tie)."""
        if any(self.rate[k] is None for k in self.kinds):
            return self.kinds[0]
        return max(self.kinds, key=lambda k: (self.rate[k], -self.kinds.index(k)))

    def choose(self) -> str:
        """The kind of the next step."""
        for k in self.kinds:
            if self.count[k] < self.warm:
                return k
        best = self.best()
        share = self.probe_share / (len(self.kinds) - 1)
        for other in self.kinds:
            steps, ms = self.since[other]
            if other != best and steps >= self.probe_every - 1 and ms * share >= self.last_ms[other] * (1 - share):
                return other
        return best

    def observe(self, kind: str, tokens: int, ms: float, extra_ms: float = 0.0) -> None:
        """Record a step of ``kind`` that emitted ``tokens`` tokens in ``ms`` milliseconds, plus ``extra_ms`` it
        cost only because other kinds ran before (a drafter's backlog: ``serving.round``): the rate is judged
        on ``ms`` (the kind's cost when it runs every step), the probing pace on ``ms + extra_ms`` (what a probe
        really costs)."""
        r = tokens / max(ms, 1e-6)
        old = self.rate[kind]
        self.rate[kind] = r if old is None else (1 - self.alpha) * old + self.alpha * r
        self.count[kind] += 1
        self.steps += 1
        self.last_ms[kind] = float(ms) + float(extra_ms)
        for k in self.kinds:
            n, t = self.since[k]
            self.since[k] = (0, 0.0) if k == kind else (n + 1, t + float(ms) + float(extra_ms))

    def report(self) -> dict:
        """Rates (tokens / ms) and step counts per kind."""
        return {"rate_tok_per_ms": dict(self.rate), "steps": dict(self.count)}


__all__ = ["RateGate"]
