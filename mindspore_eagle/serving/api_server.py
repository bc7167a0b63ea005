"""The OpenAI-compatible HTTP server: FastAPI routes on uvicorn in front of the engine thread (async_engine.py).

    mindspore-eagle serve --config configs/default.yaml [--host 127.0.0.1] [--port 8000] [--max-batch 16]
                          [--api-key KEY] [--cors-origin ORIGIN ...] [--access-log] [--log-level warning]
                          [--request-timeout SECONDS]

Endpoints (OpenAI's shapes, openai_protocol.py):

    POST /v1/chat/completions   chat turn; ``stream: true`` answers server-sent events ending ``data: [DONE]``
    POST /v1/completions        raw prompt (no chat template), streamed or not
    GET  /v1/models             the served model
    POST /tokenize              {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens"} (vLLM's shapes)
    POST /detokenize            {"tokens"} -> {"prompt"}
    GET  /health                503 {"status": "warming up"} until every graph is compiled, then 200 (HEAD: the
                                same status without a body)
    GET  /metrics               Prometheus text format (metrics.py)

Start: the socket is bound first (``/health`` answers 503), then the engine thread loads the model and runs the
full warm-up (every shape a request can reach, from the graph cache when it is there), so no request ever waits
for a compile; chat and completion requests get a 503 JSON error until then.

A request without ``max_tokens`` generates until its end of turn or the end of the context (:meth:`Server.fit`).
With ``serve.request_timeout_s`` > 0 a chat or completion request running longer is cancelled: 504 (streamed: an
error event, then ``[DONE]``). ``serve.cors_origins`` adds CORS headers for those origins (none: no CORS headers);
``serve.access_log`` and ``serve.log_level`` set uvicorn's logging.

Every error is JSON in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, never a traceback:
400 malformed JSON, a missing, unknown or wrong-typed field, an unsupported parameter, a prompt over the context
limit (the command line's words); 404 an unknown model or path; 401 a missing or wrong API key (``/v1`` routes,
when ``serve.api_key`` is set); 413 a body over ``serve.max_body_bytes``; 429 ``serve.max_queue`` requests
already waiting; 500 an engine step failed (its traceback goes to the server's log only; the server keeps
serving); 503 warming up or shutting down; 504 over ``serve.request_timeout_s``.

SIGTERM (or Ctrl-C): the listening socket closes, in-flight requests get ``serve.drain_timeout_s`` seconds to
finish and are then cancelled, the engine thread stops, and the process exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from mindspore_eagle.errors import MsEagleError
from mindspore_eagle.serving import openai_protocol as P
from mindspore_eagle.serving.async_engine import AsyncEngine, NotReady, QueueFull
from mindspore_eagle.serving.metrics import ServerMetrics

log = logging.getLogger("mindspore_eagle.server")
DONE = format_sse_event(data_str="[DONE]")
BEARER = HTTPBearer(auto_error=False)


class RequestTimeout(Exception):
    """A request ran past its ``serve.request_timeout_s`` deadline (it has been cancelled)."""


def model_name(cfg) -> str:
    """The model id clients send: ``serve.model_name``, else the teacher's name (``SmolLM2-135M-Instruct`` for
    the embedded one, else the checkpoint's file or directory name without its extension)."""
    if cfg.serve.model_name:
        return cfg.serve.model_name
    if cfg.model.teacher == "embedded":
        return "SmolLM2-135M-Instruct"
    p = Path(cfg.model.teacher.rstrip("/"))
    return p.stem if p.suffix in (".gguf", ".safetensors") else p.name


def drafts(cfg) -> bool:
    """Whether ``cfg`` drafts anything: a drafter (``model.drafter`` set, method eagle3 or hybrid) or suffix
    candidates alone (``speculative.method: suffix``, which needs no drafter; ``Engine.speculates``)."""
    return cfg.model.drafter != "none" or cfg.speculative.method == "suffix"


