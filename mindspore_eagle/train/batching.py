"""Host-side batch layout for TTT training: per-sample shifted arrays, rows of B x T, packing, sample stream.

Legend: B = rows per optimiser step, T = row length (tokens), S = ttt_length, n = tokens of one sample
(<= max_len), Ht = teacher hidden (aux is 3Ht wide), H = drafter hidden.

A step's batch is B rows of T positions. A row holds one sample (``--batch-size B``: B samples per step,
each right-padded to T = max_len) or, when packed (``--pack``), several whole samples placed one after the
other (segments), each with its own RoPE positions 0..n-1 and a block-diagonal causal attention mask (the
Cell builds it from ``seg``). Nothing crosses a segment boundary:

* ids / targets / loss mask are shifted **inside each sample** (:func:`sample_arrays`, the alignment of
  docs/design.md, "Drafter training"): position t of step s uses token x[t+s+1], teacher row t+s+1 and mask m[t+s+2] of
  the same sample; past the sample's end the token is 0 and the mask is 0, so the last s+2 positions of a segment never
  carry loss at step s (they would otherwise see the next segment's tokens);
* the teacher rows t+s+1 of a masked position may belong to the next segment; those positions have mask 0, so
  their (finite) cross-entropy is multiplied by 0;
* attention: a query sees only keys of its own segment (``seg`` equal) at or before it; the padding tail is a
  segment of its own (seg 0), so every query sees at least itself and the softmax stays finite.

Loss normalisation (``n_samples``): a sample's loss is ``L_s = -sum_t pos_mask * sum_v p log q / max_len``
whatever row it sits in; the batch loss is the mean over the step's samples, so one batched step equals the
mean of per-sample steps (tests/train/test_batching.py checks the gradients).

Sample stream: element k of the training stream is sample ``permutation(seed, epoch)[i]`` with
``(epoch, i) = divmod(k, n_train)`` (:func:`stream_sample`); a step consumes the next samples of the stream
(exactly B unpacked, a variable number when packed, :func:`plan_rows`), so a resumed run needs the stream
cursor, which the trainer stores.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass
class Batch:
    """One fixed-shape training batch (numpy), built by :func:`assemble` / :func:`make_batch`.

    Fields:
        aux float32 [B, T, 3Ht]; ids int32 [S, B, T]; hid float32 [B, T + S, H] (teacher final-normed hidden,
        zero rows after the last segment); tgt int32 [S, B, T] teacher argmax ids; pos_mask float32 [S, B, T]
        (loss weights: loss mask times "teacher argmax in the draft vocab"); loss_mask float32 [S, B, T]
        (accuracy denominators); seg int32 [B, T] segment id (1.. for samples, 0 for padding); pos int32
        [B, T] RoPE position of step 0 (position inside the sample); n_samples int (samples in the batch);
        n_valid int (real tokens in the batch).
    """
    aux: np.ndarray
    ids: np.ndarray
    hid: np.ndarray
    tgt: np.ndarray
    pos_mask: np.ndarray
    loss_mask: np.ndarray
    seg: np.ndarray
    pos: np.ndarray
    n_samples: int
    n_valid: int

    def tensors(self) -> tuple:
        """Inputs of ``TTTDrafter.construct`` in order (n_samples as a float32 scalar tensor)."""
        from mindspore import Tensor

        return (Tensor(self.aux), Tensor(self.ids), Tensor(self.hid), Tensor(self.tgt), Tensor(self.pos_mask),
                Tensor(self.seg), Tensor(self.pos), Tensor(np.float32(self.n_samples)))


def sample_arrays(input_ids, loss_mask, aux, hidden, argmax, t2d: np.ndarray, max_len: int, S: int) -> dict:
    """The TTT-shifted arrays of one sample, unpadded (docs/design.md, "Drafter training", Alignment).

    Args:
        input_ids int [n0], loss_mask {0,1} [n0] (1 on assistant tokens), aux [n0, 3Ht], hidden [n0, H] (any
        float dtype; teacher final-normed), argmax int [n0] (teacher argmax over the full V), t2d bool [V];
        max_len: truncation (n = min(n0, max_len)); S: ttt_length.
    Returns:
        dict n, aux f32 [n, 3Ht], hid f32 [n, H], ids i32 [S, n] (x[t+s+1], 0 past the end), tgt i32 [S, n]
        (argmax[t+s+1]), lm f32 [S, n] (m[t+s+2], 0 past the end), pm f32 [S, n] (lm * t2d[tgt]).
    """
    n = min(len(input_ids), max_len)
    if n < 1:
        raise ValueError("sample_arrays: a sample needs at least 1 token")
    pad = n + S + 2
    x = np.zeros(pad, np.int64)
    x[:n] = np.asarray(input_ids[:n])
    m = np.zeros(pad, np.float32)
    m[:n] = np.asarray(loss_mask[:n], np.float32)
    g = np.zeros(pad, np.int64)
    g[:n] = np.asarray(argmax[:n])
    t = np.arange(n)
    ids = np.stack([x[t + s + 1] for s in range(S)]).astype(np.int32)
    tgt = np.stack([g[t + s + 1] for s in range(S)]).astype(np.int32)
    lm = np.stack([m[t + s + 2] for s in range(S)])
    return {"n": n, "aux": np.asarray(aux[:n], np.float32), "hid": np.asarray(hidden[:n], np.float32),
            "ids": ids, "tgt": tgt, "lm": lm, "pm": lm * t2d[tgt].astype(np.float32)}


def assemble(rows: list, T: int, S: int) -> Batch:
    """Place samples (dicts from :func:`sample_arrays`) into a batch of ``len(rows)`` rows of T positions.

    Args:
        rows: B lists of samples; the samples of one row are laid out one after the other from position 0.
        T: row length; S: ttt_length (must match the samples' arrays).
    Returns:
        Batch with seg = 1, 2, ... per segment of a row (0 on the padding tail), pos = 0..n-1 per segment.
    Raises:
        ValueError: a row holds more than T tokens, a row is empty, or no rows.
    """
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("assemble: every row needs at least one sample")
    B = len(rows)
    first = rows[0][0]
    A, H = first["aux"].shape[1], first["hid"].shape[1]
    aux = np.zeros((B, T, A), np.float32)
    hid = np.zeros((B, T + S, H), np.float32)
    ids, tgt = np.zeros((S, B, T), np.int32), np.zeros((S, B, T), np.int32)
    pm, lm = np.zeros((S, B, T), np.float32), np.zeros((S, B, T), np.float32)
    seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    n_samples = n_valid = 0
    for b, row in enumerate(rows):
        off = 0
        for j, d in enumerate(row):
            n = d["n"]
            if off + n > T:
                raise ValueError(f"assemble: row {b} holds {off + n} tokens > T = {T}")
            sl = slice(off, off + n)
            aux[b, sl], hid[b, sl] = d["aux"], d["hid"]
            ids[:, b, sl], tgt[:, b, sl], pm[:, b, sl], lm[:, b, sl] = d["ids"], d["tgt"], d["pm"], d["lm"]
            seg[b, sl], pos[b, sl] = j + 1, np.arange(n)
            off += n
        pos[b, off:] = np.arange(T - off)          # padding tail: its own causal segment (seg 0)
        n_samples += len(row)
        n_valid += off
    return Batch(aux, ids, hid, tgt, pm, lm, seg, pos, n_samples, n_valid)


def make_batch(input_ids, loss_mask, aux, hidden, argmax, t2d: np.ndarray, T: int, S: int) -> Batch:
    """One sample, truncated to T, in a batch of one row right-padded to T (see :func:`sample_arrays`)."""
    return assemble([[sample_arrays(input_ids, loss_mask, aux, hidden, argmax, t2d, T, S)]], T, S)


def plan_rows(lengths: list, T: int, B: int, pack: bool) -> list:
    """Which of the next samples of the stream go into which row of the next step.

    Args:
        lengths: token counts (already truncated to <= T) of the next samples of the stream, in stream order
        (at least B of them; fewer only at the very end is an error). T: row length; B: rows per step;
        pack: False = one sample per row (takes exactly B samples); True = first-fit: each sample in stream
        order goes into the first row with room; the step ends at the first sample that fits no row (it
        starts the next step), or when ``lengths`` runs out.
    Returns:
        B lists of stream offsets (0-based into ``lengths``); together they are 0..c-1 for some c >= B.
    Raises:
        ValueError: fewer than B lengths, or a length outside 1..T.
    """
    if len(lengths) < B:
        raise ValueError(f"plan_rows: need at least B = {B} samples, have {len(lengths)}")
    if any(not 1 <= n <= T for n in lengths):
        raise ValueError(f"plan_rows: sample lengths must be in 1..{T}")
    if not pack:
        return [[b] for b in range(B)]
    rows, room = [[] for _ in range(B)], [T] * B
    for k, n in enumerate(lengths):
        b = next((b for b in range(B) if room[b] >= n), None)
        if b is None:
            break
        rows[b].append(k)
        room[b] -= n
    assert sorted(i for r in rows for i in r) == list(range(sum(len(r) for r in rows)))
    return rows


@lru_cache(maxsize=4)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def stream_sample(k: int, n: int, seed: int) -> int:
    """Sample index of element ``k`` of the training stream: permutation(seed, epoch) of range(n) at k % n."""
    epoch, i = divmod(k, n)
    return int(_epoch_permutation(n, seed, epoch)[i])
