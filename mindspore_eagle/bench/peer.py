"""Optional llama.cpp side-by-side peer (``--peer-llamacpp``): the same teacher weights as an F32 GGUF, greedy
decoding through llama-cpp-python with the same thread count, on the same prompt ids as our baseline.

* :func:`write_gguf_f32` writes our float32 HF-named teacher tensors as a llama-arch GGUF with ``gguf.GGUFWriter``
  (F32, no quantisation), re-permuting q/k rows into llama.cpp's interleaved-RoPE order with :func:`permute_qk`,
  the inverse of ``models.checkpoints.unpermute_qk`` (llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``).
  Tokenizer metadata (``tokenizer.*`` keys) is copied from a source GGUF (the embedded teacher's file).
  ``models.checkpoints.load_teacher`` reads the file back to the same tensors (tests/bench/test_bench.py).
* :class:`LlamaCppPeer` runs greedy decoding (top_k 1, temperature 0, no repeat penalty) and reports tok/s
  (new tokens / wall seconds of prompt evaluation + decoding, the same definition as ours) and how much of our
  baseline output it reproduces (``match_prefix``: fraction of our tokens before the first difference; F32
  arithmetic differs in summation order, so near-ties can flip).
llama-cpp-python is optional; :func:`available` says whether it is importable. Nothing here builds it.
"""
from __future__ import annotations

import importlib.util
import time

import numpy as np

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_BLK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def available() -> bool:
    """True when ``llama_cpp`` (llama-cpp-python) can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate_half row order -> llama.cpp interleaved order (inverse of checkpoints.unpermute_qk).

    Args:
        w: [n_head * head_dim, in] weight or [n_head * head_dim] bias. n_head: num_heads (q) / num_kv_heads (k).
    """
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    """HF tensor name -> llama.cpp GGUF name (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        mid = ".".join(parts[3:-1])
        if mid in _BLK:
            return f"blk.{parts[2]}.{_BLK[mid]}.{parts[-1]}"
    raise ValueError(f"tensor {hf_name!r} has no llama.cpp GGUF name")


def _copy_tokenizer_fields(writer, source) -> int:
    """Copy every ``tokenizer.*`` metadata key of GGUF ``source`` (path or GGUFReader) into ``writer``."""
    from gguf import GGUFReader, GGUFValueType

    reader = source if isinstance(source, GGUFReader) else GGUFReader(str(source))
    n = 0
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == GGUFValueType.ARRAY and len(fld.types) > 1 else None
        writer.add_key_value(key, fld.contents(), vtype, sub_type=sub)
        n += 1
    return n


def write_gguf_f32(path, cfg, tensors: dict, tokenizer_from) -> str:
    """Write an F32 llama-arch GGUF of a teacher.

    Args:
        path: output .gguf file. cfg: models.config.ModelConfig (llama-family, no RoPE scaling). tensors: HF-named
        float32 arrays in [out, in] layout (as load_teacher returns; q/k in HF order). tokenizer_from: a GGUF file
        (or open GGUFReader) whose ``tokenizer.*`` metadata is copied.
    Returns:
        the path as a string.
    Raises:
        ValueError: unknown tensor name, or a bias on o_proj (llama.cpp's llama arch has none).
    """
    import gguf

    if cfg.o_bias:
        raise ValueError("llama.cpp's llama architecture has no attn_output bias; cannot write this teacher")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("mindspore_eagle teacher (F32)")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer_fields(w, tokenizer_from)
    for name, arr in tensors.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = np.asarray(arr, np.float32)
        if ".q_proj." in name or ".k_proj." in name:
            a = permute_qk(a, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


class LlamaCppPeer:
    """Greedy llama.cpp decoding of the F32 GGUF on the same prompt ids.

    Args:
        gguf_path: file from write_gguf_f32. n_threads: CPU threads (the same as MindSpore's kernel threads).
        n_ctx: context window (>= prompt + max_new_tokens). eos_ids: ids that end a turn.
    """

    def __init__(self, gguf_path: str, n_threads: int, n_ctx: int, eos_ids=()):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_threads=n_threads, n_threads_batch=n_threads,
                                   n_ctx=n_ctx, n_batch=512, verbose=False, seed=0)
        self.eos = set(int(e) for e in eos_ids) | {int(self.llm.token_eos())}
        self.n_threads = n_threads

    def run(self, prompt_ids, max_new_tokens: int, ref_ids=()) -> dict:
        """Greedy continuation of ``prompt_ids``; returns {"tok_s", "new_tokens", "seconds", "match_prefix"}."""
        import inspect

        want = {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "temp": 0.0, "repeat_penalty": 1.0, "reset": True}
        params = inspect.signature(self.llm.generate).parameters     # older releases lack min_p
        kwargs = {k: v for k, v in want.items() if k in params}
        out = []
        t0 = time.perf_counter()
        for tok in self.llm.generate([int(i) for i in prompt_ids], **kwargs):
            out.append(int(tok))
            if tok in self.eos or len(out) >= max_new_tokens:
                break
        dt = time.perf_counter() - t0
        ref = list(ref_ids)
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        return {"tok_s": len(out) / dt if dt > 0 else float("nan"), "new_tokens": len(out), "seconds": dt,
                "match_prefix": same / len(ref) if ref else float("nan")}


def make_peer(cfg, loaded, outdir: str, threads: int, log=print):
    """Write <outdir>/teacher_f32.gguf and return a LlamaCppPeer, or None (with a logged reason) when llama_cpp is
    not importable or the teacher has no GGUF tokenizer to copy."""
    import os

    from mindspore_eagle.serving.pipeline import resolve_teacher

    if not available():
        log("--peer-llamacpp: llama_cpp (llama-cpp-python) is not importable; peer skipped")
        return None
    src = resolve_teacher(cfg.model.teacher)
    if not str(src).lower().endswith(".gguf"):
        log(f"--peer-llamacpp: teacher {src} is not a GGUF file, no llama.cpp tokenizer metadata to copy; skipped")
        return None
    path = os.path.join(outdir, "teacher_f32.gguf")
    if not os.path.exists(path):
        write_gguf_f32(path + ".tmp", loaded.teacher_cfg, loaded.teacher_tensors, src)
        os.replace(path + ".tmp", path)
    return LlamaCppPeer(path, threads, cfg.cache.max_seq_len, loaded.teacher_cfg.eos_token_ids)


__all__ = ["available", "permute_qk", "gguf_name", "write_gguf_f32", "LlamaCppPeer", "make_peer"]
