"""A GGUF teacher read once: its float32 tensors, config and tokenizer kept as .npy + JSON for later runs.

Reading a GGUF file costs seconds on the 2-core CPU, about half of a one-shot answer whose graphs come from the graph
store: the ``gguf`` package parses every metadata field item by item (the 49k vocabulary strings and merges of the
embedded SmolLM2 teacher: 3.8 s at a load average of 3) and dequantising takes 2.2 s more. The same checkpoint then
loads from ``$MSEAGLE_CACHE/weights/<key>/`` in a few seconds: one ``.npy`` per tensor (each read when the model
takes it into its Parameters, so the process never holds all weights twice: ``checkpoints.LazyTensors``),
``config.json`` (the ModelConfig fields), ``tokenizer.json`` (the ``tokenizers`` model) and
``meta.json`` (the Tokenizer's settings, the tensor list). The key is the file's path, size and mtime, this package's
checkpoint / tokenizer / config sources and numpy's version; a copy that fails to read is deleted and the GGUF read
again. The first run writes the copy one tensor at a time as it dequantises (the 0.5B teacher: 2.5 GB in ~15 s) and
then reads it like a later run. Only GGUF teachers whose float32 tensors take at most ``MAX_BYTES`` are kept (a
safetensors checkpoint is memory-mapped already, a large model would double its disk use);
``MSEAGLE_WEIGHTS_CACHE=0`` turns this off.

A model built from a kept copy also keeps what its load made of it (:func:`load_model_weights`): each weight
Parameter's final array (norm weights folded in, packed for the kernels, rounded to ``weight_dtype``) as one
``.npy`` in ``<copy>/prepared/<key>/``, the key covering the model's class, config, dtypes, backend, Parameter
list and the sources that shape those arrays. A later load maps those files (copy-on-write, so nothing can write
them) instead of reading, folding, packing and rounding the tensors: the 0.5B teacher's 2.5 GB in no time instead
of ~3.5 s on the 2-core VM, and processes of one machine share the weights' pages through the page cache. The two
most recently written keys of a copy are kept (float32 and float16 weights, say).
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
MAX_BYTES = 4 << 30
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
        (ModelConfig, name -> float32 array mapping (a ``checkpoints.LazyTensors`` over the kept ``.npy`` files),
        Tokenizer), equal to what ``load_teacher`` returns.
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
        if _write(d, *out):
            return _read(d)
    except (OSError, ValueError):  # a full or read-only disk: the next run reads the GGUF again
        pass
    return out


def _write(d: Path, config, tensors, tokenizer) -> bool:
    """Keep a copy of (config, tensors, tokenizer) at ``d``, one tensor in memory at a time; True when ``d`` holds
    one after (written here or by another process)."""
    from mindspore_eagle.models.checkpoints import LazyTensors
    from mindspore_eagle.models.tokenizer import _TokenizersBackend

    backend = getattr(tokenizer, "_backend", None)
    nbytes = tensors.nbytes() if isinstance(tensors, LazyTensors) else sum(4 * a.size for a in tensors.values())
    if not isinstance(backend, _TokenizersBackend) or nbytes > MAX_BYTES:
        return False
    tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_files(tmp, config, tensors, tokenizer, backend)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, d)
    except OSError:               # another process kept it first
        shutil.rmtree(tmp, ignore_errors=True)
        return (d / "meta.json").is_file()
    for old in d.parent.glob(d.name.split("-")[0] + "-*"):     # older copies of the same file
        if old.name != d.name and ".tmp" not in old.name:
            shutil.rmtree(old, ignore_errors=True)
    return True


def _write_files(tmp: Path, config, tensors, tokenizer, backend) -> None:
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


def _read(d: Path):
    from tokenizers import Tokenizer as HFTokenizer

    from mindspore_eagle.models.checkpoints import LazyTensors
    from mindspore_eagle.models.model_config import ModelConfig
    from mindspore_eagle.models.tokenizer import Tokenizer, _TokenizersBackend

    meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError("another format")
    config = ModelConfig(**json.loads((d / "config.json").read_text(encoding="utf-8")))
    files = {name: d / "tensors" / f"{i}.npy" for i, name in enumerate(meta["tensors"])}
    heads = {name: _npy_header(f) for name, f in files.items()}           # (shape, data offset): checked now

    def read(name):
        shape, offset = heads[name]
        return np.fromfile(files[name], np.float32, int(np.prod(shape)), offset=offset).reshape(shape)

    def read_into(name, out):                        # straight into the caller's rows (a fused matrix)
        _, offset = heads[name]
        with open(files[name], "rb") as f:
            f.seek(offset)
            if f.readinto(memoryview(out).cast("B")) != out.nbytes:
                raise ValueError(f"{files[name]}: shorter than its header says")

    tensors = LazyTensors({name: shape for name, (shape, _) in heads.items()}, read, read_into, origin=d)
    tk = HFTokenizer.from_str((d / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer(_TokenizersBackend(tk), vocab_size=meta["vocab_size"], bos_token_id=meta["bos_token_id"],
                          eos_token_ids=meta["eos_token_ids"], add_bos=meta["add_bos"],
                          chat_template=meta["chat_template"], special_tokens=meta["special_tokens"],
                          template_vars=meta["template_vars"])
    return config, tensors, tokenizer


PREPARED_KEEP = 2
_PREPARED_SOURCES = ("models/llama.py", "kernels/cpu.py", "kernels/attention.py", "serving/weights_cache.py")


def _weight_params(net) -> list:
    """[(name, Parameter)] of ``net``'s weights: every Parameter except its K/V caches, in Cell order."""
    caches = {id(c) for pair in net.caches() for c in pair}
    return [(n, p) for n, p in net.parameters_and_names() if id(p) not in caches]


