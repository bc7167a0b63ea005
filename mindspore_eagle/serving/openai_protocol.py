"""The OpenAI API shapes the server speaks, and their translation into the engine's parameters.

Requests (``POST /v1/chat/completions``, ``POST /v1/completions``) are parsed from the raw body by pydantic in
strict mode (``"10"`` is not an integer, ``1.5`` is not an integer, ``true`` is not a number; unknown fields are
refused), so every problem becomes an :class:`APIError` that names the field, in OpenAI's error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_type"}}

Supported per-request parameters: ``max_tokens`` (or ``max_completion_tokens``), ``temperature`` [0, 2],
``top_p`` (0, 1], ``top_k`` (0 or -1 = off), ``stop`` (a string or a list of up to 16 non-empty strings),
``seed`` (any integer; omitted with temperature > 0: a fresh seed per request), ``stream`` and
``stream_options.include_usage``, ``logprobs`` (chat: true / false with ``top_logprobs`` 0-20; completions: an
int 0-5): each generated token's log-probability under the teacher, log-softmax of its raw logits (before
temperature, top-k and top-p, as vLLM's default), exact under speculation (every token's logits come from the
teacher's own forward; on the CPU kernels bit for bit those of the token decoded alone, except in a batched tree
step of more than 32 rows, which takes MatMul); ``user`` is accepted and not used. Parameters the engine does not implement
(``n`` > 1, ``logit_bias``, the penalties, ``response_format``, tools and
functions, ``echo``, ``suffix``, ``best_of`` > 1) are refused with a 400 naming the field unless they hold their
neutral value (``n: 1``, ``presence_penalty: 0``, ``response_format: {"type": "text"}``,
...), which asks for nothing. Omitted parameters take the server configuration's ``generation`` section values,
except ``max_tokens``: omitted, a request generates until its end of turn or the end of the context (the room
left after the prompt, as vLLM does; :func:`fit`).

``POST /tokenize`` and ``POST /detokenize`` take vLLM's shapes (:class:`TokenizeCompletionRequest`,
:class:`TokenizeChatRequest`, :class:`DetokenizeRequest`) and answer ``{"count", "max_model_len", "tokens"}`` and
``{"prompt"}``.

Responses are plain dicts in OpenAI's shapes (``chat.completion``, ``chat.completion.chunk``,
``text_completion``); ``usage`` carries prompt_tokens, completion_tokens, total_tokens and ``mean_accept_len``
(mean accepted length L_k per tree verification of the request; 1.0 when no tree was verified).
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import time
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mindspore_eagle.config import GenerationConfig, range_words

MAX_STOP = 16

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error", 504: "server_error"}


class APIError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status code. message: one line for the client. param: the request field at fault (dotted
            path, e.g. ``messages[1].content``) or None. code: a short machine-readable reason or None.
        type: OpenAI's error type (default by status: invalid_request_error, rate_limit_error, server_error).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """The JSON body of the error response."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------ request models --
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """One part of a message's content list; only text parts are supported."""
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A chat message. ``developer`` is OpenAI's newer name for ``system``; ``name`` is accepted and not used."""
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields both endpoints share. Fields typed ``Any`` are unsupported: only their neutral value passes
    (:data:`NEUTRAL`, checked by :func:`check_unsupported`)."""
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` body."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None


class CompletionRequest(_Common):
    """``POST /v1/completions`` body. ``prompt``: a string, a list of one string, or a list of token ids."""
    prompt: str | list[str] | list[int]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` body, prompt form (vLLM's TokenizeCompletionRequest): ``prompt`` tokenized as
    ``/v1/completions`` tokenizes a string prompt; ``add_special_tokens`` false leaves out the BOS token the model
    prepends. ``model`` may be omitted (as in vLLM); given, it must be the served one."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Strict):
    """``POST /tokenize`` body, chat form (vLLM's TokenizeChatRequest): ``messages`` under the chat template, as
    ``/v1/chat/completions`` sends them; ``add_generation_prompt`` (default true) appends the assistant turn's
    opening, as a chat completion does."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` body (vLLM's DetokenizeRequest): ``tokens``, ids in [0, vocab)."""
    model: str | None = None
    tokens: list[int]


# field -> values that ask for nothing (anything else is a 400 naming the field)
NEUTRAL = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
           "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
           "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",), "echo": (False,),
           "suffix": ("",), "best_of": (1,)}
