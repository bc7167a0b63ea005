"""Test fixture (not a test file): a tiny openPangu-Embedded checkpoint and an independent numpy forward pass.

`write_tiny_pangu(dir)` writes what an openPangu-Embedded-1B release holds, at toy size:
    config.json       openPangu field names (model_type PanguEmbedded, `bias: true`, tied embeddings, rope 4e6)
    model.safetensors HF key names, float32, seed-fixed random weights (nonzero biases, logits well spread) plus a
                      stray model.layers.1.self_attn.rotary_emb.inv_freq buffer the loader must skip
    tokenizer.model   SentencePiece BPE trained here on inline text (identity normalisation so the full-width
                      colon '：' survives, byte fallback, [unused0..17] as user-defined symbols)
    tokenizer_config.json  the openPangu chat template, added_tokens_decoder, add_bos_token, eos [unused10]

`numpy_forward(config, tensors, tokens, positions, mask_additive)` is the reference network the MindSpore Cells
are tested against: float64 math, RMSNorm, NeoX rotate_half RoPE, GQA, q/k/v/o bias per flags, SwiGLU, final norm,
tied or separate head.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

PANGU_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '[unused9]系统：[unused10]' }}{% endif %}{% if message['role'] == 'system' %}"
    "{{ '[unused9]系统：' + message['content'] + '[unused10]' }}{% endif %}{% if message['role'] == 'assistant' %}"
    "{{'[unused9]助手：' + message['content'] + '[unused10]'}}{% endif %}{% if message['role'] == 'tool' %}"
    "{{'[unused9]工具：' + message['content'] + '[unused10]'}}{% endif %}{% if message['role'] == 'function' %}"
    "{{'[unused9]方法：' + message['content'] + '[unused10]'}}{% endif %}{% if message['role'] == 'user' %}"
    "{{'[unused9]用户：' + message['content'] + '[unused10]'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[unused9]助手：' }}{% endif %}")
UNUSED = [f"[unused{i}]" for i in range(18)]
TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.
Speculative decoding drafts several tokens and the teacher verifies them in one forward pass.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 42 100
Write a short story about a robot who learns to paint. Explain why the sky is blue.
系统：你是一个有帮助的助手。用户：你好，请介绍一下你自己。助手：我是盘古模型。工具：方法：
Please answer the question step by step, and keep the answer short and clear.
"""
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 4, 4, 2, 128


def train_sentencepiece(vocab_size: int = 400) -> bytes:
    """Serialized SentencePiece BPE model trained on TRAIN_TEXT (deterministic, well under a second)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    lines = [line for line in TRAIN_TEXT.splitlines() if line.strip()] * 4
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, user_defined_symbols=UNUSED,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return buf.getvalue()


def pangu_config_dict(vocab_size: int, eos_id: int) -> dict:
    """config.json in openPangu-Embedded's own field names (cf. openPangu-Embedded-1B)."""
    return {
        "architectures": ["PanguEmbeddedForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_openpangu_dense.PanguEmbeddedConfig",
                     "AutoModelForCausalLM": "modeling_openpangu_dense.PanguEmbeddedForCausalLM"},
        "model_type": "PanguEmbedded", "bias": True, "attention_dropout": 0.0, "bos_token_id": 1,
        "pad_token_id": 0, "eos_token_id": eos_id, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": FFN, "max_position_embeddings": 512,
        "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5, "rope_theta": 4.0e6, "tie_word_embeddings": True, "torch_dtype": "float32",
        "use_cache": True, "vocab_size": vocab_size}


def random_tensors(config, seed: int = 0) -> dict:
    """Seed-fixed float32 weights for `config` (HF names). Embedding std 0.5 so tied-head logits have std ~4;
    linear weights ~ N(0, 1/in); norms ~ 1 + N(0, 0.1); biases ~ N(0, 0.2)."""
    from mindspore_eagle.models.checkpoints import expected_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.2 * rng.standard_normal(shape)
        elif "embed_tokens" in name or name == "lm_head.weight":
            a = 0.5 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = a.astype(np.float32)
    return out


