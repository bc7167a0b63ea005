"""The engine loop beside the HTTP front: one thread runs the continuous-batching scheduler, fed by a queue.

The split of vLLM's AsyncLLM and SGLang's scheduler: the asyncio front (api_server.py) parses and checks a
request, tokenizes it and :meth:`AsyncEngine.submit` s it; the engine thread owns the Engine and its
:class:`~mindspore_eagle.serving.scheduler.BatchScheduler` (nothing else touches the model or the KV pool) and loops:

    take     every queued operation: add a request to the scheduler, cancel one, or stop
    step     ``scheduler.step()``: admit, one prefill chunk per filling sequence, one decode round step
    emit     per request, its new tokens become text (whole UTF-8 characters only; text that could still turn
             into a stop string is held back, as ``generate`` prints it) and go to the request's asyncio queue
             with ``loop.call_soon_threadsafe``; a finished request gets its final text and result
    idle     with nothing queued or live, wait on the queue

The thread first builds the engine and warms it up (``build``), so ``/health`` answers 503 until every graph
is compiled or loaded from the graph cache. An exception inside a step fails the requests of that step (their
blocks freed, each gets an ``internal`` error the front answers with a 500) and the loop goes on; the traceback
is logged here only. A client that goes away is cancelled: its sequence leaves the batch and its KV blocks go
back to the pool before the next step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from mindspore_eagle.models.tokenizer import IncrementalDecoder
from mindspore_eagle.serving.scheduler import Request, TurnResult

log = logging.getLogger("mindspore_eagle.server")


class QueueFull(Exception):
    """More requests are waiting for a row than ``serve.max_queue`` allows."""


class NotReady(Exception):
    """The engine is still warming up, failed to start, or the server is draining."""


class TextDeltas:
    """New text of a streamed request, committed tokens in, text pieces out (engine thread).

    Pieces are whole characters (``IncrementalDecoder``); the last max(len(stop)) - 1 characters are held back
    until they cannot start a stop string, and nothing from a stop string on is ever sent, so the pieces plus
    :meth:`finish` always add up to the request's final text. EOS tokens add no text.

    Args:
        tokenizer: the engine's Tokenizer. eos: EOS token ids. stop: the request's stop strings.
    """

    def __init__(self, tokenizer, eos, stop):
        self.decoder, self.eos, self.stop = IncrementalDecoder(tokenizer), set(eos), list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, tokens) -> str:
        """Feed committed tokens; returns the text that became final ("" if none)."""
        for t in tokens:
            if not self.stopped and t not in self.eos:
                self.text += self.decoder.push([t])
        if self.stopped:
            return ""
        cut = min((self.text.find(s) for s in self.stop if s in self.text), default=-1)
        if cut >= 0:
            self.stopped = True
        return self._take(cut if cut >= 0 else len(self.text) - self.hold)

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:upto], upto
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text after what was sent."""
        sent = self.text[:self.sent]
        return final_text[len(sent):] if final_text.startswith(sent) else ""


