"""Resumable regeneration shards: the teacher's replies to registry prompts (``train.prompts``), in gzip JSONL files.

Layout of a shard directory::

    manifest.json           {"meta": {...}, "shards": [{"file", "n", "new_tokens", "prompt_ids": [...]}]}
    shard_00000.jsonl.gz    one record a line (below), in the order the replies finished
    shard_00001.jsonl.gz    ...

Shards are gzip-compressed (level 9, no timestamp, so the same records give the same bytes): token ids as JSON
compress to about 1 byte a token, so a whole registry's replies are a few MB and can be committed to the
repository (``data/regen/``), where a change of machine cannot lose them. Plain ``.jsonl`` shards of older
directories are read as well.

Record fields: ``prompt_id`` (registry id, "<source>/<index>"), ``source``, ``kind``, ``prompt_ids`` (int list, the
chat-templated user turn with the generation prompt, what the teacher was fed), ``reply_ids`` (int list, the
generated tokens, the end token not included), ``stop`` ("eos": the teacher emitted an end token, stored as
``end_id``; "length": prompt + reply reached max_len; "prompt_too_long": the prompt left fewer than ``min_reply``
tokens and was not run), ``end_id`` (int or null).

Durability: a shard is written to a temporary name and renamed (atomic), then the manifest is rewritten the same
way, so a SIGKILL loses at most the replies not yet flushed. A shard file the manifest does not list (killed
between the two renames) is adopted when the directory is opened. Finished prompt ids are never run again, so a
later run over a longer registry only adds shards (append-only).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import re

import numpy as np

MANIFEST = "manifest.json"
STOPS = ("eos", "length", "prompt_too_long")
META_KEYS = ("teacher", "max_len", "temperature", "min_reply")     # must match to extend a directory
SUFFIX = ".jsonl.gz"
_SHARD = re.compile(r"^shard_(\d{5})\.jsonl(\.gz)?$")


def _atomic_write(path: str, text: str) -> None:
    """Write ``text`` (UTF-8; gzip level 9 with mtime 0 when ``path`` ends in .gz) to a temporary file, fsync, rename."""
    data = text.encode("utf-8")
    if path.endswith(".gz"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as g:
            g.write(data)
        data = buf.getvalue()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: str) -> list:
    """The records of one shard file (list of dicts); ``.jsonl.gz`` or plain ``.jsonl``."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def shard_stem(name: str) -> str:
    """``shard_NNNNN`` of a reply shard's file name (``.jsonl`` or ``.jsonl.gz``).

    Raises:
        ValueError: not a shard file name.
    """
    m = _SHARD.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a reply shard name (shard_NNNNN.jsonl[.gz])")
    return f"shard_{m.group(1)}"


def _entry(file: str, records: list) -> dict:
    return {"file": file, "n": len(records), "new_tokens": int(sum(len(r["reply_ids"]) for r in records)),
            "prompt_ids": [r["prompt_id"] for r in records]}


class ShardStore:
    """One shard directory, opened for appending.

    Args:
        out_dir: created if missing. meta: the run's settings; the :data:`META_KEYS` among them must equal those
            of an existing directory.
    Raises:
        ValueError: ``meta`` disagrees with the directory's (names the key and both values).
    """

    def __init__(self, out_dir: str, meta: dict):
        self.dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, MANIFEST)
        man = {"meta": {}, "shards": []}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                man = json.load(f)
        for k in META_KEYS:
            if man["shards"] and k in man["meta"] and k in meta and man["meta"][k] != meta[k]:
                raise ValueError(f"{out_dir} holds replies made with {k} = {man['meta'][k]!r}, not {meta[k]!r}; "
                                 "use another --out")
        man["meta"] = {**man["meta"], **meta}
        listed = {s["file"] for s in man["shards"]}
        for name in sorted(os.listdir(out_dir)):           # adopt shards renamed before a kill hit the manifest
            if _SHARD.match(name) and name not in listed:
                man["shards"].append(_entry(name, read_shard(os.path.join(out_dir, name))))
        man["shards"].sort(key=lambda s: s["file"])
        self.manifest = man
        self._write_manifest()

    def _write_manifest(self) -> None:
        _atomic_write(os.path.join(self.dir, MANIFEST), json.dumps(self.manifest, indent=1))

    def done_ids(self) -> set:
        """Prompt ids with a record in a finished shard."""
        return {i for s in self.manifest["shards"] for i in s["prompt_ids"]}

    def next_index(self) -> int:
        nums = [int(_SHARD.match(s["file"]).group(1)) for s in self.manifest["shards"]]
        return max(nums) + 1 if nums else 0

    def next_name(self) -> str:
        """File name the next :meth:`write` will use."""
        return f"shard_{self.next_index():05d}{SUFFIX}"

    def write(self, records: list) -> dict:
        """Write ``records`` as the next shard (atomically) and list it in the manifest; returns its entry.

        Raises:
            ValueError: a record lacks a field, has an unknown stop, or repeats a finished prompt id.
        """
        done = self.done_ids()
        for r in records:
            missing = {"prompt_id", "source", "kind", "prompt_ids", "reply_ids", "stop", "end_id"} - set(r)
            if missing or r["stop"] not in STOPS or r["prompt_id"] in done:
                raise ValueError(f"bad shard record {r.get('prompt_id')}: missing {sorted(missing)}, "
                                 f"stop {r.get('stop')!r} (allowed {STOPS}), or already finished")
            done.add(r["prompt_id"])
        name = self.next_name()
        _atomic_write(os.path.join(self.dir, name), "".join(json.dumps(r) + "\n" for r in records))
        entry = _entry(name, records)
        self.manifest["shards"].append(entry)
        self._write_manifest()
        return entry


