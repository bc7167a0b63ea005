"""train/ttt.py: the TTT layout, the training Cell's losses against an expanded numpy reference (EAGLE-3 target,
argmax mix, fc_norm, several layers), later layers starting as the identity, make_batch's shifts, and the inference
Cell against the training Cell's step 0 (docs/design.md, "Drafter training")."""
from __future__ import annotations

import numpy as np
import pytest

from mindspore_eagle.train.ttt import causal_bias, make_batch, ttt_layout


def test_ttt_layout_matches_hand_written_t4_s3():
    T = 4
    exp = {
        0: ["1000", "1100", "1110", "1111"],
        1: ["1000" "1000", "1100" "0100", "1110" "0010", "1111" "0001"],
        2: ["1000" "1000" "1000", "1100" "0100" "0100", "1110" "0010" "0010", "1111" "0001" "0001"],
    }
    for s, rows in exp.items():
        vis, q_pos, k_pos = ttt_layout(T, s)
        want = np.array([[c == "1" for c in r] for r in rows])
        assert vis.shape == (T, (s + 1) * T)
        np.testing.assert_array_equal(vis, want)
        np.testing.assert_array_equal(q_pos, np.arange(T) + s)
        np.testing.assert_array_equal(k_pos, np.concatenate([np.arange(T) + j for j in range(s + 1)]))
    np.testing.assert_array_equal(causal_bias(T) == 0, ttt_layout(T, 0)[0])


