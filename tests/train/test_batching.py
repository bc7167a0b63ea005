"""train/batching.py: a batched or packed step equals the mean of its single-sample steps (gradients and the
AdamW update), packed rows keep each sample's shift inside its segment, rows planned first fit in stream order."""
from __future__ import annotations

import numpy as np
import pytest

from mindspore_eagle.train.vocab import select_vocab


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
