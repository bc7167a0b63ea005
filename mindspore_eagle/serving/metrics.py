"""The server's Prometheus metrics (``GET /metrics``, text exposition format, prometheus-client).

Every metric lives in the server's own :class:`~prometheus_client.CollectorRegistry` (two servers in one process
never share counts). Names (prefix ``mseagle_``):

    num_requests_running / num_requests_waiting     gauges: sequences in the batch / requests queued for a row
    num_requests_running_peak                       gauge: most sequences one teacher step has run since the start
    kv_blocks_used / kv_blocks_reserved / kv_blocks_total
                                                     gauges: teacher KV blocks holding tokens now / promised to
                                                     running sequences (prompt + max_tokens) / in the pool
    prompt_tokens_total / generation_tokens_total   counters: prompt tokens admitted, tokens generated
    time_to_first_token_seconds                     histogram: request arrival -> its first token (queueing and
                                                     prefill included)
    inter_token_latency_seconds                     histogram: per generated token after the first, the time
                                                     since the previous step that emitted tokens divided by the
                                                     tokens that step emitted (a tree step's L_k tokens share it)
    e2e_request_latency_seconds                     histogram: arrival -> last token
    spec_accepted_length                            histogram: L_k of every tree verification (accepted draft
                                                     tokens + the bonus token)
    spec_tree_verifications_total                   counter: tree verifications (one per sequence per tree step)
    spec_accepted_at_depth_total{depth="d"}         counter: verifications that accepted a draft token at depth d;
                                                     acceptance at depth d = this / spec_tree_verifications_total
    spec_acceptance_rate{depth="d"}                 gauge: that ratio since the server started
    steps_total{kind="tree"|"plain"}                counter: engine steps by kind
    spec_step_share                                 gauge: tree steps / all steps since the server started
    request_success_total{finish_reason}            counter: finished requests (stop, length, cancelled, error)
    http_errors_total{status}                       counter: error responses by HTTP status
"""
from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)


class ServerMetrics:
    """The server's metrics and the updates the engine thread and the HTTP front make.

    Args:
        max_depth: deepest draft level counted per depth (speculative.D_max; 0 = teacher-only).
        M: tree budget ceiling (the largest L_k bucket).
    """

    def __init__(self, max_depth: int = 0, M: int = 1):
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "mseagle_"
        self.running = Gauge(p + "num_requests_running", "Sequences in the running batch", registry=r)
        self.peak_running = Gauge(p + "num_requests_running_peak", "Most sequences one teacher step has run since "
                                  "the start (continuous batching at work when > 1)", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting for a batch row or KV blocks", registry=r)
        self.kv_used = Gauge(p + "kv_blocks_used", "Teacher KV-cache blocks holding tokens", registry=r)
        self.kv_reserved = Gauge(p + "kv_blocks_reserved", "Teacher KV-cache blocks reserved by running sequences",
                                 registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "Teacher KV-cache blocks in the pool", registry=r)
        self.drafter_kv_used = Gauge(p + "drafter_kv_blocks_used", "Drafter KV-cache blocks holding features "
                                     "(0 without a drafter)", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request arrival to its first token (s)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time per generated token after the first (s)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request arrival to its last token (s)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.accept_len = Histogram(p + "spec_accepted_length", "Accepted length L_k per tree verification "
                                    "(accepted drafts + bonus)", buckets=tuple(range(1, max(M, 2) + 1)), registry=r)
        self.verifications = Counter(p + "spec_tree_verifications", "Tree verifications (per sequence)", registry=r)
        self.at_depth = Counter(p + "spec_accepted_at_depth", "Tree verifications that accepted a draft token at "
                                "this depth", ["depth"], registry=r)
        self.accept_rate = Gauge(p + "spec_acceptance_rate", "Share of tree verifications that accepted a draft "
                                 "token at this depth", ["depth"], registry=r)
        self.steps = Counter(p + "steps", "Engine steps by kind", ["kind"], registry=r)
        self.spec_share = Gauge(p + "spec_step_share", "Tree steps / all engine steps", registry=r)
        self.graphs_after_warmup = Gauge(p + "graphs_made_after_warmup", "Graphs compiled or loaded after the "
                                         "start-up warm-up (0: no request paid for one)", registry=r)
        self.finished = Counter(p + "request_success", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.http_errors = Counter(p + "http_errors", "Error responses by HTTP status", ["status"], registry=r)
        self.max_depth = max_depth
        self._n = {"tree": 0, "plain": 0, "verifications": 0, "depth": [0] * (max_depth + 1)}
        self._lock = threading.Lock()
        for kind in ("tree", "plain"):
            self.steps.labels(kind)
        for d in range(1, max_depth + 1):
            self.at_depth.labels(str(d))
            self.accept_rate.labels(str(d)).set(0.0)

    def observe_step(self, kind: str, accept_lens: list) -> None:
        """One engine step of ``kind`` ("tree" | "plain"); ``accept_lens``: L_k of each sequence's tree."""
        with self._lock:
            n = self._n
            n[kind] += 1
            self.steps.labels(kind).inc()
            self.spec_share.set(n["tree"] / (n["tree"] + n["plain"]))
            for lk in accept_lens:
                self.accept_len.observe(lk)
                self.verifications.inc()
                n["verifications"] += 1
                for d in range(1, min(lk - 1, self.max_depth) + 1):
                    n["depth"][d] += 1
                    self.at_depth.labels(str(d)).inc()
            if accept_lens:
                for d in range(1, self.max_depth + 1):
                    self.accept_rate.labels(str(d)).set(n["depth"][d] / n["verifications"])

    def set_load(self, running: int, waiting: int, kv_used: int, kv_reserved: int, kv_total: int,
                 graphs_after_warmup: int = 0, peak_running: int = 0, drafter_kv_used: int = 0) -> None:
        """The scheduler's state after a step (gauges; ``peak_running``: most sequences one step has run;
        ``drafter_kv_used``: drafter cache blocks in use)."""
        self.drafter_kv_used.set(drafter_kv_used)
        self.graphs_after_warmup.set(graphs_after_warmup)
        self.peak_running.set(peak_running)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(kv_used)
        self.kv_reserved.set(kv_reserved)
        self.kv_total.set(kv_total)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["LATENCY_BUCKETS", "ServerMetrics"]
