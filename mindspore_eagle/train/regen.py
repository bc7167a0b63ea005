"""Batched regeneration of assistant replies by the teacher (the drafter must learn the teacher's own text).

SpecForge ``scripts/regenerate_train_data.py`` asks a serving engine for the target model's reply to each prompt;
here the teacher answers with continuous batching: up to ``batch`` sequences advance together through the shared
teacher-only decode round (serving/round.py, one ``TeacherRunner.decode_batch`` forward per step), a finished
sequence frees its blocks and the next prompt is prefilled into its row. On the 2-core CPU one 16-row call costs
about twice a single-token decode, so 16 rows give several times the tokens per second of one sequence.

Greedy replies are what teacher-only decoding produces for the same prompt up to float32 summation order (the
batched call attends over a wider, masked width), which is the distribution the drafter meets at inference.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from mindspore_eagle.config import GenerationConfig
from mindspore_eagle.core.emit import Emitter
from mindspore_eagle.serving.round import DecodeRound, Sequence, first_token


def generate_stream(runner, items, eos, batch: int = 16, temperature: float = 0.0,
                    seed: int = 0, width_step: int = 512, counts: dict | None = None,
                    should_stop=None, features: bool = False):
    """Continuous-batching generation; yields each sequence as soon as it finishes.

    Args:
        runner: a TeacherRunner whose pool holds ``batch`` sequences (see :func:`build_batch_runner`).
        items: iterable of (prompt ids: int list, budget: int >= 1), read lazily as rows free up; the budget is
            the new tokens allowed (the end token is neither counted nor returned).
        eos: ids that end a sequence. batch: rows per decode call (>= 1). temperature: 0 = greedy.
        width_step: the concatenated KV width of a decode call is padded to a multiple of this many slots (each
            width is one compiled graph: larger steps compile fewer graphs and attend over more padding).
        counts: optional dict; ``counts["decoded"]`` is kept equal to the reply tokens produced so far, rows still
            in flight included (what a throughput figure must count when a run is cut short).
        should_stop: optional callable() -> bool, asked before every decode step; True ends the generator (rows still
            in flight are freed, not yielded).
        features: also collect the teacher's training features of every position the teacher was fed (the prompt
            and every reply token but the last), from the same calls that pick the tokens
            (``TeacherRunner.prefill_with_hidden`` / ``decode_batch(with_hidden=True)``; the picks are unchanged).
    Yields:
        (index of the item, reply ids list[int], stop, end id) in finishing order: stop "eos" with the end
        token the teacher emitted (not in the reply), or "length" with None. With ``features`` a fifth element
        (hidden float32 [f, H] final-normed, aux float32 [f, 3H]) for the fed positions 0..f-1 of prompt + reply:
        f = len(prompt) + len(reply) after "eos" (every reply token was fed), one less after "length" (the last
        reply token was produced, never fed); i.e. every position of the training sample but its last.
        A row's KV blocks are freed before it is yielded; closing the generator (or an error) frees the rest.
    Raises:
        ValueError: batch < 1 or a budget < 1. FloatingPointError: the teacher's logits for a row were not finite
            (names the item and the position; the rows in flight are freed).
    """
    if batch < 1:
        raise ValueError(f"regenerate batch must be >= 1, got {batch}")
    eos = set(int(e) for e in eos)
    rnd = DecodeRound(runner, rows=batch, features=features, width_step=width_step)     # teacher-only
    queue = enumerate(items)
    more = True
    active: list = []             # _Reply sequences in flight, not yet freed
    try:
        while more or active:
            if should_stop is not None and should_stop():
                return
            while more and len(active) < batch:
                i, (ids, budget) = next(queue, (None, (None, None)))
                if i is None:
                    more = False
                    break
                if budget < 1:
                    raise ValueError(f"generate_stream: item {i} has budget {budget}, need >= 1")
                gen = GenerationConfig(max_new_tokens=budget, temperature=temperature, seed=seed)
                s = _Reply(runner.new_seq(), -1, gen, Emitter(None, eos, gen), index=i)
                active.append(s)            # before prefill: an error there still frees its blocks
                if features:
                    logits, hid, aux = runner.prefill_with_hidden(s.sid, ids)
                    s.features.append((hid, aux))
                else:
                    logits, _ = runner.prefill(s.sid, ids)
                s.next = first_token(s, logits, len(ids))       # the prologue every caller shares
                if s.next is None:
                    raise FloatingPointError(f"generate_stream: item {i}: {s.error}")
                _count(counts, s.next not in eos)
                s.emitter.push(s.next)
            live = [s for s in active if not s.emitter.reason]
            if live:
                for s, toks in zip(live, rnd.step(live)):
                    if s.error:                   # a broken teacher must not write training data
                        raise FloatingPointError(f"generate_stream: item {s.index}: {s.error}")
                    _count(counts, sum(t not in eos for t in toks))
            finished = [s for s in active if s.emitter.reason]
            active = [s for s in active if not s.emitter.reason]
            for s in finished:
                runner.free(s.sid)
                s.sid = -1
            for s in finished:
                yield _finished(s, features)
    finally:                            # on an error or close mid-pass, free each row exactly once
        for s in active:
            if s.sid >= 0:
                runner.free(s.sid)


def _finished(s, features: bool) -> tuple:
    """What :func:`generate_stream` yields for a finished reply (its docstring)."""
    stop, ids = s.emitter.reason, s.emitter.ids
    reply, end = (ids[:-1], ids[-1]) if stop == "eos" else (ids, None)
    if not features:
        return s.index, reply, stop, end
    return s.index, reply, stop, end, (np.concatenate([h for h, _ in s.features]),
                                       np.concatenate([a for _, a in s.features]))


@dataclass
class _Reply(Sequence):
    """A reply in flight: a round Sequence plus the index of its item."""
    index: int = -1


def _count(counts: dict | None, n: int) -> None:
    if counts is not None:
        counts["decoded"] = counts.get("decoded", 0) + int(n)


def regenerate_replies(runner, tok, prompts: list, max_len: int, batch: int = 16, temperature: float = 0.0,
                       min_reply: int = 16, seed: int = 0, progress=None) -> list:
    """The teacher's reply to each user prompt, generated ``batch`` sequences at a time (:func:`generate_stream`).

    Args:
        runner: a TeacherRunner whose pool holds ``batch`` sequences of ``max_len`` tokens (see
            :func:`build_batch_runner`); tok: its Tokenizer.
        prompts: user messages (str). max_len: prompt + reply tokens per sample (the training truncation).
        batch: rows per decode call (>= 1). temperature: 0 = greedy, else softmax sampling.
        min_reply: prompts whose chat-templated ids leave fewer reply tokens than this are skipped (None).
        progress: optional callable(done, total, new_tokens) after each finished prompt.
    Returns:
        list with one entry per prompt: the reply text (special tokens removed), or None when skipped.
    Raises:
        ValueError: batch < 1 or max_len < min_reply.
    """
    if batch < 1:
        raise ValueError(f"regenerate batch must be >= 1, got {batch}")
    if max_len < min_reply:
        raise ValueError(f"max_len = {max_len} must be >= min_reply = {min_reply}")
    out: list = [None] * len(prompts)
    keep, ids_list = [], []
    for i, text in enumerate(prompts):
        ids = tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        if len(ids) + min_reply <= max_len:
            keep.append(i)
            ids_list.append(ids)
    done, new_tokens = len(prompts) - len(keep), 0
    gen = generate_stream(runner, [(x, max_len - len(x)) for x in ids_list], tok.eos_token_ids, batch,
                          temperature, seed)
    with contextlib.closing(gen):
        for j, reply, _, _ in gen:
            out[keep[j]] = tok.decode(reply, skip_special_tokens=True)
            done += 1
            new_tokens += len(reply)
            if progress is not None:
                progress(done, len(prompts), new_tokens)
    if progress is not None:
        progress(done, len(prompts), new_tokens)
    return out


def build_batch_runner(cfg, tensors: dict, max_len: int, batch: int, mode: str = "fused", block_size: int = 16):
    """A TeacherRunner whose KV pool holds ``batch`` sequences of ``max_len`` tokens (plus one spare each).

    Args:
        cfg: teacher ModelConfig; tensors: HF-named float32 weights. Returns (runner, teacher).
    """
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    S = max(16, -(-max_len // block_size) * block_size)
    chunk = 16
    while chunk < max_len:
        chunk *= 2
    blocks = batch * (S // block_size + 1) + 2
    teacher = LlamaModel(cfg, blocks, block_size, max(S, chunk) + 1)
    teacher.load_hf_weights(tensors)
    return TeacherRunner(teacher, blocks, block_size, S, mode, prefill_chunk=chunk), teacher


__all__ = ["generate_stream", "regenerate_replies", "build_batch_runner"]
