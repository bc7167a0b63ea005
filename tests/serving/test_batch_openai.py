"""Batch jobs in OpenAI's Batch API format (serving/batch_openai.py) and the server's request fields on native
records (serving/batch_job.py, ``generation.logprobs``).

Fast checks parse lines without a model: format detection, each line-level error, the server's own messages and
codes for bad bodies and bad native fields, resume keyed by ``custom_id``. Live checks run the tiny openPangu
teacher (teacher-only, a 64-slot context) in a batch job and in an in-process server of the same configuration
(test_api_server.py's ``start``): every OpenAI-format result's body equals the server's answer to the same body
(ids and timestamps aside), its 2 invalid requests get the server's error codes and messages, a job cut after 3
results and resumed after a partial line loses and repeats nothing, and native records honour ``max_tokens``, take
the ``developer`` role and carry the server's log-probabilities."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_api_server import live_config, post, start  # noqa: F401  (start: the in-process server fixture)
from tiny_engines import MODEL, tiny_overrides

from mindspore_eagle.serving import batch_job as batch
from mindspore_eagle.serving import openai_protocol as P
from mindspore_eagle.serving.batch_job import BatchError

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
SEA = [{"role": "user", "content": "Tell me about the sea."}]
REQUESTS = [      # (custom_id, url, body): mixed fields, then 2 the server refuses
    ("greedy", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 8}),
    ("dev-lp", CHAT, {"model": MODEL, "messages": [{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": [{"type": "text", "text": "Name"},
                                                                                {"type": "text", "text": "a fruit."}]}],
                      "max_tokens": 6, "logprobs": True, "top_logprobs": 3, "user": "u1", "n": 1}),
    ("sampled", CHAT, {"model": MODEL, "messages": SEA, "max_tokens": 10, "temperature": 1.5, "seed": 7,
                       "top_k": 50, "top_p": 0.9, "stop": ["\n\n"]}),
    ("to-the-end", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    ("raw", CMPL, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "logprobs": 2}),
    ("ids", CMPL, {"model": MODEL, "prompt": [50, 60, 70, 80], "max_tokens": 5}),
    ("too-hot", CHAT, {"model": MODEL, "messages": SEA, "temperature": 3}),
    ("too-long", CMPL, {"model": MODEL, "prompt": "word " * 10, "max_tokens": 1000}),
]
INVALID = ["too-hot", "too-long"]


def _line(cid, url, body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _no_engine():
    raise AssertionError("the engine must not be built")


def _body(b: dict) -> dict:
    """A response body without what differs from answer to answer (its id and timestamp)."""
    return {k: v for k, v in b.items() if k not in ("id", "created")}


# ------------------------------------------------------------------------------------------ parsing, fast --
def test_the_format_is_detected_by_the_first_json_object_or_given(tmp_path):
    lines = ["{broken", _line("a", CHAT, {"model": "m", "messages": SEA}), json.dumps({"id": 1, "prompt": "x"})]
    recs = batch.read_input(_write(tmp_path / "in.jsonl", lines))
    assert [r.fmt for r in recs] == ["openai"] * 3 and recs[1].kind == CHAT and recs[1].error == ""
    assert (recs[0].code, recs[2].code) == ("invalid_json", "missing_required_parameter")
    native = batch.read_input(tmp_path / "in.jsonl", "native")
    assert [r.fmt for r in native] == ["native"] * 3 and native[1].error == 'line 2: missing "id"'
    assert native[2].error == "" and batch.read_input(tmp_path / "in.jsonl", "openai")[2].fmt == "openai"
    with pytest.raises(BatchError, match="unknown batch input format 'jsonl'"):
        batch.read_input(tmp_path / "in.jsonl", "jsonl")
    with pytest.raises(BatchError, match='duplicate custom_id "a" on lines 1 and 2; custom_ids must be unique'):
        batch.read_input(_write(tmp_path / "dup.jsonl", [_line("a", CHAT, {}), _line("a", CMPL, {})]))


@pytest.mark.parametrize("text, code, message", [
    ('{"custom_id": "a", "body": {}', "invalid_json", "line 1: invalid JSON (Expecting ',' delimiter at column 30)"),
    ('[1]', "invalid_type", "line 1: a record must be a JSON object, got list"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}), "missing_required_parameter",
     'line 1: missing "custom_id"'),
    (json.dumps({"custom_id": 5, "method": "POST", "url": CHAT, "body": {}}), "invalid_type",
     "line 1: custom_id must be a string"),
    (json.dumps({"custom_id": "a", "url": CHAT, "body": {}}), "missing_required_parameter",
     "Missing required parameter: 'method'"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}), "invalid_value",
     'method = "GET" is not supported: a batch request is "POST"'),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}), "invalid_value",
     'url = "/v1/embeddings" is not supported: must be "/v1/chat/completions" or "/v1/completions"'),
    (_line("a", CHAT, {"model": "m", "messages": SEA, "stream": True}), "unsupported_parameter",
     "stream = true is not supported in a batch job: each result is one response body"),
])
def test_a_bad_line_is_that_records_error(text, code, message):
    from mindspore_eagle.serving import batch_openai

    rec = batch_openai.parse_record(1, 0, text)
    assert (rec.code, rec.error) == (code, message)
    assert batch.error_result(rec)["error"] == {"code": code, "message": message}


@pytest.mark.parametrize("url, body", [
    (CHAT, {"model": "m", "messages": SEA, "temperature": 3}),
    (CHAT, {"model": "m", "messages": SEA, "frobnicate": 1}),
    (CHAT, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
    (CHAT, {"model": "m", "messages": SEA, "top_logprobs": 2}),
    (CHAT, {"model": "m", "messages": SEA, "max_tokens": 4, "max_completion_tokens": 5}),
    (CHAT, {"model": "m", "messages": SEA, "stop": [""]}),
    (CHAT, {"messages": SEA}),
    (CMPL, {"model": "m", "prompt": ["a", "b"]}),
    (CMPL, {"model": "m", "prompt": "a", "logprobs": True}),
    (CMPL, {"model": "m", "prompt": "a", "echo": True}),
    (CMPL, "not an object"),
])
def test_a_bad_body_gets_the_servers_message_and_code(url, body):
    """The error of a body is the server's (parse_request, completion_prompt, generation_config,
    requested_logprobs: what the server raises before it runs a request, in its order)."""
    from mindspore_eagle.config import GenerationConfig
    from mindspore_eagle.serving import batch_openai

    with pytest.raises(P.APIError) as e:
        req = P.parse_request(P.ChatCompletionRequest if url == CHAT else P.CompletionRequest,
                              json.dumps(body).encode())
        if url == CMPL:
            P.completion_prompt(req)
        P.generation_config(req, GenerationConfig())
        P.requested_logprobs(req)
    rec = batch_openai.parse_record(3, 2, _line("x", url, body))
    assert (rec.id, rec.code, rec.error) == ("x", e.value.code, e.value.message) and rec.error


def test_the_body_names_the_served_model(tmp_path):
    recs = batch.read_input(_write(tmp_path / "in.jsonl", [_line("a", CHAT, {"model": "gpt-4o", "messages": SEA})]))
    stats = batch.run_batch(_no_engine, recs, tmp_path / "out.jsonl", None, model=MODEL, progress=False)
    assert stats.errors == 1 and _lines(tmp_path / "out.jsonl")[0]["error"] == {
        "code": "model_not_found", "message": f"The model 'gpt-4o' does not exist; this job serves '{MODEL}'"}


def test_errors_resume_by_custom_id_or_line_and_need_no_engine(tmp_path):
    lines = ["{oops", _line("a", "/v1/x", {}), _line("b", CHAT, {"model": "m", "messages": []}), "[]"]
    recs = batch.read_input(_write(tmp_path / "in.jsonl", lines))
    out = tmp_path / "out.jsonl"
    stats = batch.run_batch(_no_engine, recs[:2], out, None, progress=False)
    assert (stats.written, stats.errors) == (2, 2)
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_3", "custom_id": "b", "resp')          # a kill in the middle of a write
    stats = batch.run_batch(_no_engine, recs, out, None, resume=True, progress=False)
    assert (stats.skipped, stats.written, stats.errors) == (2, 2, 2)
    res = _lines(out)
    assert [(r["id"], r["custom_id"]) for r in res] == [("batch_req_1", None), ("batch_req_2", "a"),
                                                        ("batch_req_3", "b"), ("batch_req_4", None)]
    assert [batch.result_key(r) for r in res] == [r.key for r in recs] == ["line:1", 'id:"a"', 'id:"b"', "line:4"]
    assert all(r["response"] is None and set(r["error"]) == {"code", "message"} for r in res)
    assert batch.run_batch(_no_engine, recs, out, None, resume=True, progress=False).written == 0


# ------------------------------------------------------------------------------------- native fields, fast --
def test_native_records_take_the_servers_request_fields():
    assert set(batch.REQUEST_FIELDS) == set(P.ChatCompletionRequest.model_fields) - {"model", "messages",
                                                                                      *batch.GEN_FIELDS}

    def rec(**fields):
        return batch.parse_record(1, 0, json.dumps({"id": "s", "prompt": "hi", **fields}))

    assert rec(max_tokens=7).gen == {"max_new_tokens": 7} == rec(max_completion_tokens=7).gen
    assert rec(max_tokens=7, max_new_tokens=7).gen == {"max_new_tokens": 7}
    assert rec(logprobs=True, top_logprobs=3).gen == {"logprobs": 3} and rec(logprobs=False).gen == {"logprobs": None}
    assert rec(top_logprobs=0, user="u", n=1, stream=False).gen == {}
    for fields, words in [({"max_tokens": 0}, "max_tokens = 0 is out of range: must be an int >= 1"),
                          ({"max_tokens": 5, "max_new_tokens": 6}, "max_tokens and max_new_tokens disagree; give one "
                                                                   "of them"),
                          ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
                          ({"logprobs": 1}, "logprobs = 1 must be true or false"),
                          ({"n": 2}, "n = 2 is not supported by this server: one choice per request (n = 1)"),
                          ({"stream": True}, "stream = true is not supported in a batch job")]:
        assert rec(**fields).error == f'line 1 (id "s"): {words}', fields
    msgs = [{"role": "developer", "content": "Be brief.", "weight": 0.5},           # other keys: ignored
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"}]
    r = batch.parse_record(2, 1, json.dumps({"id": 2, "messages": msgs}))
    assert r.error == "" and r.payload == [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "a\nb"}]
    assert batch.parse_record(2, 1, json.dumps({"id": 2, "messages": []})).error == (
        "line 2 (id 2): Invalid value for 'messages': List should have at least 1 item after validation, not 0")


# ------------------------------------------------------------------------------------------------- live --
@pytest.fixture(scope="module")
def job(tiny_dir):
    """(engine, cfg) of a batch job on the live servers' configuration (test_api_server.live_config)."""
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = live_config(tiny_dir)
    return build_engine(cfg), cfg


