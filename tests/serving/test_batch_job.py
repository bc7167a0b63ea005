"""Batch inference: record parsing, crash-safe appends and resume, sharding/merging (fast, with a fake engine),
then the real thing: ``python -m mindspore_eagle batch`` on the embedded SmolLM2 teacher, SIGKILLed part-way and
resumed, and a two-process ``msrun`` run (scripts/msrun_batch.sh), both compared with one uninterrupted run.

Real runs use teacher-only fused decoding (model.drafter=none: two compiled graphs with prefill_chunk 16),
8 new tokens, one CPU thread per process (the msrun workers get one each), so all runs compute identically.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from error_rows import check_row

from mindspore_eagle.config import GenerationConfig
from mindspore_eagle.serving import batch_job as batch
from mindspore_eagle.serving.batch_job import BatchError

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
REAL_SETTINGS = ["--set", "model.drafter=none", "--max-new-tokens", "8", "--set", "cache.max_seq_len=256",
                 "--set", "cache.num_blocks=32", "--set", "cache.prefill_chunk=16", "--set", "context.threads=1",
                 "--mode", "fused"]
REAL_RECORDS = [
    json.dumps({"id": "capital", "prompt": "What is the capital of France?"}),
    json.dumps({"id": "colors", "prompt": "Name three primary colors."}),
    '{"id": "broken", "prompt": "unterminated',
    json.dumps({"id": "chat", "turns": ["Say hello.", "Now say goodbye."]}),
    json.dumps({"id": "long", "prompt": "word " * 300}),
    json.dumps({"id": 6, "messages": [{"role": "system", "content": "You answer in one short sentence."},
                                      {"role": "user", "content": "What color is the sky?"}]}),
    json.dumps({"id": "water", "prompt": "What is water made of?"}),
]


@pytest.fixture(autouse=True)
def _quiet_mindspore_log(monkeypatch):
    """cli.guarded() sets GLOG_v with setdefault; keep that from leaking into later tests' environment."""
    monkeypatch.setenv("GLOG_v", os.environ.get("GLOG_v", "3"))


def _write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------- fake engine --
class FakeEngine:
    """Engine stand-in: the answer is the upper-cased last user message; 'TOO LONG' raises GenerationError."""

    def __init__(self):
        self.calls = []

    def generate(self, messages, gen, speculative=True, turn_id="", on_token=None):
        from mindspore_eagle.serving.engine import GenerationError

        text = messages if isinstance(messages, str) else messages[-1]["content"]
        if "TOO LONG" in text:
            raise GenerationError("prompt of 999 tokens + generation.max_new_tokens=8 = 1007 exceeds "
                                  "cache.max_seq_len=256")
        self.calls.append(text)
        return SimpleNamespace(token_ids=[1, 2, 3, 4], text=text.upper(), stop_reason="eos", prompt_tokens=len(text),
                               steps=[SimpleNamespace(accept_len=2, budget=8), SimpleNamespace(accept_len=3, budget=8)],
                               turn=SimpleNamespace(prefill_ms=500.0, decode_ms=1500.0))

    def chat(self, turns, gen, speculative=True, turn_id="", on_token=None):
        return [self.generate(t, gen, speculative) for t in turns]


def _no_engine():
    raise AssertionError("the engine must not be built")


FAKE_LINES = [json.dumps({"id": "a", "prompt": "hello"}),
              "",
              "{not json",
              json.dumps({"id": 2, "turns": ["one", "two"]}),
              json.dumps({"id": "m", "messages": [{"role": "user", "content": "hi"}], "category": "ignored"}),
              json.dumps({"id": "x", "prompt": "TOO LONG"}),
              json.dumps({"id": "y", "text": "no prompt key"})]


def _lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_parse_records_and_errors(tmp_path):
    recs = batch.read_input(_write(tmp_path / "in.jsonl", FAKE_LINES))
    assert [r.line for r in recs] == [1, 3, 4, 5, 6, 7] and [r.index for r in recs] == list(range(6))
    assert [r.kind for r in recs] == ["prompt", "", "turns", "messages", "prompt", ""]
    check_row("invalid JSON line (`batch`)", recs[1].error)
    check_row("record without a prompt (`batch`)", recs[5].error)
    assert recs[5].error == 'line 7 (id "y"): needs exactly one of "prompt", "messages", "turns" (got none)'