def prepared_key(net) -> str:
    """Key of ``net``'s prepared weights (module docstring): a hash of its class, config, compute and weight
    dtypes, backend, weight Parameters (names, shapes, dtypes) and the sources that make their arrays."""
    desc = [FORMAT, type(net).__name__, dataclasses.asdict(net.cfg), str(net.dtype), str(net.weight_dtype),
            type(net.backend).__name__, [(n, list(p.shape), str(p.dtype)) for n, p in _weight_params(net)]]
    h = hashlib.sha256(json.dumps(desc, default=str).encode())
    for f in _PREPARED_SOURCES:
        h.update((_PKG / f).read_bytes())
    return h.hexdigest()[:16]


def load_model_weights(net, tensors) -> bool:
    """``net.load_hf_weights(tensors)``; when ``tensors`` come from a kept copy (``LazyTensors.origin``), from its
    prepared arrays if a previous load kept them, else loaded and then kept (module docstring). ``net`` is a
    ``models.llama.LlamaModel`` (``caches()``, ``cfg``, ``dtype``, ``weight_dtype``, ``backend``).

    Returns:
        True when the weights came from prepared arrays.
    Raises:
        ValueError: as ``load_hf_weights`` (a missing tensor or a wrong shape).
    """
    origin = getattr(tensors, "origin", None)
    if origin is None:
        net.load_hf_weights(tensors)
        return False
    d = Path(origin) / "prepared" / prepared_key(net)
    if (d / "index.json").is_file():
        try:
            _map_prepared(net, d)
            return True
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(d, ignore_errors=True)
    net.load_hf_weights(tensors)
    try:
        _keep_prepared(net, d)
    except OSError:                 # a full or read-only disk: the next run folds and packs again
        pass
    return False


def _map_prepared(net, d: Path) -> None:
    """Point every weight Parameter of ``net`` at its array in ``d``, mapped copy-on-write. Raises ValueError when
    the index or a file does not match the Parameters (nothing is changed then)."""
    from mindspore import Tensor

    index = json.loads((d / "index.json").read_text(encoding="utf-8"))
    params = _weight_params(net)
    if index.get("names") != [n for n, _ in params]:
        raise ValueError("another Parameter list")
    arrays = []
    for i, (name, p) in enumerate(params):
        arr = np.load(d / f"{i}.npy", mmap_mode="c", allow_pickle=False)
        if list(arr.shape) != list(p.shape) or str(arr.dtype) != index["dtypes"][i]:
            raise ValueError(f"{name}: shape or dtype differs")
        arrays.append(arr)
    for (_, p), arr in zip(params, arrays):
        p.set_data(Tensor.from_numpy(arr))
    if hasattr(net, "weights_version"):          # host views of the old storage (models/llama_host.py) renew
        net.weights_version += 1


def _keep_prepared(net, d: Path) -> None:
    """Write every weight Parameter's array of ``net`` into ``d`` (a temporary directory renamed when complete),
    then drop the copy's older prepared keys beyond ``PREPARED_KEEP``."""
    tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        params = _weight_params(net)
        dtypes = []
        for i, (_, p) in enumerate(params):
            arr = p.asnumpy()
            np.save(tmp / f"{i}.npy", arr, allow_pickle=False)
            dtypes.append(str(arr.dtype))
        (tmp / "index.json").write_text(json.dumps({"names": [n for n, _ in params], "dtypes": dtypes}),
                                        encoding="utf-8")
        os.rename(tmp, d)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (d / "index.json").is_file():       # another process kept it first, else a real failure
            raise
    keys = sorted((k for k in d.parent.iterdir() if ".tmp" not in k.name), key=lambda k: k.stat().st_mtime,
                  reverse=True)
    for old in keys[PREPARED_KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def _npy_header(path: Path) -> tuple:
    """(shape, data offset in bytes) of a float32 ``.npy`` file from its header, after checking that the file holds
    all its data.

    Raises:
        ValueError: not a float32 C-order array, or the file is shorter or longer than its header says.
    """
    with open(path, "rb") as f:
        fmt = np.lib.format
        read_header = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
    if dtype != np.float32 or fortran:
        raise ValueError(f"{path}: not a float32 C-order array")
    if path.stat().st_size != offset + 4 * int(np.prod(shape)):
        raise ValueError(f"{path}: size differs from its header")
    return tuple(shape), offset


__all__ = ["MAX_BYTES", "PREPARED_KEEP", "cache_key", "default_root", "load_model_weights", "load_teacher_cached",
           "prepared_key"]
