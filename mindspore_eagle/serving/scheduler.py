"""Continuous batching: many sequences share one teacher forward per step, admitted as rows and KV blocks free.

Legend: N = ``max_batch`` (the most sequences of one batched forward), S = cache.max_seq_len, B = cache.block_size, NB =
cache.num_blocks (the KV pool), need = prompt tokens + max_new_tokens of one request (+ speculative.M when trees
are verified).

The core is request-driven (the server and the batch job run the same code): :meth:`BatchScheduler.add` queues a
:class:`Request` (a prompt or chat messages, its own GenerationConfig, callbacks), :meth:`BatchScheduler.step`
runs one iteration, :meth:`BatchScheduler.cancel` drops a request wherever it is. One iteration:

    admit    while a row is free and the pool can hold the next request's ``need`` tokens: chat-template it
             and reserve its blocks (in order; a request that cannot run at all ends at once with an error)
    prefill  every admitted sequence still filling runs ONE prefill chunk (``cache.prefill_chunk`` tokens), so
             a long prompt never stalls the others for more than a chunk; after its last chunk it samples its
             first token with its own settings (seeded draws by position) and joins the decode round
    step     ``DecodeRound.step(ready)`` (serving/round.py): one forward for every ready sequence, plain or a
             tree per sequence; each sequence's Emitter applies its own EOS / stop strings / max_new_tokens
    emit     ``request.on_tokens(request, tokens)`` per sequence with the tokens it committed this step
             (streaming); a finished sequence frees its blocks at once and gets ``request.on_done``

:meth:`BatchScheduler.run_until_done` steps until nothing is queued or live; the batch job
(``batch_job.run_records``) and regeneration drive it with their own requests and record formats.

Pool: admission reserves a request's worst case (ceil(need / B) blocks) against NB, so a running sequence never
meets an exhausted pool and nothing is ever preempted; a request waits while the pool is full. A request whose need
exceeds S, or NB on its own, ends with an error (:meth:`BatchScheduler.fit_error` gives the words), never a crash.

Rounds: the batched round (``engine.decode_round(speculative, rows=N)``) runs exactly its rows when the teacher
takes the call on the host, else the smallest row bucket 1, 2, 4, ..., N that holds the step's sequences (a tree
step: that many x ``speculative.batch_tree_rows`` // bucket); each sequence's tree budget is allotted by value and
measured row cost (``core.policy.allot_rows``). With a drafter, a :class:`SizeGates` (one ``RateGate`` per number
of live sequences) picks drafter trees or copies alone (a plain step without suffix candidates) by measured tokens
per ms at that batch size, so the drafter steps aside where it does not pay. With ``single_round``, a step
with one sequence alone runs the single-sequence round instead (decode k = 1 / verify k = m graphs and the
engine's speculation policy), as ``Engine.generate`` serves it. Greedy decoding of a sequence in a batch uses the
same weights and per-row math as alone; only the attention width (masked columns) and the row count of the
matmuls differ, so float32 results agree to summation order (tests/serving/test_scheduler.py checks token
equality with one-at-a-time greedy).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mindspore_eagle.config import GenerationConfig
from mindspore_eagle.core.emit import Emitter
from mindspore_eagle.serving.engine import Engine, GenerationError
from mindspore_eagle.serving.round import Sequence, first_token


@dataclass
class Request:
    """One generation request (one chat turn or one prompt).

    Attributes:
        rid: the caller's id (hashable; unique among requests in flight: :meth:`BatchScheduler.cancel` finds it).
        gen: this request's GenerationConfig (max_new_tokens, temperature, top_p, top_k, seed, stop): its sequence
            samples with its own settings; seeded draws keyed by position (``core.accept.keyed_draw``).
        messages: chat messages (chat-templated at admission), or None when ``prompt_ids`` is given.
        prompt_ids: prompt token ids (int list, used as they are), or None.
        on_tokens: ``callable(request, tokens: list[int])`` after every step that committed tokens of this request
            (the first token after the prefill included; EOS included; stop strings not applied), on the thread
            that runs :meth:`BatchScheduler.step`.
        on_done: ``callable(request, result: TurnResult)``, once, when the request ends (finished, cancelled or
            failed).
        tag: anything the caller wants back (the batch job keeps its record there).
        on_logprobs: ``callable(request, entries: list)`` just before each ``on_tokens`` when ``gen.logprobs`` is
            set: (id, logprob, top alternatives) of those tokens (``core.accept.token_logprobs``).
    """
    rid: object
    gen: GenerationConfig
    messages: list | None = None
    prompt_ids: list | None = None
    on_tokens: Callable | None = None
    on_done: Callable | None = None
    tag: object = None
    on_logprobs: Callable | None = None


@dataclass
class TurnResult:
    """How a request ended.

    Attributes:
        text: its text (EOS dropped, cut before a stop string). token_ids: the generated ids (EOS included).
        prompt_tokens: prompt length (0 when it never got admitted). stop_reason: "eos" | "stop" | "length" |
        "cancelled" | "error". accept_lens: L_k of each tree verification of this sequence. error: why it failed
        ("" otherwise). internal: the failure was the engine's (a step raised), not the request's.
        t_admitted: time.perf_counter() at admission (or at its failure, when never admitted). logprobs: with
        ``gen.logprobs``, (id, logprob, top alternatives) per token of ``token_ids`` (``core.accept.token_logprobs``).
    """
    text: str
    token_ids: list
    prompt_tokens: int
    stop_reason: str
    accept_lens: list = field(default_factory=list)
    error: str = ""
    internal: bool = False
    t_admitted: float = 0.0
    logprobs: list = field(default_factory=list)


@dataclass
class StepInfo:
    """One decode step, for metrics: its kind ("tree" when any sequence verified a tree, else "plain"), the
    sequences in it, the tokens they committed, the L_k of each tree verified, its wall time (ms)."""
    kind: str
    sequences: int
    tokens: int
    accept_lens: list
    ms: float


@dataclass
class _Live(Sequence):
    """A sequence in the batch (:class:`~mindspore_eagle.serving.round.Sequence`) plus its request, its reserved
    blocks and its prefill progress."""
    req: Request | None = None
    blocks: int = 0
    prompt: list = field(default_factory=list)       # prompt ids; prefilled chunk by chunk
    filled: int = 0
    auxes: list = field(default_factory=list)
    started: bool = False                             # prefilled and handed to the round
    t_admitted: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def job(self):
        """The request's ``tag`` (the batch job's record in flight)."""
        return self.req.tag


class SizeGates:
    """One rate gate per batch size (``make()`` builds one, e.g. a ``RateGate(("tree", "plain"))``): the scheduler
    sets ``n`` (sequences in the next step) before each step, and the round's ``choose`` / ``observe`` go to that
    size's gate, so whether trees pay is measured separately at 2, 3, ... N sequences. A size seen for the first
    time starts from the nearest size's measurements (``RateGate.seed_from``) instead of warming up again: each
    warm-up took two tree steps, at every size the batch passed through."""

    def __init__(self, make):
        self.make, self.gates, self.n = make, {}, 1

    def _gate(self):
        if self.n not in self.gates:
            gate = self.make()
            if self.gates and hasattr(gate, "seed_from"):     # start from the nearest size measured
                gate.seed_from(self.gates[min(self.gates, key=lambda n: (abs(n - self.n), n))])
            self.gates[self.n] = gate
        return self.gates[self.n]

    def choose(self) -> str:
        return self._gate().choose()

    def observe(self, kind: str, tokens: int, ms: float, extra_ms: float = 0.0) -> None:
        self._gate().observe(kind, tokens, ms, extra_ms)

    def report(self) -> dict:
        """Per batch size: the gate's rates (tokens / ms) and step counts."""
        return {n: g.report() for n, g in sorted(self.gates.items())}


