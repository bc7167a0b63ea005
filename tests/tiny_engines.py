"""Helpers shared by test files: teacher runners, drafter checkpoints and engines on the tiny openPangu
checkpoint (the ``tiny_dir`` / ``tiny`` fixtures of conftest.py), random draft trees, batch records."""
from __future__ import annotations

import json

import numpy as np

from mindspore_eagle.config import load_config
from mindspore_eagle.models.eagle3 import (
    DrafterConfig,
    init_drafter_tensors,
    save_drafter,
)


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

    def observe(self, kind, tokens, ms):
        self.seen.add(kind)


def records(objs) -> list:
    """batch_job.Record objects of dicts, as if read from lines 1, 2, ... of an input file."""
    from mindspore_eagle.serving import batch_job

    return [batch_job.parse_record(i + 1, i, json.dumps(o)) for i, o in enumerate(objs)]
