"""Data-parallel drafter training (mindspore_eagle.train.distributed): sharding of each global batch, the rank
equality check, the reduced statistics, launch-environment errors, and 2 msrun CPU workers x 1 row per step ==
1 process x 2 rows per step, resumed exactly."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from mindspore_eagle.train.distributed import (
    DistContext,
    DistError,
    all_equal_from_sums,
    check_batch,
    fingerprint,
    init_from_env,
    local_positions,
    reduce_step_stats,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------------------------- pure parts --
def test_local_positions_split_each_global_batch_in_order():
    np.testing.assert_array_equal(local_positions(12, 4, 0, 2), [12, 13])      # step at cursor 12, G = 4
    np.testing.assert_array_equal(local_positions(12, 4, 1, 2), [14, 15])
    np.testing.assert_array_equal(local_positions(5, 1, 0, 1), [5])            # G = 1, W = 1: one per step
    for G, W in ((2, 2), (6, 3), (8, 2), (8, 8), (3, 1)):
        for cursor in (0, G, 7 * G):
            got = np.concatenate([local_positions(cursor, G, r, W) for r in range(W)])
            np.testing.assert_array_equal(got, np.arange(cursor, cursor + G))


def test_batch_pack_and_rank_errors_name_the_field():
    assert check_batch(6, 3) == 2 and check_batch(4, 1, pack_len=128) == 4       # packing: one process is fine
    with pytest.raises(DistError, match=r"--batch-size 3 must be a multiple .*RANK_SIZE=2"):
        check_batch(3, 2)
    with pytest.raises(DistError, match="--batch-size must be >= 1"):
        check_batch(0, 1)
    with pytest.raises(DistError, match=r"--pack-len 128 is not supported with data parallelism \(2 msrun ranks"):
        check_batch(4, 2, pack_len=128)
    with pytest.raises(DistError, match="rank 2 is out of range for 2 ranks"):
        local_positions(0, 2, 2, 2)


def test_init_from_env_single_process_and_bad_launches():
    assert init_from_env({}) == DistContext(rank=0, world=1, launched=False, scheduler=False)
    assert init_from_env({"RANK_ID": "0", "RANK_SIZE": "1"}).is_main
    assert DistContext().grad_reduce() is None                                  # one process: no all-reduce
    with pytest.raises(DistError, match="RANK_SIZE=2 but this process was not started by msrun"):
        init_from_env({"RANK_ID": "1", "RANK_SIZE": "2"})
    with pytest.raises(DistError, match="RANK_SIZE must be an integer, got 'two'"):
        init_from_env({"RANK_SIZE": "two"})


def test_rank_equality_check_from_sums():
    a = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)]
    f = fingerprint(a)
    assert f.shape == (32,) and f.dtype == np.float32 and f.max() <= 255 and np.all(f == np.round(f))
    np.testing.assert_array_equal(fingerprint([x.copy() for x in a]), f)
    b = [a[0].copy(), a[1]]
    b[0][1, 2] = np.nextafter(np.float32(5), np.float32(6))                 # one ulp in one element
    g = fingerprint(b)
    assert not np.array_equal(f, g)
    assert not np.array_equal(fingerprint([a[0].astype(np.float64), a[1]]), f)  # same values, other dtype
    assert all_equal_from_sums(3 * f, 3 * f * f, 3)                          # three equal ranks
    assert not all_equal_from_sums(2 * f + g, 2 * f * f + g * g, 3)          # one rank differs
    assert all_equal_from_sums(np.array([4.0]), np.array([8.0]), 2)          # x = (2, 2): 2 * 8 == 4^2
    assert not all_equal_from_sums(np.array([4.0]), np.array([10.0]), 2)     # x = (1, 3): 2 * 10 != 16
    DistContext().check_same(a)                                              # one process: nothing to compare


class _TwoEqualRanks(DistContext):
    """W = 2 without communication: every all-reduce sees the other rank holding the same values."""

    def __init__(self):
        super().__init__(rank=0, world=2)

    def sum(self, x):
        return 2 * np.asarray(x, np.float64)


def test_step_statistics_mean_the_losses_and_sum_the_counts():
    losses, correct, masked = np.array([1.5, 2.0]), np.array([3.0, 1.0]), np.array([10.0, 9.0])
    one = reduce_step_stats(DistContext(), 0.75, losses, correct, masked, 2, 100)
    assert one[0] == 0.75 and one[1] is losses and one[4:] == (2, 100)           # W = 1: unchanged
    loss, ls, c, m, n, tok = reduce_step_stats(_TwoEqualRanks(), 0.75, losses, correct, masked, 2, 100)
    assert loss == 0.75 and (n, tok) == (4, 200)
    np.testing.assert_array_equal(ls, losses)
    np.testing.assert_array_equal(c, 2 * correct)
    np.testing.assert_array_equal(m, 2 * masked)


def _tc(out, fdir, **kw):
    """The TrainConfig that COMMON gives on the command line (n_eval default: 12 of the 48 samples held out)."""
    from mindspore_eagle.train.trainer import TrainConfig

    base = dict(out=str(out), features_dir=fdir, vd=96, ttt_length=3, steps=STEPS, lr=3e-3, max_len=64,
                checkpoint_every=2, batch_size=2, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_rank_batches_are_the_rows_of_the_global_batch(tiny, tiny_features):  # noqa: F811
    """Rank r's batch holds rows rB .. (r+1)B-1 of the one-process batch of G = WB rows, from any stream cursor;
    every rank's cursor advances by G. Packing with 2 ranks is refused before any data is read."""
    from mindspore_eagle.models.eagle3 import vocab_maps
    from mindspore_eagle.train.features import FeatureSet
    from mindspore_eagle.train.trainer import next_batch, train

    cfg, tensors, _ = tiny
    fs = FeatureSet(tiny_features)
    lengths = np.array([min(len(fs[i]["input_ids"]), 64) for i in range(36)])
    t2d = vocab_maps(np.arange(96), cfg.vocab_size)["t2d"]
    tc = _tc("unused", tiny_features, batch_size=4)
    for cursor in (0, 34):                                                    # 34: the batch crosses an epoch
        whole, end = next_batch(fs, cursor, lengths, tc, t2d)
        parts = [next_batch(fs, cursor, lengths, tc, t2d, DistContext(rank=r, world=2)) for r in range(2)]
        assert [p[1] for p in parts] == [end, end] == [cursor + 4] * 2
        assert [p[0].n_samples for p in parts] == [2, 2]
        for name in ("aux", "hid", "seg", "pos"):
            np.testing.assert_array_equal(np.concatenate([getattr(p[0], name) for p in parts]),
                                          getattr(whole, name), err_msg=name)
        for name in ("ids", "tgt", "pos_mask", "loss_mask"):                  # [S, B, T]
            np.testing.assert_array_equal(np.concatenate([getattr(p[0], name) for p in parts], 1),
                                          getattr(whole, name), err_msg=name)
    with pytest.raises(DistError, match="--pack-len 128 is not supported"):
        train(_tc("unused", tiny_features, pack_len=128), cfg, tensors, dist=DistContext(rank=0, world=2))