class BatchScheduler:
    """Serve requests with up to ``max_batch`` sequences per teacher forward (module docstring).

    Args:
        engine: an :class:`~mindspore_eagle.serving.engine.Engine` (its teacher's pool is shared by all rows).
        gen: the GenerationConfig of the batch job's records (requests bring their own).
        max_batch: N >= 1.
        speculative: tree speculative decoding (the engine's drafter, whose cache must hold N sequences) instead
            of teacher-only decoding.
        decode_round: the batched DecodeRound (default ``engine.decode_round(speculative, rows=max_batch)``, its
            rate gate split per batch size by :class:`SizeGates`; tests inject one).
        single_round: a step with one sequence alone runs ``engine.decode_round(speculative, rows=1)`` (the
            single-sequence graphs and the engine's policy, as ``generate``); the server's choice.
        on_step: optional ``callable(StepInfo)`` after every decode step (the server's metrics).
    Raises:
        ValueError: max_batch < 1 (names the field).
    """

    def __init__(self, engine: Engine, gen: GenerationConfig, max_batch: int, speculative: bool = False,
                 decode_round=None, single_round: bool = False, on_step=None):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"batch.max_batch must be an integer >= 1, got {max_batch!r}")
        speculative = speculative and engine.speculates
        self.engine, self.gen, self.N = engine, gen, max_batch
        self.teacher = engine.teacher
        if decode_round is None:
            decode_round = engine.decode_round(speculative, rows=max_batch)
            if decode_round.gate is not None:
                kind, kinds = type(decode_round.gate), decode_round.gate_kinds
                decode_round.gate = SizeGates(lambda: kind(kinds))
        self.round = decode_round
        self.round_one = engine.decode_round(speculative, rows=1) if single_round and max_batch > 1 else None
        self.extra_slots = max(r.extra_slots for r in (self.round, self.round_one) if r is not None)
        self.B, self.NB = self.teacher.B, self.teacher.bm.num_blocks
        self.S = self.teacher.S
        self.chunk = self.teacher.buckets[-1]
        self.waiting: deque[Request] = deque()
        self.live: list[_Live] = []
        self.reserved = 0                       # blocks promised to live sequences
        self.new_tokens = 0
        self.peak_live = 0
        self.interleaved_steps = 0        # decode steps taken while another sequence was still prefilling
        self.on_step = on_step

    # ------------------------------------------------------------------ requests
    def blocks_for(self, n_tokens: int) -> int:
        """Blocks a sequence of ``n_tokens`` tokens can occupy: ceil(n / B)."""
        return -(-n_tokens // self.B)

    def fit_error(self, prompt_tokens: int, max_new_tokens: int) -> str:
        """Why a request of ``prompt_tokens`` prompt tokens and ``max_new_tokens`` can never run here ("" when it
        can): the words of the command line's error (prompt + generation.max_new_tokens exceeds
        cache.max_seq_len, or the room a tree needs, or more blocks than the pool has). Pure (any thread)."""
        need = prompt_tokens + max_new_tokens
        head = f"prompt of {prompt_tokens} tokens + generation.max_new_tokens={max_new_tokens} = {need}"
        if need > self.S:
            return f"{head} exceeds cache.max_seq_len={self.S}"
        if need + self.extra_slots > self.S:
            return (f"{head} + speculative.M={self.extra_slots} (a tree verified in a batch) exceeds "
                    f"cache.max_seq_len={self.S}")
        blocks = self.blocks_for(need + self.extra_slots)
        if blocks > self.NB:
            return f"{head} tokens needs {blocks} KV blocks but cache.num_blocks={self.NB}"
        return ""

    def add(self, req: Request, front: bool = False) -> None:
        """Queue ``req`` (at the front of the queue with ``front``); it is admitted by a later :meth:`step`."""
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def cancel(self, rid) -> bool:
        """End request ``rid`` now (stop_reason "cancelled"): dropped from the queue, or its sequence leaves the
        batch and its KV blocks go back to the pool. Returns False when no such request is in flight."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._done(req, TurnResult("", [], 0, "cancelled", t_admitted=time.perf_counter()))
                return True
        for s in self.live:
            if s.req.rid == rid:
                self._end(s, "cancelled")
                return True
        return False

    @property
    def has_work(self) -> bool:
        """Requests queued or sequences live."""
        return bool(self.waiting or self.live)

    def kv_blocks_used(self) -> int:
        """Teacher KV blocks holding tokens now (of ``cache.num_blocks``)."""
        return self.NB - self.teacher.bm.free_blocks()

    def drafter_kv_blocks_used(self) -> int:
        """Drafter KV blocks holding features now (0 when the engine has no drafter)."""
        d = self.engine.drafter
        return 0 if d is None else d.bm.num_blocks - d.bm.free_blocks()

    # ------------------------------------------------------------------ one iteration
    def step(self) -> None:
        """One iteration (module docstring): admit, one prefill chunk per filling sequence, one decode round step
        of the ready sequences, callbacks. An exception leaves the scheduler as it was before the failing call;
        :meth:`abort` then ends the live sequences."""
        while self.waiting and len(self.live) < self.N:
            s = self._admit(self.waiting[0])
            if s is _WAIT:                      # the pool is full: wait for a sequence to finish
                break
            self.waiting.popleft()
            if s is not None:
                self.live.append(s)
        self.peak_live = max(self.peak_live, len(self.live))
        for s in [s for s in self.live if s.filled < len(s.prompt)]:
            self._prefill_chunk(s)
        ready = [s for s in self.live if s.started]
        if not ready:
            return
        single = self.round_one is not None and len(ready) == 1
        rnd = self.round_one if single else self.round
        if isinstance(rnd.gate, SizeGates):
            rnd.gate.n = len(ready)
        n_lens = [len(s.accept_lens) for s in ready]
        t0 = time.perf_counter()
        emitted = rnd.step(ready)
        ms = (time.perf_counter() - t0) * 1e3
        self.interleaved_steps += any(not s.started for s in self.live)
        lens = [lk for s, n0 in zip(ready, n_lens) for lk in s.accept_lens[n0:]]
        for s, tokens in zip(ready, emitted):
            self.new_tokens += len(tokens)
            if s.error:                              # its logits were not finite: it alone ends, with an error
                self._end(s, "error", s.error, internal=True)
                continue
            if tokens:
                self._report(s, list(tokens))
            if s.emitter.reason:
                self._end(s)
        if self.on_step is not None:
            self.on_step(StepInfo("tree" if lens else "plain", len(ready), sum(len(t) for t in emitted), lens, ms))

    def abort(self, error: str, internal: bool = True) -> list:
        """End every live sequence with ``error`` (stop_reason "error"; its blocks freed, ``on_done`` called); the
        queue stays. The server calls it when a step raised. Returns the requests ended."""
        ended = [s.req for s in self.live]
        for s in list(self.live):
            self._end(s, "error", error, internal)
        return ended

    def run_until_done(self) -> None:
        """Step until no request is queued or live. On an exception every live sequence's blocks are freed and
        the queue is emptied before it propagates."""
        try:
            while self.has_work:
                self.step()
        finally:
            for s in list(self.live):
                self._release(s)
            self.live = []
            self.waiting.clear()

    # ------------------------------------------------------------------ internals
    def _admit(self, req: Request):
        """Template ``req``'s prompt and reserve its blocks. Returns its _Live (to be prefilled chunk by chunk);
        None when the request cannot run (it has ended with an error); ``_WAIT`` when the pool cannot hold it
        yet."""
        now = time.perf_counter()
        try:
            ids = list(req.prompt_ids) if req.prompt_ids is not None else self.engine.encode_chat(req.messages)
            if not ids:
                raise GenerationError("prompt is empty (0 tokens)")
        except GenerationError as e:
            self._done(req, TurnResult("", [], 0, "error", error=str(e), t_admitted=now))
            return None
        error = self.fit_error(len(ids), req.gen.max_new_tokens)
        if error:
            self._done(req, TurnResult("", [], len(ids), "error", error=error, t_admitted=now))
            return None
        blocks = self.blocks_for(len(ids) + req.gen.max_new_tokens + self.extra_slots)
        if self.reserved + blocks > self.NB:
            if not self.live:
                raise RuntimeError(f"KV pool accounting error: {self.reserved} blocks reserved, no sequence live")
            return _WAIT
        self.reserved += blocks
        return _Live(self.teacher.new_seq(), -1, req.gen,
                     Emitter(self.engine.tokenizer, self.engine.eos, req.gen), req=req, blocks=blocks, prompt=ids,
                     t_admitted=now)

    def _prefill_chunk(self, s: _Live) -> None:
        """Prefill the next chunk (``cache.prefill_chunk`` tokens) of ``s``'s prompt; after the last one sample the
        first token, report it and hand the sequence to the round (or end it, when that token ended the turn)."""
        part = s.prompt[s.filled: s.filled + self.chunk]
        logits, aux = self.teacher.prefill(s.sid, part)
        s.filled += len(part)
        s.auxes.append(aux)
        if s.filled < len(s.prompt):
            return
        s.next = first_token(s, logits, len(s.prompt))
        if s.error:                                # non-finite logits: this sequence alone ends, before any token
            self._end(s, "error", s.error, internal=True)
            return
        self.new_tokens += 1
        ended = s.emitter.push(s.next)
        self._report(s, [s.next])
        if ended:
            self._end(s)
            return
        self.round.start(s, s.prompt, np.concatenate(s.auxes))
        s.started, s.auxes = True, []

    def _release(self, s: _Live) -> None:
        """Give back the sequence's drafter sequence, teacher blocks and reservation."""
        if s.started:
            self.round.finish(s)
            s.started = False
        self.teacher.free(s.sid)
        self.reserved -= s.blocks

    def _end(self, s: _Live, reason: str = "", error: str = "", internal: bool = False) -> None:
        """``s`` leaves the batch: blocks freed, ``on_done`` with its result (``reason`` overrides the Emitter's
        stop reason: "cancelled" / "error")."""
        self._release(s)
        self.live.remove(s)
        if self.round_one is not None and self.round_one.costs is not None:
            self.engine.save_costs()
        res = TurnResult(s.emitter.text(), list(s.emitter.ids), len(s.prompt), reason or s.emitter.reason,
                         list(s.accept_lens), error, internal, s.t_admitted, list(s.logprobs[: len(s.emitter.ids)]))
        self._done(s.req, res)

    @staticmethod
    def _report(s: _Live, tokens: list) -> None:
        """Hand the tokens ``s`` committed this step to its request: ``on_logprobs`` (their entries, when the
        request asked for log-probabilities), then ``on_tokens``."""
        if s.req.on_logprobs is not None and s.gen.logprobs is not None:
            s.req.on_logprobs(s.req, s.logprobs[len(s.logprobs) - len(tokens):])
        if s.req.on_tokens is not None:
            s.req.on_tokens(s.req, tokens)

    @staticmethod
    def _done(req: Request, res: TurnResult) -> None:
        if req.on_done is not None:
            req.on_done(req, res)


_WAIT = object()


__all__ = ["BatchScheduler", "Request", "SizeGates", "StepInfo", "TurnResult"]
