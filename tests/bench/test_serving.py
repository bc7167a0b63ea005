"""bench/serving.py (``bench serve``), the script behind README's serving table, run end to end on the tiny
teacher: it starts the teacher-only and the speculative server one after the other, drives each with 1 and 2
streaming clients, and reports per row the requests served, the greedy texts equal to the first run's and the
graphs made after warm-up; the percentile helper against numpy."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mindspore_eagle.bench import serving


def test_percentiles_in_ms():
    xs = [0.010, 0.020, 0.030, 0.040]
    assert serving._pct(xs, 50) == round(float(np.percentile(xs, 50)) * 1e3, 2) == 25.0
    assert serving._pct([], 99) is None


def test_prompts_cycle_the_built_in_list_offline(monkeypatch):
    import mindspore_eagle.bench.batching as batching

    def offline(n, offset):
        raise OSError("no network")
    monkeypatch.setattr(batching, "chat_prompts", offline)
    prompts, source = serving.prompts_for(20, 0)
    assert source == "built-in prompts" and len(prompts) == 20
    assert prompts[16:] == serving.BUILTIN_PROMPTS[:4]


@pytest.mark.slow
def test_bench_serve_end_to_end_on_the_tiny_teacher(tiny, tiny_dir, tmp_path, monkeypatch):
    from tiny_engines import tiny_drafter_dir

    import mindspore_eagle.bench.batching as batching

    monkeypatch.setattr(batching, "chat_prompts", lambda n, offset: serving.BUILTIN_PROMPTS[offset:offset + n])
    d = tiny_drafter_dir(tmp_path, tiny[0])
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model:\n  teacher: {tiny_dir}\n  drafter: {d}\ncache:\n  block_size: 8\n  max_seq_len: 256\n"
                   "  prefill_chunk: 16\ncontext:\n  threads: 1\n  graph_cache: false\nspeculative:\n  policy: fixed\n  M: 4\n  D_max: 2\n"
                   "  top_k: 2\nserve:\n  model_name: tiny\n")
    out = tmp_path / "out"
    assert serving.main(["--config", str(cfg), "--clients", "1,2", "--prompts", "4", "--max-tokens", "12",
                         "--offset", "0", "--no-llamacpp", "--out", str(out), "--start-timeout", "300"]) == 0
    rep = json.loads((out / "serve_bench.json").read_text())
    rows = rep["rows"]
    assert [(r["server"], r["clients"]) for r in rows] == [
        ("mindspore-eagle teacher-only", 1), ("mindspore-eagle teacher-only", 2),
        ("mindspore-eagle speculative", 1), ("mindspore-eagle speculative", 2)]
    for r in rows:
        assert r["ok"] == r["requests"] == 4 and r["tokens"] > 0, r
        assert r["identical"] == "4 / 4", r                # greedy: every server and load gives the same texts
        assert r["graphs_after_warmup"] == 0, r
    assert rep["prompt_source"].startswith("ShareGPT")
    table = (out / "serve_bench.md").read_text().splitlines()
    assert sum(line.startswith("| mindspore-eagle") for line in table) == 4