def iter_records(out_dir: str):
    """Every record of the manifest's shards, shard by shard, in order.

    Raises:
        FileNotFoundError: no manifest in ``out_dir``.
    """
    with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
        man = json.load(f)
    for s in man["shards"]:
        yield from read_shard(os.path.join(out_dir, s["file"]))


def record_sample(rec: dict, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Training sample of one record: ids = prompt_ids + reply_ids (+ end_id when stop == "eos"), loss mask 1 on
    the reply (and its end token), 0 on the prompt (docs/design.md, "Drafter training": assistant content + end-of-turn
    token); both cut to ``max_len``. Returns (ids int32 [n], mask uint8 [n])."""
    reply = list(rec["reply_ids"]) + ([int(rec["end_id"])] if rec["stop"] == "eos" else [])
    ids = np.asarray(list(rec["prompt_ids"]) + reply, np.int32)[:max_len]
    mask = np.zeros(len(rec["prompt_ids"]) + len(reply), np.uint8)
    mask[len(rec["prompt_ids"]):] = 1
    return ids, mask[:max_len]


def keep_sample(rec: dict, mask: np.ndarray, min_assistant: int = 16) -> bool:
    """Whether a record's sample (``record_sample``: its loss ``mask``) is trained on: it was answered and keeps at
    least ``min_assistant`` loss-masked tokens after the cut."""
    return rec["stop"] != "prompt_too_long" and int(mask.sum()) >= min_assistant


def samples_from_shards(out_dir: str, max_len: int, n_samples: int | None = None,
                        min_assistant: int = 16, skip: int = 0) -> tuple[list, dict]:
    """Training samples (list of (ids, mask)) from a shard directory, in shard order, for ``--stage features``.

    The first ``skip`` records (answered or not, in shard order) are passed over: ``--regen-skip``, for training
    only on replies that a drafter has not seen. Finished shards never change (the directory is append-only), so
    record k stays the same record; to continue after an earlier features run over the same directory, skip its
    data stats' ``skipped + read``. Records with fewer than ``min_assistant`` loss-masked tokens after the cut (and
    every "prompt_too_long" record) are dropped. Returns (samples, stats) with stats {"skipped", "read", "kept",
    "too_few_assistant", "tokens", "masked_tokens", "kinds": {kind: kept}, "stops": {stop: kept}}.

    Raises:
        ValueError: ``skip`` < 0.
    """
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    samples, st = [], {"skipped": 0, "read": 0, "kept": 0, "too_few_assistant": 0, "tokens": 0,
                       "masked_tokens": 0, "kinds": {}, "stops": {}}
    for rec in iter_records(out_dir):
        if st["skipped"] < skip:
            st["skipped"] += 1
            continue
        if n_samples is not None and len(samples) >= n_samples:
            break
        st["read"] += 1
        ids, mask = record_sample(rec, max_len)
        if not keep_sample(rec, mask, min_assistant):
            st["too_few_assistant"] += 1
            continue
        samples.append((ids, mask))
        st["kept"] += 1
        st["tokens"] += len(ids)
        st["masked_tokens"] += int(mask.sum())
        st["kinds"][rec["kind"]] = st["kinds"].get(rec["kind"], 0) + 1
        st["stops"][rec["stop"]] = st["stops"].get(rec["stop"], 0) + 1
    st["regenerated"] = st["kept"]
    return samples, st


__all__ = ["ShardStore", "iter_records", "keep_sample", "read_shard", "record_sample", "samples_from_shards",
           "shard_stem", "STOPS", "SUFFIX"]
