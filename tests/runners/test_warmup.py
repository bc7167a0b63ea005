"""Warm-up and the on-disk graph cache, on the tiny openPangu teacher.

After a full warm-up no turn of a chat compiles anything, whatever its length; the warm-up visits an exact,
known list of shapes (none of a tree or the drafter for a teacher-only engine); a second process loads the same
graphs from the graph store and produces the same tokens; slow steps report progress.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from mindspore_eagle.config import load_config
from mindspore_eagle.serving.batch_job import run_records

# widths 256, 512 (S = 512); teacher prefill buckets {16}; drafter buckets 1..16; M 8, D_max 3, top_k 2
TINY = ["cache.block_size=8", "cache.max_seq_len=512", "cache.num_blocks=64", "cache.prefill_chunk=16",
        "speculative.M=8", "speculative.D_max=3", "speculative.top_k=2", "model.drafter=random", "speculative.policy=fixed",
        "generation.max_new_tokens=6"]
LONG = " ".join(f"item {i} is {i * 7 % 10}" for i in range(32))      # ~330 tiny-tokenizer tokens: the 512 width


def _cfg(tiny_dir, extra=()):
    return load_config(None, [f"model.teacher={tiny_dir}", *TINY, *extra])


def test_warmup_shape_list_is_exact(ms_runtime, tiny_dir):
    from mindspore_eagle.runners.warmup import drafter_shapes, teacher_shapes
    from mindspore_eagle.serving.pipeline import build_engine

    eng = build_engine(_cfg(tiny_dir))
    assert eng.verify_budgets() == [8]
    # every teacher call here runs on the host in fused mode on the cpu backend (models/llama_host.py): no graph
    assert eng.teacher.on_host(1) and eng.teacher.on_host(16)
    assert list(teacher_shapes(eng.teacher, eng.verify_budgets(), 3)) == []
    eng.teacher.host = None                                             # every teacher call a graph
    t = [what for what, _ in teacher_shapes(eng.teacher, eng.verify_budgets(), 3)]
    assert t == ["teacher prefill 16 x 256", "teacher decode 1 x 256", "teacher verify 8 x 256",
                 "teacher prefill 16 x 512", "teacher decode 1 x 512", "teacher verify 8 x 512"]
    # every drafter call here has at most 16 rows: on the cpu backend they all run on the host, with no graph
    assert eng.drafter.host is not None and eng.drafter.on_host(16) and not eng.drafter.on_host(33)
    assert list(drafter_shapes(eng.drafter, 8, 3, eng.teacher.S)) == []
    eng.drafter.host = None                                             # every call a graph
    d = [what for what, _ in drafter_shapes(eng.drafter, 8, 3, eng.teacher.S)]
    # drafter cache: 512 + top_k (D_max - 1) = 516 -> 520 slots; width 520 is reached by tree expansion only
    assert eng.drafter.widths == [256, 512, 520]
    assert d == ([f"drafter context {b} x 256" for b in (1, 2, 4, 8, 16)] + ["drafter expansion 2 x 256"]
                 + [f"drafter context {b} x 512" for b in (1, 2, 4, 8, 16)] + ["drafter expansion 2 x 512",
                                                                               "drafter expansion 2 x 520"])


@pytest.mark.slow
def test_full_warmup_then_no_compile_in_any_turn(ms_runtime, tiny_dir):
    from mindspore_eagle.runners.warmup import warmup
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = _cfg(tiny_dir)
    eng = build_engine(cfg)
    eng.drafter.host = None               # every drafter call a graph (the host path compiles none: shape test)
    eng.teacher.host = None               # every teacher call a graph, likewise
    out = warmup(eng, cfg.generation, "full")
    # teacher: (prefill 16, decode, verify 8) x 2 widths + the commit's K/V compaction = 7 graphs;
    # drafter: 5 context-pass buckets (fc + layer + head on the last row, one graph) x 2 widths + expansion at
    # 256, 512 and 520 = 13 graphs
    assert (out["mode"], out["compiles"]) == ("full", 20)
    assert (eng.teacher.compiles, eng.drafter.compiles) == (7, 13)
    assert warmup(eng, cfg.generation, "full")["compiles"] == 0
    gens = eng.chat(["Hi", LONG, "Thanks"], cfg.generation)
    assert gens[1].turn.prompt_tokens > 256                     # the long turn reaches the second width
    assert [g.turn.compile_count for g in gens] == [0, 0, 0]
    assert [len(g.steps) > 0 for g in gens] == [True, True, True]
    base = eng.generate(LONG, cfg.generation, speculative=False)
    assert base.turn.compile_count == 0


@pytest.mark.slow
def test_batched_warmup_then_scheduler_compiles_nothing(ms_runtime, tiny_dir):
    """max_batch 3 with trees: the warm-up also compiles decode_batch (b rows) and verify_batch (b x m_b rows) for
    each row bucket b at each width, after which a continuous-batching run over short and long prompts (both widths, tree and plain steps)
    compiles no graph."""
    from tiny_engines import ScriptedGate, records

    from mindspore_eagle.runners.warmup import (
        batch_shapes,
        drafter_batch_shapes,
        warmup,
    )
    from mindspore_eagle.serving import batch_job as batch
    from mindspore_eagle.serving.pipeline import build_engine
    from mindspore_eagle.serving.scheduler import BatchScheduler

    cfg = batch.batched_config(_cfg(tiny_dir, ["batch.max_batch=3", "batch.speculative=true"]))
    eng = build_engine(cfg)
    assert list(batch_shapes(eng.teacher, 3, 8, 3, True)) == []           # on the host: no graph
    eng.teacher.host = None                                               # every teacher call a graph
    # row buckets 1, 2, 3; each verifies min(M, 16 // b) tokens a sequence (speculative.batch_tree_rows 16)
    assert [w for w, _ in batch_shapes(eng.teacher, 3, 8, 3, True)] == [
        "teacher decode_batch 1 x 256", "teacher verify_batch 8 x 256",
        "teacher decode_batch 1 x 512", "teacher verify_batch 8 x 512",
        "teacher decode_batch 2 x 256", "teacher verify_batch 16 x 256",
        "teacher decode_batch 2 x 512", "teacher verify_batch 16 x 512",
        "teacher decode_batch 3 x 256", "teacher verify_batch 15 x 256",
        "teacher decode_batch 3 x 512", "teacher verify_batch 15 x 512"]
    assert list(batch_shapes(eng.teacher, 1, 8, 3, True)) == []
    # drafter calls of at most 32 rows run on the host: only the batched context pass of 3 x 16 rows is a graph
    assert [w for w, _ in drafter_batch_shapes(eng.drafter, 3, 8, 3, eng.teacher.S)] == [
        "drafter context 3 x 16 x 256", "drafter context 3 x 16 x 512"]
    out = warmup(eng, cfg.generation, "full", max_batch=3)
    # teacher's one-sequence graphs (test above) 7; teacher decode_batch + verify_batch at 3 row buckets and 2
    # widths 12; drafter 2 (group buckets 1 and 2 run on the host)
    assert out["compiles"] == 7 + 12 + 2
    before = eng.teacher.compiles + eng.drafter.compiles
    recs = records([{"id": i, "prompt": p} for i, p in enumerate(["Hi", LONG, "Thanks", "What is 2+2?"])])
    sched = BatchScheduler(eng, cfg.generation, 3, speculative=True)
    sched.round.gate = ScriptedGate(["tree", "plain", "tree"])
    got = {}
    run_records(sched, recs, lambda res: got.setdefault(res["id"], res))
    assert len(got) == 4 and all("error" not in r for r in got.values())
    assert sched.round.gate.seen == {"tree", "plain"}
    assert eng.teacher.compiles + eng.drafter.compiles == before


def test_compiles_on_first_use_are_reported(ms_runtime, tiny_dir):
    """No silent compiling: a note, then one line per graph (name, rows x width, seconds), and
    while a graph takes longer than the heartbeat interval, a line every interval."""
    import re

    from mindspore_eagle.kernels import runtime
    from mindspore_eagle.runners.warmup import report_compiles
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = _cfg(tiny_dir, ["model.drafter=none"])
    eng = build_engine(cfg)
    eng.teacher.host = None                   # every teacher call a graph (the host path compiles none)
    lines = []
    report_compiles(lines.append, every_s=0.02)
    try:
        eng.generate("Hi", cfg.generation, speculative=False)
    finally:
        runtime.set_compile_listener(None)
    assert lines[0].startswith("compiling graphs on first use")
    done = [ln for ln in lines[1:] if " ... " not in ln]
    # prefill of the 16-row bucket, then one decode row, both over the 256-slot width
    assert [re.sub(r"in \d+\.\d s$", "in S", ln) for ln in done] == [
        "compiled graph 1: LlamaModel.construct 16 x 256 in S", "compiled graph 2: LlamaModel.construct 1 x 256 in S"]
    beats = [ln for ln in lines[1:] if " ... " in ln]
    assert beats and all(re.fullmatch(r"compiling graph [12]: LlamaModel.construct (16|1) x 256 \.\.\. \d+ s", ln)
                         for ln in beats)                   # a tiny teacher's compile takes ~0.1-1 s: 50 beats a second
    assert eng.teacher.compiles == 2


def test_overlapping_and_failed_compiles_stop_their_heartbeats():
    """Two threads compiling at once (a server's warm-up and a request) and a compile that raises: every
    heartbeat stops, each end line carries its own graph number, and nothing prints afterwards (a leaked heartbeat
    printed "compiling graph 44 ... 2739 s" into later tests' output)."""
    import threading
    import time

    from mindspore_eagle.kernels import runtime
    from mindspore_eagle.runners.warmup import report_compiles

    lines = []
    report_compiles(lines.append, every_s=0.05)
    try:
        a, b = (((1, 8), "Float32"),), (((4, 8), "Float32"),)
        runtime._notify("compiling", "A.construct", a)
        runtime._notify("compiling", "B.construct", b)
        time.sleep(0.2)
        runtime._notify("compiled", "A.construct", a, 200.0)
        runtime._notify("failed", "B.construct", b, 210.0)
    finally:
        runtime.set_compile_listener(None)
    ends = [ln for ln in lines[1:] if " ... " not in ln]
    assert ends == ["compiled graph 1: A.construct 1 in 0.2 s", "failed graph 2: B.construct 4 in 0.2 s"]
    assert any(ln.startswith("compiling graph 2: B.construct 4 ... ") for ln in lines)
    seen = len(lines)
    time.sleep(0.2)
    assert len(lines) == seen
    assert not [t for t in threading.enumerate() if t.name == "mseagle-heartbeat"]


def test_a_compile_that_raises_is_reported_as_failed(ms_runtime):
    """CompiledFn tells the listener when its first call raises, so the listener can end what it started."""
    from mindspore_eagle.kernels import runtime

    def broken(x):
        raise RuntimeError("no graph")

    events = []
    fn = runtime.CompiledFn(broken, "fused")
    fn._fn = broken                     # raise where a compile would run
    runtime.set_compile_listener(lambda ev, name, sig, ms_: events.append(ev))
    try:
        import mindspore as ms
        import numpy as np

        with pytest.raises(RuntimeError, match="no graph"):
            fn(ms.Tensor(np.zeros((2, 3), np.float32)))
    finally:
        runtime.set_compile_listener(None)
    assert events[0] in ("compiling", "loading") and events[-1] == "failed"


def test_slow_steps_report_only_when_slow():
    import time

    from mindspore_eagle.runners.warmup import slow

    lines = []
    with slow("loading weights", lines.append, after_s=0.2, every_s=0.2):
        time.sleep(0.5)
    assert lines[0] == "loading weights ..." and lines[-1].startswith("loading weights: done in 0.")
    assert all(ln.startswith("loading weights ... ") and ln.endswith(" s") for ln in lines[1:-1]) and len(lines) >= 3
    quiet = []
    with slow("fast", quiet.append, after_s=1.0):
        pass
    assert quiet == []


def test_teacher_only_warmup_has_no_tree_or_drafter_shape(ms_runtime, tiny_dir):
    """A teacher-only engine (drafter none: a teacher-only batch job) warms up no verification budget and no
    drafter shape: prefill and decode per width, and the batched decode."""
    from mindspore_eagle.runners.warmup import full_shapes
    from mindspore_eagle.serving.pipeline import build_engine

    eng = build_engine(_cfg(tiny_dir, ["model.drafter=none"]))
    assert full_shapes(eng) == [] and full_shapes(eng, max_batch=3) == []    # the teacher's calls: on the host
    eng.teacher.host = None                                                   # every teacher call a graph
    assert [w for w, _ in full_shapes(eng)] == ["teacher prefill 16 x 256", "teacher decode 1 x 256",
                                                "teacher prefill 16 x 512", "teacher decode 1 x 512"]
    assert [w for w, _ in full_shapes(eng, max_batch=3)][4:] == [          # row buckets 1, 2, then max_batch
        "teacher decode_batch 1 x 256", "teacher decode_batch 1 x 512", "teacher decode_batch 2 x 256",
        "teacher decode_batch 2 x 512", "teacher decode_batch 3 x 256", "teacher decode_batch 3 x 512"]


def test_budgets_at_hand_are_the_verifications_already_made(ms_runtime, tiny_dir):
    """Without a verification graph made, one budget (the one nearest 4); after budget 8 was verified at width
    256, budget 8 alone while the step stays in that width, and one budget again past it."""
    from mindspore_eagle.runners.warmup import _verify, budgets_at_hand, verify_signature
    from mindspore_eagle.serving.pipeline import build_engine

    eng = build_engine(_cfg(tiny_dir, ["speculative.policy=adaptive"]))
    tg = eng.teacher
    assert eng.verify_budgets() == [2, 4, 8]
    assert budgets_at_hand(tg, [2, 4, 8], 40) == [2, 4, 8]              # on the host every budget is at hand
    tg.host = None                                                      # every teacher call a graph
    assert budgets_at_hand(tg, [2, 4, 8], 40) == [4] and budgets_at_hand(tg, [8, 16], 40) == [8]
    _verify(tg, 40, 8, 3)
    assert verify_signature(tg, 8, 256) in tg._fwd._seen
    assert budgets_at_hand(tg, [2, 4, 8], 100) == [8]
    assert budgets_at_hand(tg, [2, 4, 8], 300) == [4]                    # width 512: nothing made there yet
    assert budgets_at_hand(tg, [2, 4, 8], 509) == [2]                    # near the end only budget 2 fits


def test_warmup_rejects_unknown_mode(ms_runtime, tiny_dir):
    from mindspore_eagle.runners.warmup import warmup
    from mindspore_eagle.serving.pipeline import build_engine

    with pytest.raises(ValueError, match="warmup mode must be one of full, short, none, got 'fast'"):
        warmup(build_engine(_cfg(tiny_dir)), None, "fast")


RUN = textwrap.dedent("""
    import json, sys
    from mindspore_eagle.config import load_config
    from mindspore_eagle.serving.pipeline import build_engine
    from mindspore_eagle.serving.pipeline import prepare
    cfg = load_config(None, sys.argv[1:])
    eng = build_engine(cfg)
    eng.teacher.host = None               # every teacher call a graph (the host path stores none)
    lines = []
    out = prepare(eng, cfg, cfg.generation, "full", lines.append)
    gens = eng.chat(["What is the capital of France?", "And of Spain?", "Thanks"], cfg.generation)
    print(json.dumps({"warm": out, "log": lines, "ids": [g.token_ids for g in gens],
                      "compiles_after": [g.turn.compile_count for g in gens]}))
""")


def _run(tmp_path, tiny_dir):
    env = dict(os.environ, MSEAGLE_CACHE=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path), GLOG_v="3")
    res = subprocess.run([sys.executable, "-c", RUN, f"model.teacher={tiny_dir}", *TINY], capture_output=True,
                         text=True, env=env, timeout=900, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return dict(json.loads(res.stdout.strip().splitlines()[-1]), stderr=res.stderr)


@pytest.mark.slow
def test_a_chat_whose_shapes_an_earlier_process_compiled_compiles_nothing(tmp_path, tiny_dir):
    """The first process's full warm-up compiles the 7 teacher graphs and stores them (every drafter call has at
    most 16 rows here and runs on the host); a second process (a 3-turn chat) loads all 7 and compiles none, before
    or during its turns, and answers the same."""
    first = _run(tmp_path, tiny_dir)
    store = first["warm"]["graph_cache"]
    assert store and store.startswith(str(tmp_path / "cache" / "graphs"))
    assert (first["warm"]["compiles"], first["warm"]["loads"]) == (7, 0)
    assert len(os.listdir(os.path.join(store, "entries"))) == 2 * 7          # a graph and its record each
    assert any(ln.startswith("compiled graph 7: ") for ln in first["log"])
    second = _run(tmp_path, tiny_dir)
    assert (second["warm"]["compiles"], second["warm"]["loads"]) == (0, 7)
    assert any(ln.startswith("loaded graph 7: ") for ln in second["log"])
    assert second["compiles_after"] == [0, 0, 0] and second["ids"] == first["ids"]
