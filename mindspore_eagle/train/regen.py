"""Batched regeneration of assistant replies by the teacher (the drafter must learn the teacher's own text).

SpecForge ``scripts/regenerate_train_data.py`` asks a serving engine for the target model's reply to each prompt;
here the teacher answers with continuous batching over :meth:`TargetRunner.decode_batch`: up to ``batch``
sequences decode together in one forward (block-diagonal mask over their concatenated block tables), a finished
sequence frees its blocks and the next prompt is prefilled into its row. On the 2-core CPU one 16-row call costs
about twice a single-token decode, so 16 rows give several times the tokens per second of one sequence.

Greedy replies are what teacher-only decoding produces for the same prompt up to float32 summation order (the
batched call attends over a wider, masked width), which is the distribution the drafter meets at inference.
"""
from __future__ import annotations

import numpy as np


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def regenerate_replies(runner, tok, prompts: list, max_len: int, batch: int = 16, temperature: float = 0.0,
                       min_reply: int = 16, rng: np.random.Generator | None = None, progress=None) -> list:
    """The teacher's reply to each user prompt, generated ``batch`` sequences at a time.

    Args:
        runner: a TargetRunner whose pool holds ``batch`` sequences of ``max_len`` tokens (see
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
    rng = rng or np.random.default_rng(0)
    eos = set(int(e) for e in tok.eos_token_ids)
    out: list = [None] * len(prompts)
    queue = []
    for i, text in enumerate(prompts):
        ids = tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        if len(ids) + min_reply <= max_len:
            queue.append((i, ids))
    queue.reverse()
    active: list[dict] = []       # {"i", "sid", "budget", "out", "freed", "next"}
    done, new_tokens = len(prompts) - len(queue), 0

    def finish(a):
        nonlocal done
        runner.free(a["sid"])
        a["freed"] = True
        out[a["i"]] = tok.decode(a["out"], skip_special_tokens=True)
        done += 1
        if progress is not None:
            progress(done, len(prompts), new_tokens)

    try:
        while queue or active:
            while queue and len(active) < batch:
                i, ids = queue.pop()
                a = {"i": i, "sid": runner.new_seq(), "budget": max_len - len(ids), "out": [], "freed": False}
                active.append(a)            # before prefill: an error there still frees its blocks
                logits, _ = runner.prefill(a["sid"], ids)
                a["next"] = _pick(logits, temperature, rng)
            live = []
            for a in active:
                if a["next"] in eos or len(a["out"]) >= a["budget"]:
                    finish(a)
                    continue
                a["out"].append(a["next"])
                new_tokens += 1
                if len(a["out"]) >= a["budget"]:
                    finish(a)
                else:
                    live.append(a)
            active = live
            if not active:
                continue
            logits = runner.decode_batch([a["sid"] for a in active], [a["next"] for a in active], rows=batch)
            for a, row in zip(active, logits):
                a["next"] = _pick(row, temperature, rng)
    finally:                            # on an error mid-pass, free each row exactly once
        for a in active:
            if not a["freed"]:
                runner.free(a["sid"])
    if progress is not None:
        progress(done, len(prompts), new_tokens)
    return out


def build_batch_runner(cfg, tensors: dict, max_len: int, batch: int, mode: str = "fused", block_size: int = 16):
    """A TargetRunner whose KV pool holds ``batch`` sequences of ``max_len`` tokens (plus one spare each).

    Args:
        cfg: teacher ModelConfig; tensors: HF-named float32 weights. Returns (runner, teacher).
    """
    from ..models.pangu import PanguTeacher
    from ..target import TargetRunner

    S = max(16, -(-max_len // block_size) * block_size)
    chunk = 16
    while chunk < max_len:
        chunk *= 2
    blocks = batch * (S // block_size + 1) + 2
    teacher = PanguTeacher(cfg, blocks, block_size, max(S, chunk) + 1)
    teacher.load_hf_weights(tensors)
    return TargetRunner(teacher, blocks, block_size, S, mode, prefill_chunk=chunk), teacher


__all__ = ["regenerate_replies", "build_batch_runner"]
