"""The OpenAI-compatible server (serving/api_server.py) as a real process on 127.0.0.1, talked to with the official
``openai`` client and raw HTTP (httpx): answers equal ``Engine.generate``'s greedy text, streamed text equals
non-streamed text, concurrent clients get their own answers, per-request sampling parameters take effect, a client
that disconnects frees its KV blocks, every bad request gets its status and an OpenAI-shaped JSON error, a failed
engine step fails only its requests, and SIGTERM drains and exits 0. The tiny openPangu teacher throughout. Servers
started and stopped within one test (the smoke test, the drain timeout, the embedded default): test_server_lifecycle.py;
the helpers: tests/tiny_engines.py, the ``reference`` fixture: conftest.py."""
from __future__ import annotations

import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_engines import GOOD, MODEL, ServerProcess, chat, chat_stream, metric, tiny_overrides, wait_for
from tiny_engines import SERVER_PROMPTS as PROMPTS

from mindspore_eagle.config import load_config


@pytest.fixture(scope="module")
def server(tiny_dir, tiny, tmp_path_factory):
    """Speculative tiny server, 16 rows: an untrained tiny drafter, trees of the fixed budget (M 4, D_max 2) gated
    per batch size, the single-sequence round for a lone sequence."""
    from tiny_engines import tiny_drafter_dir

    d = tiny_drafter_dir(tmp_path_factory.mktemp("server_drafter"), tiny[0])
    p = ServerProcess(tiny_overrides(tiny_dir, d) + ["serve.max_queue=64", "speculative.policy=fixed",
                                                     "speculative.M=4", "speculative.D_max=2", "speculative.top_k=2"],
                      ["--max-batch", "16"])
    try:
        yield p.ready()
    finally:
        p.stop()


@pytest.fixture(scope="module")
def small_server(tiny_dir):
    """Teacher-only tiny server with an API key, 2 rows and a queue of 1 (the SIGTERM test, last in this file,
    stops it)."""
    p = ServerProcess(tiny_overrides(tiny_dir) + ["serve.max_queue=1", "serve.drain_timeout_s=60",
                                                  "speculative.M=2", "speculative.top_k=2"],
                      ["--max-batch", "2", "--api-key", "sekret"])
    try:
        yield p.ready()
    finally:
        p.stop()


# ------------------------------------------------------------------------------------------------- answers --
@pytest.mark.slow
def test_health_models_and_metrics(server):
    assert 503 in server.warming                 # /health answered 503 while the warm-up ran
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.head(server.url + "/health").status_code == 200      # load balancers' probes (405 before)
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    m = server.metrics()
    assert metric(m, "mseagle_kv_blocks_total") == 16 * 256 // 8
    assert metric(m, "mseagle_num_requests_running") == 0
    ready = next(i for i, line in enumerate(server.lines) if line.startswith("ready in "))
    assert not any("compiled graph" in line for line in server.lines[ready:])   # nothing compiled on first use
    assert m[("mseagle_graphs_made_after_warmup", frozenset())] == 0


@pytest.mark.slow
def test_chat_greedy_equals_generate_streamed_or_not(server, reference):
    c = server.client()
    for prompt in PROMPTS[:3]:
        want = reference(prompt)
        r = chat(c, prompt)
        assert r.choices[0].message.content == want.text
        assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[want.stop_reason]
        assert r.usage.prompt_tokens == want.prompt_tokens and r.usage.completion_tokens == len(want.token_ids)
        text, finish, use = chat_stream(c, prompt)
        assert (text, finish) == (want.text, r.choices[0].finish_reason)
        assert use.completion_tokens == len(want.token_ids) and use.prompt_tokens == want.prompt_tokens


@pytest.fixture(scope="module")
def server32(tiny_dir, tiny, tmp_path_factory):
    """Speculative tiny server whose batched tree steps stay on the CPU kernels: 8 rows x M 4 = 32 rows (more take
    MatMul, which rounds sums differently), sequences of up to 1,280 tokens."""
    from tiny_engines import tiny_drafter_dir

    d = tiny_drafter_dir(tmp_path_factory.mktemp("server32_drafter"), tiny[0])
    p = ServerProcess(tiny_overrides(tiny_dir, d) + ["speculative.policy=fixed", "speculative.M=4",
                                                     "speculative.D_max=2", "speculative.top_k=2",
                                                     "speculative.method=hybrid", "cache.max_seq_len=1280",
                                                     "cache.num_blocks=160"],
                      ["--max-batch", "8"])
    try:
        yield p.ready()
    finally:
        p.stop()