_WHY = {"n": "one choice per request (n = 1)", "logit_bias": "no logit bias",
        "presence_penalty": "no penalties", "frequency_penalty": "no penalties",
        "response_format": "plain text only", "tools": "no tool calls", "tool_choice": "no tool calls",
        "parallel_tool_calls": "no tool calls", "functions": "no function calls", "function_call": "no function calls",
        "echo": "the prompt is not echoed", "suffix": "no suffix", "best_of": "one candidate per request"}
_UNION_HINT = {"stop": "a string or a list of strings", "content": "a string or a list of text parts",
               "prompt": "a string, a list of one string, or a list of token ids"}
_FIELDS = set().union(*(m.model_fields for m in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart,
                                                  StreamOptions, TokenizeCompletionRequest, TokenizeChatRequest,
                                                  DetokenizeRequest)))


def _same(value, allowed) -> bool:
    """``value == allowed`` without ``True == 1`` (JSON booleans and numbers stay apart)."""
    if isinstance(value, bool) != isinstance(allowed, bool):
        return False
    return value == allowed


def check_unsupported(req: _Common) -> None:
    """Raise a 400 :class:`APIError` naming the first unsupported parameter set to a non-neutral value."""
    for name, neutral in NEUTRAL.items():
        if name in type(req).model_fields:
            value = getattr(req, name)
            if value is not None and not any(_same(value, a) for a in neutral):
                raise APIError(400, f"{name} = {json.dumps(value)} is not supported by this server: {_WHY[name]}",
                               name, "unsupported_parameter")


def _param(loc) -> str | None:
    """A pydantic error location as a dotted request path (``messages[0].content``); type tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS:
            out += ("." if out else "") + part
    return out or None


def parse_request(cls, body: bytes):
    """Parse and check a request body.

    Args:
        cls: a request model of this module (ChatCompletionRequest, CompletionRequest, ...). body: the raw
            request body (UTF-8 JSON).
    Returns:
        the request model.
    Raises:
        APIError: 400 for malformed JSON, a body that is not an object, a missing, unknown or wrong-typed field,
            an out-of-range value or an unsupported parameter (message and ``param`` name the field).
    """
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e, cls) from None
    check_unsupported(req)
    if isinstance(req, ChatCompletionRequest) and None not in (req.max_tokens, req.max_completion_tokens) \
            and req.max_tokens != req.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens disagree; give one of them",
                       "max_completion_tokens", "invalid_value")
    return req


def parse_tokenize(body: bytes):
    """Parse a ``POST /tokenize`` body: :class:`TokenizeChatRequest` when it holds ``messages``, else
    :class:`TokenizeCompletionRequest`.

    Raises:
        APIError: 400 as :func:`parse_request` (malformed JSON, a missing, unknown or wrong-typed field).
    """
    try:
        chat = "messages" in json.loads(body)
    except (ValueError, TypeError):         # not JSON, or not an object: parse_request names the problem
        chat = False
    return parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


def check_token_ids(ids: list, vocab: int, field: str) -> list:
    """``ids`` when each is a token id of a ``vocab``-token vocabulary, else a 400 :class:`APIError` naming the
    first bad one (``param`` ``field[i]``)."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{field}[{bad}] = {ids[bad]} is not a token id (0 <= id < {vocab})", f"{field}[{bad}]",
                       "invalid_value")
    return list(ids)