@pytest.mark.parametrize("line, words", [
    ('[1, 2]', "a record must be a JSON object, got list"),
    ('{"prompt": "hi"}', 'line 1: missing "id"'),
    ('{"id": true, "prompt": "hi"}', "id must be a string or an integer"),
    ('{"id": 1, "prompt": "  "}', '"prompt" must be a non-empty string'),
    ('{"id": 1, "prompt": "a", "turns": ["b"]}', "needs exactly one of"),
    ('{"id": 1, "turns": []}', '"turns" must be a non-empty list of non-empty strings'),
    ('{"id": 1, "messages": [{"role": "robot", "content": "x"}]}', "Invalid value for 'messages[0].role'"),
])
def test_bad_records(line, words):
    assert words in batch.parse_record(1, 0, line).error


def test_run_batch_writes_results_and_errors(tmp_path):
    out = tmp_path / "out.jsonl"
    recs = batch.read_input(_write(tmp_path / "in.jsonl", FAKE_LINES))
    eng = FakeEngine()
    stats = batch.run_batch(lambda: eng, recs, out, GenerationConfig(), progress=False)
    assert (stats.total, stats.written, stats.errors, stats.skipped) == (6, 6, 3, 0)
    res = _lines(out)
    assert [r["line"] for r in res] == [1, 3, 4, 5, 6, 7]
    assert res[0] == {"id": "a", "line": 1, "text": "HELLO", "prompt_tokens": 5, "new_tokens": 4, "tok_per_s": 2.0,
                      "mean_accept_len": 2.5, "stop_reason": "eos"}
    assert res[1]["id"] is None and res[1]["error"].startswith("line 3: invalid JSON")
    assert res[2]["text"] == ["ONE", "TWO"] and res[2]["new_tokens"] == [4, 4] and res[2]["tok_per_s"] == 2.0
    assert res[3]["text"] == "HI"
    assert res[4] == {"id": "x", "line": 6, "error": "prompt of 999 tokens + generation.max_new_tokens=8 = 1007 "
                                                      "exceeds cache.max_seq_len=256"}
    assert eng.calls == ["hello", "one", "two", "hi"]


def test_resume_cuts_partial_line_and_skips_done(tmp_path):
    out = tmp_path / "out.jsonl"
    recs = batch.read_input(_write(tmp_path / "in.jsonl", FAKE_LINES))
    batch.run_batch(FakeEngine(), recs[:2], out, GenerationConfig(), progress=False)
    with open(out, "ab") as f:
        f.write(b'{"id": 2, "line": 4, "text": ["ON')  # a kill in the middle of a write
    eng = FakeEngine()
    stats = batch.run_batch(eng, recs, out, GenerationConfig(), resume=True, progress=False)
    assert (stats.skipped, stats.written) == (2, 4)
    res = _lines(out)
    assert [r["line"] for r in res] == [1, 3, 4, 5, 6, 7]
    assert eng.calls == ["one", "two", "hi"]
    # resuming a finished job writes nothing and never builds the engine
    stats = batch.run_batch(_no_engine, recs, out, GenerationConfig(), resume=True, progress=False)
    assert (stats.skipped, stats.written) == (6, 0) and len(_lines(out)) == 6


def test_invalid_lines_need_no_engine(tmp_path):
    recs = batch.read_input(_write(tmp_path / "in.jsonl", ["{oops", "[]"]))
    stats = batch.run_batch(_no_engine, recs, tmp_path / "o.jsonl", GenerationConfig(), progress=False)
    assert stats.errors == 2


def test_empty_input(tmp_path):
    with pytest.raises(BatchError) as e:
        batch.read_input(_write(tmp_path / "empty.jsonl", ["", "   "]))
    check_row("empty input file", "error: " + str(e.value))


def test_duplicate_ids(tmp_path):
    with pytest.raises(BatchError) as e:
        batch.read_input(_write(tmp_path / "dup.jsonl", [json.dumps({"id": "a", "prompt": "x"}),
                                                         json.dumps({"id": 1, "prompt": "x"}),
                                                         json.dumps({"id": "a", "prompt": "y"})]))
    check_row("duplicate ids (`batch`)", "error: " + str(e.value))
    assert str(e.value).endswith('duplicate id "a" on lines 1 and 3; ids must be unique')