def serve_config(cfg):
    """The Config the server runs with: ``batch.max_batch`` = ``serve.max_batch``, trees in batches when
    ``serve.speculative`` and the config drafts (:func:`drafts`: a drafter, or suffix candidates alone; else no
    drafter is loaded), and a KV pool of at least max_batch sequences of ``cache.max_seq_len`` (the drafter cache
    follows)."""
    import dataclasses

    n, spec = cfg.serve.max_batch, cfg.serve.speculative and drafts(cfg)
    model = cfg.model if spec else dataclasses.replace(cfg.model, drafter="none")
    blocks = max(cfg.cache.num_blocks, n * (cfg.cache.max_seq_len // cfg.cache.block_size))
    return dataclasses.replace(cfg, model=model, cache=dataclasses.replace(cfg.cache, num_blocks=blocks),
                               batch=dataclasses.replace(cfg.batch, max_batch=n, speculative=spec)).validate()


class Server:
    """The server's state: configuration, engine thread, metrics, and the request handling the routes call.

    Args:
        cfg: the Config of :func:`serve_config`. build: zero-argument callable returning (engine, BatchScheduler),
            run on the engine thread (default: :func:`build_scheduler` of ``cfg`` and ``warmup``).
        log_line: callable(str) for progress lines (warm-up, ready).
        warmup: full (default: nothing compiles after the start) | short | none (runners/warmup.py).
    """

    def __init__(self, cfg, build=None, log_line=None, warmup: str = "full"):
        self.cfg, self.name, self.created = cfg, model_name(cfg), int(time.time())
        self.log_line = log_line or (lambda line: print(line, file=sys.stderr, flush=True))
        spec = cfg.batch.speculative                        # serve_config: serve.speculative and drafts(cfg)
        self.metrics = ServerMetrics(cfg.speculative.D_max if spec else 0, cfg.speculative.M if spec else 1)
        self.api_key = cfg.serve.api_key or os.environ.get("MSEAGLE_API_KEY", "")
        self.failed_exc: BaseException | None = None
        self.uvicorn: uvicorn.Server | None = None
        self.port = cfg.serve.port
        self.engine = AsyncEngine(build or (lambda: build_scheduler(cfg, self.log_line, warmup)), self.metrics,
                                  cfg.serve.max_queue, on_failed=self._failed)

    def _failed(self, exc: BaseException) -> None:
        """The engine could not start (engine thread): remember why and shut the HTTP server down."""
        self.failed_exc = exc
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    # ------------------------------------------------------------------ request handling
    def check_ready(self) -> None:
        """Raise 503 while warming up, after a failed start, or while draining."""
        if self.engine.state == "starting":
            raise P.APIError(503, "the model is warming up (compiling graphs); retry when GET /health answers 200",
                             code="warming_up")
        if not self.engine.ready:
            raise P.APIError(503, "the server is shutting down", code="shutting_down")

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise P.APIError(404, f"The model '{name}' does not exist; this server serves '{self.name}' "
                             "(GET /v1/models)", "model", "model_not_found")

    def context_len(self) -> int:
        """The most tokens (prompt + max_tokens) one request can hold (``openai_protocol.context_len`` of the
        engine's scheduler). ``/tokenize``'s ``max_model_len``. Engine ready only."""
        return P.context_len(self.engine.sched)

    def fit(self, prompt_tokens: int, gen, explicit: bool, prompt_param: str):
        """``gen`` with a max_new_tokens the context has room for (``openai_protocol.fit``: an explicit max_tokens
        must fit, an omitted one becomes the whole room left).
        Raises:
            APIError: 400 ``context_length_exceeded``.
        """
        return P.fit(self.engine.sched, prompt_tokens, gen, explicit, prompt_param)

    def deadline(self) -> float | None:
        """``time.monotonic()`` by which a request arriving now must be answered (``serve.request_timeout_s``);
        None without a limit."""
        t = self.cfg.serve.request_timeout_s
        return time.monotonic() + t if t > 0 else None

    def timeout_error(self) -> P.APIError:
        """The 504 of a request cancelled at its deadline."""
        return P.APIError(504, f"the request ran longer than serve.request_timeout_s="
                               f"{self.cfg.serve.request_timeout_s:g} s and was cancelled", None, "request_timeout")

    def submit(self, ids: list, gen):
        try:
            return self.engine.submit(ids, gen)
        except QueueFull as e:
            raise P.APIError(429, f"the server is busy: {e}; retry later", code="queue_full") from None
        except NotReady:
            self.check_ready()
            raise

    async def wait_events(self, handle, request: Request, deadline: float | None = None):
        """Yield the handle's events until it is done; a client that disconnects cancels it (the events end).

        Raises:
            RequestTimeout: ``deadline`` (``time.monotonic()``; None = none) passed first; the request has been
                cancelled.
        """
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(handle.events.get())
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait({get, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    self.engine.cancel(handle)
                    if gone in done:
                        return
                    raise RequestTimeout
                event = get.result()
                yield event
                if event[0] == "done":
                    return
        finally:
            gone.cancel()
            if not handle.done:
                self.engine.cancel(handle)


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 once it is over ``limit`` bytes (by its Content-Length before
    anything is read, or while it streams in)."""
    too_big = P.APIError(413, f"the request body is larger than serve.max_body_bytes={limit} bytes", None,
                         "body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (ASGI ``http.disconnect``; the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_scheduler(cfg, log_line, warmup: str = "full"):
    """Engine thread: build the engine of ``cfg``, warm it up (``full``: every reachable shape, from the graph cache
    when it is there), measure the speculation policy's costs, and return (engine, BatchScheduler) serving with
    the single-sequence round for a lone sequence."""
    from mindspore_eagle.runners.warmup import report_compiles
    from mindspore_eagle.serving.pipeline import build_engine, prepare
    from mindspore_eagle.serving.scheduler import BatchScheduler

    t0 = time.perf_counter()
    engine = build_engine(cfg)
    prepare(engine, cfg, cfg.generation, warmup, log_line, graph_cache=cfg.context.graph_cache)
    sched = BatchScheduler(engine, cfg.generation, cfg.batch.max_batch, speculative=cfg.batch.speculative,
                           single_round=True)
    report_compiles(log_line)
    how = "speculative (trees gated per batch size)" if engine.speculates else "teacher-only"
    log_line(f"ready in {time.perf_counter() - t0:.1f} s: up to {cfg.batch.max_batch} sequences per step, {how}, "
             f"KV pool {sched.NB} blocks of {sched.B} tokens")
    return engine, sched


def _error(status: int, message: str, param=None, code=None, type=None) -> JSONResponse:
    return JSONResponse(P.APIError(status, message, param, code, type).body(), status_code=status)


def _authorizer(server: Server):
    """The dependency that guards the ``/v1`` routes, ``/tokenize`` and ``/detokenize``: with an API key set,
    a request needs ``Authorization: Bearer KEY`` (else 401 ``invalid_api_key``)."""

    async def authorized(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        if not server.api_key:
            return
        if creds is None:
            raise P.APIError(401, "missing API key: send the header 'Authorization: Bearer KEY'", None,
                             "invalid_api_key")
        if not secrets.compare_digest(creds.credentials.encode(), server.api_key.encode()):
            raise P.APIError(401, "incorrect API key provided", None, "invalid_api_key")
    return authorized


def build_app(server: Server) -> FastAPI:
    """The FastAPI application of ``server`` (routes in the module docstring)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.engine.start(asyncio.get_running_loop())
        yield
        ok = await run_in_threadpool(server.engine.stop, max(5.0, server.cfg.serve.drain_timeout_s))
        if not ok:
            log.warning("the engine thread did not stop in time")

    app = FastAPI(title="mindspore-eagle", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if server.cfg.serve.cors_origins:       # browsers may call from these origins (preflights answered)
        app.add_middleware(CORSMiddleware, allow_origins=list(server.cfg.serve.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    m = server.metrics

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError):
        m.http_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        m.http_errors.labels(str(e.status_code)).inc()
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(e.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        m.http_errors.labels("400").inc()
        return _error(400, f"invalid request: {e.errors()[0].get('msg', 'bad value')}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=e)
        m.http_errors.labels("500").inc()
        return _error(500, f"internal server error ({type(e).__name__}); the server log has the details")

    authorized = _authorizer(server)

    @app.api_route("/health", methods=["GET", "HEAD"])   # HEAD: load balancers' probes (same status, no body)
    async def health():
        state = server.engine.state
        if server.engine.ready:
            return {"status": "ok"}
        words = {"starting": "warming up", "failed": "failed to start"}.get(state, "shutting down")
        return JSONResponse({"status": words}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        body, ctype = m.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return P.model_list(server.name, server.created)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request):
        return await _answer(server, request, CHAT)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        return await _answer(server, request, COMPLETION)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(request: Request):
        return await _tokenize(server, request)

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(request: Request):
        return await _detokenize(server, request)

    return app


async def _tokenize(server: Server, request: Request) -> dict:
    """``POST /tokenize``: the prompt's ids as ``/v1/completions`` would run them, or the messages' ids under the
    chat template as ``/v1/chat/completions`` would (``add_generation_prompt`` true); ``max_model_len`` =
    :meth:`Server.context_len` (prompt + max_tokens at most).

    Raises:
        APIError: 400 a bad field (named), 404 an unknown model, 503 warming up or shutting down.
    """
    req = P.parse_tokenize(await _body(request, server.cfg.serve.max_body_bytes))
    if req.model is not None:
        server.check_model(req.model)
    server.check_ready()
    tok = server.engine.engine.tokenizer
    if isinstance(req, P.TokenizeChatRequest):
        try:
            ids = await run_in_threadpool(tok.encode_chat, P.chat_messages(req), req.add_generation_prompt)
        except MsEagleError as e:           # e.g. a tokenizer without a chat template
            raise P.APIError(400, str(e), "messages", "invalid_value") from None
    else:
        ids = await run_in_threadpool(tok.encode, req.prompt, None if req.add_special_tokens else False)
    return P.tokenize_response(ids, server.context_len())


async def _detokenize(server: Server, request: Request) -> dict:
    """``POST /detokenize``: ``{"prompt": text}`` of the token ids (special tokens kept as their strings).

    Raises:
        APIError: 400 a bad field or an id outside [0, vocab) (``param`` ``tokens[i]``), 404 an unknown model,
            503 warming up or shutting down.
    """
    req = P.parse_request(P.DetokenizeRequest, await _body(request, server.cfg.serve.max_body_bytes))
    if req.model is not None:
        server.check_model(req.model)
    server.check_ready()
    tok = server.engine.engine.tokenizer
    ids = P.check_token_ids(req.tokens, tok.vocab_size, "tokens")
    return {"prompt": await run_in_threadpool(tok.decode, ids)}


def _usage(res) -> dict:
    lens = res.accept_lens
    return P.usage(res.prompt_tokens, len(res.token_ids), sum(lens) / len(lens) if lens else 1.0)


def _failure(res) -> P.APIError:
    """The error of a request that ended without an answer."""
    if res.internal:
        return P.APIError(500, res.error, code="engine_error")
    if res.stop_reason == "cancelled":
        return P.APIError(503, "the request was cancelled (the server is shutting down)", code="cancelled")
    return P.APIError(400, res.error, code="invalid_value")


async def _collect(server: Server, handle, request: Request, deadline: float | None = None):
    """Wait for a non-streamed request: (TurnResult, text), or (None, "") when the client went away (it was
    cancelled). Raises APIError when it failed, 504 when ``deadline`` passed first (it was cancelled)."""
    res = None
    try:
        async for event in server.wait_events(handle, request, deadline):
            if event[0] == "done":
                res = event[1]
    except RequestTimeout:
        raise server.timeout_error() from None
    if res is None:
        return None, ""
    if res.error or res.stop_reason == "cancelled":
        raise _failure(res)
    return res, res.text


def _sse(obj: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))


class _Route:
    """What ``/v1/chat/completions`` and ``/v1/completions`` do differently; :func:`_answer` and :func:`_stream`
    are the one path both take (parse, check, tokenize, submit, wait or stream)."""
    schema = P.ChatCompletionRequest
    prompt_field, id_prefix = "messages", "chatcmpl"

    async def prompt_ids(self, eng, req) -> list:
        return await run_in_threadpool(P.prompt_ids, eng, req)

    def logprobs(self, eng):
        """``callable(entries) -> logprobs object`` for one request's chunks, in order."""
        return lambda entries: P.chat_logprobs(entries, eng.tokenizer, eng.eos)

    def chunk(self, rid, name, created, text, finish=None, use=None, logprobs=None) -> dict:
        return P.chat_chunk(rid, name, created, None if text is None else {"content": text}, finish, use, logprobs)

    def opening(self, rid, name, created) -> list:
        return [P.chat_chunk(rid, name, created, {"role": "assistant", "content": ""})]

    def closing(self, rid, name, created, final, finish, tail) -> list:
        """The chunks after the last delta: the final text (when there is any) and then the finish reason."""
        out = [self.chunk(rid, name, created, final, logprobs=tail)] if final or (tail and tail["content"]) else []
        return out + [P.chat_chunk(rid, name, created, {}, finish)]


class _CompletionRoute(_Route):
    schema = P.CompletionRequest
    prompt_field, id_prefix = "prompt", "cmpl"

    def logprobs(self, eng):
        offset = 0                           # text_offset runs on across a request's chunks

        def lp(entries):
            nonlocal offset
            out = P.completion_logprobs(entries, eng.tokenizer, eng.eos, offset)
            offset += sum(len(t) for t in out["tokens"])
            return out
        return lp

    def chunk(self, rid, name, created, text, finish=None, use=None, logprobs=None) -> dict:
        return P.completion_chunk(rid, name, created, text, finish, use, logprobs)

    def opening(self, rid, name, created) -> list:
        return []

    def closing(self, rid, name, created, final, finish, tail) -> list:
        return [self.chunk(rid, name, created, final, finish, logprobs=tail)]


CHAT, COMPLETION = _Route(), _CompletionRoute()


async def _answer(server: Server, request: Request, route: _Route):
    """One request of either route: parsed and checked, tokenized, submitted; the answer (or its stream), cut at
    ``serve.request_timeout_s`` from now."""
    deadline = server.deadline()
    req = P.parse_request(route.schema, await _body(request, server.cfg.serve.max_body_bytes))
    server.check_model(req.model)
    server.check_ready()
    eng = server.engine.engine
    ids = await route.prompt_ids(eng, req)
    gen, explicit = P.generation_config(req, server.cfg.generation)
    gen = dataclasses.replace(gen, logprobs=P.requested_logprobs(req))
    handle = server.submit(ids, server.fit(len(ids), gen, explicit, route.prompt_field))
    rid = P.new_id(route.id_prefix)
    if req.stream:
        use = bool(req.stream_options and req.stream_options.include_usage)
        return EventSourceResponse(_stream(server, handle, request, rid, use, route, deadline))
    res, _ = await _collect(server, handle, request, deadline)
    if res is None:
        return Response(status_code=499)
    return P.response_body(req, rid, server.name, res, eng.tokenizer, eng.eos)


async def _stream(server: Server, handle, request: Request, rid: str, include_usage: bool, route: _Route,
                  deadline: float | None = None):
    """Server-sent events of a streamed answer: the route's opening chunks (chat: the role), a chunk per text
    delta as text becomes final, the closing chunks (the rest of the text, the finish reason), the usage chunk
    (``stream_options.include_usage``), ``[DONE]``; a failure, or ``deadline`` passing (the request is cancelled,
    504 ``request_timeout``), is sent as an ``{"error": ...}`` event before ``[DONE]``."""
    created, name = int(time.time()), server.name
    to_lp = route.logprobs(server.engine.engine) if handle.gen.logprobs is not None else None

    def lp(entries):                     # the chunk's tokens' log-probabilities (None when not asked)
        return to_lp(entries) if to_lp is not None else None

    def failed(e: P.APIError) -> bytes:
        server.metrics.http_errors.labels(str(e.status)).inc()
        return _sse(e.body())

    for c in route.opening(rid, name, created):
        yield _sse(c)
    try:
        async for event in server.wait_events(handle, request, deadline):
            if event[0] == "delta":
                yield _sse(route.chunk(rid, name, created, event[1], logprobs=lp(event[3])))
                continue
            res, final = event[1], event[2]
            if res.error or res.stop_reason == "cancelled":
                yield failed(_failure(res))
                break
            for c in route.closing(rid, name, created, final, P.FINISH[res.stop_reason], lp(event[3])):
                yield _sse(c)
            if include_usage:
                yield _sse(route.chunk(rid, name, created, None, use=_usage(res)))
    except RequestTimeout:
        yield failed(server.timeout_error())
    yield DONE


class _UvicornServer(uvicorn.Server):
    """uvicorn's Server, plus: the bound address is printed once listening (port 0 = a free port), and a
    SIGTERM / SIGINT first stops admission (503) before uvicorn's graceful shutdown drains the connections."""

    def __init__(self, config, server: Server):
        super().__init__(config)
        self.app_server = server

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.app_server.port = port
            self.app_server.log_line(f"serving {self.app_server.name} on http://{host}:{port} (GET /health answers "
                                     "503 while warming up, then 200)")

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.app_server.engine.draining = True
            self.app_server.log_line(f"signal {signal.Signals(sig).name}: no new requests; draining in-flight "
                                     f"ones for up to {self.config.timeout_graceful_shutdown:g} s")
        super().handle_exit(sig, frame)


def uvicorn_config(app, cfg) -> uvicorn.Config:
    """uvicorn's Config of ``app`` under ``cfg.serve``: host, port, ``log_level`` (uvicorn's loggers),
    ``access_log`` (a line per request on stdout, shown at any level: the access logger is set to INFO at most),
    ``drain_timeout_s`` as the graceful-shutdown limit. Configures uvicorn's loggers (process-wide)."""
    config = uvicorn.Config(app, host=cfg.serve.host, port=cfg.serve.port, log_level=cfg.serve.log_level,
                            timeout_graceful_shutdown=cfg.serve.drain_timeout_s, access_log=cfg.serve.access_log,
                            lifespan="on")
    access = logging.getLogger("uvicorn.access")
    if cfg.serve.access_log and access.level > logging.INFO:
        access.setLevel(logging.INFO)
    return config


def serve(cfg, log_line=None, build=None, warmup: str = "full") -> int:
    """Run the server of ``cfg`` (``serve_config`` applied) until SIGTERM / SIGINT; returns the exit code (0).

    Raises:
        the engine's start-up error (a known one, e.g. CheckpointError, is printed as one line by the CLI).
    """
    server = Server(cfg, build, log_line, warmup)
    server.uvicorn = _UvicornServer(uvicorn_config(build_app(server), cfg), server)
    if not log.handlers:                    # the server's own lines (errors with their traceback) on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    # uvicorn re-raises the signal that stopped it once it has drained; a no-op handler keeps the exit code 0
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM,)}
    try:
        server.uvicorn.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if server.failed_exc is not None:
        raise server.failed_exc
    if server.engine.state not in ("stopped", "failed"):     # stopped mid warm-up: a compile cannot be interrupted
        sys.stderr.flush()
        os._exit(0)
    return 0


__all__ = ["Server", "build_app", "build_scheduler", "model_name", "serve", "serve_config", "uvicorn_config"]
