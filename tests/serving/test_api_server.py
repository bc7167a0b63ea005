"""The server's routes and options beside the completions themselves (serving/api_server.py): an omitted
``max_tokens`` takes the whole room the context has left, ``POST /tokenize`` / ``POST /detokenize`` (vLLM's shapes),
CORS headers, the access log and log level, and ``serve.request_timeout_s``; their ``serve.`` keys and CLI flags.

Live checks run an in-process server (uvicorn in a thread, the ``serve`` path: ``Server``, ``build_app``,
``uvicorn_config``, warm-up none) of the tiny openPangu teacher, teacher-only, with a 64-slot context; the
helpers (``tiny_overrides``, ``wait_for``, ``GOOD``, ``MODEL``) are test_server.py's."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from types import SimpleNamespace

import httpx
import pytest
from test_server import GOOD, MODEL, tiny_overrides, wait_for

from mindspore_eagle.config import ConfigError, load_config

CONTEXT = 64                 # cache.max_seq_len of the live servers: prompt + generated tokens
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["What is the capital of France?", "  two  spaces\nand a line", "系统：你好", "def add(a, b): return a + b",
         ""]


def live_config(tiny_dir, *sets):
    """The serve_config of the live servers: the tiny teacher alone, CONTEXT-slot sequences, an API key, port 0."""
    from mindspore_eagle.serving.api_server import serve_config

    return serve_config(load_config(None, tiny_overrides(tiny_dir) + [
        f"cache.max_seq_len={CONTEXT}", f"serve.api_key={KEY}", "serve.port=0", "serve.max_batch=2", *sets]))


@pytest.fixture(scope="module")
def start(tiny_dir):
    """``start(*sets)``: the in-process server of ``live_config(tiny_dir, *sets)`` (one per ``sets``, started once),
    ready, with ``url`` set; all are stopped after the module."""
    import uvicorn

    from mindspore_eagle.serving.api_server import Server, build_app, uvicorn_config

    running: dict = {}

    def start_one(*sets):
        if sets not in running:
            cfg = live_config(tiny_dir, *sets)
            server = Server(cfg, log_line=lambda line: None, warmup="none")
            uv = uvicorn.Server(uvicorn_config(build_app(server), cfg))
            th = threading.Thread(target=uv.run, daemon=True)
            th.start()
            running[sets] = server, uv, th
            wait_for(lambda: server.engine.state in ("ready", "failed") and uv.started, 300, "the in-process server")
            assert server.engine.state == "ready", server.failed_exc
            server.url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
        return running[sets][0]

    yield start_one
    for _, uv, th in running.values():
        uv.should_exit = True
        th.join(30)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """In-process teacher-only engine of the live config: what a request must get."""
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = live_config(tiny_dir)
    return build_engine(cfg), cfg.generation


def post(server, path, body, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, headers=headers,
                      **({"content": body} if isinstance(body, bytes) else {"json": body}), **kw)


def sse(server, body) -> list:
    """The ``data:`` payloads of a streamed chat completion (``[DONE]`` as a string, the others parsed)."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


# -------------------------------------------------------------------------------------- omitted max_tokens --
def test_an_omitted_max_tokens_runs_to_the_end_of_turn_or_of_the_context(start, reference):
    """Chat and completions without ``max_tokens`` generate what the teacher alone generates with max_new_tokens =
    CONTEXT - prompt (no speculation: no extra slots): the same text and token count; where it ends by length,
    exactly the room. ``generation.max_new_tokens`` (24 here) plays no part."""
    eng, gen = reference
    server = start()
    finishes = []
    for i, text in enumerate(TEXTS[:4] + ["Hi", "Once upon a time"]):
        chat_route = i % 2 == 0
        ids = eng.encode_chat(text) if chat_route else eng.tokenizer.encode(text)
        room = CONTEXT - len(ids)
        want = eng.generate_ids(ids, dataclasses.replace(gen, max_new_tokens=room), speculative=False)
        body = ({"model": MODEL, "messages": [{"role": "user", "content": text}]} if chat_route
                else {"model": MODEL, "prompt": text})
        r = post(server, "/v1/chat/completions" if chat_route else "/v1/completions", body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice, use = out["choices"][0], out["usage"]
        assert (choice["message"]["content"] if chat_route else choice["text"]) == want.text
        assert use["prompt_tokens"] == len(ids) and use["completion_tokens"] == len(want.token_ids)
        assert choice["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[want.stop_reason]
        if choice["finish_reason"] == "length":
            assert use["completion_tokens"] == room > gen.max_new_tokens
        finishes.append(choice["finish_reason"])
    assert "length" in finishes, finishes                       # the context's end was reached at least once


def test_explicit_max_tokens_must_fit_and_a_full_prompt_has_no_room(start, reference):
    eng, _ = reference
    server = start()
    ids = eng.encode_chat("Hi")
    room = CONTEXT - len(ids)
    r = post(server, "/v1/chat/completions", {**GOOD, "max_tokens": room + 1})
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (400, "max_tokens", "context_length_exceeded")
    assert err["message"] == (f"prompt of {len(ids)} tokens + max_tokens={room + 1} = {CONTEXT + 1} "
                              f"exceeds cache.max_seq_len={CONTEXT}")
    r = post(server, "/v1/chat/completions", {**GOOD, "max_tokens": room})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= room
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * CONTEXT})
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (400, "prompt", "context_length_exceeded")
    assert err["message"] == (f"prompt of {CONTEXT} tokens + generation.max_new_tokens=1 = {CONTEXT + 1} exceeds "
                              f"cache.max_seq_len={CONTEXT}")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * (CONTEXT - 1)})   # room for one token
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