def test_ids_1_and_quoted_1_differ(tmp_path):
    recs = batch.read_input(_write(tmp_path / "in.jsonl", ['{"id": 1, "prompt": "x"}', '{"id": "1", "prompt": "y"}']))
    assert len({r.key for r in recs}) == 2


def test_output_exists_needs_resume_or_overwrite(tmp_path):
    recs = batch.read_input(_write(tmp_path / "in.jsonl", FAKE_LINES[:1]))
    out = tmp_path / "out.jsonl"
    batch.run_batch(FakeEngine(), recs, out, GenerationConfig(), progress=False)
    with pytest.raises(BatchError) as e:
        batch.run_batch(FakeEngine(), recs, out, GenerationConfig(), progress=False)
    check_row("output exists (`batch`)", "error: " + str(e.value))
    batch.run_batch(FakeEngine(), recs, out, GenerationConfig(), overwrite=True, progress=False)
    assert len(_lines(out)) == 1


def test_output_of_another_job_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    batch.run_batch(FakeEngine(), batch.read_input(_write(tmp_path / "a.jsonl", FAKE_LINES[:1])), out,
                    GenerationConfig(), progress=False)
    other = batch.read_input(_write(tmp_path / "b.jsonl", [json.dumps({"id": "zzz", "prompt": "q"})]))
    with pytest.raises(BatchError, match="not in this input"):
        batch.run_batch(FakeEngine(), other, out, GenerationConfig(), resume=True, progress=False)


def test_shard_and_merge_in_input_order(tmp_path):
    recs = batch.read_input(_write(tmp_path / "in.jsonl", FAKE_LINES))
    out = tmp_path / "out.jsonl"
    assert [r.index for r in batch.shard(recs, 1, 3)] == [1, 4]
    for rank in (2, 0):  # ranks finish in any order
        batch.run_batch(FakeEngine(), batch.shard(recs, rank, 3), batch.shard_path(out, rank), GenerationConfig(),
                        progress=False)
    with pytest.raises(BatchError, match="rank 1: 2 record"):
        batch.merge_shards(recs, out, 3)
    with pytest.raises(BatchError, match="rank 1"):
        batch.wait_and_merge(recs, out, 3, timeout_s=0.2, poll_s=0.05)
    batch.run_batch(FakeEngine(), batch.shard(recs, 1, 3), batch.shard_path(out, 1), GenerationConfig(),
                    progress=False)
    assert batch.merge_shards(recs, out, 3) == 6
    whole = tmp_path / "whole.jsonl"
    batch.run_batch(FakeEngine(), recs, whole, GenerationConfig(), progress=False)
    assert _lines(out) == _lines(whole)


