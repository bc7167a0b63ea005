"""OpenAI Batch API files for ``mindspore-eagle batch``: each input line one request to the server's routes, each
result line in OpenAI's batch output format, its ``body`` the JSON the server answers for that request.

Input (OpenAI's batch input; UTF-8 JSONL, blank lines ignored)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 16, "logprobs": 2}}

``custom_id`` is a unique string, ``method`` ``"POST"``, ``url`` one of :data:`URLS`, and ``body`` a request that
``openai_protocol`` parses exactly as the server does (every field, check, error message and code; ``model``
must be the served name when the job gives one). ``stream: true`` is refused: a result is one body. Other keys of
a line are ignored. Then as the server: the prompt is templated or tokenized (``openai_protocol.prompt_ids``), an
omitted field takes the job's ``generation`` section, an omitted ``max_tokens`` runs to the end of turn or of the
context (``openai_protocol.fit``), and ``generation.logprobs`` is not used (the body's ``logprobs`` fields are).

Output (OpenAI's batch output), one line per input line, in finishing order::

    {"id": "batch_req_1", "custom_id": "r1", "response": {"status_code": 200, "request_id": "req_...",
     "body": {"id": "chatcmpl-...", "object": "chat.completion", ...}}, "error": null}
    {"id": "batch_req_2", "custom_id": "r2", "response": null, "error": {"code": "invalid_value", "message": "..."}}

``id`` is ``batch_req_`` and the 1-based input line (a line without a usable ``custom_id`` is resumed by it);
``body`` is ``openai_protocol.response_body``, the server's own answer; ``error`` has the server's code and
message (a line that is not JSON, or lacks ``custom_id``, says its line number).
"""
from __future__ import annotations

import dataclasses
import json
import uuid

from mindspore_eagle.errors import MsEagleError
from mindspore_eagle.serving.batch_record import InputRecord, load_line

URLS = ("/v1/chat/completions", "/v1/completions")
ID_PREFIX = "batch_req_"


def is_openai_line(obj) -> bool:
    """Whether a parsed input line is an OpenAI batch request (it has ``custom_id`` and ``body``)."""
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj


def parse_record(line: int, index: int, text: str) -> InputRecord:
    """Parse and check one OpenAI batch input line (module docstring); problems go into ``InputRecord.error``
    with the server's message and ``InputRecord.code`` (never raised). ``kind`` is the line's url and
    ``request`` the parsed body."""
    from mindspore_eagle.serving import openai_protocol as P

    rec = InputRecord(line, index, fmt="openai")
    obj, rec.error, rec.code = load_line(line, text)
    if rec.error:
        return rec
    rec.id = obj.get("custom_id")
    if rec.id is None:
        rec.error, rec.code = f'line {line}: missing "custom_id"', "missing_required_parameter"
    elif not isinstance(rec.id, str):
        rec.error, rec.code = f"line {line}: custom_id must be a string", "invalid_type"
    if rec.error:
        return rec
    try:
        rec.request = _request(obj)
        rec.kind = obj["url"]
        _check(rec.request)
    except P.APIError as e:
        rec.error, rec.code = e.message, e.code
    return rec


def _request(obj: dict):
    """The line's ``body`` parsed as the server parses a request to its ``url`` (``parse_request``).

    Raises:
        APIError: a missing or unsupported ``method`` / ``url``, or the server's error for the body (a missing,
            unknown or wrong-typed field, a value out of range, an unsupported parameter).
    """
    from mindspore_eagle.serving import openai_protocol as P

    for key in ("method", "url", "body"):
        if key not in obj:
            raise P.APIError(400, f"Missing required parameter: '{key}'", key, "missing_required_parameter")
    if obj["method"] != "POST":
        raise P.APIError(400, f'method = {json.dumps(obj["method"])} is not supported: a batch request is "POST"',
                         "method", "invalid_value")
    if obj["url"] not in URLS:
        raise P.APIError(400, f"url = {json.dumps(obj['url'])} is not supported: must be " +
                         " or ".join(f'"{u}"' for u in URLS), "url", "invalid_value")
    schema = P.ChatCompletionRequest if obj["url"] == URLS[0] else P.CompletionRequest
    return P.parse_request(schema, json.dumps(obj["body"]).encode("utf-8"))


