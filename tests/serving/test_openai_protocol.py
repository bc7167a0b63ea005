"""serving/openai_protocol.py without a server: a bad field's error names the field, the value and the whole
allowed range in one style (pydantic's bounds turned into "must be a number in [0, 2]"), with OpenAI's codes."""
from __future__ import annotations

import json

import pytest

from mindspore_eagle.serving import openai_protocol as P

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def error(cls, body: dict, logprobs: bool = False) -> dict:
    with pytest.raises(P.APIError) as e:
        req = P.parse_request(cls, json.dumps(body).encode())
        if logprobs:
            P.requested_logprobs(req)
    return e.value.body()["error"]


@pytest.mark.parametrize("field, value, words", [
    ("temperature", 3, "temperature = 3 is out of range: must be a number in [0, 2]"),
    ("temperature", -0.5, "temperature = -0.5 is out of range: must be a number in [0, 2]"),
    ("top_p", 0, "top_p = 0 is out of range: must be a number in (0, 1]"),
    ("top_p", 1.5, "top_p = 1.5 is out of range: must be a number in (0, 1]"),
    ("top_k", -2, "top_k = -2 is out of range: must be an int >= -1"),
    ("max_tokens", 0, "max_tokens = 0 is out of range: must be an int >= 1"),
    ("max_completion_tokens", -3, "max_completion_tokens = -3 is out of range: must be an int >= 1"),
])
def test_out_of_range_values_name_the_whole_range(field, value, words):
    e = error(P.ChatCompletionRequest, {**CHAT, field: value})
    assert e == {"message": words, "type": "invalid_request_error", "param": field, "code": "invalid_value"}


def test_completions_logprobs_is_an_int():
    body = {"model": "m", "prompt": "Hi"}
    e = error(P.CompletionRequest, {**body, "logprobs": True}, logprobs=True)
    assert (e["param"], e["code"]) == ("logprobs", "invalid_type") and "must be an int in [0, 5]" in e["message"]
    e = error(P.CompletionRequest, {**body, "logprobs": 6}, logprobs=True)
    assert e["message"] == "logprobs = 6 is out of range: must be an int in [0, 5]" and e["code"] == "invalid_value"
    ok = P.parse_request(P.CompletionRequest, json.dumps({**body, "logprobs": 2}).encode())
    assert P.requested_logprobs(ok) == 2
    assert P.requested_logprobs(P.parse_request(P.CompletionRequest, json.dumps({**body, "logprobs": False})
                                                .encode())) is None


def test_types_and_unknown_fields():
    e = error(P.ChatCompletionRequest, {**CHAT, "temperature": "hot"})
    assert (e["param"], e["code"]) == ("temperature", "invalid_type")
    e = error(P.ChatCompletionRequest, {**CHAT, "max_tokens": True})
    assert (e["param"], e["code"]) == ("max_tokens", "invalid_type")
    e = error(P.ChatCompletionRequest, {**CHAT, "frobnicate": 1})
    assert e["message"] == "Unrecognized request argument supplied: frobnicate" and e["code"] == "unknown_parameter"
