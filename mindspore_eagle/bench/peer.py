"""Optional llama.cpp side-by-side peer (``--peer-llamacpp``): the same teacher weights as an F32 GGUF, greedy
decoding through llama-cpp-python with the same thread count, on the same prompt ids as our baseline.

* :func:`write_gguf_f32` writes our float32 HF-named teacher tensors as a llama-arch GGUF with ``gguf.GGUFWriter``
  (F32, no quantisation), re-permuting q/k rows into llama.cpp's interleaved-RoPE order with :func:`permute_qk`,
  the inverse of ``models.checkpoints.unpermute_qk`` (llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``).
  Tokenizer metadata (``tokenizer.*`` keys) is copied from a source GGUF (the embedded teacher's file).
  ``models.checkpoints.load_teacher`` reads the file back to the same tensors (tests/bench/test_bench.py).
* :class:`LlamaCppPeer` runs llama.cpp in a process of its own (``llamacpp_worker.py``, started with
  :func:`peer_env`: none of our or MindSpore's variables, so llama.cpp runs as a user would run it alone): greedy
  decoding (top_k 1, temperature 0, no repeat penalty) and greedy with llama-cpp-python's prompt-lookup
  speculation (``LlamaPromptLookupDecoding``, :data:`LOOKUP_TOKENS`). It reports tok/s (new tokens / wall seconds
  of prompt evaluation + decoding, the same definition as ours) and how much of our baseline output it reproduces
  (``match_prefix``: fraction of our tokens before the first difference; F32 arithmetic differs in summation
  order, so near-ties can flip). The bench calls it turn by turn between our runs, so drift hits both.
llama-cpp-python is optional; :func:`available` says whether it is importable. Nothing here builds it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import select
import subprocess
import sys
from pathlib import Path

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


def add_llama_hparams(w, layers: int, ctx: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
                      rope_theta: float, rms_eps: float, vocab: int) -> None:
    """The Llama-family hyper-parameter keys of a GGUF (``gguf.GGUFWriter`` ``w``, under its architecture):
    block count, context length, widths, heads, head dim (key / value / RoPE), RoPE base, RMSNorm eps, vocab."""
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(rms_eps))
    w.add_vocab_size(vocab)


def write_gguf_f32(path, cfg, tensors: dict, tokenizer_from) -> str:
    """Write an F32 llama-arch GGUF of a teacher.

    Args:
        path: output .gguf file. cfg: models.model_config.ModelConfig (llama-family, no RoPE scaling). tensors: HF-named
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
    add_llama_hparams(w, cfg.num_layers, cfg.max_position_embeddings, cfg.hidden_size, cfg.intermediate_size,
                      cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps, cfg.vocab_size)
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


PEER_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MSEAGLE_", "MS_")
"""Variables a peer process never inherits: OpenMP's (``OMP_WAIT_POLICY``, thread counts), ours and MindSpore's."""

WORKER = Path(__file__).with_name("llamacpp_worker.py")


def peer_env(environ=None) -> dict:
    """A copy of ``environ`` (default ``os.environ``) without :data:`PEER_ENV_PREFIXES` variables: the peer runs
    with llama.cpp's own defaults, not with whatever this process (or MindSpore in it) set."""
    env = dict(os.environ if environ is None else environ)
    return {k: v for k, v in env.items() if not k.startswith(PEER_ENV_PREFIXES)}


class PeerError(RuntimeError):
    """The peer process failed or answered with an error (message: its one-line reason)."""


class PeerProcess:
    """``llamacpp_worker.py`` in a child process of its own with :func:`peer_env`, spoken to by JSON lines.

    Args:
        timeout: seconds to wait for one answer. Raises PeerError from :meth:`call` when the process died, did not
        answer in time, or answered ``{"error": ...}``.
    """

    def __init__(self, timeout: float = 600.0):
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=peer_env(), bufsize=1)

    def call(self, **req) -> dict:
        if self.proc.poll() is not None:
            raise PeerError(f"llama.cpp peer process exited with status {self.proc.returncode}")
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise PeerError(f"llama.cpp peer process gave no answer to {req.get('cmd')!r} "
                            f"({'timed out' if not ready else 'exited'})")
        try:
            ans = json.loads(line)
        except json.JSONDecodeError:
            self.close()
            raise PeerError(f"llama.cpp peer answered {line[:120]!r}, not a JSON line") from None
        if "error" in ans:
            raise PeerError(f"llama.cpp peer: {ans['error']}")
        return ans

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


LOOKUP_TOKENS = (2, 10)
"""``num_pred_tokens`` of the two prompt-lookup peers (llama-cpp-python's LlamaPromptLookupDecoding; 10 is its
default, 2 what its docs suggest for a CPU)."""


