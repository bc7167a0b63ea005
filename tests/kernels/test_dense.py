"""kernels/dense.py: the portable backend's dense math (MindSpore ops, PyNative) against float64 numpy
references: both matmul forms of ``linear`` and where each is used, RoPE as the rotate-half formula, RMSNorm, the
SwiGLU MLP."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindspore_eagle.kernels import dense


@pytest.fixture(autouse=True)
def _runtime(ms_runtime):
    return ms_runtime


def _close(got, want, tol=2e-5):
    got = got.asnumpy().astype(np.float64)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= tol * max(1.0, np.max(np.abs(want)))


def test_weight_left_rows_only_in_float32():
    lo, hi = dense.WEIGHT_LEFT_ROWS
    assert [dense._weight_left(k) for k in (1, lo - 1, lo, hi, hi + 1)] == [False, False, True, True, False]
    assert not dense._weight_left(16, ms.float16)


@pytest.mark.parametrize("k", [1, 4, 8, 16, 32, 33])
def test_linear_equals_x_times_w_transposed(k):
    rng = np.random.default_rng(k)
    x, w = rng.normal(size=(k, 48)).astype(np.float32), rng.normal(size=(40, 48)).astype(np.float32)
    _close(dense.linear(Tensor(x), Tensor(w)), x.astype(np.float64) @ w.T.astype(np.float64))


def test_rope_is_rotate_half():
    rng = np.random.default_rng(0)
    hd, T = 8, 5
    x = rng.normal(size=(T, 2, hd)).astype(np.float32)                    # [T, heads, hd]
    ang = rng.uniform(0, 6, size=(T, 1, hd // 2))
    c, s = np.cos(ang), np.sin(ang)
    cos = np.concatenate([c, c], -1).astype(np.float32)
    sin_signed = np.concatenate([-s, s], -1).astype(np.float32)
    x1, x2 = x[..., : hd // 2].astype(np.float64), x[..., hd // 2:].astype(np.float64)
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    swap = dense.rope_swap_index(hd)
    assert swap.asnumpy().tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    _close(dense.apply_rope(Tensor(x), Tensor(cos), Tensor(sin_signed), swap), want)
    half = dense.apply_rope(Tensor(x.astype(np.float16)), Tensor(cos), Tensor(sin_signed), swap)
    assert half.dtype == ms.float16
    _close(half, want, tol=2e-3)


def test_rms_norm():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 16)).astype(np.float32) * 5
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6)
    _close(dense.rms_norm(Tensor(x), 1e-6), want)
    half = dense.rms_norm(Tensor(x.astype(np.float16)), 1e-6)
    assert half.dtype == ms.float16
    _close(half, want, tol=2e-3)


@pytest.mark.parametrize("k", [1, 16])                      # x @ w.T form and weight-left form
def test_swiglu_mlp(k):
    rng = np.random.default_rng(2)
    H, F = 24, 40
    x = rng.normal(size=(k, H)).astype(np.float32)
    wgu = (rng.normal(size=(2 * F, H)) * 0.3).astype(np.float32)
    wd = (rng.normal(size=(H, F)) * 0.3).astype(np.float32)
    x64, wgu64, wd64 = (a.astype(np.float64) for a in (x, wgu, wd))
    gate, up = x64 @ wgu64[:F].T, x64 @ wgu64[F:].T
    want = (gate / (1 + np.exp(-gate)) * up) @ wd64.T
    _close(dense.swiglu_mlp(Tensor(x), Tensor(wgu), Tensor(wd), F), want)
