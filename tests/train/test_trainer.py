"""train/trainer.py on the tiny teacher: teacher-initialised weights, learning, exact resume (also after SIGTERM),
export loaded by the inference Cell, --init-from (fine-tuning, a grown layer, fc_norm added)."""
from __future__ import annotations

import json

import numpy as np
import pytest


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