MAX_TOP_LOGPROBS = 20       # chat top_logprobs (OpenAI's limit; config.MAX_LOGPROBS)
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs (OpenAI's limit)


def requested_logprobs(req: _Common) -> int | None:
    """How many alternatives per token the request asks log-probabilities for, or None (none asked).

    Chat: ``logprobs`` true / false, ``top_logprobs`` an int in [0, 20] that needs ``logprobs: true``.
    Completions: ``logprobs`` an int in [0, 5] (the alternatives; 0 = the chosen token's alone).
    Raises:
        APIError: 400 naming the field and its range.
    """
    lp = req.logprobs
    if isinstance(req, ChatCompletionRequest):
        if lp is not None and not isinstance(lp, bool):
            raise APIError(400, f"logprobs = {json.dumps(lp)} must be true or false", "logprobs", "invalid_type")
        top = req.top_logprobs
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise APIError(400, f"top_logprobs = {json.dumps(top)} is out of range: must be an int in "
                                f"[0, {MAX_TOP_LOGPROBS}]", "top_logprobs", "invalid_value")
        if top and not lp:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        return (top or 0) if lp else None
    if lp is None or lp is False:
        return None
    if lp is True or not isinstance(lp, int):
        raise APIError(400, f"logprobs = {json.dumps(lp)} must be an int in [0, {MAX_COMPLETION_LOGPROBS}] on "
                            "/v1/completions (true / false is the chat form)", "logprobs", "invalid_type")
    if not 0 <= lp <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs = {json.dumps(lp)} is out of range: must be an int in "
                            f"[0, {MAX_COMPLETION_LOGPROBS}]", "logprobs", "invalid_value")
    return lp


def _token_text(tokenizer, tid: int) -> str:
    return tokenizer.decode([int(tid)])


def chat_logprobs(entries: list, tokenizer, eos=()) -> dict:
    """OpenAI's chat ``logprobs`` object of (id, logprob, top) entries (``core.accept.token_logprobs``):
    ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``; token
    strings are the tokenizer's decoding of the id alone (a piece of a multi-byte character decodes as U+FFFD),
    bytes their UTF-8; EOS tokens are left out (they add no text)."""
    def one(tid, lp):
        t = _token_text(tokenizer, tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]}
                        for tid, lp, top in entries if tid not in eos]}


def completion_logprobs(entries: list, tokenizer, eos=(), offset: int = 0) -> dict:
    """OpenAI's legacy completions ``logprobs`` object: ``{"tokens", "token_logprobs", "top_logprobs":
    [{token: logprob}], "text_offset"}`` (offsets from ``offset`` characters, summing the token strings); EOS
    tokens left out."""
    toks, lps, tops, offs = [], [], [], []
    for tid, lp, top in entries:
        if tid in eos:
            continue
        t = _token_text(tokenizer, tid)
        toks.append(t), lps.append(lp), offs.append(offset)
        tops.append({_token_text(tokenizer, i): v for i, v in top})
        offset += len(t)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _range(cls, leaf: str) -> str | None:
    """The allowed range of field ``leaf`` of request model ``cls`` in words ("a number in [0, 2]", "an int >= 1"),
    from its pydantic bounds; None when it has none."""
    info = getattr(cls, "model_fields", {}).get(leaf)
    if info is None:
        return None
    lo = hi = None
    lo_open = hi_open = False
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        if getattr(m, "gt", None) is not None:
            lo, lo_open = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
        if getattr(m, "lt", None) is not None:
            hi, hi_open = m.lt, True
    if lo is None and hi is None:
        return None
    kind = "an int" if int in typing.get_args(info.annotation) or info.annotation is int else "a number"
    return range_words(kind, None if lo is None else f"{lo:g}", None if hi is None else f"{hi:g}", lo_open, hi_open)