@pytest.mark.slow
def test_logprobs_equal_teacher_only_alone_and_with_8_requests_in_flight(server32, reference, tiny_dir):
    """``logprobs: true, top_logprobs: 5`` through the openai client: the values equal a teacher-only run's
    log-softmax bit for bit, alone, with 8 other requests in flight (batched plain and tree steps of up to 32 rows)
    and streamed; completions' ``logprobs: 2`` likewise."""
    import dataclasses

    from mindspore_eagle.serving import openai_protocol as P

    eng = reference.engine
    gen = dataclasses.replace(load_config(None, tiny_overrides(tiny_dir)).generation, logprobs=5)
    prompt = PROMPTS[2]
    want_gen = eng.generate_ids(eng.encode_chat(prompt), gen, speculative=False)
    want = P.chat_logprobs(want_gen.logprobs, eng.tokenizer, eng.eos)["content"]
    assert want and len(want[0]["top_logprobs"]) == 5
    c = server32.client()

    def got(r):
        return [e.model_dump() for e in r.choices[0].logprobs.content]

    assert got(chat(c, prompt, logprobs=True, top_logprobs=5)) == want
    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(chat, c, p) for p in PROMPTS[3:11]]
        mine = pool.submit(chat, c, prompt, logprobs=True, top_logprobs=5)
        assert got(mine.result()) == want and all(o.result().choices[0].logprobs is None for o in others)
    m = server32.metrics()
    assert metric(m, "mseagle_steps_total", kind="tree") > 0            # trees were verified on the way
    streamed = []
    for ch in chat(c, prompt, stream=True, logprobs=True, top_logprobs=5):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [e.model_dump() for e in ch.choices[0].logprobs.content]
    assert streamed == want
    raw = eng.generate_ids(eng.tokenizer.encode("Once upon a time"), dataclasses.replace(gen, max_new_tokens=8,
                                                                                         logprobs=2), False)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, logprobs=2)
    lp = P.completion_logprobs(raw.logprobs, eng.tokenizer, eng.eos)
    assert r.choices[0].logprobs.token_logprobs == lp["token_logprobs"] and r.choices[0].logprobs.tokens == lp["tokens"]
    assert r.choices[0].logprobs.top_logprobs == lp["top_logprobs"]


@pytest.mark.slow
def test_1000_token_greedy_and_seeded_requests_equal_teacher_only(server32, tiny_dir):
    """A 1,000-token greedy request and a 1,000-token seeded sampled one (temperature 0.9, seed 5) through the
    speculative server equal the teacher alone decoding them with the same settings, token for token."""
    import dataclasses

    from mindspore_eagle.serving.pipeline import build_engine

    cfg = load_config(None, tiny_overrides(tiny_dir) + ["cache.max_seq_len=1280", "cache.num_blocks=160"])
    eng = build_engine(cfg)
    c = server32.client()
    for kw in ({}, {"temperature": 0.9, "seed": 5}):
        gen = dataclasses.replace(cfg.generation, max_new_tokens=1000, **kw)
        want = eng.generate_ids(eng.encode_chat(PROMPTS[1]), gen, speculative=False)
        r = chat(c, PROMPTS[1], max_tokens=1000, **kw)
        assert r.choices[0].message.content == want.text and r.usage.completion_tokens == len(want.token_ids), kw


@pytest.mark.slow
def test_completions_raw_prompt_streamed_or_not(server, reference):
    c = server.client()
    want = reference("Once upon a time", 12, raw=True)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 12
    pieces = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="Once upon a time",
                                                                 max_tokens=12, stream=True) if ch.choices]
    assert "".join(pieces) == want.text and len(pieces) > 2
    ids = reference.engine.tokenizer.encode("Once upon a time")
    assert c.completions.create(model=MODEL, prompt=ids, max_tokens=12).choices[0].text == want.text


