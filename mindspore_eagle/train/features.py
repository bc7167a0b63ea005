"""Offline teacher features for drafter training, in resumable numbered shards (SF ``prepare_hidden_states``).

Legend: n = tokens of one sample (<= max_len), H = teacher hidden, V = teacher vocab.

For each sample the teacher runs once (``TeacherRunner.prefill(sid, ids, hidden=True)``, the sequence freed
afterwards) and the shard stores, concatenated over its samples (docs/design.md, "Drafter training", Stored per sample):

    input_ids int32 [N]      loss_mask uint8 [N]     offsets int64 [n_samples + 1]
    aux float16 [N, 3H]      captured residual streams entering the aux layers (docs/design.md, "Captured features")
    hidden float16 [N, H]    final-normed hidden states; teacher logits are recomputed at train time from them
                             with the frozen teacher head (SF TargetHead)
    argmax int32 [N]         teacher argmax over the full V at each row (computed here in float32, so the
                             train-time "teacher argmax in the draft vocab" test is exact)

``<out>/manifest.json`` lists finished shards ``{"file", "first", "n", "tokens"}`` plus ``meta``; a shard file is
written to a temporary name and renamed, then the manifest is rewritten, so a killed run restarts at the next
unfinished shard (``extract_features`` skips listed shards). The samples themselves live in ``<out>/samples.npz``
(data.save_samples), written once, so a resumed run sees the same samples.

A directory written by regeneration (``regen --features-dir``, :class:`RegenFeatureWriter`) has the same shard
columns, no ``samples.npz``, ``meta["source"] == "regen"`` and one ``regen_shard`` (the reply shard's file name)
per entry; its features come from the decode calls that wrote the replies, and each sample's last row is zeros
(never fed). The two kinds never share a directory (each writer refuses the other's). Shards and manifests are
fsynced before the rename.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

MANIFEST = "manifest.json"
SAMPLES = "samples.npz"
COLUMNS = ("input_ids", "loss_mask", "aux", "hidden", "argmax")


def build_runner(cfg, tensors: dict, max_len: int, mode: str = "fused", block_size: int = 16):
    """A TeacherRunner over a freshly built teacher Cell for sequences of up to ``max_len`` tokens.

    Args:
        cfg: teacher ModelConfig; tensors: HF-named float32 weights (``load_teacher``); mode: "fused" | "eager".
    Returns:
        (runner, teacher) with prefill chunk = smallest power of two >= max_len (one call per sample).
    """
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    S = -(-max_len // block_size) * block_size
    chunk = 16
    while chunk < max_len:
        chunk *= 2
    S = max(S, 16)
    blocks = S // block_size + 2
    teacher = LlamaModel(cfg, blocks, block_size, max(S, chunk) + 1)
    teacher.load_hf_weights(tensors)
    return TeacherRunner(teacher, blocks, block_size, S, mode, prefill_chunk=chunk), teacher


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
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, MANIFEST))


def extract_features(runner, head: np.ndarray, samples: list, out_dir: str, shard_size: int = 64,
                     meta: dict | None = None, progress=None, greedy_replies: bool = False) -> dict:
    """Run the teacher over ``samples`` and write the missing shards.

    Args:
        runner: TeacherRunner (its max_seq_len must hold the longest sample); head: teacher lm_head [V, H] f32.
        samples: list of (ids int [n], mask uint8 [n]); out_dir: created if missing.
        shard_size: samples per shard; meta: stored in the manifest (teacher path, max_len, ...).
        progress: optional callable(samples_done, tokens_done, seconds) after each sample.
        greedy_replies: every sample's loss-masked tokens are this teacher's greedy replies (a regeneration at
        temperature 0): the argmax before each of them is that token (``sample_columns``' next_from), without the
        [V, H] product.
    Returns:
        the final manifest.
    Raises:
        ValueError: the directory holds shards made with a different shard_size.
    """
    os.makedirs(out_dir, exist_ok=True)
    manifest = read_manifest(out_dir)
    if manifest["meta"].get("source") == "regen":
        raise ValueError(f"{out_dir} holds features written by regeneration (regen --features-dir); "
                         "use another --features-dir")
    if manifest["shards"] and manifest["meta"].get("shard_size") not in (None, shard_size):
        raise ValueError(f"{out_dir} was written with shard_size {manifest['meta']['shard_size']}, not {shard_size}")
    manifest["meta"] = {**manifest["meta"], **(meta or {}), "shard_size": shard_size}
    done = {s["first"] for s in manifest["shards"]}
    t0, n_done, tok_done = time.time(), 0, 0
    for first in range(0, len(samples), shard_size):
        if first in done:
            continue
        part = []
        for ids, mask in samples[first:first + shard_size]:
            sid = runner.new_seq()
            try:
                hid, aux = runner.prefill(sid, ids, hidden=True)
            finally:
                runner.free(sid)
            first_loss = int(np.argmax(np.asarray(mask) != 0)) if np.any(mask) else len(hid)
            nxt = min(max(first_loss - 1, 0), len(hid)) if greedy_replies else None
            part.append(sample_columns(ids, mask, hid, aux, head, next_from=nxt))
            n_done += 1
            tok_done += len(ids)
            if progress is not None:
                progress(n_done, tok_done, time.time() - t0)
        write_shard(out_dir, manifest, f"shard_{first // shard_size:05d}.npz", first, part)
    return manifest


def sample_columns(ids, mask, hidden: np.ndarray, aux: np.ndarray, head: np.ndarray,
                   next_from: int | None = None) -> dict:
    """The stored columns of one sample (module docstring), from the teacher's outputs at its positions.

    Args:
        ids int [n], mask {0,1} [n]; hidden float [f, H] final-normed and aux float [f, 3H] for positions 0..f-1,
        f = n or n - 1 (regeneration never feeds a sample's last token; its row is stored as zeros: the last
        position of a sample carries no loss and feeds no prediction, batching.sample_arrays); head: lm_head
        float32 [V, H]. next_from: greedy regeneration only: from this position on, token t + 1 of ``ids`` is
        the teacher's own greedy pick at t (the argmax of the very logits that chose it), so it is stored as the
        argmax without the [V, H] head product (which costs about a tenth of regeneration on the 2-core CPU).
    Returns:
        dict input_ids int32 [n], loss_mask uint8 [n], aux f16 [n, 3H], hidden f16 [n, H], argmax int32 [n]
        (teacher argmax over V from ``hidden`` in float32 before ``next_from``, at the positions t whose token
        t + 1 carries loss, the only ones training and its metrics read (batching.sample_arrays, the trainer's
        vocabulary counts): the [V, H] product costs ~0.3 GFLOP a row at a 152k vocabulary; 0 elsewhere and on a
        zero row).
    Raises:
        ValueError: f is not n or n - 1, hidden and aux disagree, or next_from is outside 0..f.
    """
    n, f = len(ids), len(hidden)
    if f not in (n, n - 1) or len(aux) != f:
        raise ValueError(f"sample_columns: {n} tokens need features of n or n - 1 positions, got {f} / {len(aux)}")
    c = f if next_from is None else next_from
    if not 0 <= c <= f:
        raise ValueError(f"sample_columns: next_from must be in [0, {f}], got {next_from}")
    ids = np.asarray(ids, np.int32)
    arg = np.zeros(n, np.int32)
    rows = np.flatnonzero(np.asarray(mask[1:c + 1]) != 0)             # t < c whose next token carries loss
    if len(rows):
        arg[rows] = np.argmax(np.asarray(hidden[rows], np.float32) @ head.T, -1)
    e = min(f, n - 1)                                                   # the last token predicts nothing
    arg[c:e] = ids[c + 1:e + 1]
    hid = np.zeros((n, hidden.shape[1]), np.float16)
    ax = np.zeros((n, aux.shape[1]), np.float16)
    hid[:f], ax[:f] = hidden, aux
    return {"input_ids": ids, "loss_mask": np.asarray(mask, np.uint8), "aux": ax, "hidden": hid, "argmax": arg}


def write_shard(out_dir: str, manifest: dict, name: str, first: int, part: list, **entry) -> dict:
    """Write the samples ``part`` (dicts from :func:`sample_columns`) as shard ``name`` (temporary file, then
    renamed), list it in ``manifest`` (with ``entry``'s extra keys) and rewrite the manifest; returns the entry."""
    cols = {k: [d[k] for d in part] for k in COLUMNS}
    offsets = np.zeros(len(part) + 1, np.int64)
    offsets[1:] = np.cumsum([len(a) for a in cols["input_ids"]])
    tmp = os.path.join(out_dir, name + ".tmp.npz")
    with open(tmp, "wb") as f:
        np.savez(f, offsets=offsets, **{k: np.concatenate(v) for k, v in cols.items()})
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, name))
    e = {"file": name, "first": first, "n": len(part), "tokens": int(offsets[-1]), **entry}
    manifest["shards"].append(e)
    manifest["shards"].sort(key=lambda s: s["first"])
    _write_manifest(out_dir, manifest)
    return e


