"""The generate loop: teacher-only decoding (the oracle) and EAGLE-3 tree speculative decoding, one API.

Legend: M = tree budget, D = D_max, K = top_k, V = vocab, n = committed tokens, L_k = accepted length of step k
(accepted drafts + bonus).

One speculative round (docs/architecture.md):
    draft      drafter.extend(new context pairs) ; drafter.build_tree(root)        -> DraftTree
    tensorize  tree.tensorize(DraftTree, M, D) [+ validate_tree in eager / when asked] -> TreeTensors
    mask       target.verify_mask(tt) = tree.tree_attention_bias(tt, n, w)          -> [M, w] additive bias
    verify     target.verify(tt, mask)                                              -> logits [M, V], aux [M, 3H]
    accept     verify.accept_greedy(argmax) | accept_sampling(warped probs)         -> VerifyResult
    commit     target.commit(path) ; new drafter context = (aux[path], emitted tokens)
The engine is the only place that reads device values back to the host (one read of logits + aux per round).

Losslessness: greedy acceptance keeps exactly the tokens the teacher's argmax would produce, and the emitted
tokens pass through the same stop logic as teacher-only decoding, so at temperature 0 (fp32) the two paths give
identical token ids. Sampling uses the multi-candidate rejection rule (verify.py) and follows the teacher's
(warped) distribution exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .config import GenerationConfig, SpeculativeConfig
from .kv import CacheExhaustedError
from .trace import StepTrace, Timer, TraceWriter, TurnTrace
from .tree import tensorize, validate_tree
from .verify import accept_greedy, accept_sampling, warp_probs


class GenerationError(ValueError):
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
    """
    token_ids: list
    text: str
    stop_reason: str
    prompt_tokens: int
    steps: list = field(default_factory=list)
    turn: TurnTrace | None = None

    @property
    def accept_lens(self) -> list:
        return [s.accept_len for s in self.steps]


class _Emitter:
    """Applies EOS / max_new_tokens / stop strings one token at a time (shared by both decoding paths)."""

    def __init__(self, tokenizer, eos: set, gen: GenerationConfig, on_token=None):
        self.tok, self.eos, self.gen, self.on_token = tokenizer, eos, gen, on_token
        self.ids: list = []
        self.reason = ""

    def push(self, token: int) -> bool:
        self.ids.append(int(token))
        if self.on_token is not None:
            self.on_token(int(token))
        if token in self.eos:
            self.reason = "eos"
        elif self.gen.stop and any(s in self.tok.decode(self.ids) for s in self.gen.stop):
            self.reason = "stop"
        elif len(self.ids) >= self.gen.max_new_tokens:
            self.reason = "length"
        return bool(self.reason)

    def text(self) -> str:
        ids = self.ids[:-1] if self.reason == "eos" else self.ids
        text = self.tok.decode(ids)
        for s in self.gen.stop:
            if s in text:
                text = text[: text.index(s)]
        return text


