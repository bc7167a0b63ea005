"""A llama-arch GGUF file from a ModelConfig and HF-named float32 tensors, with a byte-level BPE tokenizer and a
ChatML-like template (for the loaders' tests: weights cache, memory)."""
import numpy as np


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_BLK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """The GGUF name of an HF-named Llama tensor (model.layers.N.self_attn.q_proj.weight -> blk.N.attn_q.weight),
    spelled here apart from the loader's map, so that the loader's tests check that map."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, i, *mid, leaf = hf_name.split(".")
    return f"blk.{i}.{_BLK['.'.join(mid)]}.{leaf}"


def write_llama_gguf(path, cfg, tensors):
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
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]      # a vocabulary as large as cfg's
    for add, value in ((w.add_block_count, cfg.num_layers), (w.add_context_length, cfg.max_position_embeddings),
                       (w.add_embedding_length, cfg.hidden_size), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_heads), (w.add_head_count_kv, cfg.num_kv_heads),
                       (w.add_rope_freq_base, cfg.rope_theta), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_dimension_count, cfg.head_dim), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "smollm"), (w.add_token_list, tokens),
                       (w.add_token_types, [3, 3] + [1] * 259 + [5] * (len(tokens) - 261)),
                       (w.add_token_merges, ["Ġ t", "h e", "Ġt he"]), (w.add_bos_token_id, 0), (w.add_eos_token_id, 1),
                       (w.add_add_bos_token, False),
                       (w.add_chat_template, ("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                                              "{% endfor %}"))):
        add(value)
    for name, arr in tensors.items():
        w.add_tensor(gguf_name(name), np.ascontiguousarray(arr))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path