@dataclass
class Handle:
    """One request in flight, shared by the front (``events``, read on the event loop) and the engine thread
    (the rest).

    Attributes:
        rid: request id (int, unique in the process). prompt_tokens: prompt length. gen: its GenerationConfig.
        t_arrival: time.perf_counter() when the front accepted it. events: asyncio.Queue of ("delta", text,
        n_tokens, logprob entries) and finally ("done", TurnResult, final text piece, logprob entries): the
        entries (``core.accept.token_logprobs``, when ``gen.logprobs`` is set, else empty) of the tokens not
        reported in an earlier event. logprobs: every entry so far; lp_sent: how many went out in events.
    """
    rid: int
    prompt_ids: list
    gen: object
    t_arrival: float
    events: asyncio.Queue
    admitted: bool = False
    n_tokens: int = 0
    t_last: float = 0.0
    deltas: TextDeltas | None = None
    done: bool = False
    extra: dict = field(default_factory=dict)
    logprobs: list = field(default_factory=list)
    lp_sent: int = 0

    def new_logprobs(self) -> list:
        """The entries not yet sent, now marked sent."""
        out = self.logprobs[self.lp_sent:]
        self.lp_sent = len(self.logprobs)
        return out

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class AsyncEngine:
    """The engine thread and its queue (module docstring).

    Args:
        build: zero-argument callable run on the engine thread that loads, warms up and returns (engine,
            BatchScheduler); its exception marks the engine failed (``error``) and calls ``on_failed(exc)``.
        metrics: a :class:`~mindspore_eagle.serving.metrics.ServerMetrics` or None.
        max_queue: requests allowed to wait for a row (beyond the rows free now); :meth:`submit` raises QueueFull
            beyond it.
        on_failed: ``callable(exception)`` when ``build`` fails (the server shuts down).
    """

    def __init__(self, build, metrics=None, max_queue: int = 256, on_failed=None):
        self.build, self.metrics, self.max_queue, self.on_failed = build, metrics, max_queue, on_failed
        self.engine = self.sched = None
        self.state = "starting"             # starting | ready | failed | stopped
        self.error: BaseException | None = None
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._queued = 0                    # submitted, not yet admitted (or ended) requests
        self._free_rows = 0                 # batch rows free after the last step (engine thread writes)
        self._handles: dict[int, Handle] = {}   # engine thread: requests it knows
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ front side (event loop thread)
    @property
    def ready(self) -> bool:
        return self.state == "ready" and not self.draining

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; events are delivered on ``loop``."""
        self.loop = loop
        self._thread = threading.Thread(target=self._main, name="mseagle-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list, gen) -> Handle:
        """Queue a request of ``prompt_ids`` (int list) generated with ``gen``; returns its Handle.

        Raises:
            NotReady: warming up, failed or draining. QueueFull: ``max_queue`` requests already wait.
        """
        if not self.ready:
            raise NotReady(self.state)
        with self._lock:
            if self._queued - self._free_rows >= self.max_queue:
                waiting = max(0, self._queued - self._free_rows)
                raise QueueFull(f"{waiting} requests are waiting for a row (serve.max_queue={self.max_queue})")
            self._queued += 1
        h = Handle(next(self._ids), list(prompt_ids), gen, time.perf_counter(), asyncio.Queue(),
                   deltas=TextDeltas(self.engine.tokenizer, self.engine.eos, gen.stop))
        self._ops.put(("add", h))
        return h

    def cancel(self, h: Handle) -> None:
        """Cancel ``h`` (its client went away): its sequence leaves the batch before the next step."""
        if not h.done:
            self._ops.put(("cancel", h.rid))

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel whatever is still in flight, end the engine thread and wait up to ``timeout`` s for it.
        Returns whether it ended (a warm-up in progress cannot be interrupted)."""
        self.draining = True
        self._ops.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def queued(self) -> int:
        """Requests submitted and not yet admitted."""
        return self._queued

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            self.engine, self.sched = self.build()
        except BaseException as e:   # reported by the server (a known error as its one line)
            self.error, self.state = e, "failed"
            if self.on_failed is not None:
                self.on_failed(e)
            return
        self.sched.on_step = self._on_step
        self._graphs0 = self.engine.graphs_made       # graphs made by the warm-up; any later one a request paid for
        self._publish()
        self.state = "ready"
        try:
            self._loop()
        finally:
            for h in list(self._handles.values()):
                self.sched.cancel(h.rid)
            while True:                     # requests queued after the stop: they end cancelled too
                try:
                    kind, arg = self._ops.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self._on_done(Request(arg.rid, arg.gen, tag=arg), TurnResult("", [], 0, "cancelled"))
            self.state = "stopped"
            self._publish()

    def _loop(self) -> None:
        while True:
            try:
                op = self._ops.get(timeout=0.5) if not self.sched.has_work else self._ops.get_nowait()
            except queue.Empty:
                op = None
            while op is not None:
                kind, arg = op
                if kind == "stop":
                    return
                if kind == "add":
                    self._add(arg)
                elif kind == "cancel" and arg in self._handles:
                    self.sched.cancel(arg)
                try:
                    op = self._ops.get_nowait()
                except queue.Empty:
                    op = None
            if not self.sched.has_work:
                self._publish()
                continue
            try:
                self.sched.step()
            except Exception as e:   # one failed step fails its requests; the server goes on
                log.exception("engine step failed; its requests get a 500 error")
                self.sched.abort(f"the engine failed while running this request ({type(e).__name__}); the "
                                 "server log has the details")
            self._admissions()
            self._publish()

    def _add(self, h: Handle) -> None:
        self._handles[h.rid] = h
        self.sched.add(Request(h.rid, h.gen, prompt_ids=h.prompt_ids, on_tokens=self._on_tokens,
                               on_done=self._on_done, tag=h, on_logprobs=self._on_logprobs))

    def _admissions(self) -> None:
        """Count the requests the last step admitted out of the queue."""
        for s in self.sched.live:
            h = s.req.tag
            if not h.admitted:
                self._admit(h)

    def _admit(self, h: Handle) -> None:
        h.admitted = True
        with self._lock:
            self._queued -= 1
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(h.prompt_tokens)

    @staticmethod
    def _on_logprobs(req: Request, entries: list) -> None:
        req.tag.logprobs.extend(entries)

    def _on_tokens(self, req: Request, tokens: list) -> None:
        h: Handle = req.tag
        if not h.admitted:
            self._admit(h)
        now = time.perf_counter()
        m = self.metrics
        if m is not None:
            if h.n_tokens == 0:
                m.ttft.observe(now - h.t_arrival)
                rest = len(tokens) - 1
            else:
                rest = len(tokens)
            for _ in range(rest):
                m.itl.observe((now - h.t_last) / len(tokens))
            m.generation_tokens.inc(len(tokens))
        h.n_tokens += len(tokens)
        h.t_last = now
        text = h.deltas.push(tokens)
        if text:
            self._post(h, ("delta", text, len(tokens), h.new_logprobs()))

    def _on_done(self, req: Request, res: TurnResult) -> None:
        h: Handle = req.tag
        if not h.admitted:
            self._admit(h)
        self._handles.pop(h.rid, None)
        h.done = True
        m = self.metrics
        if m is not None:
            m.finished.labels("error" if res.error else {"eos": "stop"}.get(res.stop_reason, res.stop_reason)).inc()
            if h.n_tokens:
                m.e2e.observe(time.perf_counter() - h.t_arrival)
        final = h.deltas.finish(res.text) if not res.error and res.stop_reason != "cancelled" else ""
        self._post(h, ("done", res, final, res.logprobs[h.lp_sent:]))

    def _on_step(self, info) -> None:
        if self.metrics is not None:
            self.metrics.observe_step(info.kind, info.accept_lens)

    def _post(self, h: Handle, event) -> None:
        try:
            self.loop.call_soon_threadsafe(h.events.put_nowait, event)
        except RuntimeError:        # the event loop is closed (shutting down): nobody is listening
            pass

    def _publish(self) -> None:
        """Load gauges after a step."""
        if self.sched is None:
            return
        s = self.sched
        self._free_rows = s.N - len(s.live)
        if self.metrics is not None:
            self.metrics.set_load(len(s.live), len(s.waiting), s.kv_blocks_used(), s.reserved, s.NB,
                                  self.engine.graphs_made - self._graphs0, s.peak_live, s.drafter_kv_blocks_used())


__all__ = ["AsyncEngine", "Handle", "NotReady", "QueueFull", "TextDeltas"]
