"""Emitter: the stop rules of one turn, applied one committed token at a time.

Pure Python (the tokenizer is only asked to decode); the decode round pushes every token it commits through the
sequence's Emitter, so teacher-only decoding, tree speculation, the batch scheduler and the server stop at exactly
the same token: EOS, a stop string, or ``generation.max_new_tokens``.
"""
from __future__ import annotations


class Emitter:
    """The tokens of one turn and why it ended.

    Args:
        tokenizer: has ``decode(ids) -> str`` (stop strings are matched on the decoded text).
        eos: set of token ids that end the turn (the EOS token is kept in ``ids``, cut from ``text()``).
        gen: GenerationConfig (``stop``: list of strings; ``max_new_tokens``: int >= 1).
        on_token: optional ``callable(token_id: int)`` called for every token as it is pushed (streaming).
    Attributes:
        ids: list[int] of the pushed tokens. reason: "" while running, then "eos" | "stop" | "length".
    """

    def __init__(self, tokenizer, eos, gen, on_token=None):
        self.tok, self.eos, self.gen, self.on_token = tokenizer, eos, gen, on_token
        self.ids: list = []
        self.reason = ""

    @property
    def left(self) -> int:
        """Tokens this turn may still emit (``max_new_tokens`` minus those pushed)."""
        return self.gen.max_new_tokens - len(self.ids)

    def push(self, token: int) -> bool:
        """Append one token; True when the turn has ended (with it)."""
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

    def push_all(self, tokens) -> list:
        """Push ``tokens`` in order until the turn ends; returns those pushed (a prefix of ``tokens``)."""
        out = []
        for t in tokens:
            out.append(int(t))
            if self.push(int(t)):
                break
        return out

    def text(self) -> str:
        """The turn's text: EOS dropped, cut before the first stop string. A turn cut by ``max_new_tokens`` in the
        middle of a multi-byte character (byte-level tokens) ends before that character: the tokenizer decodes the
        incomplete bytes as U+FFFD, which are dropped from the end."""
        ids = self.ids[:-1] if self.reason == "eos" else self.ids
        text = self.tok.decode(ids)
        for s in self.gen.stop:
            if s in text:
                text = text[: text.index(s)]
        if self.reason == "length":
            text = text.rstrip("\ufffd")
        return text


__all__ = ["Emitter"]
