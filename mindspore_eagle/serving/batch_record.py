"""One input line of a batch job (``serving/batch_job.py`` reads native records, ``serving/batch_openai.py`` the
OpenAI Batch API's): the parsed record and the JSON check of a line, shared by both formats."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass
class InputRecord:
    """One input line.

    Attributes:
        line: 1-based line number in the input file.
        index: 0-based position among the non-blank lines (record i; sharding uses it).
        id: the record's ``id`` as given (None when missing or the line is not JSON).
        kind: "prompt" | "messages" | "turns", or "" when the record is invalid.
        payload: str (prompt) | list of {"role", "content"} (messages) | list of str (turns) | None.
        error: why the record cannot run ("" if it can); written as its result.
        gen: the record's own generation fields ({name in GEN_FIELDS: value}, checked; ``max_tokens`` as
            max_new_tokens, ``logprobs`` as the alternatives per token or None), {} when none.
        fmt: "native" (the fields above) or "openai" (batch_openai.py: ``id`` is the ``custom_id``, ``kind`` the
            url, ``request`` the parsed body, ``code`` the error's code).
    """
    line: int
    index: int
    id: object = None
    kind: str = ""
    payload: object = None
    error: str = ""
    gen: dict = field(default_factory=dict)
    fmt: str = "native"
    request: object = None
    code: str = ""

    def generation(self, base):
        """The GenerationConfig this record runs with: ``base`` (the job's) with the record's own fields."""
        return dataclasses.replace(base, **self.gen) if self.gen else base

    @property
    def key(self) -> str:
        """Resume / merge key: the id (JSON-encoded, so 1 and "1" differ), else the line number."""
        return f"line:{self.line}" if self.id is None else "id:" + json.dumps(self.id, sort_keys=True)



def load_line(line: int, text: str) -> tuple:
    """(JSON object, "", "") of an input line, or (None, error message, OpenAI error code) when it is not JSON or
    not an object."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        # json's reason may already end in "at" ("Unterminated string starting at"): never "at at column"
        reason = e.msg[:-3] if e.msg.endswith(" at") else e.msg
        return None, f"line {line}: invalid JSON ({reason} at column {e.colno})", "invalid_json"
    if not isinstance(obj, dict):
        return None, f"line {line}: a record must be a JSON object, got {type(obj).__name__}", "invalid_type"
    return obj, "", ""


__all__ = ["InputRecord", "load_line"]