@pytest.mark.parametrize("S, NB, B, extra", [(64, 8, 8, 0), (64, 8, 8, 4), (64, 4, 8, 4), (256, 40, 8, 16)])
def test_fit_gives_an_omitted_max_tokens_the_whole_room_and_it_always_fits(S, NB, B, extra):
    """``Server.fit`` on the scheduler's own ``fit_error``: an omitted max_tokens becomes min(S, NB * B) - prompt -
    extra_slots, which fits and is the most that fits; with no room at all, a 400 naming the prompt's field."""
    from mindspore_eagle.serving.api_server import Server
    from mindspore_eagle.serving.openai_protocol import APIError
    from mindspore_eagle.serving.scheduler import BatchScheduler

    sched = SimpleNamespace(S=S, NB=NB, B=B, extra_slots=extra, blocks_for=lambda n: -(-n // B))
    sched.fit_error = lambda p, n: BatchScheduler.fit_error(sched, p, n)
    server = SimpleNamespace(engine=SimpleNamespace(sched=sched))
    server.context_len = lambda: Server.context_len(server)
    gen = load_config(None, []).generation
    for prompt in range(1, min(S, NB * B) + 2):
        room = min(S, NB * B) - prompt - extra
        if room >= 1:
            got = Server.fit(server, prompt, gen, False, "messages").max_new_tokens
            assert got == room and not sched.fit_error(prompt, got) and sched.fit_error(prompt, got + 1)
            continue
        with pytest.raises(APIError) as e:
            Server.fit(server, prompt, gen, False, "prompt")
        assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "context_length_exceeded")
    with pytest.raises(APIError) as e:                           # an explicit max_tokens is never cut
        Server.fit(server, 1, dataclasses.replace(gen, max_new_tokens=S), True, "messages")
    assert e.value.param == "max_tokens"


# ------------------------------------------------------------------------------------ tokenize / detokenize --
def test_tokenize_equals_the_tokenizer_and_detokenize_inverts_it(start, reference):
    eng, _ = reference
    tok = eng.tokenizer
    server = start()
    for text in TEXTS:
        r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
        assert r.status_code == 200, r.text
        assert r.json() == {"count": len(tok.encode(text)), "max_model_len": CONTEXT, "tokens": tok.encode(text)}
        bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert bare == tok.encode(text, add_bos=False) and len(bare) == len(tok.encode(text)) - 1
        assert post(server, "/detokenize", {"model": MODEL, "tokens": bare}).json() == {"prompt": text}
        with_bos = post(server, "/detokenize", {"tokens": tok.encode(text)}).json()["prompt"]
        assert with_bos == tok.decode(tok.encode(text)) == "<s>" + text      # special tokens kept as strings
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    r = post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    assert r["tokens"] == tok.encode_chat(messages) == eng.encode_chat(messages) and r["count"] == len(r["tokens"])
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r["count"]             # what a chat completion runs
    r = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert r["tokens"] == tok.encode_chat(messages, add_generation_prompt=False)
    assert len(r["tokens"]) < len(tok.encode_chat(messages))
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/tokenize", b'{"prompt": ', 400, None, "invalid_json"),
    ("/tokenize", b'[1]', 400, None, "invalid_type"),
    ("/tokenize", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt", "invalid_type"),
    ("/tokenize", {"model": MODEL, "prompt": ["a"]}, 400, "prompt", "invalid_type"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens",
     "invalid_type"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model", "model_not_found"),
    ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_type"),
    ("/tokenize", {**GOOD, "add_generation_prompt": 1}, 400, "add_generation_prompt", "invalid_type"),
    ("/tokenize", {**GOOD, "prompt": "a"}, 400, "prompt", "unknown_parameter"),
    ("/detokenize", {"model": MODEL}, 400, "tokens", "missing_required_parameter"),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens", "invalid_type"),
    ("/detokenize", {"model": MODEL, "tokens": [1, "2"]}, 400, "tokens[1]", "invalid_type"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 400]}, 400, "tokens[1]", "invalid_value"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens[0]", "invalid_value"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model", "model_not_found"),
])
def test_bad_tokenize_requests_name_the_field(start, path, body, status, param, code):
    r = post(start(), path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err


def test_tokenize_routes_need_the_api_key(start):
    server = start()
    assert post(server, "/detokenize", {"tokens": [1, 400]}).json()["error"]["message"] == \
        "tokens[1] = 400 is not a token id (0 <= id < 400)"
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = post(server, path, body, headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
        assert post(server, path, body).status_code == 200


# ------------------------------------------------------------------------------------------ request timeout --
def test_a_request_over_the_timeout_is_cancelled_with_a_504(start):
    """``serve.request_timeout_s`` 0.001: a chat request (it would run to the context's end) gets 504
    ``request_timeout`` in OpenAI's error shape; streamed, the role chunk, the error event and ``[DONE]``; its KV
    blocks go back, and routes that do not generate are not cut."""
    server = start("serve.request_timeout_s=0.001")
    r = post(server, "/v1/chat/completions", GOOD)
    assert r.status_code == 504, r.text
    assert r.json() == {"error": {"message": "the request ran longer than serve.request_timeout_s=0.001 s and was "
                                             "cancelled", "type": "server_error", "param": None,
                                  "code": "request_timeout"}}
    events = sse(server, GOOD)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1] == "[DONE]"
    assert events[-2] == r.json() and len(events) >= 3
    sched = server.engine.sched
    wait_for(lambda: sched.kv_blocks_used() == 0 and sched.reserved == 0 and not sched.live, 30, "the blocks")
    m = httpx.get(server.url + "/metrics").text
    assert 'mseagle_http_errors_total{status="504"} 2.0' in m
    assert post(server, "/tokenize", {"prompt": "a"}).status_code == 200
    assert start().cfg.serve.request_timeout_s == 0                      # the default: no limit


# ---------------------------------------------------------------------------------------- CORS, logging --
def _app(tiny_dir, *sets):
    """The app of a server that is never started (no lifespan): headers only."""
    from starlette.testclient import TestClient

    from mindspore_eagle.serving.api_server import Server, build_app

    return TestClient(build_app(Server(live_config(tiny_dir, *sets), build=lambda: None, log_line=lambda line: None)))


def test_cors_headers_only_for_the_configured_origins(tiny_dir):
    origin = "https://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    plain = _app(tiny_dir)
    r = plain.get("/health", headers={"Origin": origin})
    assert r.status_code == 503 and not any(h.startswith("access-control-") for h in r.headers)
    assert plain.options("/v1/chat/completions", headers=preflight).status_code == 405
    app = _app(tiny_dir, f'serve.cors_origins=["{origin}", "http://localhost:3000"]')
    r = app.get("/health", headers={"Origin": origin})
    assert r.status_code == 503 and r.headers["access-control-allow-origin"] == origin
    r = app.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert {"authorization", "content-type"} <= {h.strip() for h in r.headers["access-control-allow-headers"]
                                                 .lower().split(",")}
    assert "POST" in r.headers["access-control-allow-methods"]
    r = app.get("/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = app.post("/tokenize", json={"prompt": "a"}, headers={"Origin": origin})     # errors carry them too
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
    star = _app(tiny_dir, 'serve.cors_origins=["*"]').get("/metrics", headers={"Origin": "https://any.example"})
    assert star.headers["access-control-allow-origin"] == "*"


class _Lines(logging.Filter):
    """Keeps the messages a logger handles (a logger filter: it adds no handler, so it changes nothing)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record) -> bool:
        self.lines.append(record.getMessage())
        return True


def test_access_log_and_log_level_configure_uvicorn(start, tiny_dir):
    """``uvicorn_config`` (what ``serve`` runs) sets uvicorn's loggers from ``serve.log_level`` and
    ``serve.access_log``: off, a request logs no access line; on, one line per request even at level error."""
    from mindspore_eagle.serving.api_server import uvicorn_config

    server = start()
    access, lines = logging.getLogger("uvicorn.access"), _Lines()
    access.addFilter(lines)
    try:
        uvicorn_config(None, live_config(tiny_dir))
        assert not access.hasHandlers() and logging.getLogger("uvicorn.error").level == logging.WARNING
        assert post(server, "/tokenize", {"prompt": "a"}).status_code == 200
        assert lines.lines == []
        config = uvicorn_config(None, live_config(tiny_dir, "serve.access_log=true", "serve.log_level=error"))
        assert config.access_log and logging.getLogger("uvicorn.error").level == logging.ERROR
        assert access.level == logging.INFO and access.hasHandlers()
        assert post(server, "/detokenize", {"tokens": [5]}).status_code == 200
        assert len(lines.lines) == 1 and '"POST /detokenize HTTP/1.1" 200' in lines.lines[0], lines.lines
        uvicorn_config(None, live_config(tiny_dir, "serve.access_log=true", "serve.log_level=debug"))
        assert access.level == logging.DEBUG
    finally:
        access.removeFilter(lines)
        uvicorn_config(None, live_config(tiny_dir))             # back to the default: warning, no access log


# ------------------------------------------------------------------------------------------ keys and flags --
@pytest.mark.parametrize("override, message", [
    ("serve.cors_origins=https://a.example", "serve.cors_origins = 'https://a.example' must be a list of origins, "
                                             "e.g. [\"https://example.com\"] ([] = no CORS headers)"),
    ('serve.cors_origins=["https://a.example/"]', "serve.cors_origins[0] = 'https://a.example/' must be \"*\" or an "
                                                  "origin scheme://host[:port] without a path, e.g. "
                                                  "https://example.com"),
    ("serve.cors_origins=[3]", "serve.cors_origins[0] = 3 must be \"*\" or an origin scheme://host[:port] without "
                               "a path, e.g. https://example.com"),
    ("serve.access_log=1", "serve.access_log must be true or false, got 1"),
    ("serve.log_level=loud", "serve.log_level = 'loud': must be one of critical, error, warning, info, debug, trace"),
    ("serve.request_timeout_s=-1", "serve.request_timeout_s = -1.0 is out of range: must be a number in "
                                   "[0.0, 86400.0]"),
    ("serve.request_timeout_s=1e6", "serve.request_timeout_s = 1000000.0 is out of range: must be a number in "
                                    "[0.0, 86400.0]"),
])
def test_serve_keys_name_key_and_range(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == message


def test_serve_flags_override_their_keys():
    from mindspore_eagle import cli

    def cfg(*argv):
        return cli.serve_config_from_args(cli.build_parser().parse_args(["serve", *argv])).serve

    keys = ["--set", 'serve.cors_origins=["https://a.example"]', "--set", "serve.access_log=true", "--set",
            "serve.log_level=info", "--set", "serve.request_timeout_s=5"]
    s = cfg(*keys)
    assert (s.cors_origins, s.access_log, s.log_level, s.request_timeout_s) == (["https://a.example"], True, "info",
                                                                                5.0)
    s = cfg(*keys, "--cors-origin", "https://b.example", "--cors-origin", "*", "--no-access-log", "--log-level",
            "debug", "--request-timeout", "2.5")
    assert (s.cors_origins, s.access_log, s.log_level, s.request_timeout_s) == (["https://b.example", "*"], False,
                                                                                "debug", 2.5)
    s = cfg("--access-log")
    assert (s.cors_origins, s.access_log, s.log_level, s.request_timeout_s) == ([], True, "warning", 0.0)
    with pytest.raises(ConfigError, match=r"^serve.request_timeout_s = -1.0 is out of range"):
        cfg("--request-timeout", "-1")
    with pytest.raises(ConfigError, match=r"^serve.cors_origins\[0\] = 'example.com' must be"):
        cfg("--cors-origin", "example.com")
    with pytest.raises(SystemExit):
        cfg("--log-level", "loud")