class Engine:
    """Teacher-only and speculative generation over a TargetRunner (+ DrafterRunner).

    Args:
        target: TargetRunner of the teacher. tokenizer: Tokenizer (chat template, decode).
        eos_ids: token ids that end a turn. drafter: DrafterRunner, or None for teacher-only only.
        spec: SpeculativeConfig (M, D_max, top_k, validate_tree). trace: TraceWriter or None.
    """

    def __init__(self, target, tokenizer, eos_ids, drafter=None, spec: SpeculativeConfig | None = None,
                 trace: TraceWriter | None = None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.eos = set(int(e) for e in eos_ids)
        self.spec = spec or SpeculativeConfig()
        self.trace = trace or TraceWriter(None)
        self.validate = self.spec.validate_tree or target.mode == "eager"

    @property
    def compiles(self) -> int:
        return self.target.compiles + (self.drafter.compiles if self.drafter else 0)

    @property
    def compile_ms(self) -> float:
        return self.target.compile_ms + (self.drafter.compile_ms if self.drafter else 0.0)

    def verify_budgets(self) -> list[int]:
        """Tree budgets M (query rows of one verification forward) this engine can verify: one static graph per
        budget and attention width, which ``warmup.warmup`` compiles ahead of use."""
        return [self.spec.M]

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

        Raises:
            GenerationError: empty prompt, or prompt + max_new_tokens (+ M when speculative) > cache.max_seq_len.
        """
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise GenerationError("prompt is empty (0 tokens)")
        speculative = speculative and self.drafter is not None
        room = len(ids) + gen.max_new_tokens + (self.spec.M if speculative else 0)
        if room > self.target.S:
            raise GenerationError(f"prompt of {len(ids)} tokens + generation.max_new_tokens={gen.max_new_tokens}"
                                  + (f" + speculative.M={self.spec.M}" if speculative else "")
                                  + f" = {room} exceeds cache.max_seq_len={self.target.S}")
        rng = np.random.default_rng(gen.seed)
        emitter = _Emitter(self.tokenizer, self.eos, gen, on_token)
        compiles0, compile_ms0 = self.compiles, self.compile_ms
        sid = self.target.new_seq()
        try:
            t0 = time.perf_counter()
            logits, aux = self.target.prefill(sid, ids)
            root = self._pick(logits, gen, rng)
            prefill_ms = (time.perf_counter() - t0) * 1e3
            done = emitter.push(root)
            t1 = time.perf_counter()
            if speculative:
                steps = self._speculate(sid, ids, aux, root, done, emitter, gen, rng)
            else:
                steps = []
                while not done:
                    logits, _ = self.target.decode(sid, root)
                    root = self._pick(logits, gen, rng)
                    done = emitter.push(root)
            decode_ms = (time.perf_counter() - t1) * 1e3
        finally:
            self.target.free(sid)
        n_new = len(emitter.ids)
        turn = TurnTrace(turn_id=turn_id, prompt_tokens=len(ids), new_tokens=n_new, prefill_ms=prefill_ms,
                         decode_ms=decode_ms, tok_per_s=n_new / max(1e-9, (prefill_ms + decode_ms) / 1e3),
                         compile_count=self.compiles - compiles0, compile_ms=self.compile_ms - compile_ms0,
                         mean_accept_len=float(np.mean([s.accept_len for s in steps])) if steps else 1.0)
        self.trace.write(turn)
        return Generation(emitter.ids, emitter.text(), emitter.reason, len(ids), steps, turn)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _pick(logits: np.ndarray, gen: GenerationConfig, rng) -> int:
        if gen.temperature == 0:
            return int(np.argmax(logits))
        p = warp_probs(logits[None], gen.temperature, gen.top_p, gen.top_k)[0]
        return int(rng.choice(p.size, p=p))

    def _speculate(self, sid, ids, aux, root, done, emitter, gen, rng) -> list:
        M, D = self.spec.M, self.spec.D_max
        dr, tg = self.drafter, self.target
        dsid = dr.new_seq()
        ctx_aux, ctx_next = aux, np.asarray(ids[1:] + [root], np.int64)
        steps = []
        try:
            while not done:
                timer = Timer()
                with timer:
                    with timer.phase("draft"):
                        first = dr.extend(dsid, ctx_aux, ctx_next)
                        tree = dr.build_tree(dsid, root, first, M, D)
                    with timer.phase("tensorize"):
                        tt = tensorize(tree, M, D)
                        if self.validate:
                            validate_tree(tt, M, D)
                    with timer.phase("mask"):
                        mask = tg.verify_mask(sid, tt)
                    with timer.phase("verify"):
                        logits, aux = tg.verify(sid, tt, mask)
                    with timer.phase("accept"):
                        if gen.temperature == 0:
                            res = accept_greedy(tt, logits.argmax(-1))
                        else:
                            res = accept_sampling(tt, warp_probs(logits, gen.temperature, gen.top_p, gen.top_k), rng)
                    with timer.phase("commit"):
                        tg.commit(sid, res.path, D + 2)
                        ctx_aux, ctx_next = aux[res.path], res.tokens
                    for t in res.tokens:
                        done = emitter.push(int(t))
                        if done:
                            break
                    root = res.bonus
                step = StepTrace(step=len(steps), accept_len=res.accept_len, accepted=res.path.tolist(),
                                 n_nodes=tt.n_nodes, total_ms=timer.total_ms, **timer.phase_kwargs())
                self.trace.write(step)
                steps.append(step)
        finally:
            dr.free(dsid)
        return steps


__all__ = ["Engine", "Generation", "GenerationError", "CacheExhaustedError"]
