"""Engine: chat turns of one sequence, teacher-only or EAGLE-3 tree speculative, over the shared decode round.

Legend: M = tree budget, D = D_max, V = vocab, L_k = accepted length of step k (accepted drafts + bonus).

A turn: chat-template the messages, prefill the prompt (root token), then advance the one sequence with
:class:`~mindspore_eagle.serving.round.DecodeRound` until its Emitter ends the turn. The round (serving/round.py)
is the same code the batch scheduler, teacher regeneration and the server run; here it has one row, the
single-sequence graphs, and the speculation policy (core/policy.py), which the engine keeps across turns so its
calibration carries over.

Losslessness: at temperature 0 (float32) speculative and teacher-only turns give identical token ids; sampling
follows the teacher's (warped) distribution exactly (core/accept.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mindspore_eagle.config import GenerationConfig, SpeculativeConfig
from mindspore_eagle.core.accept import accept_greedy
from mindspore_eagle.core.costs import (
    CostTable,
    RunningCosts,
    cap_verify_costs,
    compiled_budgets,
    prior_table,
)
from mindspore_eagle.core.emit import Emitter
from mindspore_eagle.core.policy import PLAIN_EVERY, AdaptivePolicy, FixedPolicy
from mindspore_eagle.core.suffix import SuffixIndex
from mindspore_eagle.core.trace import TraceWriter, TurnTrace
from mindspore_eagle.core.tree import DraftTree, tensorize
from mindspore_eagle.errors import MsEagleError
from mindspore_eagle.kernels import graph_cache
from mindspore_eagle.kernels.kv import CacheExhaustedError
from mindspore_eagle.runners.warmup import budgets_at_hand
from mindspore_eagle.serving.round import DecodeRound, Sequence, first_token


class GenerationError(MsEagleError, ValueError):
    """Bad generation input (empty prompt, prompt longer than the cache, ...); the message names the field."""


@dataclass
class Generation:
    """Result of one turn.

    Attributes:
        token_ids: generated ids (EOS included when it ended the turn; stop strings cut the text, not the ids).
        text: decoded text (cut at a stop string if one matched).
        stop_reason: "eos" | "length" | "stop".
        steps: per-verification StepTrace records (empty for teacher-only decoding).
        turn: the TurnTrace (prefill ms, tok/s, mean L_k, compile count).
        logprobs: with ``gen.logprobs``, (id, logprob, top alternatives) per token of ``token_ids``
            (``core.accept.token_logprobs``); else empty.
    """
    token_ids: list
    text: str
    stop_reason: str
    prompt_tokens: int
    steps: list = field(default_factory=list)
    turn: TurnTrace | None = None
    logprobs: list = field(default_factory=list)

    @property
    def accept_lens(self) -> list:
        return [s.accept_len for s in self.steps]


class Engine:
    """Teacher-only and speculative generation over a TeacherRunner (+ DrafterRunner).

    Args:
        target: TeacherRunner of the teacher. tokenizer: Tokenizer (chat template, decode).
        eos_ids: token ids that end a turn. drafter: DrafterRunner, or None for teacher-only only.
        spec: SpeculativeConfig (M, D_max, top_k, policy, validate_tree). trace: TraceWriter or None.
        costs: a fixed CostTable for the adaptive policy (tests inject one; it is then never updated). When None,
            the policy starts from the table stored in ``cost_file`` (or the prior, ``core.costs.prior_table``),
            keeps it current from the turn's step times (``core.costs.RunningCosts``) and stores it there again
            after every turn: nothing is measured before the first token.
        cost_file: optional JSON path of that table (``pipeline.build_engine`` keys it by machine, software and
            budget).

    With the graph store active (``serving.pipeline.prepare``) the adaptive policy of a process that has decoded
    fewer than ``AT_HAND_TOKENS`` tokens verifies only with budgets whose graph it already made (or, until there is
    one, a single budget: ``runners.warmup.budgets_at_hand``), since a graph costs seconds to compile against
    milliseconds saved per step; after a full warm-up every budget is at hand.
    """

    AT_HAND_TOKENS = 512

    def __init__(self, target, tokenizer, eos_ids, drafter=None, spec: SpeculativeConfig | None = None,
                 trace: TraceWriter | None = None, costs: CostTable | None = None, cost_file: str | None = None):
        self.spec = spec or SpeculativeConfig()
        self.teacher, self.tokenizer = target, tokenizer
        self.drafter = drafter if self.spec.method != "suffix" else None
        # the process's earlier outputs, for suffix candidates (core/suffix.py); outlives every turn. hybrid
        # needs a drafter: without one the engine decodes teacher-only, as model.drafter none always did
        copies = self.spec.method == "suffix" or (self.spec.method == "hybrid" and self.drafter is not None)
        self.suffix = SuffixIndex(max_tokens=self.spec.suffix_tokens) if copies else None
        self.eos = set(int(e) for e in eos_ids)
        self.trace = trace or TraceWriter(None)
        self.validate = self.spec.validate_tree or target.mode == "eager"
        self.costs, self.cost_file = costs, cost_file
        self.running_costs = None       # core.costs.RunningCosts once the policy owns its table
        self.decoded = 0                # tokens decoded by speculative turns of this engine
        self._policy = None

    def verify_budgets(self) -> list[int]:
        """Tree budgets (query rows of one verification forward) this engine verifies, each one static graph per
        attention width that ``warmup.warmup`` compiles ahead of use: [M] under the fixed policy, 2, 4, ..., M
        under the adaptive one."""
        return compiled_budgets(self.spec.M) if self.spec.policy == "adaptive" else [self.spec.M]

    @property
    def policy(self):
        """The speculation policy (policy.py), built on first use. The adaptive one takes the CostTable given to
        the engine, else the one stored in ``cost_file`` for this machine and configuration, else the prior
        (``core.costs.prior_table``), and then keeps its own table current from the steps it runs (``Engine``
        docstring), with a plain step at least every ``core.policy.PLAIN_EVERY`` steps so a decode's cost stays
        observed; nothing is measured up front. It lives as long as the engine, so its calibration carries over
        from turn to turn."""
        if self._policy is None:
            if self.spec.policy == "adaptive":
                budgets = self.verify_budgets()
                if self.costs is None:
                    stored = CostTable.load(self.cost_file) if self.cost_file else None
                    self.costs = stored.with_budgets(budgets) if stored else prior_table(budgets)
                    self.running_costs = RunningCosts(self.costs)
                probe = PLAIN_EVERY if self.running_costs is not None else 0
                self._policy = AdaptivePolicy(self.costs, budgets, plain_every=probe)
            else:
                self._policy = FixedPolicy(self.spec.M, self.spec.D_max)
        return self._policy

    def measure_costs(self, context: int = 192, repeat: int = 7) -> CostTable:
        """Time, in this process, each call a step can make, after a ``context``-token prefix: a plain step (teacher
        decode + pick), a whole verification step of each budget in ``verify_budgets()`` (tensorize, mask,
        verify, argmax, accept, commit), the drafter's context pass over one pair and one expansion step.

        Every call runs once uncounted (it compiles its shape), then the calls take turns ``repeat`` times and each
        cost is the median of its turns, so a machine that drifts while this runs shifts all of them alike. A
        verification costs less than a larger one (``core.costs.cap_verify_costs``, as the policy's running table):
        a budget whose median exceeds a larger budget's (a burst of load on a shared machine; measured once at
        2.07x a decode for m = 2 against 1.24x for m = 4) is capped below it by the prior's ratio. Takes
        about ``repeat`` x (sum of the costs) plus the compiles: ~3 s on the 2-core CPU after warm-up.
        Returns:
            CostTable (ms; host_ms = 0: host work is inside verify_ms; ``measured``: the medians before the cap).
        Raises:
            ValueError: the engine has no drafter, or context + M does not fit the cache.
        """
        if self.drafter is None:
            raise ValueError("measure_costs needs a drafter (model.drafter is 'none')")
        tg, dr, D = self.teacher, self.drafter, self.spec.D_max
        budgets = self.verify_budgets()
        grow = (repeat + 1) * (2 * len(budgets) + 1)          # tokens the timed calls append
        context = min(context, tg.S - max(budgets) - grow)
        if tg.widths[0] - max(budgets) - grow > 0:             # every call in the first attention-width bucket
            context = min(context, tg.widths[0] - max(budgets) - grow)
        if context < 1:
            raise ValueError(f"cache.max_seq_len = {tg.S} is too small to time a tree of speculative.M = "
                             f"{max(budgets)}")
        ids = (np.arange(context) % 1000 + 100).tolist()
        sid, dsid = tg.new_seq(), dr.new_seq()
        try:
            _, aux = tg.prefill(sid, ids)
            first = dr.extend(dsid, aux, np.asarray(ids[1:] + [ids[0]], np.int64))

            def plain():
                logits, _ = tg.decode(sid, ids[0])
                int(logits.argmax())

            def step(m):      # a star tree (any shape costs the same to verify); commit moves node m - 1
                tt = tensorize(DraftTree(np.arange(m) + 100, np.zeros(m, np.int64)), m, D)
                logits, _ = tg.verify(sid, tt, tg.verify_mask(sid, tt))
                accept_greedy(tt, logits.argmax(-1))
                tg.commit(sid, np.array([0, m - 1], np.int32), D + 2)

            calls = {"decode": plain, "ctx": lambda: dr.extend(dsid, aux[-1:], np.asarray([ids[0]], np.int64)),
                     "tree1": lambda: dr.build_tree(dsid, ids[0], first, max(budgets), 1),
                     "tree2": lambda: dr.build_tree(dsid, ids[0], first, max(budgets), 2)}
            calls.update({m: (lambda m=m: step(m)) for m in budgets})
            times = {k: [] for k in calls}
            for r in range(repeat + 1):
                for k, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times[k].append((time.perf_counter() - t0) * 1e3)
        finally:
            tg.free(sid)
            dr.free(dsid)
        med = {k: float(np.median(v)) for k, v in times.items()}
        measured = {1: med["decode"], **{m: med[m] for m in budgets}}
        verify_ms = cap_verify_costs(measured)
        return CostTable(decode_ms=verify_ms.pop(1), verify_ms=verify_ms, draft_ctx_ms=med["ctx"],
                         draft_step_ms=max(0.0, med["tree2"] - med["tree1"]) if D > 1 else 0.0, host_ms=0.0,
                         measured=measured)

    @property
    def compiles(self) -> int:
        return self.teacher.compiles + (self.drafter.compiles if self.drafter else 0)

    @property
    def graphs_made(self) -> int:
        """Graphs compiled or loaded from the graph store by this engine's runners so far (fused mode)."""
        return self.compiles + self.teacher.loads + (self.drafter.loads if self.drafter else 0)

    @property
    def compile_ms(self) -> float:
        return self.teacher.compile_ms + (self.drafter.compile_ms if self.drafter else 0.0)

    # ------------------------------------------------------------------ public API
    def encode_chat(self, messages) -> list:
        """Chat-templated prompt ids for ``messages`` (a str is one user message); message text is plain text
        (control tokens come from the template only, ``Tokenizer.encode_chat``)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not messages or not any(str(m.get("content", "")).strip() for m in messages):
            raise GenerationError("prompt is empty: give at least one non-empty message")
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def generate(self, messages, gen: GenerationConfig, speculative: bool = True, turn_id: str = "",
                 on_token=None) -> Generation:
        """One chat turn: apply the chat template to ``messages`` and generate the assistant reply.

        ``on_token(token_id: int)``, if given, is called for every token as it is committed (streaming; the
        EOS token included, stop strings not applied).
        """
        return self.generate_ids(self.encode_chat(messages), gen, speculative, turn_id, on_token)

    def chat(self, user_turns: list, gen: GenerationConfig, speculative: bool = True, turn_id: str = "",
             on_token=None) -> list:
        """Multi-turn conversation: each user turn is asked after the teacher's own previous answers."""
        messages, out = [], []
        for i, text in enumerate(user_turns):
            messages.append({"role": "user", "content": text})
            g = self.generate(messages, gen, speculative, f"{turn_id}-{i}" if turn_id else str(i), on_token)
            messages.append({"role": "assistant", "content": g.text})
            out.append(g)
        return out

    def generate_ids(self, prompt_ids, gen: GenerationConfig, speculative: bool = True,
                     turn_id: str = "", on_token=None) -> Generation:
        """Generate from raw prompt ids (int [T], T >= 1); ``on_token`` as in :meth:`generate`.

        The cache must hold prompt + max_new_tokens in both modes; room for verifying a tree is the engine's
        business: near the end of the cache a speculative turn decodes plainly (the policy's ``max_m``).

        Raises:
            GenerationError: empty prompt, or prompt + max_new_tokens > cache.max_seq_len.
        """
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise GenerationError("prompt is empty (0 tokens)")
        speculative = speculative and self.speculates
        room = len(ids) + gen.max_new_tokens
        if room > self.teacher.S:
            raise GenerationError(f"prompt of {len(ids)} tokens + generation.max_new_tokens={gen.max_new_tokens}"
                                  f" = {room} exceeds cache.max_seq_len={self.teacher.S}")
        rnd = self.decode_round(speculative)
        emitter = Emitter(self.tokenizer, self.eos, gen, on_token)
        compiles0, compile_ms0 = self.compiles, self.compile_ms
        seq = Sequence(self.teacher.new_seq(), -1, gen, emitter)
        try:
            t0 = time.perf_counter()
            logits, aux = self.teacher.prefill(seq.sid, ids)
            seq.next = first_token(seq, logits, len(ids))
            if seq.error:
                raise GenerationError(seq.error)
            prefill_ms = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            if not emitter.push(seq.next):
                rnd.start(seq, ids, aux)
                while not emitter.reason:
                    # with the graph store, a young process verifies with the budgets it has at hand (one graph
                    # for a one-shot answer, not one per budget); after AT_HAND_TOKENS tokens, with all of them
                    if speculative and isinstance(self._policy, AdaptivePolicy) and graph_cache.active():
                        self._policy.budgets = (budgets_at_hand(self.teacher, self.verify_budgets(),
                                                                self.teacher.length(seq.sid))
                                                if self.decoded < self.AT_HAND_TOKENS else self.verify_budgets())
                    self.decoded += len(rnd.step([seq])[0])
                    if seq.error:
                        raise GenerationError(seq.error)
            decode_ms = (time.perf_counter() - t1) * 1e3
            if speculative:
                self.save_costs()
        finally:
            rnd.finish(seq)
            self.teacher.free(seq.sid)
        steps = seq.steps if speculative else []
        n_new = len(emitter.ids)
        turn = TurnTrace(turn_id=turn_id, prompt_tokens=len(ids), new_tokens=n_new, prefill_ms=prefill_ms,
                         decode_ms=decode_ms, tok_per_s=n_new / max(1e-9, (prefill_ms + decode_ms) / 1e3),
                         compile_count=self.compiles - compiles0, compile_ms=self.compile_ms - compile_ms0,
                         mean_accept_len=mean_accept_len(steps), spec_share=spec_share(steps), warnings=list(seq.notes))
        self.trace.write(turn)
        return Generation(emitter.ids, emitter.text(), emitter.reason, len(ids), steps, turn,
                          seq.logprobs[: len(emitter.ids)])

    def save_costs(self) -> None:
        """Store the policy's cost table (kept current by the single-sequence round, core.costs.RunningCosts) in
        ``cost_file``, where the next process of this machine and configuration starts from it; nothing when no
        step was observed or there is no file."""
        if self.running_costs is not None and self.cost_file and self.running_costs.observed:
            self.costs.save(self.cost_file)

    @property
    def speculates(self) -> bool:
        """Whether speculative turns draft anything: a drafter (method eagle3 or hybrid) or suffix candidates
        (method suffix or hybrid)."""
        return self.drafter is not None or self.suffix is not None

    def decode_round(self, speculative: bool = True, rows: int = 1, features: bool = False) -> DecodeRound:
        """The shared decode round over this engine's runners: with the drafter, suffix candidates and the
        speculation policy when ``speculative`` (and the engine :attr:`speculates`), teacher-only otherwise;
        ``rows`` > 1 for batched calls."""
        spec = speculative and self.speculates
        policy = self.policy if spec and rows == 1 else None          # builds the running cost table on first use
        return DecodeRound(self.teacher, self.drafter if spec else None, self.spec, rows=rows, policy=policy,
                           validate=self.validate, trace=self.trace if spec and rows == 1 else None,
                           features=features, suffix=self.suffix if spec else None,
                           costs=self.running_costs if policy is not None else None)


def mean_accept_len(steps) -> float:
    """Mean L_k over the steps that verified a tree (budget > 1); 1.0 when none did (teacher-only decoding)."""
    lens = [s.accept_len for s in steps if s.budget != 1]
    return float(np.mean(lens)) if lens else 1.0


def spec_share(steps) -> float:
    """Share of a turn's steps that verified a draft tree (0.0 for teacher-only decoding)."""
    return float(np.mean([s.budget != 1 for s in steps])) if steps else 0.0


__all__ = ["Engine", "Generation", "GenerationError", "CacheExhaustedError", "mean_accept_len", "spec_share"]