@pytest.mark.slow
def test_16_concurrent_clients_get_their_own_answers(server, reference):
    want = {p: reference(p).text for p in PROMPTS}

    def ask(i):
        c = server.client()
        p = PROMPTS[i]
        return p, (chat_stream(c, p)[0] if i % 2 else chat(c, p).choices[0].message.content)

    before = metric(server.metrics(), "mseagle_generation_tokens_total")
    with ThreadPoolExecutor(16) as pool:
        got = dict(pool.map(ask, range(16)))
    assert got == want
    m = server.metrics()
    assert metric(m, "mseagle_steps_total", kind="tree") > 0 and metric(m, "mseagle_spec_tree_verifications_total") > 0
    assert metric(m, "mseagle_num_requests_running_peak") > 1               # requests shared teacher steps
    assert metric(m, "mseagle_kv_blocks_used") == 0
    assert metric(m, "mseagle_generation_tokens_total") - before == sum(len(reference(p).token_ids) for p in PROMPTS)
    assert m[("mseagle_graphs_made_after_warmup", frozenset())] == 0       # no request paid for a graph


@pytest.mark.slow
def test_per_request_sampling_parameters(server, reference):
    c = server.client()
    p = PROMPTS[0]
    a = chat(c, p, temperature=1.0, seed=7).choices[0].message.content
    assert chat(c, p, temperature=1.0, seed=7).choices[0].message.content == a       # same seed: same text
    assert chat(c, p, temperature=1.0, seed=8).choices[0].message.content != a       # another seed: another
    assert chat(c, p, temperature=1.0, seed=7, extra_body={"top_k": 1}).choices[0].message.content == \
        reference(p).text                                                            # top_k 1 is greedy
    r = chat(c, p, max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    full = reference(p).text
    stop = full[3:5]
    r = chat(c, p, stop=[stop, "never-there"])
    assert r.choices[0].message.content == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert chat_stream(c, p, stop=stop)[:2] == (full[: full.index(stop)], "stop")

    # temperature-0 rows batched with sampled rows stay greedy-exact; a seeded sampled row gives the same text in
    # a batch as alone (each token is drawn with the uniform of (seed, position), trees or not)
    def ask(i):
        cl = server.client()
        if i % 2:
            return chat(cl, PROMPTS[i], temperature=1.5, top_p=0.9, seed=i).choices[0].message.content
        return chat(cl, PROMPTS[i], temperature=0).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert [got[i] for i in range(0, 8, 2)] == [reference(PROMPTS[i]).text for i in range(0, 8, 2)]
    assert [got[i] for i in range(1, 8, 2)] == [ask(i) for i in range(1, 8, 2)]


def _blocks_in_use(server) -> bool:
    """One request running and blocks of both caches (teacher and drafter) holding its tokens."""
    m = server.metrics()
    return (metric(m, "mseagle_num_requests_running") == 1 and metric(m, "mseagle_kv_blocks_used") > 0
            and metric(m, "mseagle_drafter_kv_blocks_used") > 0)


def _all_blocks_back(server, cancelled_before: float) -> None:
    wait_for(lambda: metric(server.metrics(), "mseagle_request_success_total", finish_reason="cancelled")
             == cancelled_before + 1, what="the cancelled request")
    m = server.metrics()
    assert metric(m, "mseagle_num_requests_running") == 0
    assert metric(m, "mseagle_kv_blocks_used") == 0 and metric(m, "mseagle_kv_blocks_reserved") == 0
    assert metric(m, "mseagle_drafter_kv_blocks_used") == 0


@pytest.mark.slow
def test_disconnect_mid_stream_cancels_and_frees_teacher_and_drafter_blocks(server):
    before = metric(server.metrics(), "mseagle_request_success_total", finish_reason="cancelled")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 220, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if '"content": "' in line and '"role"' not in line)   # some text
        wait_for(lambda: _blocks_in_use(server), 10, "the running gauge and both caches in use")
    _all_blocks_back(server, before)


@pytest.mark.slow
def test_disconnect_without_streaming_cancels_and_frees_teacher_and_drafter_blocks(server):
    """A non-streamed client that closes its connection while its answer is computed (the 499 path)."""
    import socket
    from urllib.parse import urlsplit

    before = metric(server.metrics(), "mseagle_request_success_total", finish_reason="cancelled")
    u = urlsplit(server.url)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 220}).encode()
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: _blocks_in_use(server), 10, "the running gauge and both caches in use")
    _all_blocks_back(server, before)


