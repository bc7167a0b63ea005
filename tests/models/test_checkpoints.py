"""Checkpoint loading: tiny openPangu dir, bad inputs (one-line errors), shards, bf16, GGUF, real SmolLM2."""
import json
import shutil
import struct

import numpy as np
import pytest
from tiny_gguf import gguf_name
from tiny_pangu import causal_mask, numpy_forward, random_tensors, write_tiny_pangu

from mindspore_eagle.models.checkpoints import (
    CheckpointError,
    expected_shapes,
    load_hf_weights,
    load_teacher,
    save_hf_checkpoint,
)
from mindspore_eagle.models.model_config import ModelConfig, from_hf_config

TOK_FILES = ("tokenizer.model", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_pangu(tmp_path_factory.mktemp("tiny_pangu"))


def _copy(tiny_dir, dst):
    shutil.copytree(tiny_dir, dst)
    return dst


def _err(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_tiny_pangu_loads(tiny_dir):
    cfg, tensors, tok = load_teacher(tiny_dir)
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert (cfg.arch, cfg.qkv_bias, cfg.o_bias, cfg.tie_word_embeddings) == ("pangu", True, True, True)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 4, 2, 16)
    assert cfg.rope_theta == 4.0e6 and cfg.vocab_size == raw["vocab_size"] == tok.vocab_size
    assert cfg.eos_token_ids == (raw["eos_token_id"],) and cfg.bos_token_id == 1
    assert cfg.aux_layers == (2, 2, 1)
    assert list(tensors) == list(expected_shapes(cfg))  # inv_freq skipped, no lm_head (tied)
    assert not any("inv_freq" in k for k in tensors) and "lm_head.weight" not in tensors
    ref = random_tensors(cfg)
    for name, arr in tensors.items():
        assert arr.dtype == np.float32 and np.array_equal(arr, ref[name]), name
    assert np.abs(tensors["model.layers.0.self_attn.o_proj.bias"]).min() > 0


@pytest.mark.parametrize("model_type,flags,expect", [
    ({"model_type": "qwen2"}, {}, (True, False)),
    ({"model_type": "llama"}, {"attention_bias": True}, (True, True)),
    ({"architectures": ["LlamaForCausalLM"]}, {}, (False, False)),
    ({"model_type": "PanguEmbedded"}, {"bias": False}, (False, False)),
])
def test_config_bias_flags(model_type, flags, expect):
    base = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
            "num_attention_heads": 4, "eos_token_id": [5, 7]}
    cfg = from_hf_config({**base, **model_type, **flags})
    assert (cfg.qkv_bias, cfg.o_bias) == expect
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 8 and cfg.eos_token_ids == (5, 7) and cfg.aux_layers == (2, 3, 3)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"])
def test_missing_config_field(tiny_dir, tmp_path, field):
    d = _copy(tiny_dir, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    del cfg[field]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as ei:
        load_teacher(d)
    _err(ei, field)


def test_unsupported_config():
    with pytest.raises(CheckpointError) as ei:
        from_hf_config({"model_type": "gemma3", "vocab_size": 1})
    _err(ei, "gemma3", "llama")
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2}
    with pytest.raises(CheckpointError) as ei:
        from_hf_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    _err(ei, "rope_scaling")


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "ckpt")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as ei:
        load_teacher(d)
    _err(ei, "truncated", "model.safetensors")


def test_pickle_refused(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "ckpt")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    for path in (d, d / "pytorch_model.bin"):
        with pytest.raises(CheckpointError) as ei:
            load_teacher(path)
        _err(ei, "pickle", "safetensors")


def _rewrite(d, cfg_dict, mutate):
    _, tensors = load_hf_weights(d)
    mutate(tensors)
    save_hf_checkpoint(d, cfg_dict, tensors)


def test_shape_mismatch(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    _rewrite(d, cfg, lambda t: t.update({"model.layers.3.self_attn.k_proj.weight": np.zeros((33, 64), np.float32)}))
    with pytest.raises(CheckpointError) as ei:
        load_teacher(d)
    _err(ei, "model.layers.3.self_attn.k_proj.weight", "(33, 64)", "(32, 64)")


def test_missing_and_unexpected_tensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())

    def mutate(t):
        del t["model.layers.2.mlp.up_proj.weight"]
        t["model.layers.2.mlp.extra.weight"] = np.zeros(3, np.float32)
    _rewrite(d, cfg, mutate)
    with pytest.raises(CheckpointError) as ei:
        load_teacher(d)
    _err(ei, "missing 1", "model.layers.2.mlp.up_proj.weight", "unexpected 1", "model.layers.2.mlp.extra.weight")


def test_sharded_index_loads(tiny_dir, tmp_path):
    cfg, tensors, _ = load_teacher(tiny_dir)
    d = save_hf_checkpoint(tmp_path / "sharded", json.loads((tiny_dir / "config.json").read_text()), tensors, 3)
    for name in TOK_FILES:
        shutil.copy(tiny_dir / name, d / name)
    assert len(list(d.glob("model-0000?-of-00003.safetensors"))) == 3
    cfg2, tensors2, _ = load_teacher(d / "model.safetensors.index.json")
    assert cfg2 == cfg and all(np.array_equal(tensors[k], tensors2[k]) for k in tensors)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as ei:
        load_teacher(d)
    _err(ei, "model-00002-of-00003.safetensors")


