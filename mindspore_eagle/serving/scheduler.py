"""Continuous batching: many sequences share one teacher forward per step, admitted as slots free.

Legend: N = ``max_batch`` (rows of one batched forward), S = cache.max_seq_len, B = cache.block_size, NB =
cache.num_blocks (the KV pool), need = prompt tokens + generation.max_new_tokens of one turn.

One scheduler step (the loop of :meth:`BatchScheduler.run`):
    admit    while a row is free and the pool can hold the next turn's ``need`` tokens: chat-template it and
             reserve its blocks
    prefill  every admitted sequence still filling runs ONE prefill chunk (``cache.prefill_chunk`` tokens) per
             scheduler step, so a long prompt never stalls the others for more than a chunk; after its last
             chunk it picks its first token and joins the batched steps
    step     ``DecodeRound.step(live)`` (serving/round.py, the round every caller shares): one teacher forward
             for every live sequence, each Emitter applying EOS / stop strings / max_new_tokens, so a sequence
             stops exactly where teacher-only decoding of it alone stops
    settle   a finished turn frees its blocks at once,
             a multi-turn record queues its next turn (the answer appended), a finished record is handed to
             ``on_result`` (the batch job writes and fsyncs it then)

Pool: admission reserves a turn's worst case (ceil(need / B) blocks) against NB, so a running sequence never meets
an exhausted pool and nothing is ever preempted; a turn waits while the pool is full and runs when others finish. A
turn whose need exceeds S, or NB on its own, gets an error result (the record's ``error``), never a crash.

The round (``self.round``) has N rows: N = 1 runs the engine's single-sequence graphs and speculation policy; N > 1
decodes every live sequence in one ``TeacherRunner.decode_batch`` call, or (speculative, when the round's RateGate
measures that it pays at this batch size) drafts a tree per sequence and verifies all of them in one
``TeacherRunner.verify_batch`` forward of N x M rows.
Greedy decoding of a sequence in a batch uses the same weights and the same per-row math as alone; only the
attention width (masked columns) and the row count of the matmuls differ, so float32 results agree to summation
order (tests/serving/test_scheduler.py checks token equality with one-at-a-time greedy).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mindspore_eagle.config import GenerationConfig
from mindspore_eagle.core.accept import sample_token
from mindspore_eagle.core.emit import Emitter
from mindspore_eagle.serving.engine import Engine, GenerationError
from mindspore_eagle.serving.round import Sequence


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
class _Live(Sequence):
    """One sequence in the batch: a round Sequence plus its record, prompt (prefilled chunk by chunk) and the KV
    blocks reserved for it."""
    job: _Turn | None = None
    prompt_tokens: int = 0
    blocks: int = 0
    prompt: list = field(default_factory=list)       # prompt ids; prefilled chunk by chunk
    filled: int = 0
    auxes: list = field(default_factory=list)


class BatchScheduler:
    """Serve records with up to ``max_batch`` sequences per teacher forward (module docstring).

    Args:
        engine: an :class:`~mindspore_eagle.serving.engine.Engine` (its teacher's KV pool is shared by all rows).
        gen: GenerationConfig (per-sequence EOS / stop strings / max_new_tokens; temperature > 0 samples with a
            generator seeded by ``gen.seed`` per turn, as ``Engine.generate`` does).
        max_batch: N >= 1.
        speculative: EAGLE-3 tree speculation (the engine's drafter cache must hold N sequences) instead of
            teacher-only decoding.
        decode_round: the DecodeRound that advances the live sequences (default ``engine.decode_round(speculative,
            rows=max_batch)``; tests inject one).
        keep_ids: also keep every turn's generated token ids in ``token_ids[record id]`` (list per turn).
    Raises:
        ValueError: max_batch < 1 (names the field).
    """

    def __init__(self, engine: Engine, gen: GenerationConfig, max_batch: int, speculative: bool = False,
                 decode_round=None, keep_ids: bool = False):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"batch.max_batch must be an integer >= 1, got {max_batch!r}")
        self.engine, self.gen, self.N = engine, gen, max_batch
        self.teacher = engine.teacher
        self.round = decode_round or engine.decode_round(speculative, rows=max_batch)
        self.B, self.NB = self.teacher.B, self.teacher.bm.num_blocks
        self.chunk = self.teacher.buckets[-1]
        self.reserved = 0                       # blocks promised to live sequences
        self.new_tokens = 0
        self.peak_live = 0
        self.interleaved_steps = 0        # batched steps taken while another sequence was still prefilling
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
                    if out is None:               # cannot run: its error is the record's result
                        self._settle(job, queue, on_result)
                    else:
                        live.append(out)
                self.peak_live = max(self.peak_live, len(live))
                filling = [s for s in live if s.filled < len(s.prompt)]
                for s in filling:                 # one prefill chunk each, between two batched steps
                    if self._prefill_chunk(s):
                        live.remove(s)
                        self._settle(s.job, queue, on_result)
                ready = [s for s in live if s.filled == len(s.prompt)]
                if not ready:
                    continue
                emitted = self.round.step(ready)
                still = [s for s in live if s.filled < len(s.prompt)]
                self.interleaved_steps += bool(still)
                for s, tokens in zip(ready, emitted):
                    self.new_tokens += len(tokens)
                    if s.emitter.reason:
                        self._end_turn(s)
                        self._settle(s.job, queue, on_result)
                    else:
                        still.append(s)
                live = still
        finally:
            for s in live:
                self.round.finish(s)
                self.teacher.free(s.sid)
                self.reserved -= s.blocks

    # ------------------------------------------------------------------ internals
    def _admit(self, job: _Turn, others_live: bool):
        """Template ``job``'s current turn and reserve its blocks. Returns its _Live (to be prefilled chunk by
        chunk); None when the turn cannot run (``job.error`` set); ``_WAIT`` when the pool cannot hold it yet."""
        job.t0 = job.t0 or time.perf_counter()
        try:
            ids = self.engine.encode_chat(job.messages)
        except GenerationError as e:
            job.error = str(e)
            return None
        need = len(ids) + self.gen.max_new_tokens
        head = f"prompt of {len(ids)} tokens + generation.max_new_tokens={self.gen.max_new_tokens} = {need}"
        if need > self.teacher.S:
            job.error = f"{head} exceeds cache.max_seq_len={self.teacher.S}"
            return None
        need += self.round.extra_slots
        if need > self.teacher.S:
            job.error = (f"{head} + speculative.M={self.round.extra_slots} (a tree verified in a batch) exceeds "
                         f"cache.max_seq_len={self.teacher.S}")
            return None
        blocks = self.blocks_for(need)
        if blocks > self.NB:
            job.error = f"{head} tokens needs {blocks} KV blocks but cache.num_blocks={self.NB}"
            return None
        if self.reserved + blocks > self.NB:
            if not others_live:
                raise RuntimeError(f"KV pool accounting error: {self.reserved} blocks reserved, no sequence live")
            return _WAIT
        self.reserved += blocks
        return _Live(self.teacher.new_seq(), -1, self.gen,
                     Emitter(self.engine.tokenizer, self.engine.eos, self.gen), job=job, prompt_tokens=len(ids),
                     blocks=blocks, prompt=ids)

    def _prefill_chunk(self, s: _Live) -> bool:
        """Prefill the next chunk (``cache.prefill_chunk`` tokens) of ``s``'s prompt; after the last one pick the
        first token and hand the sequence to the round. Returns True when the turn ended at that token."""
        part = s.prompt[s.filled: s.filled + self.chunk]
        logits, aux = self.teacher.prefill(s.sid, part)
        s.filled += len(part)
        s.auxes.append(aux)
        if s.filled < len(s.prompt):
            return False
        s.next = sample_token(logits, s.gen, len(s.prompt))
        self.new_tokens += 1
        if s.emitter.push(s.next):
            self._end_turn(s)
            return True
        self.round.start(s, s.prompt, np.concatenate(s.auxes))
        s.auxes = []
        return False

    def _end_turn(self, s: _Live) -> None:
        """Free the sequence's blocks and record its turn in its job."""
        self.round.finish(s)
        self.teacher.free(s.sid)
        self.reserved -= s.blocks
        s.job.done.append({"text": s.emitter.text(), "prompt_tokens": s.prompt_tokens,
                           "new_tokens": len(s.emitter.ids), "stop_reason": s.emitter.reason,
                           "accept_lens": s.accept_lens})
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
    """The batch job's result dict of a finished record (``batch.run_record``'s fields; mean L_k over the tree
    verifications, 1.0 for teacher-only decoding)."""
    head = {"id": job.rec.id, "line": job.rec.line}
    if job.error:
        return {**head, "error": " ".join(job.error.split())}
    secs = time.perf_counter() - job.t0
    new = sum(t["new_tokens"] for t in job.done)
    lens = [n for t in job.done for n in t["accept_lens"]]
    fields = {k: [t[k] for t in job.done] for k in ("text", "prompt_tokens", "new_tokens", "stop_reason")}
    if job.rec.kind != "turns":
        fields = {k: v[0] for k, v in fields.items()}
    return {**head, "text": fields["text"], "prompt_tokens": fields["prompt_tokens"],
            "new_tokens": fields["new_tokens"], "tok_per_s": round(new / secs, 3) if secs > 0 else 0.0,
            "mean_accept_len": round(float(np.mean(lens)), 4) if lens else 1.0, "stop_reason": fields["stop_reason"]}


__all__ = ["BatchScheduler"]