# ------------------------------------------------------------------------------------------------- errors --
@pytest.mark.slow
@pytest.mark.parametrize("body, status, param, code", [
    (b'{"model": "tiny", "messages": [', 400, None, "invalid_json"),
    (b'[1, 2]', 400, None, "invalid_type"),
    ({"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ({"messages": GOOD["messages"]}, 400, "model", "missing_required_parameter"),
    ({**GOOD, "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({**GOOD, "temperature": 3}, 400, "temperature", "invalid_value"),
    ({**GOOD, "stop": 5}, 400, "stop", "invalid_type"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ({**GOOD, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({**GOOD, "messages": []}, 400, "messages", "invalid_value"),
    ({**GOOD, "messages": [{"role": "user", "content": " "}]}, 400, "messages", "invalid_value"),
    ({**GOOD, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ({**GOOD, "n": 2}, 400, "n", "unsupported_parameter"),
    ({**GOOD, "logprobs": 3}, 400, "logprobs", "invalid_type"),
    ({**GOOD, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ({**GOOD, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ({**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    ({**GOOD, "frequency_penalty": 1}, 400, "frequency_penalty", "unsupported_parameter"),
    ({**GOOD, "response_format": {"type": "json_object"}}, 400, "response_format", "unsupported_parameter"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "unsupported_parameter"),
    ({**GOOD, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({**GOOD, "messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages",
     "context_length_exceeded"),
    ({**GOOD, "max_tokens": 250}, 400, "max_tokens", "context_length_exceeded"),
])
def test_bad_chat_requests_get_openai_errors(server, body, status, param, code):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code), err
    assert "Traceback" not in r.text and err["message"]


@pytest.mark.slow
def test_error_words_limits_and_routes(server):
    url = server.url
    r = httpx.post(url + "/v1/chat/completions", json={**GOOD, "messages": [{"role": "user", "content": "word " * 300}]})
    assert re.fullmatch(r"prompt of \d+ tokens \+ generation.max_new_tokens=1 = \d+ exceeds cache.max_seq_len=256",
                        r.json()["error"]["message"])     # the command line's words (not even 1 token has room)
    big = json.dumps({**GOOD, "messages": [{"role": "user", "content": "a" * (1 << 20)}]})
    r = httpx.post(url + "/v1/chat/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "echo": True})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "echo")
    assert httpx.get(url + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    with pytest.raises(openai.BadRequestError) as e:
        chat(server.client(), "Hi", n=3)
    assert e.value.body["param"] == "n"
    m = server.metrics()
    assert metric(m, "mseagle_http_errors_total", status="413") >= 1
    assert chat(server.client(), "Hi", max_tokens=3).usage.completion_tokens == 3      # still serving


# ----------------------------------------------------------------------------------- failures inside a step --
def test_engine_step_exception_fails_its_requests_and_the_server_goes_on(ms_runtime, tiny_dir):
    """In-process server (uvicorn in a thread): the decode round raises once; the requests of that step get a 500
    JSON error (streamed: an error event, then [DONE]), the traceback is logged, and the next request is served."""
    import uvicorn

    from mindspore_eagle.serving.api_server import Server, build_app, serve_config
    from mindspore_eagle.serving.pipeline import build_engine
    from mindspore_eagle.serving.scheduler import BatchScheduler

    cfg = serve_config(load_config(None, tiny_overrides(tiny_dir) + ["serve.max_batch=2", "speculative.M=2",
                                                                     "speculative.top_k=2"]))

    def build():
        engine = build_engine(cfg)
        return engine, BatchScheduler(engine, cfg.generation, 2, single_round=True)

    server = Server(cfg, build, log_line=lambda line: None)
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=0, log_level="error"))
    th = threading.Thread(target=uv.run, daemon=True)
    th.start()
    wait_for(lambda: uv.started and server.engine.state == "ready", 120, "the in-process server")
    url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    try:
        sched = server.engine.sched
        rounds = [sched.round_one or sched.round, sched.round]
        real = [r.step for r in rounds]
        fail = {"n": 1}

        def boom(live, _real=real[0]):
            if fail["n"]:
                fail["n"] -= 1
                raise RuntimeError("injected fault")
            return _real(live)
        rounds[0].step = boom
        r = httpx.post(url + "/v1/chat/completions", json={**GOOD, "max_tokens": 8}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        assert "injected" not in r.text and "Traceback" not in r.text
        r = httpx.post(url + "/v1/chat/completions", json={**GOOD, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        fail["n"] = 1
        with httpx.stream("POST", url + "/v1/chat/completions", json={**GOOD, "max_tokens": 8, "stream": True},
                          timeout=60) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
        assert sched.kv_blocks_used() == 0 and sched.reserved == 0
        assert metric({(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(
            httpx.get(url + "/metrics").text) for s in fam.samples}, "mseagle_request_success_total",
            finish_reason="error") == 2
    finally:
        uv.should_exit = True
        th.join(30)


# ------------------------------------------------------------------------------------ auth, queue, SIGTERM --
@pytest.mark.slow
def test_api_key_required_on_v1_routes_and_teacher_only_batches(small_server, reference):
    url = small_server.url
    r = httpx.post(url + "/v1/chat/completions", json=GOOD)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        small_server.client(api_key="wrong").models.list()
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    c = small_server.client(api_key="sekret")
    assert chat(c, "Hi", max_tokens=2).usage.completion_tokens == 2
    with ThreadPoolExecutor(2) as pool:                 # teacher-only batches: greedy-exact too
        got = list(pool.map(lambda p: chat(c, p).choices[0].message.content, PROMPTS[:2]))
    assert got == [reference(p).text for p in PROMPTS[:2]]
    # teacher-only, a seeded sampled request draws once per token from its own generator: batched or alone, same text
    alone = chat(c, PROMPTS[2], temperature=1.0, seed=3).choices[0].message.content
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda q: chat(c, q[0], temperature=q[1], seed=3).choices[0].message.content,
                            [(PROMPTS[2], 1.0), (PROMPTS[3], 0.7)]))
    assert got[0] == alone


@pytest.mark.slow
def test_full_queue_answers_429(small_server):
    """2 rows + a queue of 1: of 8 simultaneous long requests, 3 run and the others get 429 at once."""
    def ask(i):
        r = httpx.post(small_server.url + "/v1/chat/completions", timeout=120,
                       headers={"Authorization": "Bearer sekret"}, json={**GOOD, "max_tokens": 200})
        return r.status_code, r.json()

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(ask, range(8)))
    codes = sorted(c for c, _ in out)
    assert codes.count(200) >= 3 and codes.count(429) >= 3, codes
    assert all(b["error"]["code"] == "queue_full" for c, b in out if c == 429)


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(small_server):
    body = {**GOOD, "max_tokens": 200, "stream": True}
    events = []

    def stream():
        with httpx.stream("POST", small_server.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer sekret"}) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))
    th = threading.Thread(target=stream)
    th.start()
    wait_for(lambda: len(events) >= 2 or metric(small_server.metrics(), "mseagle_num_requests_running") == 1,
             what="the stream to start")
    small_server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: any("SIGTERM" in line for line in small_server.lines), 10, "the drain to start")
    try:                                 # a new request during the drain is not admitted: the listening socket is
        late = httpx.post(small_server.url + "/v1/chat/completions", json=GOOD, timeout=30,   # closed, or (in the
                          headers={"Authorization": "Bearer sekret"})                          # moment before) 503
    except httpx.TransportError:
        pass
    else:
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
    th.join(120)
    assert small_server.proc.wait(60) == 0, small_server.log()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(small_server.url + "/health")
    assert any("SIGTERM" in line for line in small_server.lines)


def test_requests_while_warming_up_or_shutting_down_get_503():
    """The readiness check behind every /v1 route: 503 ``warming_up`` while the engine thread still builds and warms
    the engine, 503 ``shutting_down`` once it stopped (the window between SIGTERM and the socket closing)."""
    from types import SimpleNamespace

    from mindspore_eagle.serving.api_server import Server
    from mindspore_eagle.serving.openai_protocol import APIError

    for state, ready, code in (("starting", False, "warming_up"), ("stopped", False, "shutting_down")):
        with pytest.raises(APIError) as e:
            Server.check_ready(SimpleNamespace(engine=SimpleNamespace(state=state, ready=ready)))
        assert (e.value.status, e.value.code) == (503, code)
    assert Server.check_ready(SimpleNamespace(engine=SimpleNamespace(state="ready", ready=True))) is None
