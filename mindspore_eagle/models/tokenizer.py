"""Teacher tokenizers without torch/transformers: byte-level BPE (GGUF or tokenizer.json) and SentencePiece.

Letter legend (docs/architecture.md): V = teacher vocab.

* `Tokenizer.from_gguf(reader)`: llama.cpp `gpt2` tokenizer model rebuilt with `tokenizers` (models.BPE(vocab,
  merges), a pre-tokenizer chosen by `tokenizer.ggml.pre`, ByteLevel decoder, token types 3/4 as special tokens).
  For SmolLM2 (`pre` = smollm) this is Digits(individual) + ByteLevel, exact on MT-Bench/HumanEval text
  (docs/design.md, "Tokenizer of the GGUF teacher"). An embedded `tokenizer.huggingface.json` is used as is.
* `Tokenizer.from_hf_dir(dir)`: `tokenizer.json` via `tokenizers`, else SentencePiece `tokenizer.model` with the
  `added_tokens_decoder` of tokenizer_config.json split out first, each remaining segment encoded by SentencePiece
  (as openPangu's slow `PanguTokenizer` does), BOS prepended when `add_bos_token` is true.
* Chat templates render with jinja2 like transformers (sandboxed, trim_blocks, lstrip_blocks, loopcontrols,
  `raise_exception`, `tojson`), with bos_token/eos_token/unk_token/pad_token strings available.

Errors: `CheckpointError` (one line) for unusable tokenizer files or metadata.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from mindspore_eagle.models.model_config import CheckpointError
from mindspore_eagle.models.gguf_meta import gguf_value

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
GGUF_PRE_TYPES = ("smollm", "gpt2", "default", "qwen2", "llama-bpe", "llama3")


class Tokenizer:
    """Text <-> token ids, chat templating and streaming decode for one teacher.

    Attributes:
        vocab_size: number of ids the tokenizer can produce (may be below the model's padded V).
        bos_token_id: int or None. add_bos: whether `encode` prepends it.
        eos_token_ids: tuple of ids that end generation.
        chat_template: jinja2 source or None.
        special_tokens: dict content -> id of the special/added tokens.
    """

    def __init__(self, backend, *, vocab_size: int, bos_token_id=None, eos_token_ids=(), add_bos=False,
                 chat_template=None, special_tokens=None, template_vars=None):
        self._backend = backend
        self.vocab_size = int(vocab_size)
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.eos_token_ids = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.template_vars = {k: v for k, v in (template_vars or {}).items() if v is not None}
        self._compiled = None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids.

        BOS is prepended only when `add_bos` (default: the model's add_bos flag) is true and the text does not
        already start with the BOS string.
        """
        ids = self._backend.encode(text)
        add = self.add_bos if add_bos is None else add_bos
        bos = self.template_vars.get("bos_token")
        if add and self.bos_token_id is not None and not (bos and text.startswith(bos)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (any int sequence / numpy array); special tokens kept as their strings unless skipped."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def set_chat_template(self, template: str) -> None:
        """Replace the chat template by ``template``: a Jinja file path, or the template text itself when it holds
        ``{%`` or ``{{`` (``model.chat_template``).

        Raises:
            CheckpointError: the path does not exist or cannot be read, or the template does not compile."""
        from pathlib import Path

        text = template
        if "{%" not in template and "{{" not in template:
            try:
                text = Path(template).read_text(encoding="utf-8")
            except OSError as e:
                raise CheckpointError(f"model.chat_template = {template!r}: not a readable file ({e.strerror}) "
                                      "and not template text (no '{%' or '{{')") from None
        try:
            compiled = _compile_template(text)
        except Exception as e:           # jinja2.TemplateSyntaxError and kin: one line, naming the key
            raise CheckpointError(f"model.chat_template does not compile: {type(e).__name__}: {e}") from None
        self.chat_template, self._compiled = text, compiled

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template.

        Raises:
            CheckpointError: the tokenizer has no chat template.
        """
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat template; set model.chat_template to a Jinja chat "
                                  "template (a file or the text), or send a raw prompt (/v1/completions)")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{**self.template_vars, **kwargs})

    def encode_chat(self, messages: list, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat-templated `messages`, with control tokens coming only from the template.

        Like `encode(apply_chat_template(messages, add_generation_prompt))` (BOS per `encode`), except that the
        messages' contents are plain text: a special-token string a user types (``<|im_end|>``, ``[unused10]``)
        is encoded as the ordinary tokens of its characters, never as the control id, so message text cannot
        close its turn or forge another role's turn (cf. huggingface/transformers#29279). Text without such
        strings encodes exactly as `encode` would. Contents are put in verbatim where the template inserts them
        (string filters a template applies to a content, such as ``trim``, do not apply).

        Raises:
            CheckpointError: the tokenizer has no chat template.
        """
        marks = {}

        def mark(m):
            c = m.get("content")
            if not isinstance(c, str) or not c:
                return m
            key = f"\ue000{len(marks)}\ue001"
            marks[key] = c
            return {**m, "content": key}

        text = self.apply_chat_template([mark(m) for m in messages], add_generation_prompt)
        parts = re.split("(\ue000[0-9]+\ue001)", text)
        plain = [p for p in parts if p not in marks]
        if any("\ue000" in p for p in plain):    # a template that does not insert contents verbatim
            return self.encode(self.apply_chat_template(messages, add_generation_prompt))
        # runs: str = template text (its special strings are control tokens), tuple = a message's content
        runs = [(marks[p],) if p in marks else p for p in parts if p]
        ids = self._backend.encode_runs(runs)
        bos = self.template_vars.get("bos_token")
        starts_bos = bool(bos) and bool(runs) and isinstance(runs[0], str) and runs[0].startswith(bos)
        if self.add_bos and self.bos_token_id is not None and not starts_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def token_to_id(self, token: str):
        """Id of a special/added token string, or of a vocabulary piece; None if unknown."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._backend.piece_to_id(token)

    # ------------------------------------------------------------------------------------------- builders --
    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Build from an open `gguf.GGUFReader` (tokenizer.ggml.* metadata and tokenizer.chat_template).

        Raises:
            CheckpointError: tokenizer model other than `gpt2`, or an unknown `tokenizer.ggml.pre` type (both named).
        """
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        tokens = gguf_value(reader, "tokenizer.ggml.tokens")
        hf_json = gguf_value(reader, "tokenizer.huggingface.json", None)
        if hf_json:
            tk = HFTokenizer.from_str(hf_json)
        else:
            kind = gguf_value(reader, "tokenizer.ggml.model")
            if kind != "gpt2":
                raise CheckpointError(f"GGUF tokenizer model '{kind}' is not supported (supported: gpt2 byte-level "
                                      "BPE); convert the tokenizer to tokenizer.json")
            pre = gguf_value(reader, "tokenizer.ggml.pre", "default")
            if pre not in GGUF_PRE_TYPES:
                raise CheckpointError(f"GGUF pre-tokenizer '{pre}' is not supported (supported: "
                                      f"{', '.join(GGUF_PRE_TYPES)})")
            merges = [tuple(m.split(" ", 1)) for m in gguf_value(reader, "tokenizer.ggml.merges")]
            tk = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
            if pre == "smollm":
                tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                            pre_tokenizers.ByteLevel(add_prefix_space=False)])
            elif pre in ("gpt2", "default"):
                tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            else:
                pattern = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
                tk.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tk.decoder = decoders.ByteLevel()
            types = gguf_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
            tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                   for i, ty in enumerate(types) if ty in (3, 4)])
        special = {c.content: i for i, c in tk.get_added_tokens_decoder().items()}
        bos = gguf_value(reader, "tokenizer.ggml.bos_token_id", None)
        eos = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
        names = {k: gguf_value(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos", "unk", "pad")}
        return cls(_TokenizersBackend(tk), vocab_size=len(tokens), bos_token_id=bos,
                   eos_token_ids=[e for e in eos if e is not None],
                   add_bos=bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=gguf_value(reader, "tokenizer.chat_template", None), special_tokens=special,
                   template_vars={f"{k}_token": tokens[v] for k, v in names.items() if v is not None})

    @classmethod
    def from_hf_dir(cls, directory) -> "Tokenizer":
        """Build from an HF directory: tokenizer.json (preferred) or SentencePiece tokenizer.model, plus
        tokenizer_config.json (chat_template, added_tokens_decoder, add_bos_token, bos/eos/unk/pad_token) and an
        optional chat_template.jinja.

        Raises:
            CheckpointError: no tokenizer file, unreadable JSON, or an eos_token the vocabulary lacks.
        """
        d = Path(directory)
        cfg_path = d / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: cannot read JSON: {' '.join(str(e).split())}") from None
        added = {int(k): v["content"] for k, v in (cfg.get("added_tokens_decoder") or {}).items()}
        special_ids = {int(k) for k, v in (cfg.get("added_tokens_decoder") or {}).items() if v.get("special", True)}
        if (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            tk = HFTokenizer.from_file(str(d / "tokenizer.json"))
            backend, vocab_size = _TokenizersBackend(tk), tk.get_vocab_size(with_added_tokens=True)
            added.update({i: c.content for i, c in tk.get_added_tokens_decoder().items()})
        elif (d / "tokenizer.model").is_file():
            import sentencepiece as spm

            try:
                sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
            except (OSError, RuntimeError) as e:
                raise CheckpointError(f"{d / 'tokenizer.model'}: not a SentencePiece model: {e}") from None
            backend = _SentencePieceBackend(sp, added, special_ids)
            vocab_size = max([sp.get_piece_size()] + [i + 1 for i in added])
        else:
            raise CheckpointError(f"{d}: no tokenizer.json or tokenizer.model")
        special = {c: i for i, c in added.items()}
        names = {k: _token_str(cfg.get(f"{k}_token")) for k in ("bos", "eos", "unk", "pad")}
        ids = {k: (special.get(v, backend.piece_to_id(v)) if v else None) for k, v in names.items()}
        if names["eos"] and ids["eos"] is None:
            raise CheckpointError(f"{cfg_path}: eos_token {names['eos']!r} is not in the vocabulary")
        if isinstance(backend, _SentencePieceBackend) and backend.sp.bos_id() >= 0:
            ids["bos"] = backend.sp.bos_id()  # PanguTokenizer.bos_token_id = sp_model.bos_id()
        add_bos = cfg.get("add_bos_token")
        if add_bos is None and isinstance(backend, _TokenizersBackend) and ids["bos"] is not None:
            add_bos = backend.tk.encode("a", add_special_tokens=True).ids[:1] == [ids["bos"]]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default", template[0].get("template") if template else None)
        if not template and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, vocab_size=vocab_size, bos_token_id=ids["bos"],
                   eos_token_ids=[ids["eos"]] if ids["eos"] is not None else [], add_bos=bool(add_bos),
                   chat_template=template, special_tokens=special,
                   template_vars={f"{k}_token": v for k, v in names.items()})


def _runs_to_segments(runs, split):
    """Cut template runs (str) at their special-token strings; content runs (1-tuples) are never cut.

    Returns a list of ints (control ids) and lists of (text, is_content) pieces: the text between two control
    tokens, which a backend encodes in one go.
    """
    out, cur = [], []
    for run in runs:
        if isinstance(run, tuple):
            cur.append((run[0], True))
            continue
        for seg in (split(run) if split else [run]):
            if isinstance(seg, int):
                if cur:
                    out.append(cur)
                out.append(seg)
                cur = []
            elif seg:
                cur.append((seg, False))
    if cur:
        out.append(cur)
    return out


class _TokenizersBackend:
    def __init__(self, tk):
        self.tk = tk
        added = {c.content: i for i, c in tk.get_added_tokens_decoder().items()}
        alts = sorted(added, key=len, reverse=True)
        self._added = added
        self._split_re = re.compile("(" + "|".join(map(re.escape, alts)) + ")") if alts else None

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def _split(self, text):
        return [self._added[p] if p in self._added else p for p in self._split_re.split(text)]

    def encode_plain(self, text: str) -> list:
        """Ids of `text` with no added-token matching: normalizer, pre-tokenizer and model only (what `encode`
        does between two added tokens)."""
        tk = self.tk
        norm = tk.normalizer.normalize_str(text) if tk.normalizer is not None else text
        pieces = tk.pre_tokenizer.pre_tokenize_str(norm) if tk.pre_tokenizer is not None else [(norm, None)]
        return [t.id for piece, _ in pieces for t in tk.model.tokenize(piece)]

    def encode_runs(self, runs) -> list:
        """Ids of template runs (str; special strings -> control ids) and content runs (1-tuples, plain text)."""
        ids = []
        for seg in _runs_to_segments(runs, self._split if self._split_re else None):
            ids.extend([seg] if isinstance(seg, int) else self.encode_plain("".join(t for t, _ in seg)))
        return ids

    def decode(self, ids, skip_special):
        return self.tk.decode(ids, skip_special_tokens=skip_special)

    def piece_to_id(self, piece):
        return self.tk.token_to_id(piece)


class _SentencePieceBackend:
    """SentencePiece with added tokens matched first (longest first), like transformers' slow tokenizers."""

    def __init__(self, sp, added: dict, special_ids: set):
        self.sp, self.added, self.special_ids = sp, dict(added), set(special_ids)
        self.added_ids = {c: i for i, c in self.added.items()}
        alts = sorted(self.added_ids, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, alts)) + ")") if alts else None

    def encode(self, text):
        ids = []
        for seg in (self.split.split(text) if self.split else [text]):
            if seg in self.added_ids:
                ids.append(self.added_ids[seg])
            elif seg:
                ids.extend(self.sp.encode(seg))
        return ids

    def _split(self, text):
        return [self.added_ids[p] if p in self.added_ids else p for p in self.split.split(text)]

    def _literal(self, text: str) -> list:
        """Ids spelling `text` character by character (the piece of each character, else its UTF-8 byte
        pieces <0xNN>): an added-token string that must stay text, which SentencePiece would match as a
        user-defined symbol."""
        ids = []
        for ch in text:
            i = self.sp.piece_to_id(ch)
            if self.sp.id_to_piece(i) == ch and i not in self.added:
                ids.append(i)
            else:
                ids.extend(self.sp.piece_to_id(f"<0x{b:02X}>") for b in ch.encode("utf-8"))
        return ids

    def encode_runs(self, runs) -> list:
        """Ids of template runs (str; special strings -> control ids) and content runs (1-tuples, plain text).

        Text between two control tokens is one SentencePiece call, as in `encode`; an added-token string inside a
        content is spelled out by `_literal` and the text on each side is its own call (so, as after a control
        token, text right after it that does not start with a space gets SentencePiece's dummy-prefix space)."""
        ids = []
        for seg in _runs_to_segments(runs, self._split if self.split else None):
            if isinstance(seg, int):
                ids.append(seg)
                continue
            text, pending = "", []
            for t, is_content in seg:
                if not is_content or not self.split:
                    text += t
                    continue
                for j, piece in enumerate(self.split.split(t)):
                    if j % 2:           # an added-token string typed by the user
                        pending.append(text)
                        pending.append((piece,))
                        text = ""
                    else:
                        text += piece
            pending.append(text)
            after_literal = False
            for p in pending:
                if isinstance(p, tuple):
                    ids.extend(self._literal(p[0]))
                elif p:
                    # a new SentencePiece call prefixes a space ("▁", add_dummy_prefix): after a spelled-out
                    # string, let it stand for the text's own leading space
                    ids.extend(self.sp.encode(p[1:] if after_literal and p[0] == " " and p[1:] else p))
                after_literal = isinstance(p, tuple)
        return ids

    def decode(self, ids, skip_special):
        out, run = [], []
        for i in ids:
            if i in self.added:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                if not (skip_special and i in self.special_ids):
                    out.append(self.added[i])
            elif 0 <= i < self.sp.get_piece_size():
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def piece_to_id(self, piece):
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None


