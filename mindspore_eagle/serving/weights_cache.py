"""A GGUF teacher read once: its float32 tensors, config and tokenizer kept as .npy + JSON for later runs.

Reading a GGUF file costs seconds on the 2-core CPU, about half of a one-shot answer whose graphs come from the graph
store: the ``gguf`` package parses every metadata field item by item (the 49k vocabulary strings and merges of the
embedded SmolLM2 teacher: 3.8 s at a load average of 3) and dequantising takes 2.2 s more. The same checkpoint then
loads from ``$MSEAGLE_CACHE/weights/<key>/`` in well under a second: one ``.npy`` per tensor (read with
``allow_pickle=False``), ``config.json`` (the ModelConfig fields), ``tokenizer.json`` (the ``tokenizers`` model) and
``meta.json`` (the Tokenizer's settings, the tensor list). The key is the file's path, size and mtime, this package's
checkpoint / tokenizer / config sources and numpy's version; a copy that fails to read is deleted and the GGUF read
again. Only GGUF teachers whose float32 tensors take at most ``MAX_BYTES`` are kept (a safetensors checkpoint is
memory-mapped already, a large model would double its disk use); ``MSEAGLE_WEIGHTS_CACHE=0`` turns this off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

FORMAT = 1
MAX_BYTES = 2 << 30
_PKG = Path(__file__).resolve().parent.parent
_SOURCES = ("models/checkpoints.py", "models/tokenizer.py", "models/gguf_meta.py", "models/model_config.py",
            "serving/weights_cache.py")


def default_root() -> Path:
    """$MSEAGLE_CACHE/weights."""
    from mindspore_eagle.config import cache_dir

    return cache_dir() / "weights"


def cache_key(path) -> str:
    """Key of a checkpoint file's copy, "<file>-<version>": a hash of its real path, then of its size and mtime,
    the loader sources and numpy's version (a new version of one file replaces the old copy)."""
    p = Path(path).resolve()
    st = p.stat()
    h = hashlib.sha256(json.dumps([FORMAT, st.st_size, st.st_mtime_ns, np.__version__]).encode())
    for f in _SOURCES:
        h.update((_PKG / f).read_bytes())
    return f"{hashlib.sha256(str(p).encode()).hexdigest()[:12]}-{h.hexdigest()[:12]}"


def load_teacher_cached(path, root=None):
    """``models.checkpoints.load_teacher(path)``, from the kept copy when there is one (module docstring).

    Returns:
        (ModelConfig, dict[str, np.ndarray float32], Tokenizer), equal to what ``load_teacher`` returns.
    Raises:
        CheckpointError: as ``load_teacher``.
    """
    from mindspore_eagle.models.checkpoints import _resolve, load_teacher

    p = _resolve(path)
    if p.suffix.lower() != ".gguf" or os.environ.get("MSEAGLE_WEIGHTS_CACHE", "1") == "0":
        return load_teacher(path)
    d = Path(root or default_root()) / cache_key(p)
    if (d / "meta.json").is_file():
        try:
            return _read(d)
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(d, ignore_errors=True)
    out = load_teacher(path)
    try:
        _write(d, *out)
    except OSError:               # a full or read-only disk: the next run reads the GGUF again
        pass
    return out


def _write(d: Path, config, tensors: dict, tokenizer) -> None:
    from mindspore_eagle.models.tokenizer import _TokenizersBackend

    backend = getattr(tokenizer, "_backend", None)
    if not isinstance(backend, _TokenizersBackend) or sum(a.nbytes for a in tensors.values()) > MAX_BYTES:
        return
    tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "tensors").mkdir(parents=True)
    names = []
    for i, (name, arr) in enumerate(tensors.items()):
        np.save(tmp / "tensors" / f"{i}.npy", np.ascontiguousarray(arr, np.float32), allow_pickle=False)
        names.append(name)
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)), encoding="utf-8")
    (tmp / "tokenizer.json").write_text(backend.tk.to_str(), encoding="utf-8")
    meta = {"format": FORMAT, "tensors": names, "vocab_size": tokenizer.vocab_size,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_ids": list(tokenizer.eos_token_ids),
            "add_bos": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
            "special_tokens": tokenizer.special_tokens, "template_vars": tokenizer.template_vars}
    (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")    # last: marks the copy complete
    try:
        os.rename(tmp, d)
    except OSError:               # another process kept it first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    for old in d.parent.glob(d.name.split("-")[0] + "-*"):     # older copies of the same file
        if old.name != d.name and ".tmp" not in old.name:
            shutil.rmtree(old, ignore_errors=True)


def _read(d: Path):
    from tokenizers import Tokenizer as HFTokenizer

    from mindspore_eagle.models.model_config import ModelConfig
    from mindspore_eagle.models.tokenizer import Tokenizer, _TokenizersBackend

    meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError("another format")
    config = ModelConfig(**json.loads((d / "config.json").read_text(encoding="utf-8")))
    tensors = {name: np.load(d / "tensors" / f"{i}.npy", allow_pickle=False)
               for i, name in enumerate(meta["tensors"])}
    tk = HFTokenizer.from_str((d / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer(_TokenizersBackend(tk), vocab_size=meta["vocab_size"], bos_token_id=meta["bos_token_id"],
                          eos_token_ids=meta["eos_token_ids"], add_bos=meta["add_bos"],
                          chat_template=meta["chat_template"], special_tokens=meta["special_tokens"],
                          template_vars=meta["template_vars"])
    return config, tensors, tokenizer


__all__ = ["MAX_BYTES", "cache_key", "default_root", "load_teacher_cached"]
