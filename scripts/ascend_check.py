#!/usr/bin/env python3
"""First command on an Ascend machine: the fused-kernel path against the portable path, on the device.

    python scripts/ascend_check.py --config configs/openpangu_embedded_7b.yaml \
        --config configs/presets/ascend_openpangu_7b.yaml [--set model.dtype=float16] [--kernels-only] [--out r.json]

Two stages, each printed as a table and summarised in ``--out`` (JSON):
1. kernels: one attention layer's write + attend on random data, ``attention.FusedBackend`` (ReshapeAndCache +
   PagedAttention with mask and q_seq_lens, cache [NB + 1, B, n_kv, hd]) vs ``attention.PortableBackend``
   (ScatterUpdate / gather / matmul softmax), same K/V, same slots, same block table (shuffled blocks, pad block
   in the padding), for decode (k = 1), a tree (k = M, random ancestor mask) and a prefill chunk (k = chunk,
   causal); plus the cache content read back in the documented layout (slot s, head h at cache[s // B, s % B, h]).
2. model (unless ``--kernels-only``): the configured teacher in the configured dtype, built once per backend (one
   after the other, so the weights are on the device once at a time), runs the same call sequence: chunked
   prefill of a chat prompt, 4 greedy decodes, a chain tree and a random tree verified (M rows), commit of the
   longest path, decode, verify + rollback, decode. Compared: max |logit difference| relative to max |logit| per
   stage, and whether the greedy tokens agree.
Exit code 0 when every relative difference is below the tolerance (float32 1e-3, half types 5e-2) and the greedy
tokens agree, 1 otherwise, 2 on a configuration error. The fused kernels exist on Ascend only; on CPU the script
runs as a dry run of itself with ``--reference`` (the numpy kernel models of tests/ascend_reference.py replace the
Ascend ops; PyNative mode forced):
    python scripts/ascend_check.py --reference --set model.drafter=none --set model.dtype=float16
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import numpy as np

TOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 5e-2}


def kernel_cases(dtype_name: str, M: int, chunk: int, seed: int = 0, kernels=None) -> list[dict]:
    """Stage 1: one layer's write + attend through both backends; a row per case."""
    import mindspore as ms

    from mindspore_eagle.kernels.attention import (
        MASKED_SCORE,
        FusedBackend,
        PortableBackend,
    )
    from mindspore_eagle.kernels.kv import slot_view
    from mindspore_eagle.models.llama import COMPUTE_DTYPES

    dt = COMPUTE_DTYPES[dtype_name]
    nb, B, nkv, nh, hd = 16, 32, 8, 32, 128
    rng = np.random.default_rng(seed)
    rows = []
    for name, k in (("decode", 1), ("tree", M), ("prefill", chunk)):
        ctx = 3 * B + 5                                            # tokens already cached before the k new ones
        n_blocks = -(-(ctx + k) // B)
        table = np.full(8, nb, np.int32)                           # width 8 blocks; padding = pad block
        table[:n_blocks] = rng.permutation(nb)[:n_blocks]
        pos = np.arange(ctx + k)
        slots_all = table[pos // B] * B + pos % B
        w = table.size * B
        mask = np.full((k, w), -1e9, np.float32)
        mask[:, :ctx] = 0.0
        if name == "tree":
            anc = np.tril(rng.random((k, k)) < 0.4, -1) | np.eye(k, dtype=bool)
        else:
            anc = np.tril(np.ones((k, k), bool))
        mask[:, ctx:ctx + k] = np.where(anc, 0.0, -1e9)
        q = rng.standard_normal((k, nh, hd)).astype(np.float32)
        kk = rng.standard_normal((ctx + k, nkv, hd)).astype(np.float32)
        vv = rng.standard_normal((ctx + k, nkv, hd)).astype(np.float32)
        outs, caches = {}, {}
        fused = FusedBackend(nb, B, nkv, nh, hd, dt, 1 / np.sqrt(hd), *([kernels] if kernels else []))
        for be in (PortableBackend(nb, B, nkv, hd, dt), fused):
            kc, vc = be.make_cache("k_" + be.name), be.make_cache("v_" + be.name)
            T = lambda a: ms.Tensor(a, dt)                          # noqa: E731
            # the context first (as earlier calls would have written it), then the k new tokens with attention
            pre_mask = np.zeros((ctx, w), np.float32)
            meta = be.prepare(ms.Tensor(slots_all[:ctx].astype(np.int32)), ms.Tensor(table), ms.Tensor(pre_mask))
            be.attend(T(np.zeros((ctx, nh, hd), np.float32)), T(kk[:ctx]), T(vv[:ctx]), kc, vc, meta,
                      1 / np.sqrt(hd))
            meta = be.prepare(ms.Tensor(slots_all[ctx:].astype(np.int32)), ms.Tensor(table), ms.Tensor(mask))
            out = be.attend(T(q), T(kk[ctx:]), T(vv[ctx:]), kc, vc, meta, 1 / np.sqrt(hd))
            outs[be.name] = out.astype(ms.float32).asnumpy()
            c = kc.astype(ms.float32).asnumpy()
            caches[be.name] = slot_view(c, nkv)[slots_all] if be.name == "portable" else \
                c[slots_all // B, slots_all % B]
        # float64 reference of the documented semantics (scores scaled, mask added, softmax, times V)
        ref = np.zeros((k, nh, hd))
        keys, vals = kk.astype(np.float64), vv.astype(np.float64)
        for h in range(nh):
            s = q[:, h].astype(np.float64) @ keys[:, h // (nh // nkv)].T / np.sqrt(hd) + mask[:, :ctx + k]
            p = np.exp(s - s.max(-1, keepdims=True))
            ref[:, h] = (p / p.sum(-1, keepdims=True)) @ vals[:, h // (nh // nkv)]
        ref = ref.reshape(k, nh * hd)
        scale = np.abs(ref).max()
        rows.append({"case": name, "k": k, "fused_vs_portable": float(np.abs(outs["fused"] - outs["portable"]).max()
                                                                      / scale),
                     "fused_vs_float64": float(np.abs(outs["fused"] - ref).max() / scale),
                     "portable_vs_float64": float(np.abs(outs["portable"] - ref).max() / scale),
                     "cache_layout": float(np.abs(caches["fused"] - caches["portable"]).max()),
                     "masked_score": MASKED_SCORE})
    return rows


def model_trace(cfg, loaded, attention: str, seed: int = 0) -> dict:
    """Stage 2: the teacher's logits over one fixed call sequence with the given backend."""
    from mindspore_eagle.core.tree import DraftTree, chain_tree, tensorize
    from mindspore_eagle.models.llama import COMPUTE_DTYPES, LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    c, sp = cfg.cache, cfg.speculative
    teacher = LlamaModel(loaded.teacher_cfg, c.num_blocks, c.block_size, c.max_seq_len,
                           COMPUTE_DTYPES[cfg.model.dtype], attention=attention)
    teacher.load_hf_weights(loaded.teacher_tensors)
    r = TeacherRunner(teacher, c.num_blocks, c.block_size, c.max_seq_len, cfg.exec_mode, c.prefill_chunk)
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Explain paged attention in two "
                                               "sentences, then list three prime numbers."}]))
    rng = np.random.default_rng(seed)
    out = {"backend": type(teacher.backend).__name__, "stages": {}}

    def rec(name, logits):
        out["stages"].setdefault(name, []).append(np.asarray(logits, np.float32))
        return logits

    sid = r.new_seq()
    last, _ = r.prefill(sid, ids)
    rec("prefill", last[None])
    for _ in range(4):
        last, _ = r.decode(sid, int(np.argmax(last)))
        rec("decode", last[None])
    M, D = sp.M, sp.D_max
    V = loaded.teacher_cfg.vocab_size
    root = int(np.argmax(last))
    trees = [chain_tree([root] + [int(t) for t in rng.integers(0, V, min(D, M - 1))])]
    parents, tokens = [0], [root]
    for i in range(1, M):
        parents.append(int(rng.integers(0, i)))
        tokens.append(int(rng.integers(0, V)) + 0)
    trees.append(DraftTree(tokens, parents))
    for tree, action in zip(trees, ("commit", "rollback")):
        try:
            tt = tensorize(tree, M, max(D, 64))
        except ValueError:
            tt = tensorize(chain_tree(tree.tokens[:2]), M, max(D, 64))
        logits, _ = r.verify(sid, tt)
        rec("verify", logits)
        if action == "commit":
            path = max((row[row < M] for row in tt.retrieve), key=len)
            r.commit(sid, path, len(path))
        else:
            r.rollback(sid)
        last, _ = r.decode(sid, int(rng.integers(0, V)))
        rec("decode_after_" + action, last[None])
    del r, teacher
    gc.collect()
    return out


def _reference_kernels():
    """``ReferenceKernels`` of tests/ascend_reference.py (the numpy kernel models), loaded from this checkout."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "ascend_reference.py")
    spec = importlib.util.spec_from_file_location("ascend_reference", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ascend_reference"] = mod                     # as an import by name would (the recipe of importlib)
    spec.loader.exec_module(mod)
    return mod.ReferenceKernels


def main(argv=None) -> int:
    from mindspore_eagle.cli import _add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="ascend_check.py", description=__doc__.split("\n\n")[0])
    _add_config_args(p, generation=False)
    p.add_argument("--kernels-only", action="store_true", help="stage 1 only (no checkpoint needed)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--reference", action="store_true",
                   help="CPU dry run: numpy kernel models (tests/ascend_reference.py) instead of the Ascend ops")
    a = p.parse_args(argv)
    if a.reference:
        a.set = list(a.set) + ["context.mode=1"]
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import mindspore as ms

    from mindspore_eagle.kernels import runtime

    runtime.configure(cfg.context.threads or None, cfg.context.device_target, cfg.context.device_id)
    if cfg.model.dtype == "float32":
        print("error: model.dtype = 'float32': the fused kernels take float16 or bfloat16 only (ReshapeAndCache); "
              "use --set model.dtype=bfloat16", file=sys.stderr)
        return 2
    tol = TOL[cfg.model.dtype]
    report = {"device_target": cfg.context.device_target, "mindspore": ms.__version__, "dtype": cfg.model.dtype,
              "tolerance": tol}
    ok = True
    print(f"device {cfg.context.device_target}, MindSpore {ms.__version__}, dtype {cfg.model.dtype}, tol {tol}")
    kernels = None
    if a.reference:
        from mindspore_eagle.kernels import attention

        kernels = _reference_kernels().factory(infer_check=True)   # + MindSpore's own inference of each call
        attention.AscendKernels = kernels                         # model stage: FusedBackend's default kernels
        report["kernels_used"] = "numpy reference (dry run)"
    rows = kernel_cases(cfg.model.dtype, cfg.speculative.M, cfg.cache.prefill_chunk, kernels=kernels)
    report["kernels"] = rows
    print(f"{'case':8} {'k':>4} {'fused-portable':>15} {'fused-f64':>10} {'portable-f64':>13} {'cache':>8}")
    for row in rows:
        good = row["fused_vs_portable"] < tol and row["cache_layout"] == 0.0
        ok &= good
        print(f"{row['case']:8} {row['k']:>4} {row['fused_vs_portable']:>15.2e} {row['fused_vs_float64']:>10.2e} "
              f"{row['portable_vs_float64']:>13.2e} {row['cache_layout']:>8.1e} {'ok' if good else 'FAIL'}")
    if not a.kernels_only:
        from mindspore_eagle.serving.pipeline import load_models

        loaded = load_models(cfg)
        traces = {name: model_trace(cfg, loaded, name) for name in ("fused", "portable")}
        report["model"] = {"backends": {k: v["backend"] for k, v in traces.items()}, "stages": {}}
        print(f"{'stage':22} {'rel diff':>9} {'argmax agree':>13}")
        for stage, fl in traces["fused"]["stages"].items():
            pl = traces["portable"]["stages"][stage]
            rel = max(float(np.abs(f - q).max() / np.abs(q).max()) for f, q in zip(fl, pl))
            agree = float(np.mean(np.concatenate([np.argmax(f, -1) == np.argmax(q, -1) for f, q in zip(fl, pl)])))
            good = rel < tol and agree == 1.0
            ok &= good
            report["model"]["stages"][stage] = {"rel_diff": rel, "argmax_agree": agree}
            print(f"{stage:22} {rel:>9.2e} {agree:>13.3f} {'ok' if good else 'FAIL'}")
    report["ok"] = bool(ok)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