def _numpy_ttt_losses(t, embed, head_rows, b, cfg, S, argmax_weight=0.0):
    """Expanded-form reference of the TTT forward (ttt_layout masks over all keys of steps 0..s), float64; layer 0
    takes concat(norm(embed), hidden_norm(h)), layers 1.. (``layers.{i}.*``) norm the residual stream;
    ``argmax_weight`` a: target (1 - a) p + a onehot(argmax p); with ``fc_norm.{c}.weight`` in ``t`` each Ht-wide
    chunk of the features is RMS-normed with its weight before fc."""
    T = b.ids.shape[2]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    W = {k: np.asarray(v, np.float64) for k, v in t.items() if k not in ("d2t", "t2d")}
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w  # noqa: E731
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)

    def rope(x, pos):
        ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None]
        return x * np.cos(ang) + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * np.sin(ang)

    prefixes = ["midlayer."] + [f"layers.{i}." for i in range(1, cfg.num_hidden_layers)]
    ids, pos_mask = b.ids[:, 0], b.pos_mask[:, 0]                 # the batch's single row
    aux = b.aux[0].astype(np.float64)
    if "fc_norm.0.weight" in W:
        ht = aux.shape[-1] // 3
        aux = np.concatenate([rms(aux[:, c * ht:(c + 1) * ht], W[f"fc_norm.{c}.weight"]) for c in range(3)], -1)
    h = aux @ W["fc.weight"].T
    logits_t = b.hid[0].astype(np.float64) @ head_rows.T
    tp = np.exp(logits_t - logits_t.max(-1, keepdims=True))
    tp /= tp.sum(-1, keepdims=True)
    ks, vs, out = {p: [] for p in prefixes}, {p: [] for p in prefixes}, []
    for s in range(S):
        pos = np.arange(T) + s
        vis = ttt_layout(T, s)[0]
        for p in prefixes:
            x = (np.concatenate([rms(embed[ids[s]], W[p + "input_layernorm.weight"]),
                                 rms(h, W[p + "hidden_norm.weight"])], -1) if p == "midlayer."
                 else rms(h, W[p + "input_layernorm.weight"]))
            q = rope((x @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd), pos)
            ks[p].append(rope((x @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd), pos))
            vs[p].append((x @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd))
            K = np.repeat(np.concatenate(ks[p], 0), nh // nkv, 1)
            V = np.repeat(np.concatenate(vs[p], 0), nh // nkv, 1)
            sc = np.einsum("qhd,khd->hqk", q, K) / np.sqrt(hd) + np.where(vis, 0.0, -np.inf)[None]
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            h = h + np.einsum("hqk,khd->qhd", pr, V).reshape(T, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
            y = rms(h, W[p + "post_attention_layernorm.weight"])
            g = y @ W[p + "mlp.gate_proj.weight"].T
            h = h + (g / (1 + np.exp(-g)) * (y @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
        lg = rms(h, W["norm.weight"]) @ W["lm_head.weight"].T
        logp = lg - lg.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        ce = -(tp[s + 1:s + 1 + T] * logp).sum(-1)
        nll = -np.take_along_axis(logp, np.argmax(tp[s + 1:s + 1 + T], -1)[:, None], -1)[:, 0]
        out.append(float((((1 - argmax_weight) * ce + argmax_weight * nll) * pos_mask[s]).sum() / T))
    return np.array(out)


def _tiny_dcfg(layers=1, fc_norm=False):
    from mindspore_eagle.models.eagle3 import DrafterConfig

    return DrafterConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=50, draft_vocab_size=20, target_hidden_size=32, num_hidden_layers=layers,
                         fc_norm=fc_norm)


def _nontrivial(t, rng):
    """Tensors with large projections and random (non-zero) output projections in every layer, random norms."""
    out = {}
    for k, v in t.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")) and k.startswith("layers."):
            v = (rng.normal(size=v.shape) * 0.02).astype(np.float32)
        if k.endswith("proj.weight") or k == "fc.weight":
            v = v * 10
        elif k.endswith("norm.weight"):
            v = (1 + 0.3 * rng.normal(size=v.shape)).astype(np.float32)
        out[k] = v
    return out


@pytest.mark.parametrize("layers,argmax_weight,fc_norm", [(1, 0.0, False), (2, 0.0, False), (3, 0.0, False),
                                                          (1, 0.3, False), (1, 1.0, False), (2, 0.0, True)])
def test_ttt_cell_matches_expanded_numpy_reference(ms_runtime, layers, argmax_weight, fc_norm):
    """The TTT Cell's per-step losses against the expanded numpy reference, with the EAGLE-3 target and with part
    (or all) of the target on the teacher's argmax token, and with ``fc_norm`` (features whose chunks differ in
    scale by 100x; the weights round-trip through export)."""
    import mindspore as ms

    from mindspore_eagle.models.eagle3 import init_drafter_tensors
    from mindspore_eagle.train.ttt import TTTDrafter

    cfg = _tiny_dcfg(layers, fc_norm)
    rng = np.random.default_rng(1)
    used = np.sort(rng.choice(50, 20, replace=False))
    t = _nontrivial(init_drafter_tensors(cfg, 3, used), rng)
    if fc_norm:
        t.update({f"fc_norm.{c}.weight": rng.uniform(0.1, 2.0, 32).astype(np.float32) for c in range(3)})
    embed = rng.normal(size=(50, 32)).astype(np.float32)
    T, S, n = 8, 3, 8                        # teacher argmax tokens in the draft vocab: every step has a loss
    feats = rng.normal(size=(n, 96)).astype(np.float32)
    if fc_norm:
        feats *= np.repeat(np.array([1.0, 10.0, 100.0], np.float32), 32)
    b = make_batch(rng.integers(0, 50, n), np.ones(n), feats,
                   rng.normal(size=(n, 32)).astype(np.float32), used[rng.integers(0, 20, n)], t["t2d"], T, S)
    net = TTTDrafter(cfg, embed, embed[used], t["d2t"], T, S, argmax_weight=argmax_weight)
    net.load_tensors(t)
    loss, losses, _ = ms.jit(net.construct)(*b.tensors())
    want = _numpy_ttt_losses(t, embed.astype(np.float64), embed[used].astype(np.float64), b, cfg, S, argmax_weight)
    if argmax_weight:                                            # the mix changes the loss: the flag is used
        plain = _numpy_ttt_losses(t, embed.astype(np.float64), embed[used].astype(np.float64), b, cfg, S)
        assert np.abs(plain - want).max() > 1e-3                 # > 5x the comparison tolerance below
    assert want.min() > 0.1                                      # every step has loss-masked positions
    np.testing.assert_allclose(losses.asnumpy(), want, rtol=2e-4, atol=1e-5)
    assert abs(float(loss.asnumpy()) - sum(0.8 ** s * want[s] for s in range(S))) < 1e-4
    exported = net.export_tensors()
    assert sorted(exported) == sorted(k for k in t if k not in ("d2t", "t2d"))
    for k, v in exported.items():
        np.testing.assert_array_equal(v, t[k], err_msg=k)


def test_later_layers_start_as_identity():
    """init_drafter_tensors: layer 0's tensors do not depend on the layer count, later layers' output projections
    are zero, so a 2-layer drafter grown from a 1-layer one computes the same losses (numpy reference)."""
    from mindspore_eagle.models.eagle3 import (
        drafter_tensor_shapes,
        init_drafter_tensors,
    )

    rng = np.random.default_rng(4)
    used = np.sort(rng.choice(50, 20, replace=False))
    one, two = init_drafter_tensors(_tiny_dcfg(1), 7, used), init_drafter_tensors(_tiny_dcfg(2), 7, used)
    assert set(two) - set(one) == {k for k in drafter_tensor_shapes(_tiny_dcfg(2)) if k.startswith("layers.1.")}
    for k in one:
        np.testing.assert_array_equal(one[k], two[k], err_msg=k)
    assert not two["layers.1.self_attn.o_proj.weight"].any() and not two["layers.1.mlp.down_proj.weight"].any()
    assert two["layers.1.self_attn.q_proj.weight"].std() > 0.01
    one = _nontrivial(one, rng)
    grown = two | one
    embed = rng.normal(size=(50, 32))
    T, S, n = 8, 3, 8
    b = make_batch(rng.integers(0, 50, n), np.ones(n), rng.normal(size=(n, 96)).astype(np.float32),
                   rng.normal(size=(n, 32)).astype(np.float32), used[rng.integers(0, 20, n)], one["t2d"], T, S)
    a = _numpy_ttt_losses(one, embed, embed[used], b, _tiny_dcfg(1), S)
    assert a.min() > 0.1
    np.testing.assert_array_equal(_numpy_ttt_losses(grown, embed, embed[used], b, _tiny_dcfg(2), S), a)
    grown["layers.1.mlp.down_proj.weight"] = rng.normal(size=(32, 48))
    assert np.abs(_numpy_ttt_losses(grown, embed, embed[used], b, _tiny_dcfg(2), S) - a).max() > 1e-3


def test_make_batch_shifts_ids_targets_and_mask_together():
    x = np.array([10, 11, 12, 13, 14])
    m = np.array([0, 0, 1, 1, 1])
    g = np.array([20, 21, 22, 23, 24])
    t2d = np.ones(30, bool)
    t2d[23] = False
    b = make_batch(x, m, np.ones((5, 6), np.float32), np.ones((5, 2), np.float32), g, t2d, T=5, S=3)
    np.testing.assert_array_equal(b.ids[:, 0], [[11, 12, 13, 14, 0], [12, 13, 14, 0, 0], [13, 14, 0, 0, 0]])
    np.testing.assert_array_equal(b.tgt[:, 0], [[21, 22, 23, 24, 0], [22, 23, 24, 0, 0], [23, 24, 0, 0, 0]])
    np.testing.assert_array_equal(b.loss_mask[:, 0], [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b.pos_mask[:, 0], [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])  # 23 ∉ Vd
    assert b.hid.shape == (1, 8, 2) and b.hid[0, 5:].sum() == 0 and b.aux.shape == (1, 5, 6) and b.n_valid == 5
    np.testing.assert_array_equal(b.seg, [[1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(b.pos, [[0, 1, 2, 3, 4]])
    assert b.n_samples == 1


@pytest.mark.parametrize("attention,layers,fc_norm", [("portable", 3, False), ("auto", 3, False),
                                                      ("portable", 1, True), ("auto", 1, True)])
def test_multi_layer_inference_cell_matches_training_step0(ms_runtime, tmp_path, attention, layers, fc_norm):
    """A drafter of 3 layers (1 with ``fc_norm``) saved and loaded (``layers.1.*``, ``layers.2.*``): the inference
    Cell over the paged cache (each layer its own cache, norms folded into its weights) gives the training Cell's
    step-0 log-probs (top-K values and ids), on the portable backend and the default one (the C++ kernels where they build).
    With ``fc_norm`` (SpecForge's per-chunk RMSNorm before fc; its weights folded into fc's columns at inference)
    the same, on features whose three chunks differ in scale by 100x and rows by 1000x, and the norm changes the
    result (the drafter without it, same other weights, gives other log-probs)."""
    import mindspore as ms
    from mindspore import Parameter, Tensor

    from mindspore_eagle.models.eagle3 import (
        Eagle3Drafter,
        init_drafter_tensors,
        load_drafter,
        save_drafter,
    )
    from mindspore_eagle.train.ttt import TTTDrafter

    cfg = _tiny_dcfg(layers, fc_norm)
    rng = np.random.default_rng(9)
    used = np.sort(rng.choice(50, 20, replace=False))
    t0 = _nontrivial(init_drafter_tensors(cfg, 2, used), rng)
    if fc_norm:
        t0.update({f"fc_norm.{c}.weight": (rng.uniform(0.2, 3.0, 32) * 0.1).astype(np.float32) for c in range(3)})
    save_drafter(str(tmp_path / "d"), cfg, t0, dtype=np.float32)
    dcfg, t = load_drafter(str(tmp_path / "d"))
    assert dcfg.num_hidden_layers == layers and ("layers.2.mlp.down_proj.weight" in t) == (layers == 3)
    assert dcfg.fc_norm == fc_norm and ("fc_norm.2.weight" in t) == fc_norm
    embed = rng.normal(size=(50, 32)).astype(np.float32)
    T, K, B, n = 16, 4, 4, 11
    aux = rng.normal(size=(T, 96)).astype(np.float32)
    if fc_norm:
        aux *= np.repeat(np.array([1.0, 10.0, 100.0], np.float32), 32) * rng.uniform(0.5, 2.0, (T, 1))
        aux[0] *= 1000.0                                          # an attention-sink row
    ids = rng.integers(0, 50, T).astype(np.int32)
    train_net = TTTDrafter(dcfg, embed, embed[used], t["d2t"], T, 1)
    train_net.load_tensors(t)
    ref = ms.jit(train_net.step0_logp)(Tensor(aux), Tensor(ids)).asnumpy()[:n]
    inf = Eagle3Drafter(dcfg, Parameter(Tensor(embed), name="shared_embed", requires_grad=False), top_k=K,
                        num_blocks=T // B, block_size=B, max_seq_len=T, attention=attention)
    inf.load_tensors(t)
    mask = np.where(np.tri(n, T, dtype=bool), 0.0, -1e9).astype(np.float32)
    top_logp, top_ids, _ = inf(inf.fuse(Tensor(aux[:n])), Tensor(ids[:n]), Tensor(np.arange(n, dtype=np.int32)),
                               Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(T // B, dtype=np.int32)),
                               Tensor(mask))
    want_idx = np.argsort(-ref, -1, kind="stable")[:, :K]
    np.testing.assert_allclose(top_logp.asnumpy(), np.take_along_axis(ref, want_idx, -1), atol=2e-4)
    np.testing.assert_array_equal(top_ids.asnumpy(), used[want_idx])
    if fc_norm:
        plain = TTTDrafter(_tiny_dcfg(layers), embed, embed[used], t["d2t"], T, 1)
        plain.load_tensors({k: v for k, v in t.items() if not k.startswith("fc_norm.")})
        other = ms.jit(plain.step0_logp)(Tensor(aux), Tensor(ids)).asnumpy()[:n]
        assert np.abs(other - ref).max() > 0.1