class LlamaCppPeer:
    """llama.cpp on the F32 GGUF in a process of its own: greedy, and greedy with its prompt-lookup speculation.

    Args:
        gguf_path: file from write_gguf_f32. n_threads: CPU threads (the same as MindSpore's kernel threads).
        n_ctx: the longest prompt + max_new_tokens of any call (``cache.max_seq_len``); each process gets
        ``n_ctx + max(lookup) + 1``, since a prompt-lookup step evaluates its drafts past the last kept token (and
        llamacpp_worker.py gives those variants a logits buffer of the whole context). eos_ids: ids that end a
        turn. lookup:
        ``num_pred_tokens`` of each prompt-lookup variant (:data:`LOOKUP_TOKENS`; () = greedy only).
    Raises:
        PeerError: the process could not load the model.
    """

    def __init__(self, gguf_path: str, n_threads: int, n_ctx: int, eos_ids=(), lookup=LOOKUP_TOKENS):
        self.proc = PeerProcess()
        self.n_ctx = int(n_ctx) + max((int(n) for n in lookup), default=0) + 1
        self.variants = self.proc.call(cmd="load", model=str(gguf_path), n_threads=int(n_threads), n_ctx=self.n_ctx,
                                       lookup=[int(n) for n in lookup])["variants"]
        self.eos = [int(e) for e in eos_ids]
        self.n_threads = n_threads

    def generate(self, variant: str, prompt_ids, max_new_tokens: int, ref_ids=()) -> dict:
        """One variant's greedy continuation: {"tok_s", "new_tokens", "seconds", "match_prefix"} (tok/s = new
        tokens / wall seconds of prompt evaluation + decoding, as ours; match_prefix = share of ``ref_ids`` before
        the first difference, F32 sums differ in order so near-ties can flip)."""
        ans = self.proc.call(cmd="generate", variant=variant, prompt_ids=[int(i) for i in prompt_ids],
                             max_new_tokens=int(max_new_tokens), eos=self.eos)
        out, dt = ans["ids"], float(ans["seconds"])
        ref = list(ref_ids)
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        return {"tok_s": len(out) / dt if dt > 0 else float("nan"), "new_tokens": len(out), "seconds": dt,
                "match_prefix": same / len(ref) if ref else float("nan")}

    def run(self, prompt_ids, max_new_tokens: int, ref_ids=()) -> dict:
        """Greedy, then every prompt-lookup variant, on one prompt: the greedy result's fields plus ``lookup``
        {num_pred_tokens: the same fields}."""
        rec = self.generate("greedy", prompt_ids, max_new_tokens, ref_ids)
        rec["lookup"] = {v[len("lookup"):]: self.generate(v, prompt_ids, max_new_tokens, ref_ids)
                         for v in self.variants if v.startswith("lookup")}
        return rec

    def forward_ms(self, ctx_ids, ks, repeat: int = 5) -> dict:
        """{"decode_ms", "ms": {k: ms}} of one eval of k tokens after ``ctx_ids`` (logits for all k rows)."""
        return self.proc.call(cmd="forward", ctx_ids=[int(i) for i in ctx_ids], ks=[int(k) for k in ks],
                              repeat=int(repeat))

    def close(self) -> None:
        self.proc.close()


def write_peer_gguf(cfg, loaded, outdir: str, log=print, what: str = "--peer-llamacpp"):
    """``<outdir>/teacher_f32-<tag>.gguf`` of the config's teacher (written once, atomically; the tag names the
    source GGUF by path and size, so a folder shared by runs of two teachers holds one file each), or None with a
    logged reason when the teacher has no GGUF tokenizer metadata to copy.

    Args:
        cfg: the run's Config. loaded: ``pipeline.load_models(cfg)`` (None: loaded here only when the file is
        missing). outdir: folder of the file. log: where the reason goes. what: the option named in the reason.
    """
    from mindspore_eagle.serving.pipeline import load_models, resolve_teacher

    src = resolve_teacher(cfg.model.teacher)
    if not str(src).lower().endswith(".gguf"):
        log(f"{what}: teacher {src} is not a GGUF file, no llama.cpp tokenizer metadata to copy; skipped")
        return None
    tag = hashlib.sha256(f"{os.path.abspath(src)}:{os.path.getsize(src)}".encode()).hexdigest()[:12]
    path = os.path.join(outdir, f"teacher_f32-{tag}.gguf")
    if not os.path.exists(path):
        loaded = loaded or load_models(cfg)
        write_gguf_f32(path + ".tmp", loaded.teacher_cfg, loaded.teacher_tensors, src)
        os.replace(path + ".tmp", path)
    return path


def make_peer(cfg, loaded, outdir: str, threads: int, log=print, lookup=LOOKUP_TOKENS):
    """Write <outdir>/teacher_f32-<tag>.gguf (``write_peer_gguf``) and return a :class:`LlamaCppPeer` on it, or None (with a logged reason)
    when llama_cpp is not importable or the teacher has no GGUF tokenizer to copy."""
    if not available():
        log("--peer-llamacpp: llama_cpp (llama-cpp-python) is not importable; peer skipped")
        return None
    path = write_peer_gguf(cfg, loaded, outdir, log)
    if path is None:
        return None
    return LlamaCppPeer(path, threads, cfg.cache.max_seq_len, loaded.teacher_cfg.eos_token_ids, lookup)


__all__ = ["add_llama_hparams", "available", "permute_qk", "gguf_name", "write_gguf_f32", "peer_env", "PeerProcess", "PeerError",
           "LlamaCppPeer", "LOOKUP_TOKENS", "write_peer_gguf", "make_peer"]
