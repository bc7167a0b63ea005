"""Continuous batching: many sequences share one teacher forward per step, admitted as slots free.

Legend: N = ``max_batch`` (rows of one batched forward), S = cache.max_seq_len, B = cache.block_size, NB =
cache.num_blocks (the KV pool), need = prompt tokens + generation.max_new_tokens of one turn.

One scheduler step (the loop of :meth:`BatchScheduler.run`):
    admit    while a row is free and the pool can hold the next turn's ``need`` tokens: chat-template it, prefill
             it (chunked, its own calls, between two batched steps) and pick its first token
    step     ``stepper.step(live)``: one forward for every live sequence -> the next token of each
    emit     per sequence: EOS / stop strings / max_new_tokens (the engine's ``_Emitter``, so a sequence stops
             exactly where teacher-only decoding of it alone stops); a finished turn frees its blocks at once,
             a multi-turn record queues its next turn (the answer appended), a finished record is handed to
             ``on_result`` (the batch job writes and fsyncs it then)

Pool: admission reserves a turn's worst case (ceil(need / B) blocks) against NB, so a running sequence never meets
an exhausted pool and nothing is ever preempted; a turn waits while the pool is full and runs when others finish. A
turn whose need exceeds S, or NB on its own, gets an error result (the record's ``error``), never a crash.

The stepper is the one interface behind which the way tokens are produced lives: :class:`TeacherStepper` decodes
every live sequence through ``TargetRunner.decode_batch`` (block-diagonal mask over their concatenated block
tables, a fixed row count N per graph). Speculative steppers (stacked draft trees) plug in at the same place.
Greedy decoding of a sequence in a batch uses the same weights and the same per-row math as alone; only the
attention width (masked columns) and the row count of the matmuls differ, so float32 results agree to summation
order (tests/test_scheduler.py checks token equality with one-at-a-time greedy).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .config import GenerationConfig
from .engine import Engine, GenerationError, _Emitter


class TeacherStepper:
    """Teacher-only batched decoding: one ``decode_batch`` call of ``rows`` rows per step.

    Args:
        target: the engine's TargetRunner. rows: N, the fixed row count of every call (padding rows write to the
            pad block), so one graph serves each attention width bucket.
    """

    def __init__(self, target, rows: int):
        self.target, self.rows = target, rows

    def step(self, live: list) -> np.ndarray:
        """Append each live sequence's pending token; returns logits float32 [len(live), V]."""
        return self.target.decode_batch([s.sid for s in live], [s.next for s in live], rows=self.rows)


@dataclass
class _Turn:
    """A record in flight: its chat so far, the user turns still to ask, and the finished turns' results."""
    rec: object
    messages: list
    todo: list
    done: list = field(default_factory=list)
    t0: float = 0.0
    error: str = ""


@dataclass
class _Live:
    """One sequence in the batch: its turn, cache sequence id, emitter, RNG, pending token, blocks reserved."""
    job: _Turn
    sid: int
    emitter: _Emitter
    rng: np.random.Generator
    next: int
    prompt_tokens: int
    blocks: int


