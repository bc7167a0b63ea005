"""serving/async_engine.py: the engine thread beside an asyncio loop, on the tiny MindSpore engine (eager) with an
untrained tiny drafter: concurrent requests share teacher steps and each gets teacher-only greedy text, streamed
pieces add up to the final text, a cancel frees teacher and drafter blocks, the load gauges (graphs made after
warm-up counts graphs loaded from the store, drafter blocks) and the queue limit."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from tiny_engines import PROMPTS, tiny_drafter_dir, tiny_engine

from mindspore_eagle.serving.async_engine import AsyncEngine, NotReady, QueueFull, TextDeltas
from mindspore_eagle.serving.metrics import ServerMetrics
from mindspore_eagle.serving.scheduler import BatchScheduler


def gauge(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name)


@pytest.fixture(scope="module")
def spec_engine(tiny, tiny_dir, tmp_path_factory):
    """A speculative tiny engine (eager, fixed budget M 4, D_max 2, top_k 2) and its config."""
    d = tiny_drafter_dir(tmp_path_factory.mktemp("async_drafter"), tiny[0])
    return tiny_engine(tiny_dir, d, "eager", ["speculative.M=4", "speculative.D_max=2", "speculative.top_k=2",
                                              "generation.max_new_tokens=20"])


def _run(eng, cfg, body, rows=4):
    """Start an AsyncEngine over ``eng`` (a BatchScheduler of ``rows`` speculative rows), run ``body(ae)`` on a
    fresh event loop, stop the engine; returns (body's result, metrics)."""
    metrics = ServerMetrics(max_depth=2, M=4)

    def build():
        return eng, BatchScheduler(eng, cfg.generation, rows, speculative=True)

    async def main():
        ae = AsyncEngine(build, metrics)
        ae.start(asyncio.get_running_loop())
        while ae.state == "starting":
            await asyncio.sleep(0.01)
        assert ae.state == "ready"
        try:
            return await body(ae)
        finally:
            assert await asyncio.to_thread(ae.stop, 60)
            assert ae.state == "stopped"
    return asyncio.run(main()), metrics


async def collect(h):
    """(pieces, result, final piece) of one handle's events."""
    pieces = []
    while True:
        ev = await h.events.get()
        if ev[0] == "delta":
            pieces.append(ev[1])
        else:
            return pieces, ev[1], ev[2]


def test_concurrent_requests_share_steps_and_equal_teacher_only(spec_engine):
    eng, cfg = spec_engine
    gen = cfg.generation
    ids = [eng.encode_chat(p) for p in PROMPTS]
    want = [eng.generate_ids(i, gen, speculative=False) for i in ids]

    async def body(ae):
        hs = [ae.submit(i, gen) for i in ids]
        return await asyncio.gather(*(collect(h) for h in hs))

    out, m = _run(eng, cfg, body)
    for (pieces, res, final), w in zip(out, want):
        assert res.token_ids == w.token_ids and res.text == w.text
        assert "".join(pieces) + final == res.text           # streamed pieces add up to the final text
        assert res.stop_reason in ("eos", "length") and res.prompt_tokens > 0
    assert gauge(m, "mseagle_num_requests_running_peak") == 3  # the three shared teacher steps
    assert gauge(m, "mseagle_generation_tokens_total") == sum(len(w.token_ids) for w in want)
    assert gauge(m, "mseagle_spec_tree_verifications_total") > 0
    for name in ("mseagle_kv_blocks_used", "mseagle_kv_blocks_reserved", "mseagle_drafter_kv_blocks_used",
                 "mseagle_num_requests_running"):
        assert gauge(m, name) == 0, name


def test_cancel_frees_teacher_and_drafter_blocks(spec_engine):
    eng, cfg = spec_engine
    gen = dataclasses.replace(cfg.generation, max_new_tokens=200)
    seen = []

    async def body(ae):
        h = ae.submit(eng.encode_chat(PROMPTS[1]), gen)
        ev = await h.events.get()
        while ev[0] == "delta" and h.n_tokens < 4:       # a few tokens in: blocks of both caches in use
            ev = await h.events.get()
        assert ev[0] == "delta"
        seen.append((ae.sched.kv_blocks_used(), ae.sched.drafter_kv_blocks_used()))
        ae.cancel(h)
        while ev[0] != "done":
            ev = await h.events.get()
        seen.append((ae.sched.kv_blocks_used(), ae.sched.drafter_kv_blocks_used(), ae.sched.reserved))
        return ev[1]

    res, m = _run(eng, cfg, body)
    assert res.stop_reason == "cancelled" and 4 <= len(res.token_ids) < 200
    assert seen[0][0] > 0 and seen[0][1] > 0
    assert seen[1] == (0, 0, 0)
    assert gauge(m, "mseagle_drafter_kv_blocks_used") == 0 and gauge(m, "mseagle_kv_blocks_used") == 0
    assert m.registry.get_sample_value("mseagle_request_success_total", {"finish_reason": "cancelled"}) == 1


def test_graphs_after_warmup_count_loads_and_compiles(spec_engine, monkeypatch):
    """The gauge is the engine's graphs compiled *or loaded from the store* since the build returned: a runner
    that loads 2 graphs and compiles 1 during a request shows 3."""
    eng, cfg = spec_engine
    made = {"teacher_loads": 5, "drafter_loads": 1, "compiles": 7}       # what the warm-up made: not counted
    monkeypatch.setattr(type(eng.teacher), "loads", property(lambda self: made["teacher_loads"]))
    monkeypatch.setattr(type(eng.drafter), "loads", property(lambda self: made["drafter_loads"]))
    monkeypatch.setattr(type(eng), "compiles", property(lambda self: made["compiles"]))

    async def body(ae):
        made["teacher_loads"] += 1
        made["drafter_loads"] += 1
        made["compiles"] += 1
        h = ae.submit(eng.encode_chat(PROMPTS[0]), dataclasses.replace(cfg.generation, max_new_tokens=2))
        return await collect(h)

    _, m = _run(eng, cfg, body)
    assert gauge(m, "mseagle_graphs_made_after_warmup") == 3


def test_queue_limit_and_not_ready(spec_engine):
    """``submit`` (the front's side, no engine thread needed): NotReady while starting or draining; QueueFull once
    ``max_queue`` requests wait beyond the rows free after the last step."""
    eng, cfg = spec_engine
    ids = eng.encode_chat(PROMPTS[0])
    ae = AsyncEngine(build=None, max_queue=2)
    with pytest.raises(NotReady):
        ae.submit(ids, cfg.generation)
    ae.engine, ae.state, ae._free_rows = eng, "ready", 1
    hs = [ae.submit(ids, cfg.generation) for _ in range(3)]            # 1 row free + 2 waiting
    assert [h.rid for h in hs] == [1, 2, 3] and ae.queued == 3
    with pytest.raises(QueueFull, match=r"2 requests are waiting for a row \(serve.max_queue=2\)"):
        ae.submit(ids, cfg.generation)
    ae.draining = True
    with pytest.raises(NotReady):
        ae.submit(ids, cfg.generation)


class _Tok:
    """Token id -> one character (id 0 is EOS); enough of a Tokenizer for the IncrementalDecoder."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i - 1) for i in ids if i)


def test_text_deltas_hold_back_a_possible_stop_string():
    d = TextDeltas(_Tok(), eos=[0], stop=["cde"])
    assert d.push([1]) == ""                        # "a": could still start "cde"? no, but 2 characters are held
    assert d.push([2]) == ""
    assert d.push([3]) == "a"                       # "abc": "bc" could begin "cde"
    assert d.push([4, 5]) == "b"                    # "abcde": the stop string found, nothing from it on is sent
    assert d.stopped and d.push([6]) == ""
    assert d.finish("ab") == ""
    free = TextDeltas(_Tok(), eos=[0], stop=[])
    assert free.push([1, 0, 2]) == "ab" and free.finish("abc") == "c"
