"""Helpers shared by test files: teacher runners, drafter checkpoints and engines on the tiny openPangu
checkpoint (the ``tiny_dir`` / ``tiny`` fixtures of conftest.py), random draft trees, batch records, the tolerance
of the CPU kernel contracts, and the tiny teacher's server in a child process with its OpenAI client calls."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mindspore_eagle.config import load_config
from mindspore_eagle.models.eagle3 import (
    DrafterConfig,
    init_drafter_tensors,
    save_drafter,
)

if TYPE_CHECKING:
    import openai


def make_target(loaded_cfg, tensors, mode, num_blocks=32, block_size=8, max_seq_len=128, chunk=16, host=None):
    """A TeacherRunner of the loaded tiny teacher (``host`` as TeacherRunner: False = every call a graph)."""
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    net = LlamaModel(loaded_cfg, num_blocks, block_size, max_seq_len)
    net.load_hf_weights(tensors)
    return TeacherRunner(net, num_blocks, block_size, max_seq_len, mode, chunk, host=host)


def tiny_tree(rng, root, M, D, vocab):
    """A random DraftTree (root + up to M-1 nodes, depth <= D, distinct sibling tokens)."""
    from mindspore_eagle.core.tree import DraftTree

    n = int(rng.integers(1, M + 1))
    parents, depth, tokens = [0], [0], [root]
    for i in range(1, n):
        cands = [j for j in range(i) if depth[j] < D]
        p = int(rng.choice(cands))
        used = {tokens[c] for c in range(1, i) if parents[c] == p}
        t = int(rng.integers(0, vocab))
        while t in used:
            t = int(rng.integers(0, vocab))
        parents.append(p), depth.append(depth[p] + 1), tokens.append(t)
    return DraftTree(tokens, parents)


def tiny_drafter_dir(tmp_path, tcfg, seed=0, vd=96, layers=1, fc_norm=False):
    rng = np.random.default_rng(seed)
    used = np.sort(rng.choice(tcfg.vocab_size, vd, replace=False))
    dcfg = DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=tcfg.vocab_size, draft_vocab_size=vd,
                         target_hidden_size=tcfg.hidden_size, aux_layers=tcfg.aux_layers, num_hidden_layers=layers,
                         fc_norm=fc_norm)
    t = init_drafter_tensors(dcfg, seed, used)
    t = {k: (v * 25 if k == "lm_head.weight" else v) for k, v in t.items()}   # spread draft logits
    for k in t:                                          # later layers: non-zero output projections (not identity)
        if k.startswith("layers.") and k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = (rng.normal(size=t[k].shape) * 0.2).astype(np.float32)
    if fc_norm:                                          # unequal chunk weights (folded into fc at load)
        t.update({f"fc_norm.{c}.weight": rng.uniform(0.5, 2.0, tcfg.hidden_size).astype(np.float32) for c in range(3)})
    d = tmp_path / (f"drafter{seed}" + (f"_l{layers}" if layers > 1 else "") + ("_fcn" if fc_norm else ""))
    save_drafter(str(d), dcfg, t)
    return d


def tiny_engine(tiny_dir, drafter_dir, mode, extra=()):
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = load_config(None, [f"model.teacher={tiny_dir}", f"model.drafter={drafter_dir}",
                             f"speculative.mode={mode}", "speculative.policy=fixed", "speculative.method=eagle3",
                             "cache.block_size=8", "cache.max_seq_len=256",
                             "cache.num_blocks=64", "cache.prefill_chunk=16", *extra])
    return build_engine(cfg), cfg


PROMPTS = ["What is the capital of France?", "Write a short story about a robot.", "def add(a, b):"]


class ScriptedGate:
    """A RateGate stand-in that cycles through a fixed list of step kinds."""

    def __init__(self, pattern):
        self.pattern, self.i, self.seen = pattern, 0, set()

    def choose(self):
        kind = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        return kind

    def observe(self, kind, tokens, ms, extra_ms=0.0):
        self.seen.add(kind)


def records(objs) -> list:
    """batch_job.Record objects of dicts, as if read from lines 1, 2, ... of an input file."""
    from mindspore_eagle.serving import batch_job

    return [batch_job.parse_record(i + 1, i, json.dumps(o)) for i, o in enumerate(objs)]


# ------------------------------------------------------------------------------------------ CPU kernels --
TOL = 1e-5          # relative to the reference's largest magnitude (float32 kernels, float64 references)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def round_matrices(net, names):
    """Round every Parameter of ``net`` whose name ends with one of ``names`` to float16 values (kept float32)."""
    import mindspore as ms

    for p in net.get_parameters():
        if p.name.split(".")[-1] in names:
            p.set_data(ms.Tensor(p.asnumpy().astype(np.float16).astype(np.float32)))


# --------------------------------------------------------------------------------- the server's process --
ROOT = Path(__file__).resolve().parents[1]
SERVER_PROMPTS = ["What is the capital of France?", "Hi", "Write a short story about a robot who learns to paint.",
                  "def add(a, b):", "List three colours.", "2+2?", "Tell me about the sea.", "Name a fruit.",
                  "Why is the sky blue?", "Count to five.", "Say hello in French.", "What is water?", "Spell 'cat'.",
                  "Give me a word that rhymes with moon.", "Who wrote Hamlet?", "What day comes after Monday?"]
MODEL = "tiny"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def tiny_overrides(tiny_dir, drafter="none") -> list[str]:
    """The tiny teacher's config: 256-slot sequences of 8-token blocks, 16-token prefill chunks, 24 new tokens."""
    return [f"model.teacher={tiny_dir}", f"model.drafter={drafter}", "cache.block_size=8", "cache.max_seq_len=256",
            "cache.prefill_chunk=16", "generation.max_new_tokens=24", "context.graph_cache=false",
            "context.threads=1", f"serve.model_name={MODEL}"]


class ServerProcess:
    """``python -m mindspore_eagle serve --port 0 ...`` in a child process; ``url`` once it listens, ``ready()``
    once /health answers 200 (``warming`` = the statuses seen before)."""

    def __init__(self, sets: list[str], args=(), env=None):
        cmd = [sys.executable, "-m", "mindspore_eagle", "serve", "--port", "0", *args]
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **(env or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = None
        self.warming: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.url is None and line.startswith("serving ") and " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]

    def log(self) -> str:
        return "\n".join(self.lines[-40:])

    def ready(self, timeout: float = 600.0) -> ServerProcess:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
            if self.url is not None:
                try:
                    status = httpx.get(self.url + "/health", timeout=5).status_code
                except httpx.TransportError:
                    status = None
                if status == 200:
                    return self
                self.warming.append(status)
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log()}")

    def client(self, **kw) -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 300), **kw)

    def metrics(self) -> dict:
        """{(sample name, frozenset(labels)): value} of GET /metrics (prometheus_client's parser)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def chat(client, prompt, model=MODEL, **kw):
    """A chat completion of one user message; ``max_tokens`` 24 (the reference's) unless given (the server's own
    default is the rest of the context)."""
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], **kw)


def chat_stream(client, prompt, **kw) -> tuple[str, str, dict | None]:
    """(text, finish_reason, usage) of a streamed chat completion."""
    text, finish, use = "", None, None
    for ch in chat(client, prompt, stream=True, stream_options={"include_usage": True}, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            use = ch.usage
    return text, finish, use
