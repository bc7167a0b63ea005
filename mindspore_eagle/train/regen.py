"""Batched regeneration of assistant replies by the teacher (the drafter must learn the teacher's own text).

SpecForge ``scripts/regenerate_train_data.py`` asks a serving engine for the target model's reply to each prompt;
here the teacher answers with continuous batching over :meth:`TeacherRunner.decode_batch`: up to ``batch``
sequences decode together in one forward (block-diagonal mask over their concatenated block tables), a finished
sequence frees its blocks and the next prompt is prefilled into its row. On the 2-core CPU one 16-row call costs
about twice a single-token decode, so 16 rows give several times the tokens per second of one sequence.

Greedy replies are what teacher-only decoding produces for the same prompt up to float32 summation order (the
batched call attends over a wider, masked width), which is the distribution the drafter meets at inference.
"""
from __future__ import annotations

import contextlib

import numpy as np


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def generate_stream(runner, items, eos, batch: int = 16, temperature: float = 0.0,
                    rng: np.random.Generator | None = None, width_step: int = 512, counts: dict | None = None,
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
        ValueError: batch < 1 or a budget < 1.
    """
    if batch < 1:
        raise ValueError(f"regenerate batch must be >= 1, got {batch}")
    rng = rng or np.random.default_rng(0)
    eos = set(int(e) for e in eos)
    queue = enumerate(items)
    more = True
    active: list[dict] = []       # {"i", "sid", "budget", "out", "freed", "next"}
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
                a = {"i": i, "sid": runner.new_seq(), "budget": budget, "out": [], "freed": False}
                active.append(a)            # before prefill: an error there still frees its blocks
                if features:
                    logits, hid, aux = runner.prefill_with_hidden(a["sid"], ids)
                    a["hid"], a["aux"] = [hid], [aux]
                else:
                    logits, _ = runner.prefill(a["sid"], ids)
                a["next"] = _pick(logits, temperature, rng)
            live, finished = [], []
            for a in active:
                if a["next"] in eos:
                    finished.append((a, "eos", a["next"]))
                    continue
                a["out"].append(a["next"])
                if counts is not None:
                    counts["decoded"] = counts.get("decoded", 0) + 1
                if len(a["out"]) >= a["budget"]:
                    finished.append((a, "length", None))
                else:
                    live.append(a)
            for a, _, _ in finished:
                runner.free(a["sid"])
                a["freed"] = True
            active = live                                 # finished rows are already freed
            for a, stop, end in finished:
                if features:
                    yield a["i"], a["out"], stop, end, (np.concatenate(a["hid"]), np.concatenate(a["aux"]))
                else:
                    yield a["i"], a["out"], stop, end
            if not active:
                continue
            sids, toks = [a["sid"] for a in active], [a["next"] for a in active]
            if features:
                logits, hid, aux = runner.decode_batch(sids, toks, rows=batch, width_step=width_step,
                                                       with_hidden=True)
                for i, a in enumerate(active):
                    a["hid"].append(hid[i:i + 1].copy())      # copies: a view would keep the whole call's
                    a["aux"].append(aux[i:i + 1].copy())      # output alive until the row finishes
            else:
                logits = runner.decode_batch(sids, toks, rows=batch, width_step=width_step)
            for a, row in zip(active, logits):
                a["next"] = _pick(row, temperature, rng)
    finally:                            # on an error or close mid-pass, free each row exactly once
        for a in active:
            if not a["freed"]:
                runner.free(a["sid"])


def regenerate_replies(runner, tok, prompts: list, max_len: int, batch: int = 16, temperature: float = 0.0,
                       min_reply: int = 16, rng: np.random.Generator | None = None, progress=None) -> list:
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
                          temperature, rng)
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
