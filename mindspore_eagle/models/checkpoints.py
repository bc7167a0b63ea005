"""Teacher checkpoint loading: HF safetensors directories and llama.cpp GGUF files -> float32 numpy in HF names.

Letter legend (docs/architecture.md): V = teacher vocab, H = hidden size, L = teacher layers; per layer
Q = num_heads * head_dim, KV = num_kv_heads * head_dim, I = intermediate size.

Tensor names and shapes returned (HF Linear layout [out, in]), see `expected_shapes`:
    model.embed_tokens.weight [V, H]; lm_head.weight [V, H] (absent when tie_word_embeddings);
    model.norm.weight [H]; for N in 0..L-1, prefix model.layers.N.:
    self_attn.q_proj.weight [Q, H], k_proj.weight / v_proj.weight [KV, H], o_proj.weight [H, Q],
    self_attn.{q,k,v}_proj.bias [Q]/[KV]/[KV] (qkv_bias), self_attn.o_proj.bias [H] (o_bias),
    mlp.gate_proj.weight / up_proj.weight [I, H], mlp.down_proj.weight [H, I],
    input_layernorm.weight / post_attention_layernorm.weight [H].

Sources: openPangu key layout (docs/design.md, "openPangu-Embedded"; stray rotary_emb.inv_freq skipped), GGUF
facts and the q/k un-permutation (docs/design.md, "Offline model and data sources"; the inverse of llama.cpp
convert_hf_to_gguf.py `LlamaModel.permute`).
Every failure is a `CheckpointError` (ValueError) with a one-line message naming the file/tensor/field.
Pickle checkpoints (.bin/.pt/.pth/.ckpt) are refused: unpickling runs arbitrary code.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from mindspore_eagle.models.model_config import CheckpointError, ModelConfig
from mindspore_eagle.models.gguf_meta import gguf_value

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
GGUF_ARCHS = ("llama", "qwen2")
_SKIP_SUFFIX = "rotary_emb.inv_freq"
_ST_FLOAT = ("F32", "F16", "F64", "BF16")
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_GGUF_BLK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The exact tensor set (HF names, in load order) and shapes a checkpoint for `config` must provide."""
    H, Q, KV, I = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, H)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (Q, H),
                       p + "self_attn.k_proj.weight": (KV, H), p + "self_attn.v_proj.weight": (KV, H),
                       p + "self_attn.o_proj.weight": (H, Q)})
        if config.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (Q,), p + "self_attn.k_proj.bias": (KV,),
                           p + "self_attn.v_proj.bias": (KV,)})
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        shapes.update({p + "post_attention_layernorm.weight": (H,), p + "mlp.gate_proj.weight": (I, H),
                       p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
    shapes["model.norm.weight"] = (H,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, H)
    return shapes


def load_teacher(path):
    """Load a teacher: weights, config and tokenizer.

    Args:
        path: an HF-style directory (config.json + model.safetensors or model.safetensors.index.json + shards,
            tokenizer.model/tokenizer.json + tokenizer_config.json), a file inside one, or a `.gguf` file
            (arch llama or qwen2).
    Returns:
        (ModelConfig, dict[str, np.ndarray float32] in HF names (see module docstring), Tokenizer). The config's
        eos_token_ids are the union of the config's, generation_config.json's and the tokenizer's EOS ids.
    Raises:
        CheckpointError: missing/invalid config field, truncated or corrupt file, pickle checkpoint, unknown
            GGUF arch, missing/unexpected tensors, shape mismatch, unusable tokenizer.
    """
    from mindspore_eagle.models.tokenizer import Tokenizer

    p = _resolve(path)
    if p.suffix.lower() == ".gguf":
        reader = open_gguf(p)
        config, tensors = load_gguf_weights(reader)
        tokenizer = Tokenizer.from_gguf(reader)
    else:
        config, tensors = load_hf_weights(p)
        tokenizer = Tokenizer.from_hf_dir(p)
        gen = p / "generation_config.json"
        if gen.is_file():
            eos = _read_json(gen).get("eos_token_id")
            extra = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
            config = config.replace(eos_token_ids=config.eos_token_ids + tuple(extra))
    eos = tuple(dict.fromkeys(config.eos_token_ids + tuple(tokenizer.eos_token_ids)))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    return config.replace(eos_token_ids=eos, bos_token_id=bos), tensors, tokenizer


def _resolve(path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise CheckpointError(f"{p}: not a checkpoint directory (no config.json and {len(ggufs)} .gguf files; "
                              "expected a .gguf file or a directory with config.json and *.safetensors)")
    suffix = p.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise _pickle_error(p)
    if suffix == ".gguf":
        return p
    if suffix == ".safetensors" or p.name.endswith(".index.json") or p.name == "config.json":
        return p.parent
    raise CheckpointError(f"{p}: unknown checkpoint file type (expected a .gguf file or a directory with "
                          "config.json and *.safetensors)")


def _pickle_error(p: Path) -> CheckpointError:
    return CheckpointError(f"{p}: pickle checkpoints are refused (loading them can run arbitrary code); convert it "
                           "to safetensors (e.g. safetensors.torch.save_file(torch.load(f), 'model.safetensors'))")


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: cannot read JSON: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ----------------------------------------------------------------------------------------------- safetensors --
def load_hf_weights(path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Weights of an HF-style directory, without the tokenizer.

    Args:
        path: directory with config.json and model.safetensors, or model.safetensors.index.json plus the shards
            it names, or exactly one other *.safetensors file.
    Returns:
        (ModelConfig from config.json, dict name -> float32 array, exactly `expected_shapes(config)`).
        F16/BF16/F64 tensors are converted to float32; `*.rotary_emb.inv_freq` is dropped; a `lm_head.weight`
        equal to the embedding is dropped when the config ties them.
    Raises:
        CheckpointError: as `load_teacher`.
    """
    d = _resolve(path)
    if d.suffix.lower() == ".gguf":
        raise CheckpointError(f"{d}: is a GGUF file; use load_gguf_weights or load_teacher")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{d}: no config.json (an HF checkpoint directory needs one)")
    config = ModelConfig.from_hf_config(_read_json(cfg_path))
    index = d / "model.safetensors.index.json"
    raw: dict[str, np.ndarray] = {}
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        for shard in dict.fromkeys(weight_map.values()):
            if not (d / shard).is_file():
                raise CheckpointError(f"{index}: shard {shard} is missing from {d}")
            raw.update(read_safetensors(d / shard))
    else:
        files = [d / "model.safetensors"] if (d / "model.safetensors").is_file() else sorted(d.glob("*.safetensors"))
        if len(files) != 1:
            pickles = sorted(f for f in d.iterdir() if f.suffix.lower() in PICKLE_SUFFIXES)
            if not files and pickles:
                raise _pickle_error(pickles[0])
            raise CheckpointError(f"{d}: expected model.safetensors or model.safetensors.index.json, found "
                                  f"{[f.name for f in files] or 'no .safetensors file'}")
        raw = read_safetensors(files[0])
    return config, check_tensors(config, raw)


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All float tensors of one .safetensors file as float32 numpy arrays (inv_freq buffers skipped).

    F32/F16/F64 go through `safetensors.safe_open(framework="numpy")`; BF16, which numpy cannot represent, is read
    as raw little-endian uint16 words at the header's offsets and widened (bits << 16) to float32.
    Raises:
        CheckpointError: file shorter than its header declares ("truncated"), corrupt header, non-float dtype.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, header incomplete)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {_one_line(e)}") from None
    header.pop("__metadata__", None)
    need = 8 + n + max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if need > size:
        raise CheckpointError(f"{path}: truncated safetensors file: header declares {need} bytes, file has {size}")
    out = {}
    try:
        with safe_open(str(path), framework="numpy") as sf:
            for name, info in header.items():
                if name.endswith(_SKIP_SUFFIX):
                    continue
                dtype, shape = info["dtype"], tuple(int(s) for s in info["shape"])
                if dtype not in _ST_FLOAT:
                    raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}; weights must be "
                                          f"one of {', '.join(_ST_FLOAT)}")
                if dtype == "BF16":
                    words = np.fromfile(path, dtype="<u2", count=int(np.prod(shape)),
                                        offset=8 + n + int(info["data_offsets"][0]))
                    out[name] = (words.astype(np.uint32) << 16).view(np.float32).reshape(shape)
                else:
                    out[name] = np.ascontiguousarray(sf.get_tensor(name), dtype=np.float32)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read safetensors: {_one_line(e)}") from None
    return out


class LazyTensors(Mapping):
    """A read-only name -> float32 array mapping whose arrays are read when asked for and not kept.

    A model's loader copies each tensor into its own storage and drops it, so with this mapping the process never
    holds a second copy of all weights (the 0.5B teacher's 2.5 GB of float32 would otherwise be held twice while its
    Parameters fill; docs/models.md, "Memory"). Each ``m[name]`` reads again: callers that need a tensor twice
    keep it.

    Args:
        shapes: name -> shape, in the mapping's order (what ``check_tensors`` validates without reading).
        read: ``read(name)`` -> a new float32 array of that name that nobody else holds (a loader may take it
            over without copying).
        read_into: optional ``read_into(name, out)`` that fills a C-contiguous float32 array of the tensor's
            shape in place (:meth:`into`; without it ``into`` copies ``read(name)``).
        origin: the directory of the kept copy the tensors are read from (``serving.weights_cache``), else None.
    """

    def __init__(self, shapes: dict, read, read_into=None, origin=None):
        self._shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self._read = read
        self._read_into = read_into
        self.origin = origin

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        arr = self._read(name)
        if arr.dtype != np.float32 or not arr.flags.c_contiguous:
            raise TypeError(f"LazyTensors: the reader of {name} returned {arr.dtype}, not a C-order float32 array")
        return arr

    def __contains__(self, name) -> bool:       # without reading (Mapping's own would read the tensor)
        return name in self._shapes

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def shape(self, name: str) -> tuple:
        """The shape of ``name`` without reading it."""
        return self._shapes[name]

    def nbytes(self) -> int:
        """Bytes of all tensors as float32."""
        return sum(4 * int(np.prod(s)) for s in self._shapes.values())

    def into(self, name: str, out: np.ndarray) -> None:
        """Read ``name`` into ``out`` (a C-contiguous float32 array of its shape, e.g. rows of a fused matrix) without
        a temporary where the reader can. Raises KeyError (unknown name) or ValueError (``out`` of another shape,
        dtype or layout)."""
        if name not in self._shapes:
            raise KeyError(name)
        if out.shape != self._shapes[name] or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"LazyTensors.into: {name} is float32 {self._shapes[name]}, got {out.dtype} "
                             f"{out.shape} (C-contiguous: {out.flags.c_contiguous})")
        if self._read_into is not None:
            self._read_into(name, out)
        else:
            out[...] = self[name]

    def subset(self, names) -> "LazyTensors":
        """The same reader over ``names`` only, in that order."""
        return LazyTensors({n: self._shapes[n] for n in names}, self._read, self._read_into, self.origin)


def _shape_of(raw, name: str) -> tuple:
    return raw.shape(name) if isinstance(raw, LazyTensors) else tuple(raw[name].shape)


def check_tensors(config: ModelConfig, raw) -> dict[str, np.ndarray]:
    """Validate a name -> array mapping against `expected_shapes(config)`; return it in canonical order, float32.

    A :class:`LazyTensors` is checked by its shapes and returned lazy (its arrays stay unread).
    Raises:
        CheckpointError: missing and/or unexpected tensors (named, first 5 of each), a shape mismatch (names the
            tensor, the checkpoint's shape and the config's), or an untied lm_head under tie_word_embeddings.
    """
    expected = expected_shapes(config)
    names = [k for k in raw if not k.endswith(_SKIP_SUFFIX)]
    if config.tie_word_embeddings and "lm_head.weight" in names:
        names.remove("lm_head.weight")
        emb = raw["model.embed_tokens.weight"] if "model.embed_tokens.weight" in names else None
        head = raw["lm_head.weight"]
        if emb is not None and (head.shape != emb.shape or not np.array_equal(head, emb)):
            raise CheckpointError("lm_head.weight differs from model.embed_tokens.weight but the config says "
                                  "tie_word_embeddings=true")
    missing = [k for k in expected if k not in names]
    unexpected = sorted(k for k in names if k not in expected)
    _names = lambda names: ", ".join(names[:5]) + (f", ... (+{len(names) - 5})" if len(names) > 5 else "")  # noqa
    if missing or unexpected:
        parts = [f"missing {len(missing)} tensor(s): {_names(missing)}"] if missing else []
        parts += [f"unexpected {len(unexpected)} tensor(s): {_names(unexpected)}"] if unexpected else []
        raise CheckpointError("checkpoint does not match its config: " + "; ".join(parts))
    for name, shape in expected.items():
        if _shape_of(raw, name) != shape:
            raise CheckpointError(f"tensor {name}: shape {_shape_of(raw, name)} in the checkpoint, {shape} "
                                  "expected from the config")
    if isinstance(raw, LazyTensors):
        return raw.subset(expected)
    return {name: np.asarray(raw[name], dtype=np.float32) for name in expected}


def save_hf_checkpoint(directory, config_dict: dict, tensors: dict, num_shards: int = 1) -> Path:
    """Write an HF-style checkpoint: config.json plus model.safetensors (or num_shards shards and the index).

    Args:
        directory: created if needed.
        config_dict: written verbatim as config.json.
        tensors: name -> numpy array (written in its own dtype).
        num_shards: > 1 writes model-0000i-of-0000n.safetensors (names split in order) and
            model.safetensors.index.json with weight_map and metadata.total_size.
    Returns:
        the directory as a Path.
    """
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config_dict, indent=2, ensure_ascii=False), encoding="utf-8")
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if num_shards <= 1:
        save_file(arrays, str(d / "model.safetensors"))
        return d
    names = list(arrays)
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.arange(len(names)), num_shards)):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({names[j]: arrays[names[j]] for j in chunk}, str(d / fname))
        weight_map.update({names[j]: fname for j in chunk})
    total = int(sum(a.nbytes for a in arrays.values()))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
    return d


# ------------------------------------------------------------------------------------------------------ GGUF --
def gguf_config(reader) -> ModelConfig:
    """ModelConfig from GGUF metadata ({arch}.block_count, embedding_length, feed_forward_length,
    attention.head_count[_kv], attention.key_length, rope.freq_base, attention.layer_norm_rms_epsilon,
    context_length, vocab_size; tokenizer.ggml.bos/eos/eot_token_id). Bias flags and tying come from the tensors.

    Raises:
        CheckpointError: arch not in GGUF_ARCHS (named with the supported ones), missing key, RoPE scaling or partial
            rotary dimension.
    """
    arch = gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise CheckpointError(f"unsupported GGUF architecture '{arch}' (supported: {', '.join(GGUF_ARCHS)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or gguf_value(reader, f"{arch}.rope.scaling.type", "none") not in ("none", ""):
        raise CheckpointError("GGUF file uses RoPE scaling, which is not supported (plain RoPE only)")
    hidden = int(gguf_value(reader, f"{arch}.embedding_length"))
    heads = int(gguf_value(reader, f"{arch}.attention.head_count"))
    head_dim = int(gguf_value(reader, f"{arch}.attention.key_length", hidden // heads))
    rot = int(gguf_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise CheckpointError(f"GGUF: rope.dimension_count {rot} != head_dim {head_dim} (partial RoPE unsupported)")
    vocab = gguf_value(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = len(gguf_value(reader, "tokenizer.ggml.tokens"))
    eos = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(gguf_value(reader, f"{arch}.feed_forward_length")),
        num_layers=int(gguf_value(reader, f"{arch}.block_count")), num_heads=heads,
        num_kv_heads=int(gguf_value(reader, f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        rope_theta=_f32(gguf_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(gguf_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(gguf_value(reader, f"{arch}.context_length", 2048)),
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)), arch=arch)


def _f32(value) -> float:
    """GGUF stores float32: 9.9999997e-06 -> the shortest decimal that rounds to it (1e-05)."""
    return float(str(np.float32(value)))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved-RoPE order -> HF rotate_half order).

    Args:
        w: [n_head * head_dim, in] weight or [n_head * head_dim] bias, as stored in a llama-arch GGUF.
        n_head: num_heads for attn_q, num_kv_heads for attn_k.
    Returns:
        array of the same shape in HF order. Not applied to qwen2 files (llama.cpp does not permute those).
    """
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path):
    """`gguf.GGUFReader` over `path` (memory-mapped). Raises CheckpointError (one line) on a damaged file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on damaged files
        raise CheckpointError(f"{path}: cannot read GGUF file: {_one_line(e)}") from None


def load_gguf_weights(path_or_reader) -> tuple[ModelConfig, LazyTensors]:
    """A llama/qwen2 GGUF file (a path or an open `gguf.GGUFReader`) as float32 HF-named tensors, each dequantised
    when it is read.

    Every tensor goes through `gguf.quants.dequantize` (any ggml type gguf supports) and is reshaped to the
    reversed ggml shape, i.e. HF [out, in]; llama-arch attn_q/attn_k weights and biases are un-permuted. Names and
    shapes are checked here, before any tensor is read.
    Returns:
        (ModelConfig from metadata, :class:`LazyTensors` name -> float32 array, each a copy of its own).
    Raises:
        CheckpointError: unreadable/truncated file, unsupported arch, unknown tensor name, shape mismatch.
    """
    reader = open_gguf(path_or_reader) if isinstance(path_or_reader, (str, Path)) else path_or_reader
    config = gguf_config(reader)
    by_name = {_hf_name(t.name): t for t in reader.tensors}
    shapes = {name: tuple(int(s) for s in reversed(t.shape)) for name, t in by_name.items()}
    file = reader.data.filename
    return config, check_tensors(config, LazyTensors(shapes, lambda n: _dequantise(config, n, by_name[n], file)))


def _dequantise(config: ModelConfig, name: str, t, file) -> np.ndarray:
    """One GGUF tensor as float32 HF [out, in], read through a mapping of its own bytes that is dropped after (the
    reader's whole-file mapping would keep every page read so far resident)."""
    from gguf.quants import dequantize

    data = np.memmap(file, dtype=t.data.dtype, mode="r", offset=t.data_offset, shape=t.data.shape)
    arr = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32)
    arr = arr.reshape(tuple(int(s) for s in reversed(t.shape)))
    if config.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        arr = unpermute_qk(arr, config.num_heads if ".q_proj." in name else config.num_kv_heads)
    return np.array(arr, dtype=np.float32)  # own copy: do not keep the file mapped


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TOP:
        return _GGUF_TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_BLK:
        return f"model.layers.{parts[1]}.{_GGUF_BLK[parts[2]]}.{parts[3]}"
    raise CheckpointError(f"GGUF tensor '{gguf_name}' has no HF equivalent in a Llama/Qwen2 network")