@pytest.fixture(scope="module")
def openai_run(job, tmp_path_factory):
    """(input records, output lines) of the OpenAI-format file of REQUESTS, 2 rows per step, uninterrupted."""
    eng, cfg = job
    d = tmp_path_factory.mktemp("batch_openai")
    recs = batch.read_input(_write(d / "in.jsonl", [_line(*r) for r in REQUESTS]))
    stats = batch.run_batch(eng, recs, d / "out.jsonl", cfg.generation, max_batch=2, model=MODEL, progress=False)
    assert (stats.total, stats.written, stats.errors) == (len(REQUESTS), len(REQUESTS), len(INVALID))
    return recs, _lines(d / "out.jsonl")


def test_openai_results_are_the_servers_answers(start, openai_run):
    server = start()
    got = {r["custom_id"]: r for r in openai_run[1]}
    assert len(got) == len(REQUESTS)
    for n, (cid, url, body) in enumerate(REQUESTS, 1):
        r, line = post(server, url, body), got[cid]
        assert line["id"] == f"batch_req_{n}"
        if cid in INVALID:
            e = r.json()["error"]
            assert r.status_code == 400 and line["response"] is None, r.text
            assert line["error"] == {"code": e["code"], "message": e["message"]}
            continue
        assert r.status_code == 200 and line["error"] is None, (r.text, line)
        resp = line["response"]
        assert resp["status_code"] == 200 and resp["request_id"].startswith("req_")
        assert resp["body"]["id"].startswith("chatcmpl-" if url == CHAT else "cmpl-")
        assert _body(resp["body"]) == _body(r.json()), cid
    assert [got[c]["error"]["code"] for c in INVALID] == ["invalid_value", "context_length_exceeded"]
    lp = got["dev-lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(lp) >= 1 and all(len(e["top_logprobs"]) == 3 for e in lp)
    assert len(got["raw"]["response"]["body"]["choices"][0]["logprobs"]["tokens"]) >= 1
    assert got["greedy"]["response"]["body"]["choices"][0]["logprobs"] is None
    use = got["to-the-end"]["response"]["body"]["usage"]                 # an omitted max_tokens: the whole context
    assert use["total_tokens"] == 64 or got["to-the-end"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert got["ids"]["response"]["body"]["usage"]["completion_tokens"] <= 5


def test_openai_job_cut_and_resumed_loses_and_repeats_nothing(job, openai_run, tmp_path):
    eng, cfg = job
    recs, ref = openai_run
    out = tmp_path / "out.jsonl"
    batch.run_batch(eng, recs[:3], out, cfg.generation, max_batch=2, model=MODEL, progress=False)   # then killed
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_4", "custom_id": "to-the-end", "response": {"status_co')
    stats = batch.run_batch(eng, recs, out, cfg.generation, max_batch=2, model=MODEL, resume=True, progress=False)
    assert (stats.skipped, stats.written, stats.errors) == (3, len(REQUESTS) - 3, len(INVALID))
    res = _lines(out)
    assert sorted(r["custom_id"] for r in res) == sorted(c for c, _, _ in REQUESTS)   # each exactly once

    def strip(r):
        resp = r["response"] and {**r["response"], "request_id": None, "body": _body(r["response"]["body"])}
        return {**r, "response": resp}
    assert sorted(map(json.dumps, map(strip, res))) == sorted(map(json.dumps, map(strip, ref)))


@pytest.mark.parametrize("max_batch", [1, 2])
def test_native_max_tokens_developer_role_and_logprobs(start, job, tmp_path, max_batch):
    """A record's max_tokens is its length; a developer message runs as a system one; log-probabilities asked by
    the record (or by generation.logprobs) equal the server's chat logprobs for the same request."""
    server = start()
    eng, cfg = job
    brief = [{"role": "user", "content": "Name a fruit."}]
    lines = [{"id": "mt", "prompt": "What is the capital of France?", "max_tokens": 5},
             {"id": "dev", "messages": [{"role": "developer", "content": "Be brief."}, *brief], "max_tokens": 6},
             {"id": "sys", "messages": [{"role": "system", "content": "Be brief."}, *brief], "max_tokens": 6},
             {"id": "lp", "messages": SEA, "max_tokens": 6, "logprobs": True, "top_logprobs": 4},
             {"id": "off", "prompt": "Hi", "max_tokens": 3, "logprobs": False},
             {"id": "t", "turns": ["Hi", "Again"], "max_tokens": 3}]
    recs = batch.read_input(_write(tmp_path / "in.jsonl", [json.dumps(x) for x in lines]))
    gen = dataclasses.replace(cfg.generation, logprobs=2)             # the job's default: 2 alternatives
    stats = batch.run_batch(eng, recs, tmp_path / "out.jsonl", gen, max_batch=max_batch, progress=False)
    assert stats.errors == 0
    res = {r["id"]: r for r in _lines(tmp_path / "out.jsonl")}
    assert (res["mt"]["new_tokens"], res["mt"]["stop_reason"]) == (5, "length")
    assert res["dev"]["text"] == res["sys"]["text"] and res["dev"]["prompt_tokens"] == res["sys"]["prompt_tokens"]
    want = post(server, CHAT, {"model": MODEL, "messages": SEA, "max_tokens": 6, "logprobs": True,
                               "top_logprobs": 4}).json()["choices"][0]
    assert res["lp"]["text"] == want["message"]["content"] and res["lp"]["logprobs"] == want["logprobs"]["content"]
    want = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of "
                                                                                        "France?"}],
                               "max_tokens": 5, "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
    assert res["mt"]["logprobs"] == want["logprobs"]["content"] and len(want["logprobs"]["content"][0]
                                                                       ["top_logprobs"]) == 2
    assert "logprobs" not in res["off"]
    assert len(res["t"]["logprobs"]) == 2 and all(len(e["top_logprobs"]) == 2 for t in res["t"]["logprobs"]
                                                  for e in t)


