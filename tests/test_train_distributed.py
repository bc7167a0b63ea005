"""Data-parallel drafter training (mindspore_eagle.train.distributed): sharding of each global batch, the rank
equality check, launch-environment errors, and 2 msrun CPU workers x 1 sample == 1 process x 2 samples."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from mindspore_eagle.train.distributed import (DistContext, DistError, all_equal_from_sums, check_batch, fingerprint,
                                               init_from_env, local_positions)
from test_train import tiny_features  # noqa: F401  (module fixture: 48 tiny-teacher samples, max_len 64)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------- pure parts --
def test_local_positions_split_each_global_batch_in_order():
    np.testing.assert_array_equal(local_positions(3, 4, 0, 2), [12, 13])       # step 3 of G = 4: positions 12..15
    np.testing.assert_array_equal(local_positions(3, 4, 1, 2), [14, 15])
    np.testing.assert_array_equal(local_positions(5, 1, 0, 1), [5])            # G = 1, W = 1: the old order
    for G, W in ((2, 2), (6, 3), (8, 2), (8, 8), (3, 1)):
        for step in (0, 1, 7):
            got = np.concatenate([local_positions(step, G, r, W) for r in range(W)])
            np.testing.assert_array_equal(got, np.arange(step * G, (step + 1) * G))


def test_batch_and_rank_errors_name_the_field():
    assert check_batch(6, 3) == 2
    with pytest.raises(DistError, match=r"--batch-size 3 must be a multiple .*RANK_SIZE=2"):
        check_batch(3, 2)
    with pytest.raises(DistError, match="--batch-size must be >= 1"):
        check_batch(0, 1)
    with pytest.raises(DistError, match="rank 2 is out of range for 2 ranks"):
        local_positions(0, 2, 2, 2)


def test_init_from_env_single_process_and_bad_launches():
    assert init_from_env({}) == DistContext(rank=0, world=1, launched=False, scheduler=False)
    assert init_from_env({"RANK_ID": "0", "RANK_SIZE": "1"}).is_main
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


# --------------------------------------------------------------------------------------- msrun, 2 CPU workers --
STEPS = 4
COMMON = ["--vd", "96", "--ttt-length", "3", "--steps", str(STEPS), "--lr", "3e-3", "--max-len", "64",
          "--checkpoint-every", str(STEPS), "--batch-size", "2", "--stage", "train"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _msrun_train(tmp_path, tiny_dir, fdir, out, workers=2):
    """`msrun --worker_num W --local_worker_num W --join True python -m mindspore_eagle.train ...` (the msrun
    console script is mindspore.parallel.cluster.run's main); returns (returncode, worker log tails)."""
    log_dir = tmp_path / "msrun_log"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), MSEAGLE_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])  # msrun starts `python`
    cmd = [sys.executable, "-m", "mindspore.parallel.cluster.run", "--worker_num", str(workers),
           "--local_worker_num", str(workers), "--master_port", str(_free_port()), "--join", "True",
           "--cluster_time_out", "120", "--log_dir", str(log_dir),
           "python", "-m", "mindspore_eagle.train", "--teacher", str(tiny_dir), "--out", str(out),
           "--features-dir", fdir] + COMMON
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


def _tc(out, fdir, **kw):
    """The TrainConfig that COMMON gives on the command line (n_eval default: 12 of the 48 samples held out)."""
    from mindspore_eagle.train.trainer import TrainConfig

    base = dict(out=str(out), features_dir=fdir, vd=96, ttt_length=3, steps=STEPS, lr=3e-3, max_len=64,
                checkpoint_every=STEPS, batch_size=2, progress=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def one_process(tiny, tiny_features, tmp_path_factory):  # noqa: F811
    """1 process, global batch 2 (gradient accumulation), STEPS steps: its output directory."""
    from mindspore_eagle.train.trainer import train

    cfg, tensors, _ = tiny
    out = tmp_path_factory.mktemp("one")
    train(_tc(out, tiny_features), cfg, tensors)
    return out


def test_accumulated_global_batch_resumes_exactly(tiny, tiny_features, one_process, tmp_path):  # noqa: F811
    """Stopping after 2 of 4 steps at global batch 2 and resuming repeats the uninterrupted curve; resuming with
    another --batch-size is refused (the sample order depends on it)."""
    from mindspore_eagle.train.trainer import train

    cfg, tensors, _ = tiny
    full = [json.loads(ln)["loss"] for ln in open(one_process / "train_log.jsonl")]
    part = train(_tc(tmp_path, tiny_features, stop_at=2), cfg, tensors)  # same held-out split
    np.testing.assert_allclose(part["losses_this_run"], np.round(full[:2], 5), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="--batch-size 4 differs from the resumed run's 2"):
        train(_tc(tmp_path, tiny_features, batch_size=4), cfg, tensors, resume=True)
    rest = train(_tc(tmp_path, tiny_features), cfg, tensors, resume=True)
    assert rest["resumed_from"] == 2
    np.testing.assert_allclose(rest["losses_this_run"], np.round(full[2:], 5), atol=1e-5, rtol=0)


def test_two_msrun_workers_reproduce_one_process_global_batch(tiny_dir, tiny_features, one_process,  # noqa: F811
                                                              tmp_path):
    """2 workers x 1 sample per step (gradients all-reduced, mean) give the loss curve, statistics and final
    weights of 1 process x 2 samples per step (gradient accumulation, mean), up to float rounding (measured:
    weights and optimiser moments bit-identical after 4 steps, logged losses within 1 float32 ulp); only rank 0
    writes the log."""
    one = one_process
    two = tmp_path / "two"
    rc, tails = _msrun_train(tmp_path, tiny_dir, tiny_features, two)
    assert rc == 0, tails
    log1 = [json.loads(ln) for ln in open(one / "train_log.jsonl")]
    log2 = [json.loads(ln) for ln in open(two / "train_log.jsonl")]
    assert [r["step"] for r in log2] == list(range(STEPS)), tails          # one writer: each step once
    np.testing.assert_allclose([r["loss"] for r in log2], [r["loss"] for r in log1], rtol=1e-5)
    np.testing.assert_allclose([r["losses"] for r in log2], [r["losses"] for r in log1], rtol=1e-5, atol=1e-5)
    assert [r["masked"] for r in log2] == [r["masked"] for r in log1]          # same samples in each step
    assert [r["tokens"] for r in log2] == [r["tokens"] for r in log1]
    assert [r["correct"] for r in log2] == [r["correct"] for r in log1]
    assert log1[-1]["loss"] != log1[0]["loss"]                                # the weights did move
    s1, s2 = np.load(one / "resume" / "state.npz"), np.load(two / "resume" / "state.npz")
    assert int(s2["step"]) == STEPS and int(s2["batch_size"]) == 2
    for k in s1.files:
        if k.startswith(("w:", "o:")):
            np.testing.assert_allclose(s2[k], s1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    summ = json.load(open(two / "summary.json"))
    assert summ["world_size"] == 2 and summ["batch_size"] == 2 and summ["heldout"]["samples"] == 12
