"""Drafter training (mindspore_eagle.train): TTT layout, data masks, vocab, learning on a tiny teacher, exact
resume, and consistency of the training Cell with the inference Cell (docs/design.md, "Drafter training")."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_corpus import TEXTS, conversations

from mindspore_eagle.train.ttt import causal_bias, make_batch, ttt_layout
from mindspore_eagle.train.vocab import select_vocab


# ----------------------------------------------------------------------------------------------- pure parts --
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


def test_packed_row_keeps_each_sample_shift_inside_its_segment():
    """Two samples packed in one row: each segment carries exactly its own single-sample arrays (ids / targets /
    masks shifted inside the sample, zero past its end), positions restart at 0, segment ids 1, 2, pad 0."""
    from mindspore_eagle.train.batching import assemble, sample_arrays

    t2d = np.ones(40, bool)
    a = sample_arrays([10, 11, 12], [0, 1, 1], np.ones((3, 2)), np.ones((3, 1)), [20, 21, 22], t2d, 8, 2)
    b = sample_arrays([30, 31, 32, 33], [1, 1, 1, 1], 2 * np.ones((4, 2)), 2 * np.ones((4, 1)),
                      [34, 35, 36, 37], t2d, 8, 2)
    p = assemble([[a, b]], T=9, S=2)
    np.testing.assert_array_equal(p.ids[:, 0], [[11, 12, 0, 31, 32, 33, 0, 0, 0], [12, 0, 0, 32, 33, 0, 0, 0, 0]])
    np.testing.assert_array_equal(p.tgt[:, 0], [[21, 22, 0, 35, 36, 37, 0, 0, 0], [22, 0, 0, 36, 37, 0, 0, 0, 0]])
    np.testing.assert_array_equal(p.loss_mask[:, 0], [[1, 0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(p.seg, [[1, 1, 1, 2, 2, 2, 2, 0, 0]])
    np.testing.assert_array_equal(p.pos, [[0, 1, 2, 0, 1, 2, 3, 0, 1]])
    np.testing.assert_array_equal(p.aux[0, :, 0], [1, 1, 1, 2, 2, 2, 2, 0, 0])
    np.testing.assert_array_equal(p.hid[0, :, 0], [1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0])
    assert (p.n_samples, p.n_valid) == (2, 7)
    with pytest.raises(ValueError, match="row 0 holds 7 tokens"):
        assemble([[a, b]], T=6, S=2)


def test_plan_rows_first_fit_in_stream_order():
    from mindspore_eagle.train.batching import plan_rows

    assert plan_rows([5, 3, 4, 2, 1, 2], 8, 2, pack=True) == [[0, 1], [2, 3, 4]]  # last 2: rows hold 8 and 7
    assert plan_rows([5, 4, 6, 1], 8, 2, pack=True) == [[0], [1]]              # 6 fits no row: next step
    assert plan_rows([2, 7, 5, 1, 3], 8, 2, pack=True) == [[0, 2, 3], [1]]    # first fit, not next fit
    assert plan_rows([5, 4, 6], 8, 2, pack=False) == [[0], [1]]
    with pytest.raises(ValueError, match="at least B"):
        plan_rows([5], 8, 2, pack=False)
    with pytest.raises(ValueError, match="1..8"):
        plan_rows([9, 1], 8, 2, pack=True)


def test_topk_coverage_and_implied_accept_length_hand_computed():
    from mindspore_eagle.train.coverage import (
        coverage_counts,
        coverage_report,
        implied_accept_length,
        topk_ids,
    )

    used = np.array([2, 5, 7, 9])
    d2t = used - np.arange(4)                                  # offsets: draft id i -> teacher id used[i]
    logits = np.array([[0.1, 0.5, 0.3, -1.0],                 # teacher ids by rank: 5, 7, 2, 9
                       [2.0, 1.0, 0.0, 3.0],                  # 9, 2, 5, 7
                       [0.0, 0.0, 1.0, 0.0],                  # 7, then the ties 2, 5, 9 in draft-id order
                       [9.0, 0.0, 0.0, 0.0]])
    top = topk_ids(logits, d2t, 4)
    np.testing.assert_array_equal(top, [[5, 7, 2, 9], [9, 2, 5, 7], [7, 2, 5, 9], [2, 5, 7, 9]])
    target = np.array([7, 9, 4, 2])                            # rank 2, rank 1, not in the draft vocab, masked
    mask = np.array([1, 1, 1, 0])
    hits, n = coverage_counts(top, target, mask, ks=(1, 2, 4))
    np.testing.assert_array_equal(hits, [1, 2, 2])
    assert n == 3
    hits2, n2 = coverage_counts(top[:, :2], target, np.array([1, 1, 0, 0]), ks=(1, 2))
    np.testing.assert_array_equal(hits2, [1, 2])
    assert n2 == 2
    # chain: 1 + a1 + a1 a2 + a1 a2 a3; a constant alpha gives (1 - alpha^(D+1)) / (1 - alpha) (Leviathan Eq. 1)
    assert implied_accept_length([0.5, 0.5, 0.5]) == pytest.approx(1.875) == (1 - 0.5 ** 4) / (1 - 0.5)
    assert implied_accept_length([1.0, 0.0, 1.0]) == 2.0
    assert implied_accept_length([]) == 1.0
    with pytest.raises(ValueError):
        implied_accept_length([1.2])
    rep = coverage_report(np.array([[1, 2, 2], [0, 1, 2]]), np.array([3, 2]), ks=(1, 2, 4), depths=(1, 2, 3))
    assert rep["cov"] == {"k1": [0.3333, 0.0], "k2": [0.6667, 0.5], "k4": [0.6667, 1.0]}
    assert rep["positions"] == [3, 2]
    assert rep["L_implied"] == {"D1": {"k1": 1.3333, "k2": 1.6667, "k4": 1.6667},
                                "D2": {"k1": 1.3333, "k2": 2.0, "k4": 2.3333}}   # D3 > S = 2: left out


def test_select_vocab_top_counts_sorted_and_padded():
    counts = np.array([0, 5, 0, 9, 1, 0, 5, 0])
    np.testing.assert_array_equal(select_vocab(counts, 3), [1, 3, 6])        # tie 1 vs 6: both kept
    np.testing.assert_array_equal(select_vocab(counts, 2), [1, 3])           # tie broken by smaller id
    np.testing.assert_array_equal(select_vocab(counts, 6), [0, 1, 2, 3, 4, 6])  # padded with unused 0, 2
    with pytest.raises(ValueError):
        select_vocab(counts, 9)


class _CharTok:
    """Minimal tokenizer: one id per character, ChatML-like template (prefix-stable)."""
    eos_token_ids = (2,)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        s = "".join(f"<{m['role'][0]}>{m['content']}#\n" for m in messages)
        return s + ("<a>" if add_generation_prompt else "")

    def encode(self, text, add_bos=None):
        return [ord(c) for c in text]


def test_loss_mask_covers_assistant_content_and_end_token_only():
    from mindspore_eagle.train.data import tokenize_conversation

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]
    ids, mask, same = tokenize_conversation(_CharTok(), conv)
    text = "".join(chr(i) for i in ids)
    assert same and text == "<u>hi#\n<a>yo#\n<u>q#\n<a>ok#\n"
    assert "".join(c for c, k in zip(text, mask) if k) == "yo#ok#"


def test_loss_mask_by_token_offsets_on_sentencepiece_template(tiny):
    from mindspore_eagle.train.data import tokenize_conversation

    _, _, tok = tiny
    conv = [{"role": "user", "content": "Explain why the sky is blue."},
            {"role": "assistant", "content": "The quick brown fox."}, {"role": "user", "content": "ok"},
            {"role": "assistant", "content": "Paris."}]
    ids, mask, exact = tokenize_conversation(tok, conv)
    assert exact                                   # whole-text ids, the tokenisation the teacher sees at inference
    np.testing.assert_array_equal(ids, tok.encode(tok.apply_chat_template(conv, add_generation_prompt=False)))
    assert tok.decode(ids[mask == 1]) == "The quick brown fox.[unused10]Paris.[unused10]"


def test_eval_prompt_matching_normalises_text():
    from mindspore_eagle.train.data import is_eval_prompt

    keys = {"write a python function that returns the sum of a list of numbers"}
    assert is_eval_prompt("Write a Python   function that returns\nthe sum of a list of numbers", keys)
    assert is_eval_prompt("Please: write a python function that returns the sum of a list of numbers. Thanks", keys)
    assert not is_eval_prompt("Write a poem", keys)


# ------------------------------------------------------------------------------------- tiny teacher training --
def _tc(out, fdir, **kw):
    from mindspore_eagle.train.trainer import TrainConfig

    base = dict(out=str(out), features_dir=fdir, vd=96, ttt_length=3, steps=300, lr=3e-3, max_len=64,
                checkpoint_every=100, n_eval=8, progress=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def trained(tiny, tiny_features, tmp_path_factory):
    from mindspore_eagle.train.trainer import train

    cfg, tensors, _ = tiny
    out = tmp_path_factory.mktemp("drafter")
    return out, train(_tc(out, tiny_features), cfg, tensors)


@pytest.mark.slow
def test_batched_and_packed_steps_equal_mean_of_single_sample_steps(tiny, tiny_features):
    """One optimiser step on 3 samples (3 rows; and the same 3 packed into 2 rows) has the mean of the 3
    single-sample gradients, and its AdamW update is the one of that mean gradient (numpy AdamW, eps = 1 so the
    update is smooth in g); eval_topk's ids are the numpy top-k of step 0's log-probs."""
    import mindspore as ms
    from mindspore import Tensor

    from mindspore_eagle.models.eagle3 import vocab_maps
    from mindspore_eagle.train.batching import assemble, sample_arrays
    from mindspore_eagle.train.coverage import topk_ids
    from mindspore_eagle.train.features import FeatureSet, head_weight
    from mindspore_eagle.train.trainer import drafter_config, initial_tensors
    from mindspore_eagle.train.ttt import TrainStep, TTTDrafter

    cfg, tensors, _ = tiny
    fs = FeatureSet(tiny_features)
    T, S, vd = 64, 3, 96
    ds = [fs[i] for i in range(40)]
    used = select_vocab(np.bincount(np.concatenate([d["argmax"] for d in ds]), minlength=cfg.vocab_size), vd)
    vocab = vocab_maps(used, cfg.vocab_size)
    dcfg = drafter_config(cfg, vd)
    t0 = initial_tensors(dcfg, 0, used, "teacher", cfg, tensors)
    t0 = {k: (v * 10 if k.endswith("proj.weight") or k == "fc.weight" else v) for k, v in t0.items()}
    arrs = []                          # three lengths (the fixture's samples fill 64), each with loss positions
    for d in ds:
        if len(arrs) == 3:
            break
        a = sample_arrays(d["input_ids"], d["loss_mask"], d["aux"], d["hidden"], d["argmax"], vocab["t2d"],
                          (T, 60, 55)[len(arrs)], S)
        if a["pm"].sum() > 0:
            arrs.append(a)
    assert [a["n"] for a in arrs] == [T, 60, 55]

    def net_for(R):
        net = TTTDrafter(dcfg, tensors["model.embed_tokens.weight"], head_weight(cfg, tensors)[used],
                         vocab["d2t"], R, S, max_len=T)
        net.load_tensors(t0)
        return net

    single = [TrainStep(net_for(T)).grads(assemble([[a]], T, S)) for a in arrs]
    want = [np.mean(g, 0) for g in zip(*single)]
    R = max(arrs[0]["n"] + arrs[1]["n"], arrs[2]["n"])
    layouts = {"rows": ([[a] for a in arrs], T), "packed": ([[arrs[0], arrs[1]], [arrs[2]]], R)}
    for name, (rows, width) in layouts.items():
        net = net_for(width)
        batch = assemble(rows, width, S)
        got = TrainStep(net).grads(batch)
        for p, g, w in zip(net.trainable(), got, want):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6 * np.abs(w).max(), err_msg=f"{name} {p.name}")
    # the optimiser step of the batch = AdamW (no bias correction, betas 0.9 / 0.95) on the clipped mean
    lr, clip, eps = 0.05, 0.5, 1.0
    net = net_for(T)
    w0 = [p.asnumpy().copy() for p in net.trainable()]
    TrainStep(net, clip=clip, eps=eps)(assemble([[a] for a in arrs], T, S), lr)
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in want))
    for p, w, g in zip(net.trainable(), w0, want):
        g = g * clip / max(norm, clip)
        m, v = 0.1 * g, 0.05 * g * g
        np.testing.assert_allclose(p.asnumpy(), w - lr * m / (np.sqrt(v) + eps), rtol=1e-5, atol=1e-6,
                                   err_msg=p.name)
    # eval_topk (the coverage metric's input) = numpy top-k of the step-0 log-probs, mapped through d2t
    net = net_for(T)
    b = assemble([[arrs[0]]], T, S)
    top = ms.jit(net.eval_topk)(*b.tensors())[3].asnumpy()
    ref = ms.jit(net.step0_logp)(Tensor(b.aux[0]), Tensor(b.ids[0, 0])).asnumpy()
    np.testing.assert_array_equal(top[0, 0], topk_ids(ref, vocab["d2t"], 4))


def test_teacher_init_takes_head_rows_and_final_norm(tiny):
    from mindspore_eagle.models.eagle3 import init_drafter_tensors
    from mindspore_eagle.train.features import head_weight
    from mindspore_eagle.train.trainer import drafter_config, initial_tensors

    cfg, tensors, _ = tiny
    dcfg = drafter_config(cfg, 96)
    used = np.arange(0, 192, 2)
    t = initial_tensors(dcfg, 5, used, "teacher", cfg, tensors)
    r = initial_tensors(dcfg, 5, used, "random", cfg, tensors)
    np.testing.assert_array_equal(t["lm_head.weight"], head_weight(cfg, tensors)[used])
    np.testing.assert_array_equal(t["norm.weight"], tensors["model.norm.weight"])
    ref = init_drafter_tensors(dcfg, 5, used)
    for k in ref:
        np.testing.assert_array_equal(r[k], ref[k])
        if k not in ("lm_head.weight", "norm.weight"):
            np.testing.assert_array_equal(t[k], ref[k])
    with pytest.raises(ValueError, match="--init"):
        initial_tensors(dcfg, 5, used, "zeros", cfg, tensors)


@pytest.mark.slow
def test_init_from_fine_tunes_the_given_drafter(tiny, tiny_features, trained, tmp_path):
    """--init-from starts from the given drafter's weights and keeps its draft vocabulary (a vd mismatch is an
    error); with a vanishing learning rate the export equals the source up to fp16 storage."""
    from mindspore_eagle.models.eagle3 import load_drafter
    from mindspore_eagle.train.trainer import train

    cfg, tensors, _ = tiny
    src, _ = trained
    _, t0 = load_drafter(str(src))
    out = tmp_path / "ft"
    train(_tc(out, tiny_features, steps=2, lr=1e-12, warmup=1, init_from=str(src)), cfg, tensors)
    _, t1 = load_drafter(str(out))
    np.testing.assert_array_equal(t1["t2d"], t0["t2d"])
    np.testing.assert_array_equal(t1["d2t"], t0["d2t"])
    for k in ("fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"):
        np.testing.assert_allclose(t1[k], t0[k], atol=1e-3, rtol=1e-3, err_msg=k)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train(_tc(tmp_path / "bad", tiny_features, steps=2, vd=64, init_from=str(src)), cfg, tensors)


def test_regenerate_reply_uses_teacher_greedy_decode(tiny, ms_runtime):
    from mindspore_eagle.train.data import build_samples, regenerate_reply
    from mindspore_eagle.train.features import build_runner

    cfg, tensors, tok = tiny
    runner, _ = build_runner(cfg, tensors, 64)
    a = regenerate_reply(runner, tok, TEXTS[1], max_new=6)
    assert a == regenerate_reply(runner, tok, TEXTS[1], max_new=6) and runner.bm.free_blocks() > 0
    samples, st = build_samples(tok, conversations(3), 2, 64, min_assistant=1, regenerate=1, runner=runner,
                                eval_keys=set())
    assert st.regenerated == 1 and len(samples) == 2


@pytest.mark.slow
def test_batched_regeneration_equals_one_sequence_greedy(tiny, ms_runtime):
    """Continuous batching over decode_batch (block-diagonal mask, concatenated block tables) gives each prompt
    the same greedy reply as decoding it alone; every block goes back to the pool."""
    from mindspore_eagle.train.data import build_samples, regenerate_reply
    from mindspore_eagle.train.features import build_runner
    from mindspore_eagle.train.regen import build_batch_runner, regenerate_replies

    cfg, tensors, tok = tiny
    single, _ = build_runner(cfg, tensors, 256)
    max_len = 128
    prompts = TEXTS[:5] + ["word " * 300]                     # the last one leaves no room: skipped (None)
    batch_runner, _ = build_batch_runner(cfg, tensors, max_len, batch=2)
    free0 = batch_runner.bm.free_blocks()
    got = regenerate_replies(batch_runner, tok, prompts, max_len, batch=2, min_reply=4)
    assert got[-1] is None and batch_runner.bm.free_blocks() == free0
    for text, reply in zip(prompts[:-1], got[:-1]):
        n = len(tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True))
        assert reply == regenerate_reply(single, tok, text, max_new=max_len - n), text
    with pytest.raises(ValueError, match="batch"):
        regenerate_replies(batch_runner, tok, prompts, max_len, batch=0)
    for method, fail_at in (("decode_batch", 1), ("decode_batch", 12), ("prefill", 3), ("progress", 1)):
        calls, real = [], getattr(batch_runner, method, None)   # an error mid-run: every row freed exactly once

        def flaky(*a, **k):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("injected")
            return real(*a, **k) if real is not None else None
        if method != "progress":
            setattr(batch_runner, method, flaky)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                regenerate_replies(batch_runner, tok, prompts, max_len, batch=2, min_reply=4,
                                   progress=flaky if method == "progress" else None)
        finally:
            if method != "progress":
                setattr(batch_runner, method, real)
        assert batch_runner.bm.free_blocks() == free0, (method, fail_at)
    samples, st = build_samples(tok, conversations(6), 4, max_len, min_assistant=1, regenerate=3,
                                runner=batch_runner, eval_keys=set(), regen_batch=2)
    assert 1 <= st.regenerated <= 3 and len(samples) == 4     # empty replies (EOS first) are skipped


def test_features_resume_skips_finished_shards(tiny, tiny_features):
    from mindspore_eagle.train.features import FeatureSet, extract_features, head_weight

    cfg, tensors, _ = tiny
    fs = FeatureSet(tiny_features)
    assert len(fs) == 48
    d = fs[0]
    assert d["aux"].dtype == np.float16 and d["aux"].shape == (len(d["input_ids"]), 3 * cfg.hidden_size)

    class NoRunner:  # every shard is listed: the teacher must not run again
        def new_seq(self):
            raise AssertionError("teacher ran for a finished shard")
    man = extract_features(NoRunner(), head_weight(cfg, tensors), [(d["input_ids"], d["loss_mask"])] * 48,
                           tiny_features, shard_size=16)
    assert len(man["shards"]) == 3


def test_load_shard_maps_each_savez_member_to_its_exact_array(tmp_path):
    """load_shard memory-maps the members of an np.savez file (read-only np.memmap) and returns exactly what
    np.load reads, for C / Fortran order, 0-d, empty and wide-dtype members; an np.savez_compressed file falls
    back to arrays in memory; a member that is not a .npy array is a one-line error."""
    import zipfile

    from mindspore_eagle.train.features import load_shard

    rng = np.random.default_rng(0)
    cols = {"aux": rng.standard_normal((37, 11)).astype(np.float16), "ids": np.arange(37, dtype=np.int32),
            "fort": np.asfortranarray(rng.standard_normal((5, 3))), "scalar": np.array(7, np.int64),
            "empty": np.zeros((0, 4), np.float32), "u8": (rng.random(9) > 0.5).astype(np.uint8)}
    for save, mapped in ((np.savez, True), (np.savez_compressed, False)):
        path = str(tmp_path / f"{save.__name__}.npz")
        save(path, **cols)
        got = load_shard(path)
        assert set(got) == set(cols)
        for k, v in cols.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)
        assert isinstance(got["aux"], np.memmap) is mapped
        if mapped:
            assert not got["aux"].flags.writeable and got["fort"].flags.f_contiguous
    bad = str(tmp_path / "bad.npz")
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("notes.txt", "x")
    with pytest.raises(ValueError, match="notes.txt.*not a .npy array"):
        load_shard(bad)


def test_feature_set_mapped_equals_loaded(tiny_features):
    """FeatureSet over memory-mapped shards (the default) gives every column of every sample exactly as with the
    shards loaded into memory."""
    from mindspore_eagle.train.features import COLUMNS, FeatureSet

    mapped, loaded = FeatureSet(tiny_features), FeatureSet(tiny_features, mmap=False)
    assert len(mapped) == len(loaded) == 48 and mapped.tokens == loaded.tokens
    assert isinstance(mapped[0]["aux"], np.memmap) and not isinstance(loaded[0]["aux"], np.memmap)
    for i in range(48):
        for c in COLUMNS:
            np.testing.assert_array_equal(mapped[i][c], loaded[i][c])


@pytest.mark.slow
def test_training_loss_falls_and_accuracy_rises(trained):
    out, summary = trained
    log = [json.loads(ln) for ln in open(out / "train_log.jsonl")]
    assert len(log) == 300
    first = np.mean([r["loss"] for r in log[:20]])
    last = np.mean([r["loss"] for r in log[-20:]])
    acc = lambda rs: sum(r["correct"][0] for r in rs) / max(1, sum(r["masked"][0] for r in rs))  # noqa: E731
    assert last < 0.75 * first, (first, last)
    # chance is 1 / Vd ~ 0.01; measured: step-0 accuracy ~0.13 over the first 50 steps, ~0.6 over the last 50
    assert acc(log[-50:]) > acc(log[:20]) + 0.25 and acc(log[-50:]) > 0.4, (acc(log[:20]), acc(log[-50:]))
    assert summary["heldout"]["acc"][0] > 0.25
    # held-out coverage: top-1 coverage is the accuracy; coverage grows with k; L_implied from the formula
    held = summary["heldout"]
    np.testing.assert_allclose(held["cov"]["k1"], held["acc"], atol=1e-4)
    assert all(a <= b <= c for a, b, c in zip(held["cov"]["k1"], held["cov"]["k2"], held["cov"]["k4"]))
    c = held["cov"]["k4"]
    assert held["L_implied"]["D3"]["k4"] == pytest.approx(1 + c[0] + c[0] * c[1] + c[0] * c[1] * c[2], abs=2e-4)
    evals = [json.loads(ln) for ln in open(out / "eval_log.jsonl")]
    assert [e["step"] for e in evals] == [0, 100, 200, 300] and evals[-1]["cov"] == held["cov"]
    assert evals[0]["tokens_seen"] == 0 and evals[0]["acc"][0] < held["acc"][0] - 0.2      # the random init
    assert evals[-1]["tokens_seen"] == sum(r["tokens"] for r in log)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size,pack_len,steps", [(1, 0, 30), (3, 0, 10), (2, 160, 10)])
def test_resume_reproduces_uninterrupted_losses(tiny, tiny_features, tmp_path, batch_size, pack_len, steps):
    """Stopping half-way and resuming repeats the uninterrupted loss curve, with one sample per step, with B rows
    per step, and with packed rows (the stream cursor is part of the resume state)."""
    from mindspore_eagle.train.trainer import train

    cfg, tensors, _ = tiny
    half = steps // 2
    kw = dict(steps=steps, n_eval=0, batch_size=batch_size, pack_len=pack_len)
    full = train(_tc(tmp_path / "a", tiny_features, checkpoint_every=half, **kw), cfg, tensors)
    part = train(_tc(tmp_path / "b", tiny_features, stop_at=half, **kw), cfg, tensors)
    assert len(part["losses_this_run"]) == half
    if batch_size == 1:              # another features set (here the same directory twice) is refused on resume
        with pytest.raises(ValueError, match="samples per features directory changed"):
            train(_tc(tmp_path / "b", f"{tiny_features},{tiny_features}", **kw), cfg, tensors, resume=True)
    rest = train(_tc(tmp_path / "b", tiny_features, **kw), cfg, tensors, resume=True)
    assert rest["resumed_from"] == half
    np.testing.assert_allclose(rest["losses_this_run"], full["losses_this_run"][half:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(part["losses_this_run"], full["losses_this_run"][:half], atol=1e-5, rtol=0)
    log = [json.loads(ln) for ln in open(tmp_path / "b" / "train_log.jsonl")]
    assert [r["step"] for r in log] == list(range(steps))
    if pack_len:                                          # packed: more samples than rows in some step
        assert max(r["samples"] for r in log) > batch_size
    else:
        assert all(r["samples"] == batch_size for r in log) and log[-1]["cursor"] == steps * batch_size
    if batch_size > 1:
        with pytest.raises(ValueError, match="--batch-size"):
            train(_tc(tmp_path / "b", tiny_features, **{**kw, "batch_size": 1}), cfg, tensors, resume=True)
    with pytest.raises(ValueError, match="started with --num-layers 1, not 2"):   # never drops or invents a layer
        train(_tc(tmp_path / "b", tiny_features, **{**kw, "num_layers": 2}), cfg, tensors, resume=True)


@pytest.mark.slow
def test_sigterm_saves_state_and_resume_continues_the_curve(tiny, tiny_features, tmp_path, monkeypatch):
    """SIGTERM during step 4 ends the run after that step with the resume state written (summary stopped_by),
    the handler before the run is restored, and --resume repeats the uninterrupted loss curve."""
    import os
    import signal

    from mindspore_eagle.train import trainer

    cfg, tensors, _ = tiny
    kw = dict(steps=10, n_eval=8, batch_size=1, checkpoint_every=100)
    full = trainer.train(_tc(tmp_path / "a", tiny_features, **kw), cfg, tensors)
    real_lr = trainer.lr_at

    def lr_and_term(step, *a):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_lr(step, *a)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(trainer, "lr_at", lr_and_term)
    part = trainer.train(_tc(tmp_path / "b", tiny_features, **kw), cfg, tensors)
    assert signal.getsignal(signal.SIGTERM) is before
    assert part["stopped_by"] == "SIGTERM" and len(part["losses_this_run"]) == 4
    state = np.load(tmp_path / "b" / "resume" / "state.npz")
    assert int(state["step"]) == 4 and int(state["cursor"]) == 4
    monkeypatch.setattr(trainer, "lr_at", real_lr)
    rest = trainer.train(_tc(tmp_path / "b", tiny_features, **kw), cfg, tensors, resume=True)
    assert rest["resumed_from"] == 4 and rest["stopped_by"] is None
    np.testing.assert_allclose(part["losses_this_run"] + rest["losses_this_run"], full["losses_this_run"],
                               atol=1e-5, rtol=0)
    assert [json.loads(ln)["step"] for ln in open(tmp_path / "b" / "eval_log.jsonl")] == [0, 10]


@pytest.mark.slow
def test_export_loads_and_inference_cell_matches_training_step0(tiny, tiny_features, trained):
    import mindspore as ms
    from mindspore import Parameter, Tensor

    from mindspore_eagle.models.eagle3 import Eagle3Drafter, load_drafter
    from mindspore_eagle.train.features import FeatureSet, head_weight
    from mindspore_eagle.train.ttt import TTTDrafter, make_batch

    cfg, tensors, _ = tiny
    out, _ = trained
    dcfg, dt = load_drafter(str(out))
    assert "embed_tokens.weight" not in dt and dt["d2t"].dtype == np.int64 and dt["t2d"].sum() == 96
    used = np.nonzero(dt["t2d"])[0]
    np.testing.assert_array_equal(dt["d2t"], used - np.arange(96))
    T, K, B = 64, 5, 8
    d = FeatureSet(tiny_features)[40]
    n = len(d["input_ids"]) - 1
    embed = tensors["model.embed_tokens.weight"]
    train_net = TTTDrafter(dcfg, embed, head_weight(cfg, tensors)[used], dt["d2t"], T, 3)
    train_net.load_tensors(dt)
    b = make_batch(d["input_ids"], d["loss_mask"], d["aux"], d["hidden"], d["argmax"], dt["t2d"], T, 3)
    ref = ms.jit(train_net.step0_logp)(Tensor(b.aux[0]), Tensor(b.ids[0, 0])).asnumpy()[:n]

    inf = Eagle3Drafter(dcfg, Parameter(Tensor(embed), name="shared_embed", requires_grad=False), top_k=K,
                        num_blocks=T // B, block_size=B, max_seq_len=T)
    inf.load_tensors(dt)
    mask = np.where(np.tri(n, T, dtype=bool), 0.0, -1e9).astype(np.float32)
    h = inf.fuse(Tensor(b.aux[0, :n]))
    top_logp, top_ids, _ = inf(h, Tensor(b.ids[0, 0][:n]), Tensor(np.arange(n, dtype=np.int32)),
                               Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(T // B, dtype=np.int32)),
                               Tensor(mask))
    want_idx = np.argsort(-ref, -1, kind="stable")[:, :K]
    np.testing.assert_allclose(top_logp.asnumpy(), np.take_along_axis(ref, want_idx, -1), atol=2e-4)
    np.testing.assert_array_equal(top_ids.asnumpy()[:, 0], used[want_idx[:, 0]])


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


@pytest.mark.slow
def test_init_from_grows_a_one_layer_drafter(tiny, tiny_features, trained, tmp_path):
    """--num-layers 2 --init-from a 1-layer drafter: layer 0 keeps the source's weights, the new layer starts as
    the identity (held-out accuracy at step 0 equals the source's), it trains, and shrinking is refused."""
    from mindspore_eagle.models.eagle3 import load_drafter
    from mindspore_eagle.train.trainer import train

    cfg, tensors, _ = tiny
    src, _ = trained
    _, t0 = load_drafter(str(src))
    grown = tmp_path / "grown"
    train(_tc(grown, tiny_features, steps=4, lr=1e-3, warmup=1, checkpoint_every=4, init_from=str(src),
              num_layers=2), cfg, tensors)
    c1, t1 = load_drafter(str(grown))
    assert c1.num_hidden_layers == 2 and np.abs(t1["layers.1.mlp.down_proj.weight"]).max() > 0
    ev = [json.loads(ln) for ln in open(grown / "eval_log.jsonl")]
    same = tmp_path / "same"
    train(_tc(same, tiny_features, steps=4, lr=1e-3, warmup=1, checkpoint_every=4, init_from=str(src)), cfg,
          tensors)
    ev1 = [json.loads(ln) for ln in open(same / "eval_log.jsonl")]
    assert ev[0]["step"] == ev1[0]["step"] == 0
    np.testing.assert_allclose(ev[0]["acc"], ev1[0]["acc"], atol=1e-6)
    with pytest.raises(ValueError, match="it has 2 layers, more than --num-layers 1"):
        train(_tc(tmp_path / "shrink", tiny_features, steps=2, init_from=str(grown)), cfg, tensors)


@pytest.mark.slow
def test_init_from_adds_fc_norm_at_the_median_scale(tiny, tiny_features, trained, tmp_path):
    """--fc-norm --init-from a drafter without it: each chunk's weights start at the median RMS of that chunk's
    rows (first rows left out; checked against a direct computation), the run trains the weights and exports
    ``fc_norm.{c}.weight`` with ``"fc_norm": true`` in config.json; resuming without --fc-norm and fine-tuning
    an fc_norm drafter without it are refused."""
    from mindspore_eagle.models.eagle3 import load_drafter
    from mindspore_eagle.train.features import FeatureSet
    from mindspore_eagle.train.trainer import fc_norm_weights, train

    cfg, tensors, _ = tiny
    src, _ = trained
    fs = FeatureSet(tiny_features)
    H = cfg.hidden_size
    w = fc_norm_weights(fs, range(3), H)
    for c in range(3):
        rows = np.concatenate([np.asarray(fs[i]["aux"][1:-1, c * H:(c + 1) * H], np.float64) for i in range(3)])
        want = np.median(np.sqrt((rows ** 2).mean(1)))
        assert w[f"fc_norm.{c}.weight"].shape == (H,)
        np.testing.assert_allclose(w[f"fc_norm.{c}.weight"], want, rtol=1e-5)
    n_train = len(fs) - min(8, len(fs) // 4)                                   # _tc's n_eval 8
    start = fc_norm_weights(fs, range(min(64, n_train)), H)
    still = tmp_path / "still"                                                # lr 0: the export is the start
    train(_tc(still, tiny_features, steps=2, lr=0.0, warmup=1, checkpoint_every=2, init_from=str(src),
              fc_norm=True), cfg, tensors)
    _, t_still = load_drafter(str(still))
    for c in range(3):
        np.testing.assert_allclose(t_still[f"fc_norm.{c}.weight"], start[f"fc_norm.{c}.weight"], rtol=1e-3)
    out = tmp_path / "fcn"
    train(_tc(out, tiny_features, steps=4, lr=1e-3, warmup=1, checkpoint_every=2, init_from=str(src),
              fc_norm=True, stop_at=2), cfg, tensors)
    with pytest.raises(ValueError, match="started with --fc-norm"):
        train(_tc(out, tiny_features, steps=4, lr=1e-3, warmup=1, checkpoint_every=2), cfg, tensors, resume=True)
    train(_tc(out, tiny_features, steps=4, lr=1e-3, warmup=1, checkpoint_every=2, fc_norm=True), cfg, tensors,
          resume=True)
    c1, t1 = load_drafter(str(out))
    assert c1.fc_norm and json.loads((out / "config.json").read_text())["fc_norm"] is True
    moved = [np.abs(t1[f"fc_norm.{c}.weight"] - start[f"fc_norm.{c}.weight"]).max() for c in range(3)]
    assert max(moved) > 0 and all(np.isfinite(t1[f"fc_norm.{c}.weight"]).all() for c in range(3))
    with pytest.raises(ValueError, match="has fc_norm: train it with --fc-norm"):
        train(_tc(tmp_path / "drop", tiny_features, steps=2, init_from=str(out)), cfg, tensors)


def test_lk_curve_chains_runs_by_tokens_seen(tmp_path):
    """scripts/lk_curve.py: a second run started from the first one's export continues the x axis; its step-0
    line (the same weights as the first run's end) is not repeated; the implied L_k is read at D = 3."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("lk_curve", Path(__file__).parents[2] / "scripts" / "lk_curve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def line(step, tok, l4):
        L = {"D3": {"k1": 1.1, "k2": 1.2, "k4": l4}}
        return json.dumps({"step": step, "tokens_seen": tok, "acc": [0.3] * 3, "cov": {"k4": [0.5] * 3},
                           "L_implied": L}) + "\n"

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "eval_log.jsonl").write_text(line(0, 0, 2.0) + line(100, 1000, 2.1) + line(200, 2000, 2.2))
    (b / "eval_log.jsonl").write_text(line(0, 0, 2.2) + line(50, 700, 2.4))
    rows = mod.load_curve([str(a), str(b)], start_tokens=10)
    assert [r["tokens"] for r in rows] == [10, 1010, 2010, 2710]
    assert [r["L_k4"] for r in rows] == [2.0, 2.1, 2.2, 2.4]
    assert mod.main([str(a), str(tmp_path / "missing")]) == 2
