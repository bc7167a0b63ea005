"""Offline teacher features for drafter training, in resumable numbered shards (SF ``prepare_hidden_states``).

Legend: n = tokens of one sample (<= max_len), H = teacher hidden, V = teacher vocab.

For each sample the teacher runs once (``TargetRunner.prefill(sid, ids, hidden=True)``, the sequence freed
afterwards) and the shard stores, concatenated over its samples (eagle3.md §4 "Stored or computed per sample"):

    input_ids int32 [N]      loss_mask uint8 [N]     offsets int64 [n_samples + 1]
    aux float16 [N, 3H]      captured residual streams entering the aux layers (eagle3.md §1)
    hidden float16 [N, H]    final-normed hidden states; teacher logits are recomputed at train time from them
                             with the frozen teacher head (SF TargetHead)
    argmax int32 [N]         teacher argmax over the full V at each row (computed here in float32, so the
                             train-time "teacher argmax in the draft vocab" test is exact)

``<out>/manifest.json`` lists finished shards ``{"file", "first", "n", "tokens"}`` plus ``meta``; a shard file is
written to a temporary name and renamed, then the manifest is rewritten, so a killed run restarts at the next
unfinished shard (``extract_features`` skips listed shards). The samples themselves live in ``<out>/samples.npz``
(data.save_samples), written once, so a resumed run sees the same samples.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

MANIFEST = "manifest.json"
SAMPLES = "samples.npz"


def build_runner(cfg, tensors: dict, max_len: int, mode: str = "fused", block_size: int = 16):
    """A TargetRunner over a freshly built teacher Cell for sequences of up to ``max_len`` tokens.

    Args:
        cfg: teacher ModelConfig; tensors: HF-named float32 weights (``load_teacher``); mode: "fused" | "eager".
    Returns:
        (runner, teacher) with prefill chunk = smallest power of two >= max_len (one call per sample).
    """
    from ..models.pangu import PanguTeacher
    from ..target import TargetRunner

    S = -(-max_len // block_size) * block_size
    chunk = 16
    while chunk < max_len:
        chunk *= 2
    S = max(S, 16)
    blocks = S // block_size + 2
    teacher = PanguTeacher(cfg, blocks, block_size, max(S, chunk) + 1)
    teacher.load_hf_weights(tensors)
    return TargetRunner(teacher, blocks, block_size, S, mode, prefill_chunk=chunk), teacher


def head_weight(cfg, tensors: dict) -> np.ndarray:
    """Teacher lm_head float32 [V, H] (the embedding when tied)."""
    name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return np.asarray(tensors[name], np.float32)


def read_manifest(out_dir: str) -> dict:
    """The manifest dict ({"shards": [...], "meta": {...}}); an empty one if the directory has none."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return {"shards": [], "meta": {}}
    with open(path) as f:
        return json.load(f)


def _write_manifest(out_dir: str, manifest: dict) -> None:
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))


def extract_features(runner, head: np.ndarray, samples: list, out_dir: str, shard_size: int = 64,
                     meta: dict | None = None, progress=None) -> dict:
    """Run the teacher over ``samples`` and write the missing shards.

    Args:
        runner: TargetRunner (its max_seq_len must hold the longest sample); head: teacher lm_head [V, H] f32.
        samples: list of (ids int [n], mask uint8 [n]); out_dir: created if missing.
        shard_size: samples per shard; meta: stored in the manifest (teacher path, max_len, ...).
        progress: optional callable(samples_done, tokens_done, seconds) after each sample.
    Returns:
        the final manifest.
    Raises:
        ValueError: the directory holds shards made with a different shard_size.
    """
    os.makedirs(out_dir, exist_ok=True)
    manifest = read_manifest(out_dir)
    if manifest["shards"] and manifest["meta"].get("shard_size") not in (None, shard_size):
        raise ValueError(f"{out_dir} was written with shard_size {manifest['meta']['shard_size']}, not {shard_size}")
    manifest["meta"] = {**manifest["meta"], **(meta or {}), "shard_size": shard_size}
    done = {s["first"] for s in manifest["shards"]}
    t0, n_done, tok_done = time.time(), 0, 0
    for first in range(0, len(samples), shard_size):
        if first in done:
            continue
        part = samples[first:first + shard_size]
        cols = {k: [] for k in ("input_ids", "loss_mask", "aux", "hidden", "argmax")}
        for ids, mask in part:
            sid = runner.new_seq()
            try:
                hid, aux = runner.prefill(sid, ids, hidden=True)
            finally:
                runner.free(sid)
            cols["input_ids"].append(np.asarray(ids, np.int32))
            cols["loss_mask"].append(np.asarray(mask, np.uint8))
            cols["aux"].append(aux.astype(np.float16))
            cols["hidden"].append(hid.astype(np.float16))
            cols["argmax"].append(np.argmax(hid @ head.T, -1).astype(np.int32))
            n_done += 1
            tok_done += len(ids)
            if progress is not None:
                progress(n_done, tok_done, time.time() - t0)
        offsets = np.zeros(len(part) + 1, np.int64)
        offsets[1:] = np.cumsum([len(a) for a in cols["input_ids"]])
        name = f"shard_{first // shard_size:05d}.npz"
        tmp = os.path.join(out_dir, name + ".tmp.npz")
        np.savez(tmp, offsets=offsets, **{k: np.concatenate(v) for k, v in cols.items()})
        os.replace(tmp, os.path.join(out_dir, name))
        manifest["shards"].append({"file": name, "first": first, "n": len(part), "tokens": int(offsets[-1])})
        manifest["shards"].sort(key=lambda s: s["first"])
        _write_manifest(out_dir, manifest)
    return manifest


class FeatureSet:
    """Random access to the samples of a features directory (all shards loaded into memory).

    ``len(fs)``; ``fs[i]`` -> dict(input_ids int32 [n], loss_mask uint8 [n], aux f16 [n, 3H], hidden f16 [n, H],
    argmax int32 [n]). ``fs.meta`` is the manifest meta.
    Raises:
        FileNotFoundError: no manifest or no shard in ``out_dir``.
    """

    def __init__(self, out_dir: str):
        manifest = read_manifest(out_dir)
        if not manifest["shards"]:
            raise FileNotFoundError(f"{out_dir}: no finished feature shards (run feature extraction first)")
        self.meta = manifest["meta"]
        self._shards, self._index = [], []
        for s in manifest["shards"]:
            z = np.load(os.path.join(out_dir, s["file"]))
            data = {k: z[k] for k in z.files}
            k = len(self._shards)
            self._shards.append(data)
            self._index += [(k, j) for j in range(len(data["offsets"]) - 1)]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict:
        k, j = self._index[i]
        d = self._shards[k]
        a, b = d["offsets"][j], d["offsets"][j + 1]
        return {name: d[name][a:b] for name in ("input_ids", "loss_mask", "aux", "hidden", "argmax")}

    @property
    def tokens(self) -> int:
        return int(sum(d["offsets"][-1] for d in self._shards))
