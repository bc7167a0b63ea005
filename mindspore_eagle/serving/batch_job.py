"""Resumable batch inference: JSONL records in, one JSONL result line per record out.

Input (UTF-8 JSONL, blank lines ignored), one record per line, exactly one of ``prompt`` / ``messages`` / ``turns``
(other keys are ignored, so MT-Bench style files with ``category`` etc. load as they are)::

    {"id": "q1", "prompt": "What is the capital of France?"}                       one user message
    {"id": 7, "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}]}
    {"id": "chat-3", "turns": ["Name a colour.", "Why that one?"]}                  multi-turn; answers chained
    {"id": "s1", "prompt": "A poem", "temperature": 0.8, "seed": 3, "max_new_tokens": 64}  its own sampling

A record may carry its own generation fields (:data:`GEN_FIELDS`: ``temperature``, ``top_p``, ``top_k``,
``max_new_tokens``, ``stop``, ``seed``), checked as the config's ``generation`` section is (a bad one is an error
of that record only); a field it leaves out comes from the job's config, as vLLM applies one SamplingParams to
every prompt. It may also carry the server's chat request fields (:data:`REQUEST_FIELDS`: ``max_tokens`` /
``max_completion_tokens`` = ``max_new_tokens``, ``logprobs`` / ``top_logprobs``, ``user``, the unsupported ones at
their neutral value), and its ``messages`` are the server's (roles ``system``, ``developer``, ``user``,
``assistant``; content a string or text parts), all parsed by ``openai_protocol`` with the server's checks and
messages. With log-probabilities asked (the record's ``logprobs``, else ``generation.logprobs``) a result has
``logprobs``: the server's chat ``logprobs.content`` entries (a list per turn for ``turns``).

A file of OpenAI Batch API lines (``{"custom_id", "method", "url", "body"}``; detected by its first JSON object,
or ``read_input(fmt="openai")``) is read and answered in OpenAI's batch formats instead: batch_openai.py.

Output, one line per input record (``line`` = 1-based input line)::

    {"id": "q1", "line": 1, "text": "...", "prompt_tokens": 31, "new_tokens": 8, "tok_per_s": 3.1,
     "mean_accept_len": 2.4, "stop_reason": "eos"}
    multi-turn: text / prompt_tokens / new_tokens / stop_reason are lists (one entry per turn); tok_per_s and
    mean_accept_len cover all turns (tokens per wall second incl. prefill; L_k counts the bonus token).
    failed record: {"id": ..., "line": 4, "error": "..."} (invalid JSON line: "id": null), and the job goes on.
    with log-probabilities: "logprobs": [{"token", "logprob", "bytes", "top_logprobs"}, ...] (per turn for turns).

Crash safety: every finished record is appended as one whole line with a single ``write`` then ``fsync``; a JSON
line never contains a newline, so a job killed at any moment leaves complete lines plus at most one partial last
line. ``resume=True`` truncates that partial line and skips the records already written (by id; by line number for
records without a usable id), so no record is lost or duplicated.

Data parallel: ``shard(records, rank, size)`` keeps record i (0-based, in input order) when i % size == rank; each
rank writes ``shard_path(output, rank)`` and ``merge_shards`` writes the union in input order.

Errors: :class:`BatchError` (one line) for job-level problems: missing or empty input, duplicate ids, an output that
exists without resume/overwrite, or an output that belongs to another input.
"""
from __future__ import annotations

import json
import os
import sys
import time
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from mindspore_eagle.errors import MsEagleError
from mindspore_eagle.serving.batch_record import InputRecord, load_line