def _validation_error(e: ValidationError, cls=None) -> APIError:
    err = e.errors()[0]
    kind, loc, msg = err["type"], err["loc"], err["msg"]
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', msg)})", None,
                        "invalid_json")
    if kind == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object", None, "invalid_type")
    param = _param(loc)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        param = ".".join(filter(None, [param, str(loc[-1])])) if loc and loc[-1] not in _FIELDS else param
        return APIError(400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    leaf = param.split(".")[-1].split("[")[0] if param else ""
    if leaf in _UNION_HINT and len(e.errors()) > 1 and kind.endswith("_type"):
        return APIError(400, f"Invalid type for '{param}': expected {_UNION_HINT[leaf]}", param, "invalid_type")
    if kind.endswith(("_type", "_parsing")):
        return APIError(400, f"Invalid type for '{param}': {msg}", param, "invalid_type")
    allowed = _range(cls, leaf) if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") \
        and param == leaf else None
    if allowed is not None:
        return APIError(400, f"{param} = {json.dumps(err.get('input'))} is out of range: must be {allowed}", param,
                        "invalid_value")
    return APIError(400, f"Invalid value for '{param}': {msg}", param, "invalid_value")


# ------------------------------------------------------------------------------------------- translation --
def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the engine's ``[{"role", "content"}]`` (text parts joined by newlines,
    ``developer`` as ``system``)."""
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def completion_prompt(req: CompletionRequest):
    """The prompt of a completion request: a str, or a list of token ids (ints).

    Raises:
        APIError: 400 for several prompts or an empty one.
    """
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise APIError(400, f"prompt holds {len(p)} prompts; this server takes one prompt per request",
                           "prompt", "unsupported_parameter")
        p = p[0]
    if not p:
        raise APIError(400, "prompt is empty", "prompt", "invalid_value")
    return p


def generation_config(req: _Common, defaults: GenerationConfig) -> tuple[GenerationConfig, bool]:
    """The request's sampling parameters as a GenerationConfig (omitted ones from ``defaults``).

    Args:
        req: a parsed request. defaults: the server's ``generation`` section.
    Returns:
        (GenerationConfig, whether max_tokens was given by the request). Without it, max_new_tokens is
        ``defaults.max_new_tokens`` until ``Server.fit`` sets it to the room the context has left.
    Raises:
        APIError: 400 for an empty stop string or more than :data:`MAX_STOP` of them.
    """
    max_tokens = req.max_tokens
    if max_tokens is None and isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens
    stop = defaults.stop if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop holds {len(stop)} strings; at most {MAX_STOP}", "stop", "invalid_value")
    if any(not s for s in stop):
        raise APIError(400, "stop strings must be non-empty", "stop", "invalid_value")
    temperature = defaults.temperature if req.temperature is None else float(req.temperature)
    if req.seed is not None:
        seed = req.seed % (1 << 64)
    else:
        seed = defaults.seed if temperature == 0 else secrets.randbits(63)
    gen = dataclasses.replace(
        defaults, max_new_tokens=max_tokens or defaults.max_new_tokens,
        temperature=temperature, top_p=defaults.top_p if req.top_p is None else float(req.top_p),
        top_k=defaults.top_k if req.top_k is None else max(0, req.top_k), seed=seed, stop=stop)
    return gen, max_tokens is not None


def prompt_ids(engine, req: _Common) -> list:
    """The prompt token ids a parsed request runs: a chat's messages under the teacher's chat template
    (``engine.encode_chat``), a completion's prompt tokenized without one, or its token ids checked against the
    vocabulary. The server (on a worker thread) and ``batch`` OpenAI-format records call it.

    Raises:
        APIError: 400 naming ``messages`` (e.g. every message empty) or ``prompt`` (several prompts, an empty
            one, an id outside [0, vocab)).
    """
    if isinstance(req, ChatCompletionRequest):
        from mindspore_eagle.serving.engine import GenerationError

        try:
            return engine.encode_chat(chat_messages(req))
        except GenerationError as e:        # e.g. every message empty
            raise APIError(400, str(e), "messages", "invalid_value") from None
    prompt = completion_prompt(req)
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt)
    return check_token_ids(prompt, engine.tokenizer.vocab_size, "prompt")


def context_len(sched) -> int:
    """The most tokens (prompt + max_tokens) one request can hold on a BatchScheduler: min(cache.max_seq_len, the
    KV pool's slots) less the slots a tree verification takes beyond a sequence's tokens (``extra_slots``:
    speculative.M while drafting, else 0). ``/tokenize``'s ``max_model_len``."""
    return min(sched.S, sched.NB * sched.B) - sched.extra_slots


def fit(sched, prompt_tokens: int, gen: GenerationConfig, explicit: bool, prompt_param: str) -> GenerationConfig:
    """``gen`` with a max_new_tokens the context of BatchScheduler ``sched`` has room for.

    A request's own max_tokens (``explicit``) must fit; an omitted one becomes the whole room left,
    :func:`context_len` - ``prompt_tokens`` (generation runs to the end of turn or the end of the context, as
    vLLM's default), which ``BatchScheduler.fit_error`` always accepts: prompt + room + extra_slots =
    min(S, NB * B) is at most S tokens and at most NB blocks. The server and ``batch`` OpenAI-format records.
    Raises:
        APIError: 400 ``context_length_exceeded`` in the command line's words, with ``max_tokens=<n>`` for the
            request's own field (``param`` max_tokens when the request set it, else ``prompt_param``): the explicit max_tokens does not fit, or the prompt leaves
            no room for one token.
    """
    if explicit:                 # the request's field named as the client sent it, not the config key
        error = sched.fit_error(prompt_tokens, gen.max_new_tokens).replace("generation.max_new_tokens=",
                                                                          "max_tokens=")
        if error:
            raise APIError(400, error, "max_tokens", "context_length_exceeded")
        return gen
    room = context_len(sched) - prompt_tokens
    error = sched.fit_error(prompt_tokens, max(room, 1))
    if room < 1 or error:
        raise APIError(400, error or f"prompt of {prompt_tokens} tokens leaves no room to generate",
                       prompt_param, "context_length_exceeded")
    return dataclasses.replace(gen, max_new_tokens=room)


# --------------------------------------------------------------------------------------------- responses --
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def new_id(prefix: str) -> str:
    """A response id, e.g. ``chatcmpl-3f2a...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, mean_accept_len: float | None = None) -> dict:
    """OpenAI's usage object (+ ``mean_accept_len``: mean L_k per tree verification, when known)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if mean_accept_len is not None:
        out["mean_accept_len"] = round(float(mean_accept_len), 4)
    return out


def chat_response(rid: str, model: str, text: str, finish: str, use: dict, logprobs: dict | None = None) -> dict:
    """A ``chat.completion`` object with one choice (``logprobs``: :func:`chat_logprobs`, or None)."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
               use: dict | None = None, logprobs: dict | None = None) -> dict:
    """A ``chat.completion.chunk``: one choice with ``delta`` (and ``finish_reason``, ``logprobs`` of its
    tokens), or, with ``delta`` None, the usage chunk (no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_response(rid: str, model: str, text: str, finish: str, use: dict,
                        logprobs: dict | None = None) -> dict:
    """A ``text_completion`` object with one choice (``logprobs``: :func:`completion_logprobs`, or None)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish: str | None = None,
                     use: dict | None = None, logprobs: dict | None = None) -> dict:
    """A streamed ``text_completion`` chunk (``text`` None: the usage chunk, no choices)."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def response_body(req: _Common, rid: str, model: str, res, tokenizer, eos=()) -> dict:
    """The non-streamed answer to ``req`` (``chat.completion`` or ``text_completion``) of a finished request's
    result ``res`` (a ``scheduler.TurnResult``: text, token_ids, prompt_tokens, stop_reason, accept_lens,
    logprobs): usage with ``mean_accept_len`` (1.0 without tree verifications) and, when the request asked,
    the tokens' log-probabilities. The server's answer, and the ``body`` of a ``batch`` OpenAI-format result."""
    lens = res.accept_lens
    use = usage(res.prompt_tokens, len(res.token_ids), sum(lens) / len(lens) if lens else 1.0)
    asked = requested_logprobs(req) is not None
    if isinstance(req, ChatCompletionRequest):
        lp = chat_logprobs(res.logprobs, tokenizer, eos) if asked else None
        return chat_response(rid, model, res.text, FINISH[res.stop_reason], use, lp)
    lp = completion_logprobs(res.logprobs, tokenizer, eos) if asked else None
    return completion_response(rid, model, res.text, FINISH[res.stop_reason], use, lp)


def tokenize_response(tokens: list, max_model_len: int) -> dict:
    """``POST /tokenize``'s answer (vLLM's TokenizeResponse): ``{"count", "max_model_len", "tokens"}``."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens)}


def model_list(name: str, created: int) -> dict:
    """``GET /v1/models``: the one served model."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "mindspore-eagle"}]}


__all__ = ["FINISH", "APIError", "ChatCompletionRequest", "CompletionRequest", "chat_chunk", "chat_messages",
           "chat_response", "check_unsupported", "completion_chunk", "completion_prompt", "completion_response",
           "error_body", "generation_config", "model_list", "new_id", "parse_request", "usage", "requested_logprobs",
           "chat_logprobs", "completion_logprobs", "TokenizeCompletionRequest", "TokenizeChatRequest",
           "DetokenizeRequest", "parse_tokenize", "check_token_ids", "tokenize_response", "prompt_ids", "context_len",
           "fit", "response_body"]