def test_cli_reads_an_openai_file_and_names_the_served_model(tiny_dir, tmp_path, capsys, monkeypatch):
    from mindspore_eagle import cli

    monkeypatch.setenv("GLOG_v", "3")
    inp = _write(tmp_path / "in.jsonl", [_line("ok", CHAT, {"model": MODEL, "messages": SEA, "max_tokens": 4}),
                                         _line("other", CHAT, {"model": "gpt-4o", "messages": SEA})])
    sets = [a for s in tiny_overrides(tiny_dir) + ["cache.max_seq_len=64"] for a in ("--set", s)]
    argv = ["batch", "--input", str(inp), "--no-progress", "--warmup", "none", "--baseline", *sets]
    assert cli.main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 0
    res = {r["custom_id"]: r for r in _lines(tmp_path / "o.jsonl")}
    assert res["ok"]["response"]["body"]["model"] == MODEL and res["ok"]["response"]["body"]["usage"][
        "completion_tokens"] <= 4
    assert res["other"]["error"]["code"] == "model_not_found"
    assert "2 record(s) written (1 with an error)" in capsys.readouterr().err
    assert cli.main([*argv, "--output", str(tmp_path / "n.jsonl"), "--format", "native"]) == 0
    assert [r["error"] for r in _lines(tmp_path / "n.jsonl")] == ['line 1: missing "id"', 'line 2: missing "id"']