def _boot_module():
    spec = importlib.util.spec_from_file_location("modelarts_boot", ROOT / "scripts" / "modelarts_boot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_modelarts_boot_merge_step_and_scheduler_role(tmp_path, monkeypatch, capsys):
    boot = _boot_module()
    inp = _write(tmp_path / "in.jsonl", FAKE_LINES)
    recs = batch.read_input(inp)
    out = tmp_path / "out.jsonl"
    for rank in range(2):
        batch.run_batch(FakeEngine(), batch.shard(recs, rank, 2), batch.shard_path(out, rank), GenerationConfig(),
                        progress=False)
    monkeypatch.setenv("RANK_ID", "1")
    monkeypatch.setenv("RANK_SIZE", "2")
    assert boot.main(["--input", str(inp), "--output", str(out), "--merge"]) == 0
    assert [r["line"] for r in _lines(out)] == [1, 3, 4, 5, 6, 7]
    monkeypatch.setenv("RANK_ID", "2")
    assert boot.main(["--input", str(inp), "--output", str(out), "--merge"]) == 2
    assert capsys.readouterr().err.strip().endswith("error: RANK_ID=2 is out of range for RANK_SIZE=2")
    monkeypatch.setenv("MS_ROLE", "MS_SCHED")  # msrun's scheduler process runs the boot file too
    assert boot.main(["--input", "/does/not/matter", "--output", "x"]) == 0


# ------------------------------------------------------------------------------------------- real model --
def _cli(*args) -> list:
    return [sys.executable, "-m", "mindspore_eagle", *args]


@pytest.fixture(scope="module")
def real_input(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("batch_in") / "prompts.jsonl", REAL_RECORDS)


@pytest.fixture(scope="module")
def reference(real_input, tmp_path_factory) -> list:
    """One uninterrupted run."""
    d = tmp_path_factory.mktemp("batch_ref")
    res = subprocess.run(_cli("batch", "--input", str(real_input), "--output", str(d / "ref.jsonl"), "--no-progress",
                              *REAL_SETTINGS), cwd=d, env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return _lines(d / "ref.jsonl")


def _by_key(results: list) -> dict:
    return {batch.result_key(r): r for r in results}


def _assert_same_records(results: list, ref: list) -> None:
    keys = [batch.result_key(r) for r in results]
    assert len(keys) == len(set(keys)) == len(REAL_RECORDS), keys  # every record exactly once
    assert [r["line"] for r in results] == list(range(1, len(REAL_RECORDS) + 1))  # input order
    ref_by = _by_key(ref)
    for r in results:
        want = ref_by[batch.result_key(r)]
        assert r.get("text") == want.get("text") and r.get("error") == want.get("error"), (r, want)


@pytest.mark.slow
def test_reference_run(reference):
    by = _by_key(reference)
    assert "Paris" in by['id:"capital"']["text"]
    assert isinstance(by['id:"chat"']["text"], list) and len(by['id:"chat"']["text"]) == 2
    assert by['id:"chat"']["new_tokens"][0] >= 1 and by["id:6"]["stop_reason"] in ("eos", "length")
    assert by["line:3"]["id"] is None
    check_row("invalid JSON line (`batch`)", by["line:3"]["error"])
    check_row("prompt longer than the context (`batch` record)", by['id:"long"']["error"])
    assert set(by['id:"capital"']) == {"id", "line", "text", "prompt_tokens", "new_tokens", "tok_per_s",
                                       "mean_accept_len", "stop_reason"}


@pytest.mark.slow
def test_sigkill_and_resume_lose_and_duplicate_nothing(real_input, reference, tmp_path):
    out, log = tmp_path / "out.jsonl", tmp_path / "killed.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(_cli("batch", "--input", str(real_input), "--output", str(out), "--no-progress",
                                     *REAL_SETTINGS), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"not killed part-way: {log.read_text()[-2000:]}"
    done = out.read_bytes().count(b"\n")
    assert 2 <= done < len(REAL_RECORDS)
    with open(out, "ab") as f:  # as if the kill had landed in the middle of a write
        f.write(b'{"id": "water", "line": 7, "text": "Wat')

    res = subprocess.run(_cli("batch", "--input", str(real_input), "--output", str(out), "--resume", "--no-progress",
                              *REAL_SETTINGS), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{done} already done" in res.stderr
    _assert_same_records(_lines(out), reference)

    before = out.read_bytes()
    res = subprocess.run(_cli("batch", "--input", str(real_input), "--output", str(out), "--resume", "--no-progress",
                              *REAL_SETTINGS), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "0 record(s) written" in res.stderr and out.read_bytes() == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_msrun_two_processes_match_one_process(real_input, reference, tmp_path):
    """scripts/msrun_batch.sh: 2 CPU workers (RANK_ID 0/1 from msrun), rank 0 merges in input order."""
    out = tmp_path / "out.jsonl"
    env = {**ENV, "WORKERS": "2", "MASTER_PORT": str(_free_port()), "LOG_DIR": str(tmp_path / "msrun_log"),
           "PYTHON": sys.executable}
    settings = [a for a in REAL_SETTINGS if a != "--no-progress"]
    res = subprocess.run(["bash", str(ROOT / "scripts" / "msrun_batch.sh"), str(real_input), str(out), *settings],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text(errors="replace")[-1500:] for p in sorted((tmp_path / "msrun_log").glob("*.log")))
    assert res.returncode == 0, res.stderr[-2000:] + logs
    for rank in (0, 1):
        shard = _lines(Path(batch.shard_path(out, rank)))
        assert [r["line"] for r in shard] == [i + 1 for i in range(len(REAL_RECORDS)) if i % 2 == rank]
    _assert_same_records(_lines(out), reference)


@pytest.mark.parametrize("text, reason", [('{"id": 3, "prompt": "unterminated', "Unterminated string starting at column 21"),
                                          ('{"id": 3 "prompt": 1}', "Expecting ',' delimiter at column 10")])
def test_invalid_json_reason_reads_once(text, reason):
    """json's own "starting at" reason never becomes "at at column"."""
    from mindspore_eagle.serving.batch_job import parse_record

    assert parse_record(4, 0, text).error == f"line 4: invalid JSON ({reason})"


# ------------------------------------------------------------------------------------ per-record sampling --
@pytest.mark.parametrize("fields, words", [
    ({"temperature": -1}, "temperature = -1.0 is out of range: must be a number in [0.0, 100.0]"),
    ({"top_p": 0}, "top_p = 0 is out of range: must be a number in (0.0, 1.0]"),
    ({"top_k": 2.5}, "top_k = 2.5 is out of range: must be an int >= 0"),
    ({"seed": -3}, "seed = -3 is out of range: must be an int >= 0"),
    ({"max_new_tokens": 0}, "max_new_tokens = 0 is out of range: must be an int in [1, 1048576]"),
    ({"stop": "x"}, "stop must be a list of non-empty strings"),
])
def test_a_bad_record_generation_field_is_that_records_error(fields, words):
    rec = batch.parse_record(4, 3, json.dumps({"id": "s", "prompt": "hi", **fields}))
    assert rec.error == f'line 4 (id "s"): {words}'
    if "temperature" in fields:
        check_row("bad generation field (`batch` record)", rec.error)


def test_record_generation_fields_override_the_jobs():
    rec = batch.parse_record(1, 0, json.dumps({"id": 1, "prompt": "hi", "temperature": 1, "seed": 5,
                                               "stop": ["\n"], "category": "ignored"}))
    assert rec.error == "" and rec.gen == {"temperature": 1.0, "seed": 5, "stop": ["\n"]}
    job = GenerationConfig(max_new_tokens=9, top_p=0.9)
    assert rec.generation(job) == GenerationConfig(max_new_tokens=9, top_p=0.9, temperature=1.0, seed=5,
                                                   stop=["\n"])
    plain = batch.parse_record(2, 1, json.dumps({"id": 2, "prompt": "hi"}))
    assert plain.gen == {} and plain.generation(job) is job


SAMPLED = [json.dumps({"id": f"s{i}", "prompt": "Tell me about the sea.", "temperature": 1.5, "seed": seed})
           for i, seed in enumerate((1, 2, 3, 1))]
GREEDY = [json.dumps({"id": "g1", "prompt": "Tell me about the sea."}),
          json.dumps({"id": "g2", "prompt": "What is the capital of France?", "max_new_tokens": 5})]


@pytest.mark.parametrize("max_batch", [1, 4])
def test_seeded_records_mixed_with_greedy_ones_and_resumed(tiny_dir, tmp_path, max_batch):
    """Four records of one prompt at temperature 1.5 (the tiny random teacher is too peaked at 0.8 for three
    seeds to differ), seeds 1, 2, 3, 1, between greedy ones: three different
    texts, the first equal to the last; the greedy records as the job's greedy config gives them; a second run,
    and a run stopped after three records then resumed, write the same results."""
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = load_config(None, [f"model.teacher={tiny_dir}", "model.drafter=none", "cache.block_size=8",
                             "cache.max_seq_len=256", "cache.num_blocks=64", "cache.prefill_chunk=16",
                             "generation.max_new_tokens=24"])
    eng = build_engine(cfg)
    inp = _write(tmp_path / "in.jsonl", [GREEDY[0], *SAMPLED, GREEDY[1]])
    recs = batch.read_input(inp)

    def run(out, records, resume=False):              # the fields that do not depend on timing
        batch.run_batch(eng, records, out, cfg.generation, resume=resume, progress=False, max_batch=max_batch)
        return {r["id"]: {k: r[k] for k in ("line", "text", "prompt_tokens", "new_tokens", "stop_reason")}
                for r in _lines(out)}

    first = run(tmp_path / "a.jsonl", recs)
    texts = [first[f"s{i}"]["text"] for i in range(4)]
    assert texts[0] == texts[3] and len(set(texts)) == 3, texts
    greedy = eng.generate("Tell me about the sea.", cfg.generation, speculative=False)
    assert first["g1"]["text"] == greedy.text and texts[0] != greedy.text
    assert first["g2"]["new_tokens"] == 5 and first["g2"]["stop_reason"] == "length"
    assert run(tmp_path / "b.jsonl", recs) == first
    run(tmp_path / "c.jsonl", recs[:3])
    assert run(tmp_path / "c.jsonl", recs, resume=True) == first


def load_config(path, sets):
    from mindspore_eagle.config import load_config as load

    return load(path, sets)