def _check(req) -> None:
    """The checks the server makes of a parsed request after its model, in its order (the prompt, stop strings,
    log-probabilities), then that it is not streamed.

    Raises:
        APIError: the server's error, or ``stream: true`` (``unsupported_parameter``).
    """
    from mindspore_eagle.config import GenerationConfig
    from mindspore_eagle.serving import openai_protocol as P

    if isinstance(req, P.CompletionRequest):
        P.completion_prompt(req)                           # several prompts, an empty one
    P.generation_config(req, GenerationConfig())           # stop strings
    P.requested_logprobs(req)
    if req.stream:
        raise P.APIError(400, "stream = true is not supported in a batch job: each result is one response body",
                         "stream", "unsupported_parameter")


def check_model(rec: InputRecord, served: str) -> None:
    """Give ``rec`` the server's ``model_not_found`` error when its body names another model than ``served`` (the
    server checks the model right after parsing the body, so this error comes before the later checks' ones)."""
    if rec.request is not None and rec.request.model != served:
        rec.error = f"The model '{rec.request.model}' does not exist; this job serves '{served}'"
        rec.code = "model_not_found"


def record_id(line: int) -> str:
    """The output line's ``id`` of input line ``line``."""
    return f"{ID_PREFIX}{line}"


def line_of(result: dict) -> int | None:
    """The input line of an output line (from its ``id``), or None."""
    rid = str(result.get("id") or "")
    tail = rid[len(ID_PREFIX):]
    return int(tail) if rid.startswith(ID_PREFIX) and tail.isdigit() else None


def is_result(obj: dict) -> bool:
    """Whether an output line is an OpenAI batch result."""
    return "custom_id" in obj and "response" in obj and "error" in obj


def result_line(rec: InputRecord, body: dict) -> dict:
    """The output line of a request answered with ``body``."""
    return {"id": record_id(rec.line), "custom_id": rec.id,
            "response": {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}, "error": None}


def error_line(rec: InputRecord, message: str, code: str) -> dict:
    """The output line of a request that failed."""
    return {"id": record_id(rec.line), "custom_id": rec.id, "response": None,
            "error": {"code": code or "invalid_value", "message": message}}


def run_records(sched, records: list, on_result, model: str | None = None) -> None:
    """Answer every record (valid, parsed) on a BatchScheduler as the server does and call ``on_result(output
    line)`` as each finishes: the prompt ids, generation config and context fit of ``openai_protocol`` (their
    errors become the record's error line), then the request on the scheduler; the body is
    ``openai_protocol.response_body`` with ``model`` (default: the body's own) as the model name. A request that
    fails in the engine gets ``engine_error`` (a failed step) or ``invalid_value``."""
    from mindspore_eagle.serving import openai_protocol as P
    from mindspore_eagle.serving.scheduler import Request

    eng = sched.engine

    def done(rec, res):
        if res.error or res.stop_reason == "cancelled":
            code = "engine_error" if res.internal else "invalid_value"
            on_result(error_line(rec, " ".join(res.error.split()) or "the request was cancelled", code))
            return
        rid = P.new_id("chatcmpl" if rec.kind == URLS[0] else "cmpl")
        on_result(result_line(rec, P.response_body(rec.request, rid, model or rec.request.model, res,
                                                   eng.tokenizer, eng.eos)))

    for rec in records:
        req = rec.request
        try:
            ids = P.prompt_ids(eng, req)
            gen, explicit = P.generation_config(req, sched.gen)
            gen = dataclasses.replace(gen, logprobs=P.requested_logprobs(req))
            gen = P.fit(sched, len(ids), gen, explicit, "messages" if rec.kind == URLS[0] else "prompt")
        except P.APIError as e:
            on_result(error_line(rec, e.message, e.code))
            continue
        except MsEagleError as e:           # e.g. a tokenizer without a chat template (the server: a 500)
            on_result(error_line(rec, " ".join(str(e).split()), "invalid_value"))
            continue
        sched.add(Request(rec.key, gen, prompt_ids=ids, tag=rec, on_done=lambda r, res: done(r.tag, res)))
    sched.run_until_done()


__all__ = ["URLS", "check_model", "error_line", "is_openai_line", "is_result", "line_of", "parse_record",
           "record_id", "result_line", "run_records"]
