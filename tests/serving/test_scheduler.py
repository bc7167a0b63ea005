"""Continuous batching (scheduler.py) on the tiny openPangu teacher: every sequence of a batch gets exactly the tokens
one-at-a-time greedy decoding gives it, whatever the mix of prompt lengths, EOS steps, admissions mid-run, turns and
pool size; and the batch job keeps its guarantees (every record exactly once after a SIGKILL and --resume)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_engines import ScriptedGate, records

from mindspore_eagle.config import load_config
from mindspore_eagle.serving.batch_job import run_records
from mindspore_eagle.serving import batch_job as batch
from mindspore_eagle.serving.scheduler import BatchScheduler

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is the capital of France?", "Hi", "Write a short story about a robot who learns to paint.",
           "def add(a, b):", "List three colours, please, and say why each one is nice to look at.", "2+2?",
           "Tell me about the sea."]


def tiny_engine(tiny_dir, extra=()):
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = load_config(None, [f"model.teacher={tiny_dir}", "model.drafter=none", "speculative.policy=fixed",
                             "cache.block_size=8",
                             "cache.max_seq_len=256", "cache.num_blocks=64", "cache.prefill_chunk=16",
                             "generation.max_new_tokens=24", *extra])
    return build_engine(cfg), cfg


def one_at_a_time(eng, gen, recs) -> dict:
    """Reference results: each record alone through the engine's teacher-only loop (batch.run_record)."""
    from mindspore_eagle.serving.engine import GenerationError

    out = {}
    for r in recs:
        try:
            out[r.id] = batch.run_record(eng, r, gen, speculative=False)
        except GenerationError as e:
            out[r.id] = {"id": r.id, "error": str(e)}
    return out


def run_batched(eng, gen, recs, max_batch, speculative=False) -> tuple[dict, list, BatchScheduler]:
    out, order = {}, []

    def on_result(res):
        assert res["id"] not in out, "a record was handed out twice"
        out[res["id"]] = res
        order.append(res["id"])
    sched = BatchScheduler(eng, gen, max_batch, speculative=speculative)
    run_records(sched, recs, on_result)
    return out, order, sched


