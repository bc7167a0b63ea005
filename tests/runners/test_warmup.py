"""Warm-up (issue 15, finding 2) and the on-disk graph cache (finding 1), on the tiny openPangu teacher.

After a full warm-up no turn of a chat compiles anything, whatever its length; the warm-up visits an exact,
known list of shapes; a second process loads the same graphs from disk and produces the same tokens; a damaged
cache is dropped and rebuilt.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from mindspore_eagle.config import load_config

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
    t = [what for what, _ in teacher_shapes(eng.teacher, eng.verify_budgets(), 3)]
    assert t == ["teacher prefill 16 x 256", "teacher decode 1 x 256", "teacher verify 8 x 256",
                 "teacher prefill 16 x 512", "teacher decode 1 x 512", "teacher verify 8 x 512"]
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
    """max_batch 3 with trees: the warm-up also compiles decode_batch (3 rows) and verify_batch (3 x M rows) at each
    width, after which a continuous-batching run over short and long prompts (both widths, tree and plain steps)
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
    assert [w for w, _ in batch_shapes(eng.teacher, 3, 8, 3, True)] == [
        "teacher decode_batch 3 x 256", "teacher verify_batch 24 x 256",
        "teacher decode_batch 3 x 512", "teacher verify_batch 24 x 512"]
    assert list(batch_shapes(eng.teacher, 1, 8, 3, True)) == []
    assert [w for w, _ in drafter_batch_shapes(eng.drafter, 3, 8, 3, eng.teacher.S)] == (
        [f"drafter context 3 x {b} x 256" for b in (1, 2, 4, 8, 16)] + ["drafter expansion 3 x 2 x 256"]
        + [f"drafter context 3 x {b} x 512" for b in (1, 2, 4, 8, 16)] + ["drafter expansion 3 x 2 x 512",
                                                                          "drafter expansion 3 x 2 x 520"])
    out = warmup(eng, cfg.generation, "full", max_batch=3)
    # one-sequence graphs (test above) 20; teacher decode_batch + verify_batch at 2 widths 4; drafter: context
    # passes of 3 x b rows at 2 widths 10 + expansion (3 x 2 rows) at 256, 512 and 520 3
    assert out["compiles"] == 20 + 4 + 13
    before = eng.teacher.compiles + eng.drafter.compiles
    recs = records([{"id": i, "prompt": p} for i, p in enumerate(["Hi", LONG, "Thanks", "What is 2+2?"])])
    sched = BatchScheduler(eng, cfg.generation, 3, speculative=True)
    sched.round.gate = ScriptedGate(["tree", "plain", "tree"])
    got = {}
    sched.run(recs, lambda res: got.setdefault(res["id"], res))
    assert len(got) == 4 and all("error" not in r for r in got.values())
    assert sched.round.gate.seen == {"tree", "plain"}
    assert eng.teacher.compiles + eng.drafter.compiles == before


def test_compiles_on_first_use_are_reported(ms_runtime, tiny_dir):
    """Issue 15 finding 1: no silent compiling: a note, then one line per graph (name, rows x width, seconds)."""
    import re

    from mindspore_eagle.kernels import runtime
    from mindspore_eagle.runners.warmup import report_compiles
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = _cfg(tiny_dir, ["model.drafter=none"])
    eng = build_engine(cfg)
    lines = []
    report_compiles(lines.append)
    try:
        eng.generate("Hi", cfg.generation, speculative=False)
    finally:
        runtime.set_compile_listener(None)
    assert lines[0].startswith("compiling graphs on first use")
    # prefill of the 16-row bucket, then one decode row, both over the 256-slot width
    assert [re.sub(r"in \d+\.\d s$", "in S", ln) for ln in lines[1:]] == [
        "compiled graph 1: LlamaModel.construct 16 x 256 in S", "compiled graph 2: LlamaModel.construct 1 x 256 in S"]
    assert eng.teacher.compiles == 2


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
    lines = []
    out = prepare(eng, cfg, cfg.generation, "full", lines.append)
    g = eng.generate("What is the capital of France?", cfg.generation)
    print(json.dumps({"warm": out, "log": lines, "ids": g.token_ids, "compiles_after": g.turn.compile_count}))
""")


def _run(tmp_path, tiny_dir):
    env = dict(os.environ, MSEAGLE_CACHE=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", RUN, f"model.teacher={tiny_dir}", *TINY], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return dict(json.loads(res.stdout.strip().splitlines()[-1]), stderr=res.stderr)


@pytest.mark.slow
def test_graph_cache_reused_by_next_process_and_rebuilt_when_damaged(tmp_path, tiny_dir):
    first = _run(tmp_path, tiny_dir)
    cdir = first["warm"]["graph_cache"]
    assert cdir and cdir.startswith(str(tmp_path / "cache" / "graphs"))
    assert first["log"][0].startswith("warm-up: compiling and saving all graphs")
    files = sorted(os.listdir(os.path.join(cdir, "rank_0", "graph_cache")))
    assert len([f for f in files if f.endswith(".mindir")]) == 20
    assert json.load(open(os.path.join(cdir, "complete.json")))["compiles"] == 20

    assert sorted(os.listdir(tmp_path / "cache" / "graphs")) == [os.path.basename(cdir)]   # no .tmp<pid> left
    second = _run(tmp_path, tiny_dir)
    assert second["log"][0].startswith("warm-up: loading all graphs")
    assert "dependency files hash failed" not in second["stderr"]      # MindSpore really used the cached graphs
    assert (second["warm"]["graph_cache"], second["ids"], second["compiles_after"]) == (cdir, first["ids"], 0)

    for f in files:                       # damage every cached graph: the warm-up must drop them and compile
        if f.endswith(".mindir"):
            with open(os.path.join(cdir, "rank_0", "graph_cache", f), "wb") as fh:
                fh.write(b"not a graph")
    third = _run(tmp_path, tiny_dir)
    assert third["ids"] == first["ids"] and third["compiles_after"] == 0
    assert third["warm"]["compiles"] == 20