class RegenFeatureWriter:
    """Feature shards written by regeneration as it decodes (``regen --features-dir``), one per reply shard.

    Feature shard ``shard_NNNNN.npz`` holds the training samples (``shards.keep_sample``) of reply shard
    ``shard_NNNNN.jsonl.gz``, in its record order, and is written **before** it; so after a kill a feature shard
    whose reply shard never landed is an orphan (its prompts are answered again) and is dropped when the
    directory is opened. The directory is a features directory like any other (:class:`FeatureSet`).

    Args:
        out_dir: created if missing. regen_files: file names of the reply shards listed in the regeneration
            manifest. meta: settings; ``teacher``, ``max_len`` and ``aux_layers`` must equal the directory's.
    Raises:
        ValueError: ``meta`` disagrees with the directory's (names the key and both values).
    """

    KEYS = ("teacher", "max_len", "aux_layers", "regen_dir")

    def __init__(self, out_dir: str, regen_files: set, meta: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.dir, man = out_dir, read_manifest(out_dir)
        if man["shards"] and man["meta"].get("source") != "regen":
            raise ValueError(f"--features-dir {out_dir} holds features of a separate feature pass, not of "
                             "regeneration; use another directory")
        for k in self.KEYS:
            if man["shards"] and k in man["meta"] and k in meta and man["meta"][k] != meta[k]:
                raise ValueError(f"--features-dir {out_dir} holds features made with {k} = {man['meta'][k]!r}, "
                                 f"not {meta[k]!r}; use another directory")
        man["meta"] = {**man["meta"], **meta, "source": "regen"}
        drop = [e for e in man["shards"] if e.get("regen_shard") not in regen_files]
        man["shards"] = [e for e in man["shards"] if e not in drop]
        self.manifest = man
        _write_manifest(out_dir, man)                 # first: a kill below leaves unlisted files, never missing ones
        for e in drop:
            if os.path.exists(os.path.join(out_dir, e["file"])):
                os.remove(os.path.join(out_dir, e["file"]))

    def write(self, regen_shard: str, part: list) -> dict | None:
        """Write the samples of reply shard ``regen_shard`` (dicts from :func:`sample_columns`); None if empty."""
        if not part:
            return None
        first = sum(e["n"] for e in self.manifest["shards"])
        from mindspore_eagle.train.shards import shard_stem
        name = shard_stem(regen_shard) + ".npz"
        return write_shard(self.dir, self.manifest, name, first, part, regen_shard=regen_shard)


def load_shard(path: str, mmap: bool = True) -> dict:
    """The columns of one feature shard (an ``np.savez`` file), memory-mapped where the shard allows it.

    ``np.load`` cannot memory-map the members of an ``.npz``; but ``np.savez`` stores them uncompressed
    (ZIP_STORED), so each member's ``.npy`` payload lies contiguous in the file: this maps it read-only at its
    offset (zip local header: 30 bytes + name + extra field, APPNOTE.TXT 4.3.7; then the ``.npy`` header,
    numpy.lib.format). Pages are read on first touch and stay in the OS page cache, which the kernel can reclaim,
    so a feature set larger than memory still trains (at disk speed where it does not fit).

    Args:
        path: the shard file.
        mmap: False loads every column into memory (the behaviour before memory mapping).
    Returns:
        dict column name -> numpy array (``np.memmap`` for stored members; compressed members are read into
        memory, as ``np.load`` would).
    Raises:
        ValueError: a member that is not a ``.npy`` array, or an object array.
    """
    import zipfile

    from numpy.lib import format as npy

    if not mmap:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else None
            if name is None:
                raise ValueError(f"{path}: member {info.filename!r} is not a .npy array")
            if info.compress_type != zipfile.ZIP_STORED:
                with zf.open(info) as m:
                    out[name] = npy.read_array(m, allow_pickle=False)
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + \
                int.from_bytes(local[28:30], "little")
            f.seek(start)
            version = npy.read_magic(f)
            shape, fortran, dtype = (npy.read_array_header_1_0(f) if version == (1, 0)
                                     else npy.read_array_header_2_0(f))
            if dtype.hasobject:
                raise ValueError(f"{path}: member {name!r} is an object array")
            out[name] = (np.memmap(path, dtype=dtype, mode="r", offset=f.tell(), shape=shape,
                                   order="F" if fortran else "C")
                         if int(np.prod(shape)) > 0 else np.empty(shape, dtype))
    return out


class FeatureSet:
    """Random access to the samples of one or more features directories (shards memory-mapped, ``load_shard``).

    ``len(fs)``; ``fs[i]`` -> dict(input_ids int32 [n], loss_mask uint8 [n], aux f16 [n, 3H], hidden f16 [n, H],
    argmax int32 [n]). ``fs.meta`` is the first directory's manifest meta.

    Args:
        out_dir: a directory, a comma-separated list of them, or a list; samples are numbered directory by
            directory in the given order (so the trainer's held-out samples, the last ones, come from the last
            directory: keep a fixed directory last to keep the held-out set fixed as data grows).
        mmap: map the shards (default; resident memory stays small, the page cache holds what is read) or, with
            False, load them into memory (~4.6 KB per token at H 576).
    Raises:
        FileNotFoundError: a directory without a manifest or finished shard.
        ValueError: directories made with different ``aux_layers`` or ``max_len``.
    """

    def __init__(self, out_dir, mmap: bool = True):
        if isinstance(out_dir, os.PathLike):
            out_dir = os.fspath(out_dir)
        dirs = [os.fspath(d) for d in (out_dir.split(",") if isinstance(out_dir, str) else out_dir) if d]
        self.dirs, self.counts = dirs, []
        self._shards, self._index, self.meta = [], [], None
        for d in dirs:
            manifest = read_manifest(d)
            if not manifest["shards"]:
                raise FileNotFoundError(f"{d}: no finished feature shards (run feature extraction first)")
            if self.meta is None:
                self.meta = manifest["meta"]
            for key in ("aux_layers", "max_len"):          # where both directories record it
                if None not in (manifest["meta"].get(key), self.meta.get(key)) and \
                        manifest["meta"][key] != self.meta[key]:
                    raise ValueError(f"features directories disagree on {key}: {dirs[0]} has "
                                     f"{self.meta.get(key)!r}, {d} has {manifest['meta'].get(key)!r}")
            n0 = len(self._index)
            for s in manifest["shards"]:
                data = load_shard(os.path.join(d, s["file"]), mmap)
                k = len(self._shards)
                self._shards.append(data)
                self._index += [(k, j) for j in range(len(data["offsets"]) - 1)]
            self.counts.append(len(self._index) - n0)
        if self.meta is None:
            raise FileNotFoundError(f"no features directory given ({out_dir!r})")

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict:
        k, j = self._index[i]
        d = self._shards[k]
        a, b = d["offsets"][j], d["offsets"][j + 1]
        return {name: d[name][a:b] for name in COLUMNS}

    @property
    def tokens(self) -> int:
        return int(sum(d["offsets"][-1] for d in self._shards))