class BatchScheduler:
    """Serve records with up to ``max_batch`` sequences per teacher forward (module docstring).

    Args:
        engine: an :class:`~mindspore_eagle.engine.Engine` (its target's pool is shared by all rows).
        gen: GenerationConfig (per-sequence EOS / stop strings / max_new_tokens; temperature > 0 samples with a
            generator seeded by ``gen.seed`` per turn, as ``Engine.generate`` does).
        max_batch: N >= 1.
        stepper: how a step produces tokens (default :class:`TeacherStepper` with N rows).
        keep_ids: also keep every turn's generated token ids in ``token_ids[record id]`` (list per turn).
    Raises:
        ValueError: max_batch < 1 (names the field).
    """

    def __init__(self, engine: Engine, gen: GenerationConfig, max_batch: int, stepper=None, keep_ids: bool = False):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"batch.max_batch must be an integer >= 1, got {max_batch!r}")
        self.engine, self.gen, self.N = engine, gen, max_batch
        self.target = engine.target
        self.stepper = stepper or TeacherStepper(self.target, max_batch)
        self.B, self.NB = self.target.B, self.target.bm.num_blocks
        self.reserved = 0                       # blocks promised to live sequences
        self.new_tokens = 0
        self.peak_live = 0
        self.token_ids: dict | None = {} if keep_ids else None

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks a sequence of ``n_tokens`` tokens can occupy: ceil(n / B)."""
        return -(-n_tokens // self.B)

    def run(self, records, on_result) -> None:
        """Generate every record (InputRecord with kind prompt / messages / turns, no error) and call
        ``on_result(result_dict)`` as each one finishes (fields as ``batch.run_record``; ``tok_per_s`` = the
        record's new tokens per second from its admission to its end). Records are admitted in order (a
        record's next turn goes first); results arrive in finishing order. On an exception every live
        sequence's blocks are freed before it propagates."""
        queue = deque(_Turn(r, *_first_turn(r)) for r in records)
        live: list[_Live] = []
        try:
            while queue or live:
                while queue and len(live) < self.N:
                    out = self._admit(queue[0], bool(live))
                    if out is _WAIT:              # the pool is full: wait for a sequence to finish
                        break
                    job = queue.popleft()
                    if out is None:               # ended at its first token, or cannot run
                        self._settle(job, queue, on_result)
                    else:
                        live.append(out)
                self.peak_live = max(self.peak_live, len(live))
                if not live:
                    continue
                logits = self.stepper.step(live)
                still = []
                for s, row in zip(live, logits):
                    s.next = Engine._pick(row, self.gen, s.rng)
                    self.new_tokens += 1
                    if s.emitter.push(s.next):
                        self._end_turn(s)
                        self._settle(s.job, queue, on_result)
                    else:
                        still.append(s)
                live = still
        finally:
            for s in live:
                self.target.free(s.sid)
                self.reserved -= s.blocks

    # ------------------------------------------------------------------ internals
    def _admit(self, job: _Turn, others_live: bool):
        """Prefill ``job``'s current turn and pick its first token. Returns its _Live; None when the turn ended
        at that token or cannot run (``job.error`` set); ``_WAIT`` when the pool cannot hold it yet."""
        job.t0 = job.t0 or time.perf_counter()
        try:
            ids = self.engine.encode_chat(job.messages)
        except GenerationError as e:
            job.error = str(e)
            return None
        need = len(ids) + self.gen.max_new_tokens
        blocks = self.blocks_for(need)
        head = f"prompt of {len(ids)} tokens + generation.max_new_tokens={self.gen.max_new_tokens} = {need}"
        if need > self.target.S:
            job.error = f"{head} exceeds cache.max_seq_len={self.target.S}"
            return None
        if blocks > self.NB:
            job.error = f"{head} tokens needs {blocks} KV blocks but cache.num_blocks={self.NB}"
            return None
        if self.reserved + blocks > self.NB:
            if not others_live:
                raise RuntimeError(f"KV pool accounting error: {self.reserved} blocks reserved, no sequence live")
            return _WAIT
        sid = self.target.new_seq()
        self.reserved += blocks
        try:
            rng = np.random.default_rng(self.gen.seed)
            logits, _ = self.target.prefill(sid, ids)
        except BaseException:
            self.target.free(sid)
            self.reserved -= blocks
            raise
        s = _Live(job, sid, _Emitter(self.engine.tokenizer, self.engine.eos, self.gen), rng,
                  Engine._pick(logits, self.gen, rng), len(ids), blocks)
        self.new_tokens += 1
        if s.emitter.push(s.next):
            self._end_turn(s)
            return None
        return s

    def _end_turn(self, s: _Live) -> None:
        """Free the sequence's blocks and record its turn in its job."""
        self.target.free(s.sid)
        self.reserved -= s.blocks
        s.job.done.append({"text": s.emitter.text(), "prompt_tokens": s.prompt_tokens,
                           "new_tokens": len(s.emitter.ids), "stop_reason": s.emitter.reason})
        if self.token_ids is not None:
            self.token_ids.setdefault(s.job.rec.id, []).append(list(s.emitter.ids))

    @staticmethod
    def _settle(job: _Turn, queue: deque, on_result) -> None:
        """After a turn: queue the record's next turn (at the front, the answer appended) or hand out its result."""
        if not job.error and job.todo:
            job.messages = job.messages + [{"role": "assistant", "content": job.done[-1]["text"]},
                                           {"role": "user", "content": job.todo[0]}]
            job.todo = job.todo[1:]
            queue.appendleft(job)
        else:
            on_result(_result(job))


_WAIT = object()


def _first_turn(rec) -> tuple[list, list]:
    """(messages of the first turn, user turns after it) of an InputRecord."""
    if rec.kind == "turns":
        return [{"role": "user", "content": rec.payload[0]}], list(rec.payload[1:])
    if rec.kind == "messages":
        return list(rec.payload), []
    return [{"role": "user", "content": rec.payload}], []


def _result(job: _Turn) -> dict:
    """The batch job's result dict of a finished record (``batch.run_record``'s fields; teacher-only: L_k 1)."""
    head = {"id": job.rec.id, "line": job.rec.line}
    if job.error:
        return {**head, "error": " ".join(job.error.split())}
    secs = time.perf_counter() - job.t0
    new = sum(t["new_tokens"] for t in job.done)
    fields = {k: [t[k] for t in job.done] for k in ("text", "prompt_tokens", "new_tokens", "stop_reason")}
    if job.rec.kind != "turns":
        fields = {k: v[0] for k, v in fields.items()}
    return {**head, "text": fields["text"], "prompt_tokens": fields["prompt_tokens"],
            "new_tokens": fields["new_tokens"], "tok_per_s": round(new / secs, 3) if secs > 0 else 0.0,
            "mean_accept_len": 1.0, "stop_reason": fields["stop_reason"]}


__all__ = ["BatchScheduler", "TeacherStepper"]