# --------------------------------------------------------------------------------------- msrun, 2 CPU workers --
STEPS = 4
COMMON = ["--vd", "96", "--ttt-length", "3", "--steps", str(STEPS), "--lr", "3e-3", "--max-len", "64",
          "--checkpoint-every", "2", "--batch-size", "2", "--stage", "train"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _msrun_train(tmp_path, tiny_dir, fdir, out, extra=(), workers=2):
    """`msrun --worker_num W --local_worker_num W --join True python -m mindspore_eagle.train ...` (the msrun
    console script is mindspore.parallel.cluster.run's main); returns (returncode, worker log tails)."""
    log_dir = tmp_path / "msrun_log"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), MSEAGLE_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])  # msrun starts `python`
    cmd = [sys.executable, "-m", "mindspore.parallel.cluster.run", "--worker_num", str(workers),
           "--local_worker_num", str(workers), "--master_port", str(_free_port()), "--join", "True",
           "--cluster_time_out", "120", "--log_dir", str(log_dir),
           "python", "-m", "mindspore_eagle.train", "--teacher", str(tiny_dir), "--out", str(out),
           "--features-dir", fdir] + COMMON + list(extra)
    p = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)              # msrun, its scheduler and workers: our process group only
        p.communicate()
    tails = ""
    for f in sorted(log_dir.glob("*.log")) if log_dir.exists() else []:
        tails += f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]) + "\n"
    return p.returncode, tails


