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
        # a stop string of n characters spans at most 4 n tokens (a token holds >= 1 byte, a character <= 4
        # bytes); 4 more cover a character split before the window's first token
        self._window = 4 * max((len(s) for s in gen.stop), default=0) + 4

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
        elif self.gen.stop and self._stop_in_tail():
            self.reason = "stop"
        elif len(self.ids) >= self.gen.max_new_tokens:
            self.reason = "length"
        return bool(self.reason)

    def _stop_in_tail(self) -> bool:
        """True when a stop string ends in the last token's text: only the last ``_window`` tokens are decoded, so
        checking a turn costs O(tokens), not O(tokens^2). A stop string is found at the token that completes it,
        since every push checks."""
        tail = self.tok.decode(self.ids[-self._window:])
        return any(s in tail for s in self.gen.stop)

    def push_all(self, tokens) -> list:
        """Push ``tokens`` in order until the turn ends; returns those pushed (a prefix of ``tokens``)."""
        out = []
        for t in tokens:
            out.append(int(t))
            if self.push(int(t)):
                break
        return out

    def text(self) -> str:
        """The turn's text: EOS dropped, cut before the earliest match of any stop string (whatever their order in
        the list). A turn cut by ``max_new_tokens`` in the middle of a multi-byte character (byte-level tokens)
        ends before that character: the tokenizer decodes the incomplete bytes as U+FFFD, which are dropped from
        the end."""
        ids = self.ids[:-1] if self.reason == "eos" else self.ids
        text = self.tok.decode(ids)
        hits = [text.find(s) for s in self.gen.stop if s in text]
        if hits:
            text = text[: min(hits)]
        if self.reason == "length":
            text = text.rstrip("\ufffd")
        return text


__all__ = ["Emitter"]