def write_tiny_pangu(directory, seed: int = 0) -> Path:
    """Write the tiny openPangu checkpoint directory (see module docstring) and return its Path."""
    import sentencepiece as spm
    from safetensors.numpy import save_file

    from mindspore_eagle.models.model_config import ModelConfig

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model = train_sentencepiece()
    (d / "tokenizer.model").write_bytes(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    eos_id = sp.piece_to_id("[unused10]")
    cfg = pangu_config_dict(sp.get_piece_size(), eos_id)
    (d / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    tensors = random_tensors(ModelConfig.from_hf_config(cfg), seed)
    head_dim = HIDDEN // HEADS
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = (
        1.0 / 4.0e6 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    added = {str(sp.piece_to_id(t)): {"content": t, **flags} for t in ["<unk>", "<s>", "</s>"] + UNUSED}
    tok_cfg = {"add_bos_token": True, "add_eos_token": False, "add_prefix_space": True,
               "added_tokens_decoder": added, "bos_token": "<s>", "clean_up_tokenization_spaces": False,
               "eos_token": "[unused10]", "legacy": True, "pad_token": "<unk>", "sp_model_kwargs": {},
               "spaces_between_special_tokens": False, "tokenizer_class": "PanguTokenizer", "unk_token": "<unk>",
               "use_default_system_prompt": False, "chat_template": PANGU_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg, ensure_ascii=False), encoding="utf-8")
    return d


def causal_mask(k: int) -> np.ndarray:
    """Additive causal mask float32 [k, k]: 0 on and below the diagonal, -inf above."""
    return np.triu(np.full((k, k), -np.inf, dtype=np.float32), 1)


def numpy_forward(config, tensors, tokens, positions, mask_additive, dtype=np.float64):
    """Reference forward pass over a full token sequence (no cache).

    Args:
        config: ModelConfig.
        tensors: HF-named arrays as returned by load_teacher / random_tensors.
        tokens: int [k]; positions: int [k] (RoPE positions).
        mask_additive: float [k, k], added to the attention scores (0 = attend, -inf = blocked); every row needs
            at least one finite entry.
        dtype: compute dtype (float64 default; float32 for speed on real models).
    Returns:
        (logits [k, V], aux [k, 3H]) in `dtype`; aux = concatenated residual-stream inputs of config.aux_layers.
    """
    c, t = config, tensors
    W = lambda name: np.asarray(t[name], dtype=dtype)  # noqa: E731
    tokens, positions = np.asarray(tokens), np.asarray(positions, dtype=dtype)
    mask = np.asarray(mask_additive, dtype=dtype)
    k, hd, nh, nkv = len(tokens), c.head_dim, c.num_heads, c.num_kv_heads
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, hd, 2, dtype=dtype) / hd))
    ang = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rope(x):  # x [k, heads, hd]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * w

    def linear(x, name, bias):
        y = x @ W(name + ".weight").T
        return y + W(name + ".bias") if bias else y

    x = W("model.embed_tokens.weight")[tokens]
    captured = {}
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        if n in c.aux_layers:
            captured[n] = x.copy()
        h = rms(x, W(p + "input_layernorm.weight"))
        q = rope(linear(h, p + "self_attn.q_proj", c.qkv_bias).reshape(k, nh, hd))
        kk = rope(linear(h, p + "self_attn.k_proj", c.qkv_bias).reshape(k, nkv, hd))
        v = linear(h, p + "self_attn.v_proj", c.qkv_bias).reshape(k, nkv, hd)
        kk, v = np.repeat(kk, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # head j uses kv head j // g
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(hd) + mask[None]
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(k, nh * hd)
        x = x + linear(attn, p + "self_attn.o_proj", c.o_bias)
        h = rms(x, W(p + "post_attention_layernorm.weight"))
        gate = linear(h, p + "mlp.gate_proj", False)
        x = x + linear(gate / (1.0 + np.exp(-gate)) * linear(h, p + "mlp.up_proj", False), p + "mlp.down_proj",
                       False)
    head = W("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
    logits = rms(x, W("model.norm.weight")) @ head.T
    return logits, np.concatenate([captured[a] for a in c.aux_layers], -1)


def exact_two_tokens(cfg, tensors, ids, temperature: float, top_k: int) -> dict:
    """{(x1, x2): probability} of the first two tokens sampled after ``ids`` from the teacher's warped distribution
    (temperature, top_k; top_p 1), computed with the numpy reference forward: the ground truth of the sampling
    chi-square tests."""
    from mindspore_eagle.core.accept import warp_probs

    n = len(ids)
    l0, _ = numpy_forward(cfg, tensors, ids, np.arange(n), causal_mask(n))
    p1 = warp_probs(l0[-1:], temperature, 1.0, top_k)[0]
    exact = {}
    for x1 in np.flatnonzero(p1):
        l1, _ = numpy_forward(cfg, tensors, list(ids) + [int(x1)], np.arange(n + 1), causal_mask(n + 1))
        p2 = warp_probs(l1[-1:], temperature, 1.0, top_k)[0]
        for x2 in np.flatnonzero(p2):
            exact[(int(x1), int(x2))] = p1[x1] * p2[x2]
    return exact
