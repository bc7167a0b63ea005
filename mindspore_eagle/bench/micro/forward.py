"""Cost of the teacher's forward on this machine, beside a numpy-only forward of the same shapes (one run).

Prints, for the embedded default teacher (or --teacher PATH):
  - teacher-only decode ms/token in fused (jit) mode (and eager / PyNative with --eager), after a 256-token context;
  - prefill tok/s (256 tokens, chunk 128);
  - one forward over k = 1, 4, 8, 16, 32 query tokens (logits for all k rows, as tree verification needs)
    against a 256-token cached context, MindSpore fused vs a float32 numpy implementation of the same math
    (fused q/k/v and gate/up weights in [out, in] layout, GQA attention over the cached K/V);
  - the drafter's cost per round;
  - llama.cpp on the same F32 weights in a process of its own with a clean environment (bench/peer.py), the same
    k rows after the same 256-token context, logits for all k rows, beside ours (where llama-cpp-python is
    installed: pip install -e ".[peer-forward]").
Not a test: figures only. Usage: python -m mindspore_eagle.bench.micro.forward [--teacher PATH] [--repeat 5] [--eager]
"""
import argparse
import os
import time

import numpy as np

from mindspore_eagle.kernels import runtime


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


class NumpyTeacher:
    """float32 numpy forward of the same network with a dense per-layer K/V context (the bandwidth reference)."""

    def __init__(self, cfg, t, ctx=256, seed=0):
        self.c = cfg
        hd = cfg.head_dim
        L = cfg.num_layers
        self.layers = []
        for i in range(L):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                wqkv=np.ascontiguousarray(np.concatenate([t[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])),
                wo=t[p + "self_attn.o_proj.weight"], ln1=t[p + "input_layernorm.weight"],
                ln2=t[p + "post_attention_layernorm.weight"],
                wgu=np.ascontiguousarray(np.concatenate([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]])),
                wd=t[p + "mlp.down_proj.weight"]))
        rng = np.random.default_rng(seed)
        self.kc = rng.normal(size=(L, ctx, cfg.num_kv_heads, hd)).astype(np.float32)
        self.vc = rng.normal(size=(L, ctx, cfg.num_kv_heads, hd)).astype(np.float32)
        self.embed = t["model.embed_tokens.weight"]
        self.head = t.get("lm_head.weight", self.embed)
        self.norm = t["model.norm.weight"]
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2) / hd))
        ang = np.arange(4096)[:, None] * inv[None]
        self.cos = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32)
        self.sin = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32)

    def forward(self, tokens, positions):
        c = self.c
        k, nh, nkv, hd = len(tokens), c.num_heads, c.num_kv_heads, c.head_dim
        g = nh // nkv
        x = self.embed[tokens]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]

        def rms(v, w):
            return v / np.sqrt((v * v).mean(-1, keepdims=True) + c.rms_norm_eps) * w

        def rope(v):
            return v * cos + np.concatenate([-v[..., hd // 2:], v[..., :hd // 2]], -1) * sin

        for i, ly in enumerate(self.layers):
            qkv = rms(x, ly["ln1"]) @ ly["wqkv"].T
            q = rope(qkv[:, :nh * hd].reshape(k, nh, hd))
            kk = rope(qkv[:, nh * hd:(nh + nkv) * hd].reshape(k, nkv, hd))
            v = qkv[:, (nh + nkv) * hd:].reshape(k, nkv, hd)
            keys = np.concatenate([self.kc[i], kk])                      # [ctx + k, nkv, hd]
            vals = np.concatenate([self.vc[i], v])
            qg = q.reshape(k, nkv, g, hd).transpose(1, 2, 0, 3).reshape(nkv, g * k, hd)
            s = qg @ keys.transpose(1, 2, 0) / np.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            ctx = (s @ vals.transpose(1, 0, 2)).reshape(nkv, g, k, hd).transpose(2, 0, 1, 3).reshape(k, nh * hd)
            x = x + ctx @ ly["wo"].T
            gu = rms(x, ly["ln2"]) @ ly["wgu"].T
            f = gu.shape[1] // 2
            x = x + (gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:]) @ ly["wd"].T
        return rms(x, self.norm) @ self.head.T


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="embedded")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ks", default="1,4,8,16,32")
    ap.add_argument("--eager", action="store_true", help="also time PyNative decoding (slow)")
    args = ap.parse_args(argv)
    runtime.configure()
    import mindspore as ms

    from mindspore_eagle.config import load_config
    from mindspore_eagle.core.tree import NEG_BIAS
    from mindspore_eagle.serving.pipeline import build_engine, load_models

    cfg = load_config(None, [f"model.teacher={args.teacher}", "model.drafter=none"])
    loaded = load_models(cfg)
    ks = [int(k) for k in args.ks.split(",")]
    rng = np.random.default_rng(0)
    ctx = rng.integers(100, 20000, size=256)
    print(f"teacher: {loaded.teacher_cfg.num_layers} layers, hidden {loaded.teacher_cfg.hidden_size}, "
          f"vocab {loaded.teacher_cfg.vocab_size}; threads {os.environ.get('MSEAGLE_THREADS', 'default')}")
    results = {}
    for mode in ("fused", "eager") if args.eager else ("fused",):
        eng = build_engine(load_config(None, ["model.drafter=none", f"speculative.mode={mode}"]), loaded)
        tg = eng.teacher
        sid = tg.new_seq()
        t0 = time.perf_counter()
        tg.prefill(sid, ctx)
        first = time.perf_counter() - t0
        tg.free(sid)
        sid = tg.new_seq()
        t0 = time.perf_counter()
        tg.prefill(sid, ctx)
        prefill_s = time.perf_counter() - t0
        n_dec = 16 if mode == "eager" else 32
        tok = 42
        tg.decode(sid, tok)
        t0 = time.perf_counter()
        for _ in range(n_dec):
            logits, _ = tg.decode(sid, tok)
            tok = int(np.argmax(logits))
        dec_ms = (time.perf_counter() - t0) * 1e3 / n_dec
        results[mode] = dec_ms
        print(f"[{mode}] prefill 256 tokens: {prefill_s * 1e3:.0f} ms ({256 / prefill_s:.0f} tok/s; first call "
              f"incl. compile {first:.1f} s); decode: {dec_ms:.1f} ms/token ({1e3 / dec_ms:.1f} tok/s)")
        if mode == "fused":
            base = tg.length(sid)
            rows = {}
            for k in ks:
                tg.bm.reserve(sid, k)
                slots = tg.bm.slots(sid, np.arange(base, base + k))
                w = tg.width(base + k)                    # the attention width bucket verify uses
                mask = np.full((k, w), NEG_BIAS, np.float32)
                mask[:, :base] = 0
                mask[:, base:base + k] = np.where(np.tril(np.ones((k, k), bool)), 0, NEG_BIAS)
                args_ = (ms.Tensor(rng.integers(100, 20000, size=k).astype(np.int32)),
                         ms.Tensor((base + np.arange(k)).astype(np.int32)), ms.Tensor(slots.astype(np.int32)),
                         ms.Tensor(tg.bm.block_table(sid)[: w // tg.B]), ms.Tensor(mask),
                         ms.Tensor(np.arange(k, dtype=np.int32)))
                rows[k] = median_ms(lambda: tg._fwd(*args_)[0].asnumpy(), args.repeat)
                tg.bm.rollback(sid)
            npt = NumpyTeacher(loaded.teacher_cfg, loaded.teacher_tensors)
            print(f"{'k':>4} {'MindSpore fused ms':>19} {'x(k=1)':>7} {'numpy ms':>9} {'MS/numpy':>9}")
            for k in ks:
                toks, pos = rng.integers(100, 20000, size=k), 256 + np.arange(k)
                nms = median_ms(lambda: npt.forward(toks, pos), args.repeat)
                print(f"{k:>4} {rows[k]:>19.1f} {rows[k] / rows[ks[0]]:>7.2f} {nms:>9.1f} {rows[k] / nms:>9.2f}")
            rows_fused = rows
        tg.free(sid)
    if args.eager:
        print(f"eager / fused decode: {results['eager'] / results['fused']:.2f}x")
    drafter_cost(loaded, ctx, results["fused"], args.repeat)
    cfg = load_config(None, [f"model.teacher={args.teacher}"])
    llamacpp_cost(cfg, loaded, ctx, ks, results["fused"], args.repeat, rows_fused)


def drafter_cost(loaded, ctx, decode_ms, repeat):
    """Drafter cost of one round with the config's budget (fused): context pass of one pair + build_tree."""
    from mindspore_eagle.config import load_config
    from mindspore_eagle.serving.pipeline import build_engine, load_models

    cfg = load_config(None, [])
    dl = load_models(cfg)
    eng = build_engine(cfg, dl)
    dr, sp = eng.drafter, cfg.speculative
    rng = np.random.default_rng(1)
    aux = rng.standard_normal((len(ctx), 3 * dl.teacher_cfg.hidden_size)).astype(np.float32)
    sid = dr.new_seq()
    first = dr.extend(sid, aux, ctx)
    one = lambda: dr.extend(sid, aux[:1], ctx[:1])        # a 1-pair context pass (grows the context by one)
    ext_ms = median_ms(one, repeat)
    tree_ms = median_ms(lambda: dr.build_tree(sid, int(ctx[-1]), first, sp.M, sp.D_max), repeat)
    steps = max(1, sp.D_max - 1)
    print(f"[drafter] 1-pair context pass {ext_ms:.1f} ms; build_tree M={sp.M} D_max={sp.D_max} "
          f"top_k={sp.top_k}: {tree_ms:.1f} ms = {tree_ms / steps:.1f} ms per expansion step "
          f"({tree_ms / steps / decode_ms:.2f} of a teacher decode); draft per round "
          f"{(ext_ms + tree_ms) / decode_ms:.2f} decodes")
    dr.free(sid)


def llamacpp_cost(cfg, loaded, ctx, ks, decode_ms, repeat, ours_rows):
    """llama.cpp on the same weights (F32 GGUF, same threads) in a process of its own with a clean environment
    (bench/peer.py): decode ms/token and one eval of k tokens with logits for all k rows, beside ours."""
    import tempfile

    from mindspore_eagle.bench import peer

    if not peer.available():
        print("[llama.cpp] llama_cpp (llama-cpp-python) not importable: peer skipped")
        return
    threads = int(os.environ.get("MSEAGLE_THREADS", 0)) or min(os.cpu_count() or 1, 8)
    out = os.path.join(tempfile.gettempdir(), "mseagle_bench_forward")
    os.makedirs(out, exist_ok=True)
    p = peer.make_peer(cfg, loaded, out, threads, lookup=())
    if p is None:                            # the reason was printed
        return
    try:
        got = p.forward_ms(ctx, ks, repeat)
    finally:
        p.close()
    dec = got["decode_ms"]
    print(f"[llama.cpp F32, {threads} threads, own process] decode {dec:.1f} ms/token ({1e3 / dec:.1f} tok/s); "
          f"ours / llama.cpp = {decode_ms / dec:.2f}x")
    print(f"{'k':>4} {'ours ms':>8} {'llama.cpp ms':>13} {'ours / llama.cpp':>17}")
    for k in ks:
        theirs = got["ms"][str(k)]
        print(f"{k:>4} {ours_rows[k]:>8.1f} {theirs:>13.1f} {ours_rows[k] / theirs:>17.2f}")


if __name__ == "__main__":
    main()