def same_answers(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert "error" not in w and "error" not in got[k], (k, w, got[k])
        for f in ("text", "new_tokens", "prompt_tokens", "stop_reason"):
            assert got[k][f] == w[f], (k, f, got[k][f], w[f])


@pytest.mark.slow
def test_batched_greedy_equals_one_at_a_time_with_eos_at_different_steps(ms_runtime, tiny_dir):
    eng, cfg = tiny_engine(tiny_dir)
    gen = cfg.generation
    recs = records([{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    ref = one_at_a_time(eng, gen, recs)
    # make the tiny model stop at different steps: the pair of tokens that, taken as EOS, ends the most answers
    # at the most distinct steps (answers end at their first EOS)
    ids = {r.id: eng.generate(r.payload, gen, speculative=False).token_ids for r in recs}
    seen = sorted({t for toks in ids.values() for t in toks})

    def ends(eos):
        return [next((i for i, t in enumerate(toks) if t in eos), None) for toks in ids.values()]
    pair = max(((a, b) for a in seen for b in seen if a < b),
               key=lambda e: len({x for x in ends(e) if x is not None}))
    assert len({x for x in ends(pair) if x is not None}) >= 3, ids
    eng.eos = set(eng.eos) | set(pair)
    ref = one_at_a_time(eng, gen, recs)
    stops = [ref[r.id]["stop_reason"] for r in recs]
    assert stops.count("eos") >= 3 and len({ref[r.id]["new_tokens"] for r in recs}) >= 3
    got, order, sched = run_batched(eng, gen, recs, max_batch=3)
    same_answers(got, ref)
    assert sched.peak_live == 3 and sched.reserved == 0
    assert sched.interleaved_steps > 0            # prompts of several 16-token chunks prefilled between steps
    assert order != [r.id for r in recs]          # records finished out of order: admission happened mid-run
    assert eng.teacher.bm.free_blocks() == eng.teacher.bm.num_blocks


def test_multi_turn_and_messages_records_in_a_batch(ms_runtime, tiny_dir):
    eng, cfg = tiny_engine(tiny_dir, ["generation.max_new_tokens=8", "cache.max_seq_len=512", "cache.num_blocks=128"])
    gen = cfg.generation
    recs = records([{"id": "a", "turns": ["Say hello.", "Now bye.", "Again?"]},
                    {"id": "b", "prompt": "What is water?"},
                    {"id": "c", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Name a fruit."}]},
                    {"id": "d", "turns": ["Count to three.", "And back."]}])
    ref = one_at_a_time(eng, gen, recs)
    rows, real = [], eng.teacher.decode_batch

    def spy(sids, tokens, **kw):
        rows.append((len(sids), kw["rows"]))
        return real(sids, tokens, **kw)
    eng.teacher.decode_batch = spy
    got, _, _ = run_batched(eng, gen, recs, max_batch=8)
    same_answers(got, ref)
    assert isinstance(got["a"]["text"], list) and len(got["a"]["text"]) == 3
    # each step runs its sequences' rows exactly on the host, else the smallest row bucket that holds them (one
    # graph per bucket), never max_batch rows
    bucket = lambda n: n if eng.teacher.on_host(n) else next(b for b in (1, 2, 4, 8) if b >= n)  # noqa: E731
    assert rows and all(r == bucket(n) for n, r in rows), rows
    assert any(r != next(b for b in (1, 2, 4, 8) if b >= n) for n, r in rows) == (eng.teacher.host is not None)
    assert {r for _, r in rows} >= {4}


@pytest.mark.slow
def test_pool_too_small_for_the_batch_waits_and_finishes_every_record(ms_runtime, tiny_dir):
    # the smallest pool allowed (32 blocks of 8 slots = one sequence of max_seq_len): each turn reserves
    # ceil((prompt + 24) / 8) >= 5 blocks, so at most 6 of the 8 rows can run at once
    eng, cfg = tiny_engine(tiny_dir, ["cache.num_blocks=32"])
    gen = cfg.generation
    recs = records([{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    ref = one_at_a_time(eng, gen, recs)
    sched = BatchScheduler(eng, gen, 8)
    out = {}
    run_records(sched, recs, lambda res: out.setdefault(res["id"], res))
    same_answers(out, ref)
    assert 1 < sched.peak_live < 8 and sched.reserved == 0


@pytest.mark.slow
def test_records_that_cannot_run_get_an_error_and_the_rest_go_on(ms_runtime, tiny_dir):
    eng, cfg = tiny_engine(tiny_dir)
    gen = cfg.generation
    recs = records([{"id": "ok", "prompt": "Hi"}, {"id": "long", "prompt": "word " * 300},
                    {"id": "ok2", "prompt": "2+2?"}])
    got, _, _ = run_batched(eng, gen, recs, max_batch=2)
    assert "exceeds cache.max_seq_len=256" in got["long"]["error"]
    same_answers({k: got[k] for k in ("ok", "ok2")}, one_at_a_time(eng, gen, [recs[0], recs[2]]))


def test_a_record_whose_logits_turn_nan_fails_alone(ms_runtime, tiny_dir, monkeypatch):
    """One sequence's logits row of a batched step becomes NaN after a few steps: that record gets an error of its
    own (the batch job's "error" line), the records beside it in the same forwards finish with their
    one-at-a-time answers."""
    import numpy as np

    eng, cfg = tiny_engine(tiny_dir)
    gen = cfg.generation
    recs = records([{"id": "a", "prompt": "Hi"}, {"id": "bad", "prompt": "Tell me about the sea."},
                    {"id": "b", "prompt": "2+2?"}])
    tg = eng.teacher
    sids, calls = [], [0]
    new_seq, decode_batch = tg.new_seq, tg.decode_batch

    def spy_new_seq():
        sids.append(new_seq())
        return sids[-1]

    def poisoned(seqs, tokens, **kw):
        out = decode_batch(seqs, tokens, **kw)
        calls[0] += 1
        logits = out[0] if isinstance(out, tuple) else out
        if calls[0] >= 4 and sids[1] in seqs:
            logits[list(seqs).index(sids[1])] = np.nan
        return out

    monkeypatch.setattr(tg, "new_seq", spy_new_seq)
    monkeypatch.setattr(tg, "decode_batch", poisoned)
    got, _, sched = run_batched(eng, gen, recs, max_batch=3)
    assert sched.peak_live == 3
    assert got["bad"]["error"].startswith("the teacher's logits for this sequence were not finite")
    monkeypatch.setattr(tg, "decode_batch", decode_batch)
    same_answers({k: got[k] for k in ("a", "b")}, one_at_a_time(eng, gen, [recs[0], recs[2]]))


def test_a_record_whose_prefill_logits_are_nan_fails_alone(ms_runtime, tiny_dir, monkeypatch):
    """The first token's logits (after the prefill) are NaN for one record: it ends with its own error before any
    token, greedy and seeded alike; the records beside it finish with their one-at-a-time answers."""
    import numpy as np

    eng, cfg = tiny_engine(tiny_dir)
    gen = cfg.generation
    recs = records([{"id": "a", "prompt": "Hi"}, {"id": "bad", "prompt": "Tell me about the sea.", "temperature": 0.7},
                    {"id": "b", "prompt": "2+2?"}])
    tg = eng.teacher
    sids = []
    new_seq, prefill = tg.new_seq, tg.prefill

    def spy_new_seq():
        sids.append(new_seq())
        return sids[-1]

    def poisoned(sid, ids):
        logits, aux = prefill(sid, ids)
        return (np.full_like(logits, np.nan) if sid == sids[1] else logits), aux

    monkeypatch.setattr(tg, "new_seq", spy_new_seq)
    monkeypatch.setattr(tg, "prefill", poisoned)
    got, _, _ = run_batched(eng, gen, recs, max_batch=3)
    assert got["bad"]["error"].startswith("the teacher's logits for this sequence were not finite") and \
        "at output token 0" in got["bad"]["error"]
    monkeypatch.setattr(tg, "prefill", prefill)
    same_answers({k: got[k] for k in ("a", "b")}, one_at_a_time(eng, gen, [recs[0], recs[2]]))
    monkeypatch.setattr(tg, "prefill", lambda sid, ids: (np.full_like(prefill(sid, ids)[0], np.inf), None))
    from mindspore_eagle.serving.engine import GenerationError

    with pytest.raises(GenerationError, match="not finite"):
        eng.generate("Hi", gen, speculative=False)
    assert tg.bm.free_blocks() == tg.bm.num_blocks


def test_max_batch_must_be_positive(ms_runtime, tiny_dir):
    eng, cfg = tiny_engine(tiny_dir)
    with pytest.raises(ValueError, match=r"batch.max_batch must be an integer >= 1, got 0"):
        BatchScheduler(eng, cfg.generation, 0)


@pytest.mark.slow
def test_batch_job_with_max_batch_sigkill_and_resume(tiny_dir, tmp_path):
    """The CLI batch job at --max-batch 3 is SIGKILLed after its first result line, then resumed: every id appears
    exactly once and every text equals the uninterrupted one-record-at-a-time run."""
    objs = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(PROMPTS * 2)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    common = [sys.executable, "-m", "mindspore_eagle", "batch", "--input", str(inp), "--no-progress",
              "--warmup", "none", "--set", f"model.teacher={tiny_dir}", "--set", "model.drafter=none",
              "--set", "cache.block_size=8", "--set", "cache.max_seq_len=256", "--set", "cache.num_blocks=64",
              "--set", "cache.prefill_chunk=16", "--max-new-tokens", "40", "--set", "context.threads=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    ref_out = tmp_path / "ref.jsonl"
    subprocess.run(common + ["--output", str(ref_out)], check=True, env=env, capture_output=True, timeout=600)
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(common + ["--output", str(out), "--max-batch", "3"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    first = batch.read_results(out)
    assert 1 <= len(first) < len(objs), "the kill must land mid-job"
    subprocess.run(common + ["--output", str(out), "--max-batch", "3", "--resume"], check=True, env=env,
                   capture_output=True, timeout=600)
    got = batch.read_results(out)
    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(o["id"] for o in objs) and len(ids) == len(set(ids))
    ref = {r["id"]: r["text"] for r in batch.read_results(ref_out)}
    assert {r["id"]: r["text"] for r in got} == ref


def test_bench_batch_sizes_rows_and_report(ms_runtime, tiny_dir, tmp_path):
    """bench/batching.py on the tiny teacher: one row per batch size, every text token-identical to the batch-1
    reference, tokens counted from the sequences, x-vs-batch-1 relative to the teacher-only batch-1 row."""
    from mindspore_eagle.bench import batching

    eng, cfg = tiny_engine(tiny_dir)
    logs = []
    res = batching.run_batch_sizes(eng, PROMPTS[:5], [1, 3], cfg.generation, logs.append)
    rows = res["rows"]
    assert [(r["max_batch"], r["kind"]) for r in rows] == [(1, "teacher-only"), (3, "teacher-only")]
    assert all(r["identical"] == 5 and r["mismatches"] == [] for r in rows)
    assert rows[0]["new_tokens"] == rows[1]["new_tokens"] == 5 * cfg.generation.max_new_tokens
    assert rows[0]["x_vs_batch1"] == 1.0
    assert abs(rows[1]["x_vs_batch1"] - rows[1]["tok_s"] / rows[0]["tok_s"]) < 1e-2
    assert res["texts"]["teacher-only@1"] == res["texts"]["teacher-only@3"]
    batching.write_report(res, {"name": "t", "prompts": 5, "max_new_tokens": 24}, str(tmp_path))
    md = (tmp_path / "batching.md").read_text()
    assert "| 3 | teacher-only |" in md and "5 / 5" in md
    assert json.loads((tmp_path / "batching.json").read_text())["rows"] == rows


@pytest.mark.slow
def test_speculative_batch_equals_one_at_a_time_greedy(ms_runtime, tiny, tiny_dir, tmp_path):
    """Trees of 3 sequences verified in one forward (verify_batch): with an untrained drafter and with an oracle
    drafter that puts each sequence's true continuation into its tree at a random depth (long accepted paths,
    multi-node commits), every record's tokens equal teacher-only one-at-a-time greedy decoding."""
    import numpy as np
    from tiny_engines import tiny_drafter_dir

    from mindspore_eagle.core.tree import DraftTree

    d = tiny_drafter_dir(tmp_path, tiny[0])
    eng, cfg = tiny_engine(tiny_dir, [f"model.drafter={d}", "speculative.M=8", "speculative.D_max=4",
                                      "cache.num_blocks=96", "speculative.method=eagle3"])   # the oracle's trees
    gen = cfg.generation
    recs = records([{"id": i, "prompt": p} for i, p in enumerate(PROMPTS[:5])] +
                   [{"id": "chat", "turns": ["Say hello.", "Bye?"]}])
    ref = one_at_a_time(eng, gen, recs)
    for pattern in (["tree"], ["plain", "plain", "tree"]):       # forced step kinds: trees only, and a mix
        sched = BatchScheduler(eng, gen, 3, speculative=True)
        sched.round.gate = ScriptedGate(pattern)
        out = {}
        run_records(sched, recs, lambda res: out.setdefault(res["id"], res))
        same_answers(out, ref)
        assert sched.round.gate.seen == {"tree", *pattern}

    truth = {r.id: eng.generate(r.payload, gen, speculative=False).token_ids for r in recs[:5]}
    sched = BatchScheduler(eng, gen, 3, speculative=True)
    sched.round.gate = ScriptedGate(["tree"])
    by_dsid, rng, V = {}, np.random.default_rng(0), tiny[0].vocab_size
    start = sched.round.start

    def spy_start(s, ids, aux):
        start(s, ids, aux)
        by_dsid[s.state.dsid] = s

    def oracle(dsid, root, first, M, D, grow=None):
        s = by_dsid[dsid]
        done = eng.teacher.length(s.sid) - s.prompt_tokens + 1
        want = truth[s.job.rec.id][done:done + D]
        tokens, parents, node = [root], [0], 0
        for t in want[: int(rng.integers(0, len(want) + 1))]:
            kids = [int(w) for w in rng.choice(V, 2, replace=False) if w != t][: int(rng.integers(0, 2))] + [int(t)]
            rng.shuffle(kids)
            kids = kids[: M - len(tokens)]
            if int(t) not in kids:
                break
            base = len(tokens)
            tokens += kids
            parents += [node] * len(kids)
            node = base + kids.index(int(t))
        depth = np.zeros(len(tokens))
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
        return DraftTree(tokens, parents, np.log(0.7) * depth)     # scores: cumulative log-probs, as drafted
    sched.round.start = spy_start
    assert eng.drafter.grouped                      # draft_batch batches: the oracle replaces its tree expansion
    eng.drafter._build_trees = lambda sids, roots, firsts, M, D, groups: [
        oracle(d, r, f, M, D) for d, r, f in zip(sids, roots, firsts)]
    out = {}
    run_records(sched, recs[:5], lambda res: out.setdefault(res["id"], res))
    same_answers(out, {k: ref[k] for k in range(5)})
    assert max(r["mean_accept_len"] for r in out.values()) > 2.0
    assert eng.drafter.bm.free_blocks() == eng.drafter.bm.num_blocks and sched.reserved == 0


def test_request_core_per_request_settings_streaming_cancel_and_abort(ms_runtime, tiny_dir):
    """The request-driven core the server runs (add / step / cancel / abort): each request's own max_new_tokens,
    temperature and seed in one batch (greedy rows equal one-at-a-time greedy, a seeded sampled row equals the same
    request alone), the tokens streamed through on_tokens add up to the result's, a request cancelled while queued
    or while running ends "cancelled" with its blocks freed, and an aborted step ends its sequences with an internal
    error while the queue goes on."""
    import dataclasses

    from mindspore_eagle.serving.scheduler import Request

    eng, cfg = tiny_engine(tiny_dir)
    gen = cfg.generation
    sched = BatchScheduler(eng, gen, 3, single_round=True)
    streamed, done = {}, {}

    def req(rid, prompt, **kw):
        return Request(rid, dataclasses.replace(gen, **kw), messages=[{"role": "user", "content": prompt}],
                       on_tokens=lambda r, toks: streamed.setdefault(r.rid, []).extend(toks),
                       on_done=lambda r, res: done.__setitem__(r.rid, res))

    sampled = dict(temperature=1.0, top_p=0.9, seed=5, max_new_tokens=12)
    for r in (req("g0", PROMPTS[0]), req("s", PROMPTS[1], **sampled), req("short", PROMPTS[3], max_new_tokens=3),
              req("live", PROMPTS[4]), req("queued", PROMPTS[5]), req("g1", PROMPTS[6])):
        sched.add(r)
    sched.step()
    assert [s.req.rid for s in sched.live] == ["g0", "s", "short"]
    assert sched.cancel("queued") and done["queued"].stop_reason == "cancelled"
    assert not sched.cancel("no such request")
    while "short" not in done:
        sched.step()
    while not any(s.req.rid == "live" and s.started for s in sched.live):
        sched.step()
    assert sched.cancel("live") and done["live"].stop_reason == "cancelled" and done["live"].prompt_tokens > 0
    while sched.has_work:
        sched.step()
    assert sched.reserved == 0 and eng.teacher.bm.free_blocks() == eng.teacher.bm.num_blocks
    for rid, prompt in (("g0", PROMPTS[0]), ("g1", PROMPTS[6])):
        want = eng.generate(prompt, gen, speculative=False)
        assert (done[rid].text, done[rid].token_ids, done[rid].stop_reason) == (want.text, want.token_ids,
                                                                                want.stop_reason)
    alone = eng.generate(PROMPTS[1], dataclasses.replace(gen, **sampled), speculative=False)
    assert done["s"].token_ids == alone.token_ids and done["s"].text == alone.text
    assert len(done["short"].token_ids) == 3 and done["short"].stop_reason == "length"
    assert all(streamed[rid] == done[rid].token_ids for rid in ("g0", "g1", "s", "short"))

    fails = {"n": 1}

    def failing(real):
        def boom(live):
            if fails["n"]:
                fails["n"] -= 1
                raise RuntimeError("injected")
            return real(live)
        return boom
    sched.round.step, sched.round_one.step = failing(sched.round.step), failing(sched.round_one.step)
    for r in (req("a", PROMPTS[0]), req("b", PROMPTS[1])):
        sched.add(r)
    with pytest.raises(RuntimeError, match="injected"):
        while sched.has_work:
            sched.step()
    assert {r.rid for r in sched.abort("engine failed")} == {"a", "b"}
    assert done["a"].stop_reason == "error" and done["a"].internal and done["a"].error == "engine failed"
    assert sched.reserved == 0 and eng.teacher.bm.free_blocks() == eng.teacher.bm.num_blocks
    sched.add(req("after", PROMPTS[0]))
    while sched.has_work:
        sched.step()
    assert done["after"].text == eng.generate(PROMPTS[0], gen, speculative=False).text


def test_logprobs_in_a_batch_equal_one_at_a_time_and_reach_on_logprobs(ms_runtime, tiny_dir):
    """Requests asking for log-probabilities (greedy and seeded, 2 alternatives) in one batch of 3: each result's
    entries equal the request alone, bit for bit, one per token; ``on_logprobs`` hands them over before each
    ``on_tokens``, adding up to the result's."""
    import dataclasses

    from mindspore_eagle.serving.scheduler import Request

    eng, cfg = tiny_engine(tiny_dir)
    sched = BatchScheduler(eng, cfg.generation, 3, single_round=True)
    gens = {"g": dataclasses.replace(cfg.generation, logprobs=2),
            "s": dataclasses.replace(cfg.generation, logprobs=2, temperature=0.9, seed=3),
            "off": cfg.generation}
    handed, done = {}, {}
    for (rid, gen), prompt in zip(gens.items(), PROMPTS):
        sched.add(Request(rid, gen, messages=[{"role": "user", "content": prompt}], tag=rid,
                          on_logprobs=lambda r, e: handed.setdefault(r.rid, []).extend(e),
                          on_done=lambda r, res: done.__setitem__(r.rid, res)))
    while sched.has_work:
        sched.step()
    assert sched.peak_live == 3 and done["off"].logprobs == [] and "off" not in handed
    for (rid, gen), prompt in zip(gens.items(), PROMPTS):
        if rid == "off":
            continue
        alone = eng.generate(prompt, gen, speculative=False)
        assert done[rid].token_ids == alone.token_ids and done[rid].logprobs == alone.logprobs
        assert handed[rid] == done[rid].logprobs and [e[0] for e in handed[rid]] == done[rid].token_ids