def _write_bf16_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        words = (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [off, off + len(words)]}
        blobs.append(words)
        off += len(words)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_bf16_converted_to_float32(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "ckpt")
    _, tensors = load_hf_weights(d)
    _write_bf16_safetensors(d / "model.safetensors", tensors)
    _, loaded = load_hf_weights(d)
    for name, arr in tensors.items():
        want = (arr.view(np.uint32) & 0xFFFF0000).view(np.float32)
        assert loaded[name].dtype == np.float32 and np.array_equal(loaded[name], want), name


def test_numpy_forward_reference(tiny_dir):
    cfg, tensors, tok = load_teacher(tiny_dir)
    ids = np.array(tok.encode("The capital of France is Paris. def add(a, b): return a + b"))
    k = len(ids)
    logits, aux = numpy_forward(cfg, tensors, ids, np.arange(k), causal_mask(k))
    assert logits.shape == (k, cfg.vocab_size) and aux.shape == (k, 3 * cfg.hidden_size)
    assert logits.std() > 2.0 and len(set(logits.argmax(-1).tolist())) > k // 3  # well spread
    half, _ = numpy_forward(cfg, tensors, ids[:6], np.arange(6), causal_mask(6))
    np.testing.assert_allclose(half, logits[:6], rtol=1e-9, atol=1e-9)  # causal: prefix independent of the rest
    # a tree branch: nodes 0..3 chain, node 4 is a sibling of node 3 (same position, attends to 0..2 and itself)
    tree_tokens = np.concatenate([ids[:4], ids[5:6]])
    mask = np.full((5, 5), -np.inf)
    for i, anc in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4]]):
        mask[i, anc] = 0.0
    tree, tree_aux = numpy_forward(cfg, tensors, tree_tokens, np.array([0, 1, 2, 3, 3]), mask)
    chain, chain_aux = numpy_forward(cfg, tensors, tree_tokens[[0, 1, 2, 4]], np.arange(4), causal_mask(4))
    np.testing.assert_allclose(tree[4], chain[3], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(tree_aux[4], chain_aux[3], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------------- GGUF --
def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, arch, cfg=None, tensors=None, pre="smollm"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if cfg is None:  # just something with the given arch
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    else:
        tokens = ["<|im_start|>", "<|im_end|>"] + _bytes_to_unicode() + ["Ġt", "he", "Ġthe"]
        w.add_block_count(cfg.num_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges(["Ġ t", "h e", "Ġt he"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
        for name, arr in tensors.items():
            if arch == "llama" and ("q_proj" in name or "k_proj" in name):
                arr = _permute(arr, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
            w.add_tensor(gguf_name(name), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unknown_arch(tmp_path):
    path = _write_gguf(tmp_path / "g.gguf", "gemma3")
    with pytest.raises(CheckpointError) as ei:
        load_teacher(path)
    _err(ei, "gemma3", "llama", "qwen2")


@pytest.mark.parametrize("arch,pre,bias,tied", [("llama", "smollm", False, True), ("qwen2", "qwen2", True, False)])
def test_gguf_roundtrip(tmp_path, arch, pre, bias, tied):
    cfg = ModelConfig(vocab_size=261, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e5, rms_norm_eps=1e-5, qkv_bias=bias,
                      tie_word_embeddings=tied, max_position_embeddings=256, arch=arch)
    tensors = random_tensors(cfg, seed=3)
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch, cfg, tensors, pre)
    cfg2, loaded, tok = load_teacher(path)
    assert cfg2 == cfg.replace(bos_token_id=0, eos_token_ids=(1,))
    assert list(loaded) == list(tensors)
    for name, arr in tensors.items():  # q/k un-permuted for llama, untouched for qwen2
        assert np.array_equal(loaded[name], arr), name
    text = "<|im_start|>the thethe 123 tea<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 0 and ids[-1] == 1 and tok.decode(ids) == text and tok.eos_token_ids == (1,)
    assert tok.token_to_id("Ġthe") in ids
    with pytest.raises(CheckpointError) as ei:
        path.write_bytes(path.read_bytes()[:-64])
        load_teacher(path)
    _err(ei, str(path))


# --------------------------------------------------------------------------------------- real SmolLM2 GGUF --
@pytest.fixture(scope="module")
def smollm():
    from mindspore_eagle.models.fetch import AssetError, embedded_teacher_path

    try:
        path = embedded_teacher_path()
    except AssetError as e:
        pytest.skip(f"embedded teacher unavailable (package index unreachable): {e}")
    return load_teacher(path)


@pytest.mark.slow
def test_smollm2_gguf_loads(smollm):
    cfg, tensors, tok = smollm
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (1536, 49152, 1e5, True)
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9 and cfg.eos_token_ids == (2,) and cfg.aux_layers == (2, 15, 27)
    assert len(tensors) == 272 and all(a.dtype == np.float32 for a in tensors.values())
    assert sum(a.size for a in tensors.values()) == 134_515_008


@pytest.mark.slow
def test_smollm2_greedy_answer(smollm):
    """End to end through loader (q/k un-permutation), tokenizer, chat template and the numpy reference."""
    cfg, tensors, tok = smollm
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = []
    for _ in range(10):
        seq = np.array(ids + out)
        logits, _ = numpy_forward(cfg, tensors, seq, np.arange(len(seq)), causal_mask(len(seq)), dtype=np.float32)
        nxt = int(logits[-1].argmax())
        if nxt in cfg.eos_token_ids:
            break
        out.append(nxt)
    assert tok.decode(out) == "The capital of France is Paris."