def _token_str(value):
    return value.get("content") if isinstance(value, dict) else value


def _compile_template(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise CheckpointError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDecoder:
    """Streaming detokenizer: feed ids as they are accepted, get the newly completed text.

    Uses the prefix/read-offset scheme of HF text-generation-inference/vLLM: text is emitted only once it no
    longer ends in an incomplete UTF-8 sequence (U+FFFD), and each decode covers a short window so the cost per
    call stays small. The concatenation of all `push` results plus `flush()` equals `decode(all ids)` for
    byte-level BPE and SentencePiece tokenizers.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = self._read = 0

    def push(self, ids) -> str:
        """Append `ids` (iterable of ints) and return the text they complete ('' if still incomplete)."""
        self.ids.extend(int(i) for i in ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back (possibly ending in U+FFFD)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        dec = self.tokenizer.decode
        prefix_text = dec(self.ids[self._prefix:self._read], self.skip_special_tokens)
        new_text = dec(self.ids[self._prefix:], self.skip_special_tokens)
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""


def decode_stream(tokenizer: Tokenizer, id_chunks, skip_special_tokens: bool = False):
    """Generator over text pieces for an iterable of id chunks (each an iterable of ints); ends with the flush."""
    dec = IncrementalDecoder(tokenizer, skip_special_tokens)
    for chunk in id_chunks:
        text = dec.push(chunk)
        if text:
            yield text
    text = dec.flush()
    if text:
        yield text
