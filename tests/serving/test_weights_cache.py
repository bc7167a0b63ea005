"""serving/weights_cache.py: a GGUF teacher read once, then loaded from its .npy + JSON copy with the same config,
tensors and tokenizer; a damaged copy is read again from the GGUF; other checkpoints are not copied."""
import json

import numpy as np
from tiny_pangu import random_tensors

from mindspore_eagle.models.checkpoints import load_teacher
from mindspore_eagle.models.model_config import ModelConfig


def _gguf(path, cfg, tensors):
    """A llama-arch GGUF with a byte-level BPE tokenizer (the layout of tests/models/test_checkpoints.py)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b), cs.append(256 + n)
            n += 1
    tokens = ["<|im_start|>", "<|im_end|>"] + [chr(c) for _, c in sorted(zip(bs, cs))] + ["Ġt", "he", "Ġthe"]
    for add, value in ((w.add_block_count, cfg.num_layers), (w.add_context_length, cfg.max_position_embeddings),
                       (w.add_embedding_length, cfg.hidden_size), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_heads), (w.add_head_count_kv, cfg.num_kv_heads),
                       (w.add_rope_freq_base, cfg.rope_theta), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_dimension_count, cfg.head_dim), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "smollm"), (w.add_token_list, tokens),
                       (w.add_token_types, [3, 3] + [1] * (len(tokens) - 2)),
                       (w.add_token_merges, ["Ġ t", "h e", "Ġt he"]), (w.add_bos_token_id, 0), (w.add_eos_token_id, 1),
                       (w.add_add_bos_token, False),
                       (w.add_chat_template, ("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                                              "{% endfor %}"))):
        add(value)
    rename = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    blk = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, arr in tensors.items():
        if name in rename:
            gname = rename[name]
        else:
            _, _, i, *mid, leaf = name.split(".")
            gname = f"blk.{i}.{blk['.'.join(mid)]}.{leaf}"
        w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_a_gguf_teacher_is_read_once(tmp_path, monkeypatch):
    from mindspore_eagle.serving import weights_cache as wc

    cfg = ModelConfig(vocab_size=261, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      max_position_embeddings=256, arch="llama")
    path = _gguf(tmp_path / "t.gguf", cfg, random_tensors(cfg, seed=3))
    ref_cfg, ref_tensors, ref_tok = load_teacher(path)
    root = tmp_path / "weights"
    first = wc.load_teacher_cached(path, root)
    (copy,) = list(root.iterdir())
    assert json.loads((copy / "meta.json").read_text())["tensors"] == list(ref_tensors)
    calls = []
    monkeypatch.setattr("mindspore_eagle.models.checkpoints.load_teacher", lambda p: calls.append(p) or first)
    again_cfg, again_tensors, again_tok = wc.load_teacher_cached(path, root)
    assert calls == [] and again_cfg == ref_cfg == first[0]
    assert list(again_tensors) == list(ref_tensors)
    assert all(np.array_equal(again_tensors[k], v) and again_tensors[k].dtype == np.float32
               for k, v in ref_tensors.items())
    text = "<|im_start|>the thethe 123 tea<|im_end|>"
    msgs = [{"role": "user", "content": "the <|im_end|> tea"}]
    for a, b in ((again_tok, ref_tok),):
        assert a.encode(text) == b.encode(text) and a.decode(b.encode(text)) == text
        assert a.encode_chat(msgs) == b.encode_chat(msgs)
        assert (a.vocab_size, a.bos_token_id, a.eos_token_ids, a.add_bos, a.chat_template, a.special_tokens,
                a.template_vars) == (b.vocab_size, b.bos_token_id, b.eos_token_ids, b.add_bos, b.chat_template,
                                     b.special_tokens, b.template_vars)
    next((copy / "tensors").iterdir()).write_bytes(b"damaged")          # a damaged copy: read the GGUF again
    assert wc.load_teacher_cached(path, root)[0] == ref_cfg and calls == [path]
    stale = root / (copy.name.split("-")[0] + "-000000000000")            # a copy from older sources
    stale.mkdir()
    monkeypatch.setattr(wc, "_SOURCES", wc._SOURCES[:-1])                  # the loader changed: a new copy
    wc.load_teacher_cached(path, root)
    assert len(calls) == 2 and [p.name for p in root.iterdir()] == [wc.cache_key(path)] != [copy.name]


def test_other_checkpoints_are_not_copied(tmp_path, tiny_dir):
    from mindspore_eagle.serving import weights_cache as wc

    wc.load_teacher_cached(tiny_dir, tmp_path / "weights")              # safetensors: memory-mapped already
    assert not (tmp_path / "weights").exists()