KINDS = ("prompt", "messages", "turns")
GEN_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed")
"""Generation fields a record may set for itself (``config.GenerationConfig``'s names)."""
REQUEST_FIELDS = ("max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "user", "stream",
                  "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias", "response_format",
                  "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
"""The server's chat request fields (``openai_protocol.ChatCompletionRequest``) a native record may set beyond
:data:`GEN_FIELDS` and ``messages``; parsed and checked by the server's parser."""
FORMATS = ("auto", "native", "openai")


class BatchError(MsEagleError, ValueError):
    """A batch job cannot start or finish (bad input file, duplicate ids, output conflict); one-line message."""


def result_key(result: dict) -> str:
    """The :attr:`InputRecord.key` of an output line (an OpenAI batch result: by ``custom_id``, else the line in
    its ``id``)."""
    if "line" not in result and "custom_id" in result:
        from mindspore_eagle.serving.batch_openai import line_of

        rid, line = result.get("custom_id"), line_of(result)
    else:
        rid, line = result.get("id"), result.get("line")
    return f"line:{line}" if rid is None else "id:" + json.dumps(rid, sort_keys=True)


def error_result(rec: InputRecord, message: str | None = None, code: str = "") -> dict:
    """The output line of a record that failed (``message`` default: its ``error``), in its file's format."""
    if rec.fmt == "openai":
        from mindspore_eagle.serving.batch_openai import error_line

        return error_line(rec, rec.error if message is None else message, code or rec.code)
    return {"id": rec.id, "line": rec.line, "error": rec.error if message is None else message}


def parse_record(line: int, index: int, text: str) -> InputRecord:
    """Parse and check one input line; problems go into ``InputRecord.error`` (never raised)."""
    rec = InputRecord(line, index)
    obj, rec.error, _ = load_line(line, text)
    if obj is None:
        return rec
    rec.id = obj.get("id")
    where = f"line {line}" + ("" if rec.id is None else f" (id {json.dumps(rec.id)})")
    if rec.id is None:
        rec.error = f'{where}: missing "id"'
    elif isinstance(rec.id, bool) or not isinstance(rec.id, (str, int)):
        rec.error = f"{where}: id must be a string or an integer"
    kinds = [k for k in KINDS if k in obj]
    if rec.error:
        return rec
    if len(kinds) != 1:
        rec.error = f'{where}: needs exactly one of "prompt", "messages", "turns" (got {kinds or "none"})'
        return rec
    rec.kind, rec.payload = kinds[0], obj[kinds[0]]
    rec.error = (_check_payload(rec.kind, rec.payload, where) or _check_gen(rec, obj, where)
                 or _check_request(rec, obj, where))
    return rec


def _check_gen(rec: InputRecord, obj: dict, where: str) -> str:
    """Take the record's generation fields into ``rec.gen``; the first bad one's message, or ""."""
    from mindspore_eagle.config import ConfigError, GenerationConfig

    rec.gen = {k: obj[k] for k in GEN_FIELDS if k in obj}
    if isinstance(rec.gen.get("temperature"), int) and not isinstance(rec.gen["temperature"], bool):
        rec.gen["temperature"] = float(rec.gen["temperature"])
    try:
        GenerationConfig(**rec.gen).validate()
    except ConfigError as e:
        return f"{where}: {str(e).replace('generation.', '')}"
    return ""


def _check_request(rec: InputRecord, obj: dict, where: str) -> str:
    """Parse the record's :data:`REQUEST_FIELDS` and ``messages`` with the server's parser (its checks and
    messages): ``max_tokens`` (or ``max_completion_tokens``) becomes ``rec.gen["max_new_tokens"]``, a given
    ``logprobs`` ``rec.gen["logprobs"]``, and messages the engine's ``{"role", "content"}`` (developer = system,
    text parts joined). Returns the first problem's message, or ""."""
    from mindspore_eagle.serving import openai_protocol as P

    fields = {k: obj[k] for k in REQUEST_FIELDS if k in obj}
    if not fields and rec.kind != "messages":
        return ""
    messages = [{"role": "user", "content": "."}]
    if rec.kind == "messages":                  # other keys of a message are ignored, as other keys of a record
        known = P.ChatMessage.model_fields
        messages = rec.payload if not isinstance(rec.payload, list) else [
            {k: v for k, v in m.items() if k in known} if isinstance(m, dict) else m for m in rec.payload]
    try:
        req = P.parse_request(P.ChatCompletionRequest, json.dumps({"model": "", "messages": messages, **fields})
                              .encode("utf-8"))
        if req.stream:
            raise P.APIError(400, "stream = true is not supported in a batch job", "stream", "unsupported_parameter")
        top = P.requested_logprobs(req)
    except P.APIError as e:
        return f"{where}: {e.message}"
    if rec.kind == "messages":
        rec.payload = P.chat_messages(req)
    most = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    if most is not None:
        if rec.gen.get("max_new_tokens", most) != most:
            return f"{where}: max_tokens and max_new_tokens disagree; give one of them"
        rec.gen["max_new_tokens"] = most
    if "logprobs" in fields:
        rec.gen["logprobs"] = top
    return ""


def _check_payload(kind: str, p, where: str) -> str:
    if kind == "prompt":
        return "" if isinstance(p, str) and p.strip() else f'{where}: "prompt" must be a non-empty string'
    if kind == "turns":
        ok = isinstance(p, list) and p and all(isinstance(t, str) and t.strip() for t in p)
        return "" if ok else f'{where}: "turns" must be a non-empty list of non-empty strings'
    return ""                                   # messages: the server's parser (_check_request)


def read_input(path, fmt: str = "auto") -> list:
    """All records of a JSONL input file, in order (invalid lines included, carrying their error).

    Args:
        fmt: "native" (:func:`parse_record`), "openai" (OpenAI Batch API lines, ``batch_openai.parse_record``) or
            "auto": "openai" when the first line that is a JSON object has ``custom_id`` and ``body``.
    Raises:
        BatchError: the file is missing or unreadable, holds no record (empty or blank lines only), or two records
            share an id (both line numbers named); an unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise BatchError(f"unknown batch input format {fmt!r}; one of {', '.join(FORMATS)}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise BatchError(f"input file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BatchError(f"input file {str(path)!r} cannot be read: {e}") from None
    from mindspore_eagle.serving import batch_openai

    if fmt == "auto":
        fmt = "openai" if batch_openai.is_openai_line(_first_object(lines)) else "native"
    parse = batch_openai.parse_record if fmt == "openai" else parse_record
    records = []
    for n, text in enumerate(lines, 1):
        if text.strip():
            records.append(parse(n, len(records), text))
    if not records:
        raise BatchError(f"input file {str(path)!r} is empty: expected one JSON record per line, e.g. "
                         '{"id": "q1", "prompt": "..."}')
    seen: dict = {}
    name = "custom_id" if fmt == "openai" else "id"
    for r in records:
        if r.id is not None and r.key in seen:
            raise BatchError(f"input file {str(path)!r}: duplicate {name} {json.dumps(r.id)} on lines "
                             f"{seen[r.key]} and {r.line}; {name}s must be unique")
        seen.setdefault(r.key, r.line)
    return records


def _first_object(lines: list):
    """The first line of ``lines`` that parses as a JSON object, parsed (None if none does)."""
    for text in lines:
        if text.strip():
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def shard(records: list, rank: int, size: int) -> list:
    """Records i with i % size == rank (data parallel: record i goes to rank i % size)."""
    if size < 1 or not 0 <= rank < size:
        raise BatchError(f"rank {rank} is out of range for {size} ranks")
    return [r for r in records if r.index % size == rank]


def shard_path(output, rank: int) -> str:
    """``out.jsonl`` -> ``out.rank{rank}.jsonl`` (same directory)."""
    root, ext = os.path.splitext(os.fspath(output))
    return f"{root}.rank{rank}{ext or '.jsonl'}"


def read_results(path, truncate_partial: bool = False) -> list:
    """Complete result lines of an output file ([] if it does not exist).

    Args:
        truncate_partial: cut a trailing partial line (left by a killed job) off the file; otherwise it is
            only ignored.
    Raises:
        BatchError: a complete line is not a JSON object (the file is not an output of this tool).
    """
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data) and truncate_partial:
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    out = []
    for n, raw in enumerate(data[:end].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict) or not ("line" in obj or _is_openai_result(obj)):
            raise BatchError(f"output file {str(path)!r} line {n} is not a result record; is it the output of "
                             "another program?")
        out.append(obj)
    return out


def _is_openai_result(obj: dict) -> bool:
    from mindspore_eagle.serving.batch_openai import is_result

    return is_result(obj)


class ResultWriter:
    """Appends result dicts as whole JSON lines: one ``os.write`` per record, then ``fsync``."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, result: dict) -> None:
        data = (json.dumps(result, ensure_ascii=False) + "\n").encode("utf-8")
        while data:  # a short write is continued; a kill in between leaves a partial line resume() cuts
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _known_generation_errors() -> tuple:
    from mindspore_eagle.models.model_config import CheckpointError
    from mindspore_eagle.serving.engine import CacheExhaustedError, GenerationError

    return GenerationError, CacheExhaustedError, CheckpointError


def run_record(engine, rec: InputRecord, gen, speculative: bool = True) -> dict:
    """Generate one record's answer; returns its result dict (see module docstring).

    Raises:
        GenerationError / CacheExhaustedError: the record cannot run (too long, empty); ``run_batch`` turns
            them into the record's ``error``.
    """
    from mindspore_eagle.serving.engine import mean_accept_len

    gen = rec.generation(gen)
    if rec.kind == "turns":
        gens = engine.chat(rec.payload, gen, speculative, turn_id=str(rec.id))
    else:
        gens = [engine.generate(rec.payload, gen, speculative, turn_id=str(rec.id))]
    turns = [turn_fields(g, engine, gen) for g in gens]
    secs = sum(g.turn.prefill_ms + g.turn.decode_ms for g in gens) / 1e3
    return record_result(rec, turns, secs, mean_accept_len([s for g in gens for s in g.steps]))


def turn_fields(res, engine, gen) -> dict:
    """One turn's result fields of a finished turn ``res`` (an engine ``Generation`` or a scheduler
    ``TurnResult``): text, prompt_tokens, new_tokens, stop_reason and, when ``gen.logprobs`` is set, logprobs (the
    server's chat ``logprobs.content``: ``openai_protocol.chat_logprobs``)."""
    out = {"text": res.text, "prompt_tokens": res.prompt_tokens, "new_tokens": len(res.token_ids),
           "stop_reason": res.stop_reason}
    if getattr(gen, "logprobs", None) is not None:
        from mindspore_eagle.serving.openai_protocol import chat_logprobs

        out["logprobs"] = chat_logprobs(res.logprobs, engine.tokenizer, engine.eos)["content"]
    return out


def record_result(rec: InputRecord, turns: list, seconds: float, mean_lk: float) -> dict:
    """The result dict of a finished record (module docstring): ``turns`` = one :func:`turn_fields` dict per turn
    (a "turns" record lists each field per turn, the others give the one turn's values); ``tok_per_s`` = all new
    tokens / ``seconds``; ``mean_lk`` = mean L_k over tree verifications (1.0 without any); ``logprobs`` last,
    when the turns have them."""
    names = ("text", "prompt_tokens", "new_tokens", "stop_reason") + (("logprobs",) if "logprobs" in turns[0] else ())
    fields = {k: [t[k] for t in turns] for k in names}
    if rec.kind != "turns":
        fields = {k: v[0] for k, v in fields.items()}
    new = sum(t["new_tokens"] for t in turns)
    out = {"id": rec.id, "line": rec.line, "text": fields["text"], "prompt_tokens": fields["prompt_tokens"],
           "new_tokens": fields["new_tokens"], "tok_per_s": round(new / seconds, 3) if seconds > 0 else 0.0,
           "mean_accept_len": round(float(mean_lk), 4), "stop_reason": fields["stop_reason"]}
    if "logprobs" in fields:
        out["logprobs"] = fields["logprobs"]
    return out


@dataclass
class _InFlight:
    """A record on the scheduler: its chat so far, the user turns still to ask, the finished turns."""
    rec: InputRecord
    messages: list
    todo: list
    done: list = field(default_factory=list)
    accept_lens: list = field(default_factory=list)
    t0: float = 0.0


def run_records(sched, records: list, on_result, token_ids: dict | None = None) -> None:
    """Generate every record (kind prompt / messages / turns, no error) on a BatchScheduler and call
    ``on_result(result dict)`` as each finishes (fields as :func:`run_record`; ``tok_per_s`` = the record's new
    tokens per second from its first admission to its end; a failed turn gives the record's ``error``). Records
    are admitted in order; a record's next turn is queued at the front when an answer is done, with that answer
    appended to its chat; results arrive in finishing order. ``token_ids``: when given, ``token_ids[record id]``
    gets each turn's generated ids (list per turn)."""
    from mindspore_eagle.serving.scheduler import Request

    def ask(job: _InFlight, front: bool = False) -> None:
        gen = job.rec.generation(sched.gen)
        sched.add(Request((job.rec.id, len(job.done)), gen, messages=job.messages, tag=job,
                          on_done=lambda req, res: turn_done(job, res)), front=front)

    def turn_done(job: _InFlight, res) -> None:
        job.t0 = job.t0 or res.t_admitted
        if res.error:
            on_result({"id": job.rec.id, "line": job.rec.line, "error": " ".join(res.error.split())})
            return
        job.done.append(turn_fields(res, sched.engine, job.rec.generation(sched.gen)))
        job.accept_lens += res.accept_lens
        if token_ids is not None:
            token_ids.setdefault(job.rec.id, []).append(list(res.token_ids))
        if job.todo:
            job.messages = job.messages + [{"role": "assistant", "content": res.text},
                                           {"role": "user", "content": job.todo[0]}]
            job.todo = job.todo[1:]
            ask(job, front=True)
            return
        lk = float(np.mean(job.accept_lens)) if job.accept_lens else 1.0
        on_result(record_result(job.rec, job.done, time.perf_counter() - job.t0, lk))

    for r in records:
        ask(_InFlight(r, *_first_turn(r)))
    sched.run_until_done()


def _first_turn(rec: InputRecord) -> tuple[list, list]:
    """(messages of the first turn, user turns after it) of a record."""
    if rec.kind == "turns":
        return [{"role": "user", "content": rec.payload[0]}], list(rec.payload[1:])
    if rec.kind == "messages":
        return list(rec.payload), []
    return [{"role": "user", "content": rec.payload}], []


@dataclass
class BatchStats:
    """Counts of one ``run_batch`` call: records in scope, already done before (resume), written now
    (results + errors), errors among them, wall seconds."""
    total: int
    skipped: int
    written: int
    errors: int
    seconds: float


def prepare_output(records: list, output, resume: bool, overwrite: bool) -> set:
    """Make ``output`` ready to append to; returns the keys already done (resume).

    Raises:
        BatchError: the output exists (non-empty) without resume / overwrite, or holds records that are not in
            ``records`` (it belongs to another input or shard).
    """
    output = os.fspath(output)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    exists = os.path.exists(output) and os.path.getsize(output) > 0
    if exists and not (resume or overwrite):
        raise BatchError(f"output file {output!r} already exists: pass --resume to continue it or --overwrite to "
                         "start over")
    if exists and overwrite and not resume:
        open(output, "wb").close()
        return set()
    done = {result_key(r) for r in read_results(output, truncate_partial=True)}
    stray = done - {r.key for r in records}
    if stray:
        raise BatchError(f"output file {output!r} holds {len(stray)} record(s) that are not in this input "
                         f"(e.g. {sorted(stray)[0]}); it belongs to another job")
    return done


def run_batch(engine, records: list, output, gen, speculative: bool = True, resume: bool = False,
              overwrite: bool = False, progress: bool = True, max_batch: int = 1,
              model: str | None = None) -> BatchStats:
    """Run every record not yet in ``output`` and append its result (or error) line.

    Args:
        engine: an Engine, or a zero-argument callable building one (called at most once, and only if some
            record needs generating: resuming a finished job loads no model).
        records: InputRecords (``read_input``, possibly ``shard``-ed), processed in order.
        output: JSONL path, appended to. gen: GenerationConfig. speculative: False = teacher-only decoding.
        resume: skip records already in ``output`` (after cutting a partial last line).
        overwrite: start ``output`` afresh if it exists. progress: tqdm bar on stderr (records, and tokens per
            second with batching).
        max_batch: > 1 serves up to that many records at once through one teacher forward per step
            (``scheduler.BatchScheduler``, continuous batching; results are written as records finish, so in
            finishing order). With ``speculative`` and an engine with a drafter, every sequence drafts a tree
            of the fixed budget (speculative.M, D_max) and all trees are verified in one forward; else the
            batch decodes teacher-only. The CLI builds the engine from :func:`batched_config`.
        model: OpenAI-format records (batch_openai.py, always run on the scheduler as the server runs them, in
            finishing order): the served model name their body's ``model`` must be and their answers give (None:
            any, each answer giving its body's).
    Returns:
        BatchStats.
    Raises:
        BatchError: see ``prepare_output``. Model loading errors (CheckpointError, ...) propagate.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    done = prepare_output(records, output, resume, overwrite)
    todo = [r for r in records if r.key not in done]
    stats = BatchStats(len(records), len(records) - len(todo), 0, 0, 0.0)
    bar = tqdm(total=len(records), initial=stats.skipped, disable=not progress, unit="rec", file=sys.stderr,
               dynamic_ncols=True, desc="batch")
    errors: tuple = ()
    with ResultWriter(output) as writer, bar:
        def emit(result):
            writer.write(result)
            stats.written += 1
            stats.errors += result.get("error") is not None
            bar.update(1)

        if max_batch > 1 or (todo and todo[0].fmt == "openai"):
            if model is not None and todo and todo[0].fmt == "openai":
                from mindspore_eagle.serving.batch_openai import check_model

                for rec in todo:
                    check_model(rec, model)
            runnable = [r for r in todo if not r.error]
            for rec in todo:
                if rec.error:
                    emit(error_result(rec))
            if runnable:
                _run_batched(engine() if not hasattr(engine, "generate") else engine, runnable, gen, max_batch,
                             speculative, emit, bar, model)
            todo = []
        for rec in todo:
            result = error_result(rec) if rec.error else None
            if result is None:
                if not hasattr(engine, "generate"):
                    engine = engine()
                errors = errors or _known_generation_errors()
                try:
                    result = run_record(engine, rec, gen, speculative)
                except errors as e:
                    result = {"id": rec.id, "line": rec.line, "error": " ".join(str(e).split())}
            emit(result)
    stats.seconds = time.perf_counter() - t0
    return stats


def batched_config(cfg):
    """The Config a ``batch.max_batch`` > 1 job runs with: a KV pool of at least max_batch sequences of
    ``cache.max_seq_len`` (``cache.num_blocks`` = max(its value, max_batch x max_seq_len / block_size); the drafter
    cache follows), and no drafter unless ``batch.speculative`` (a one-line note on stderr says so when one was
    configured)."""
    import dataclasses

    n = cfg.batch.max_batch
    model = cfg.model
    if model.drafter != "none" and not cfg.batch.speculative:
        print(f"batch: batch.max_batch = {n}: sequences decode teacher-only in batches (batch.speculative: true "
              "verifies a draft tree per sequence in one forward)", file=sys.stderr, flush=True)
        model = dataclasses.replace(model, drafter="none")
    blocks = max(cfg.cache.num_blocks, n * (cfg.cache.max_seq_len // cfg.cache.block_size))
    return dataclasses.replace(cfg, model=model, cache=dataclasses.replace(cfg.cache, num_blocks=blocks)).validate()


def _run_batched(engine, records: list, gen, max_batch: int, speculative: bool, emit, bar, model=None) -> None:
    """``run_batch`` on the scheduler (``max_batch`` > 1, or OpenAI-format records, which run as the server runs
    them: ``single_round``): continuous batching (scheduler.py), tokens/s on the progress bar."""
    from mindspore_eagle.serving import batch_openai
    from mindspore_eagle.serving.scheduler import BatchScheduler

    openai = records[0].fmt == "openai"
    sched = BatchScheduler(engine, gen, max_batch, speculative=speculative and engine.speculates,
                           single_round=openai)
    t0 = time.perf_counter()

    def on_result(result):
        emit(result)
        bar.set_postfix(tok_s=f"{sched.new_tokens / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)

    if openai:
        batch_openai.run_records(sched, records, on_result, model)
    else:
        run_records(sched, records, on_result)


def shard_progress(records: list, output, size: int) -> dict:
    """rank -> number of its records still missing from its shard file (partial last lines ignored)."""
    missing = {}
    for rank in range(size):
        want = {r.key for r in shard(records, rank, size)}
        have = {result_key(r) for r in read_results(shard_path(output, rank))}
        missing[rank] = len(want - have)
    return missing


def merge_shards(records: list, output, size: int) -> int:
    """Write ``output`` = the results of all ``size`` shard files, in input order (atomic replace).

    Returns:
        number of records written.
    Raises:
        BatchError: some shard lacks records (names the ranks and counts).
    """
    missing = {r: n for r, n in shard_progress(records, output, size).items() if n}
    if missing:
        raise BatchError("cannot merge: shards incomplete (" + ", ".join(f"rank {r}: {n} record(s) missing"
                                                                      for r, n in missing.items()) + ")")
    by_key = {}
    for rank in range(size):
        for res in read_results(shard_path(output, rank)):
            by_key.setdefault(result_key(res), res)
    tmp = f"{os.fspath(output)}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(by_key[r.key], ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    return len(records)


def wait_and_merge(records: list, output, size: int, timeout_s: float = 86400.0, poll_s: float = 2.0) -> int:
    """Poll until every shard is complete, then ``merge_shards``.

    Raises:
        BatchError: still incomplete after ``timeout_s`` seconds (names the ranks).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if not any(shard_progress(records, output, size).values()):
            return merge_shards(records, output, size)
        if time.monotonic() > deadline:
            return merge_shards(records, output, size)  # raises, naming what is missing
        time.sleep(poll_s)


__all__ = ["BatchError", "BatchStats", "FORMATS", "GEN_FIELDS", "InputRecord", "REQUEST_FIELDS", "ResultWriter",
           "error_result", "load_line", "merge_shards", "parse_record", "prepare_output", "read_input", "read_results",
           "result_key", "run_batch", "run_record", "shard", "shard_path", "shard_progress", "turn_fields",
           "wait_and_merge"]