@pytest.fixture(scope="module")
def one_process(tiny, tiny_features, tmp_path_factory):  # noqa: F811
    """1 process, 2 rows per step (one batched step), STEPS steps, checkpoints every 2: its output directory."""
    from mindspore_eagle.train.trainer import train

    cfg, tensors, _ = tiny
    out = tmp_path_factory.mktemp("one")
    train(_tc(out, tiny_features), cfg, tensors)
    return out


@pytest.mark.slow
def test_two_msrun_workers_reproduce_one_process_global_batch_and_resume(tiny_dir, tiny_features,  # noqa: F811
                                                                         one_process, tmp_path):
    """2 workers x 1 row per step (gradients all-reduced, mean), stopped after 2 of 4 steps and resumed under
    msrun, give the loss curve, statistics, held-out evaluation and final weights of 1 process x 2 rows per step
    run without a break, up to float rounding (measured: losses within 1 float32 ulp, weights within 3e-7);
    only rank 0 writes."""
    one = one_process
    two = tmp_path / "two"
    log1 = [json.loads(ln) for ln in open(one / "train_log.jsonl")]
    rc, tails = _msrun_train(tmp_path, tiny_dir, tiny_features, two, ["--stop-at", "2"])
    assert rc == 0, tails
    st = np.load(two / "resume" / "state.npz")
    assert (int(st["step"]), int(st["cursor"]), int(st["batch_size"])) == (2, 4, 2)     # global stream cursor
    rc, tails = _msrun_train(tmp_path, tiny_dir, tiny_features, two, ["--resume"])
    assert rc == 0, tails
    log2 = [json.loads(ln) for ln in open(two / "train_log.jsonl")]
    assert [r["step"] for r in log2] == list(range(STEPS)), tails          # one writer: each step once
    np.testing.assert_allclose([r["loss"] for r in log2], [r["loss"] for r in log1], rtol=1e-5)
    np.testing.assert_allclose([r["losses"] for r in log2], [r["losses"] for r in log1], rtol=1e-5, atol=1e-5)
    for key in ("masked", "tokens", "correct", "samples", "cursor"):       # same samples in each step
        assert [r[key] for r in log2] == [r[key] for r in log1], key
    assert log1[-1]["loss"] != log1[0]["loss"]                                # the weights did move
    s1, s2 = np.load(one / "resume" / "state.npz"), np.load(two / "resume" / "state.npz")
    assert int(s2["step"]) == STEPS and int(s2["cursor"]) == int(s1["cursor"]) == 2 * STEPS
    for k in s1.files:
        if k.startswith(("w:", "o:")):
            np.testing.assert_allclose(s2[k], s1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    summ1, summ2 = json.load(open(one / "summary.json")), json.load(open(two / "summary.json"))
    assert summ2["world_size"] == 2 and summ2["batch_size"] == 2 and summ2["resumed_from"] == 2
    assert summ2["heldout"]["samples"] == 12
    h1, h2 = summ1["heldout"], summ2["heldout"]                             # held-out split over the ranks
    assert h2["positions"] == h1["positions"] and h2["masked_tokens_step0"] == h1["masked_tokens_step0"]
    # accuracy / coverage: equal here (measured); 5e-3 (~1 of the ~190 positions per step) leaves room for an
    # argmax tie that a weight difference of 1e-7 could break on another build
    np.testing.assert_allclose(h2["acc"], h1["acc"], atol=5e-3)
    for k in h1["cov"]:
        np.testing.assert_allclose(h2["cov"][k], h1["cov"][k], atol=5e-3, err_msg=k)
    assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-5)
    evals1 = [json.loads(ln) for ln in open(one / "eval_log.jsonl")]
    evals2 = [json.loads(ln) for ln in open(two / "eval_log.jsonl")]
    assert [e["step"] for e in evals2] == [e["step"] for e in evals1] == [0, 2, 4]
    assert [e["tokens_seen"] for e in evals2] == [e["tokens_seen"] for e in evals1]
    np.testing.assert_allclose([e["acc"] for e in evals2], [e["acc"] for e in evals1], atol=5e-3)
