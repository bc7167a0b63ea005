"""serving/metrics.py: the Prometheus families a server exposes, fed as the engine thread feeds them; every value
checked against counts made here by hand (a step's L_k list -> verifications, per-depth acceptance, step share)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mindspore_eagle.serving.metrics import LATENCY_BUCKETS, ServerMetrics


def samples(m: ServerMetrics) -> dict:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_acceptance_per_depth_and_step_share():
    m = ServerMetrics(max_depth=3, M=6)
    steps = [("tree", [1, 3, 5]), ("plain", []), ("tree", [2]), ("tree", [6, 1])]
    for kind, lens in steps:
        m.observe_step(kind, lens)
    s = samples(m)
    lens = [lk for _, ls in steps for lk in ls]
    assert s[("mseagle_spec_tree_verifications_total", ())] == len(lens) == 6
    assert s[("mseagle_steps_total", (("kind", "tree"),))] == 3
    assert s[("mseagle_steps_total", (("kind", "plain"),))] == 1
    assert s[("mseagle_spec_step_share", ())] == 3 / 4
    for d in (1, 2, 3):          # a verification accepted a draft at depth d when L_k - 1 >= d (the bonus is free)
        accepted = sum(lk - 1 >= d for lk in lens)
        assert s[("mseagle_spec_accepted_at_depth_total", (("depth", str(d)),))] == accepted
        assert s[("mseagle_spec_acceptance_rate", (("depth", str(d)),))] == accepted / len(lens)
    assert ("mseagle_spec_accepted_at_depth_total", (("depth", "4"),)) not in s     # deeper than max_depth
    assert s[("mseagle_spec_accepted_length_sum", ())] == sum(lens)
    assert s[("mseagle_spec_accepted_length_bucket", (("le", "2.0"),))] == sum(lk <= 2 for lk in lens)


def test_teacher_only_server_has_no_depth_series_and_a_plain_step_keeps_the_rates():
    m = ServerMetrics(max_depth=0, M=1)
    m.observe_step("plain", [])
    s = samples(m)
    assert s[("mseagle_spec_step_share", ())] == 0.0
    assert not any(name.startswith(("mseagle_spec_accepted_at_depth", "mseagle_spec_acceptance_rate"))
                   for name, _ in s)
    two = ServerMetrics(max_depth=2, M=4)
    two.observe_step("tree", [3])
    two.observe_step("plain", [])                      # no verification: the rates stay what they were
    assert samples(two)[("mseagle_spec_acceptance_rate", (("depth", "2"),))] == 1.0


def test_load_gauges():
    m = ServerMetrics(max_depth=1, M=2)
    m.set_load(running=3, waiting=5, kv_used=40, kv_reserved=48, kv_total=64, graphs_after_warmup=2, peak_running=4,
               drafter_kv_used=7)
    s = samples(m)
    want = {"num_requests_running": 3, "num_requests_waiting": 5, "kv_blocks_used": 40, "kv_blocks_reserved": 48,
            "kv_blocks_total": 64, "graphs_made_after_warmup": 2, "num_requests_running_peak": 4,
            "drafter_kv_blocks_used": 7}
    for k, v in want.items():
        assert s[("mseagle_" + k, ())] == v, k


def test_latency_histograms_use_the_shared_buckets():
    m = ServerMetrics()
    for x in (0.004, 0.2, 120.0):
        m.ttft.observe(x)
    s = samples(m)
    for le in LATENCY_BUCKETS:
        assert s[("mseagle_time_to_first_token_seconds_bucket", (("le", repr(float(le))),))] == \
            sum(x <= le for x in (0.004, 0.2, 120.0))
    assert s[("mseagle_time_to_first_token_seconds_count", ())] == 3
