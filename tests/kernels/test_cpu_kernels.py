"""Contract tests of the CPU kernels (kernels/cpu.py, cpu_kernels.cc) and of the CPU backend.

- each kernel against its float64 numpy reference (shapes with tails: K and hd not multiples of 8, N not a
  multiple of 4, odd row counts), and each contract shown able to fail: a transposed weight, a wrong RoPE sign,
  an off-by-one cache row, a shifted mask all differ from the reference beyond the tolerance;
- batch invariance: every row of a k-row call equals, bit for bit, the same row computed alone;
- float16 weights: a call with half-float matrices equals, bit for bit, the float32 call on the same weights
  widened (a half converts to exactly one float), and a half weight is really read as half (not as float bits);
- the teacher on the CPU backend against the portable backend (chunked prefill, decode, tree verification,
  commit, rollback; logits, features and the cache), eager and fused;
- end to end: the logits of a tree's nodes in one verification equal, bit for bit, the logits of the same tokens
  decoded one at a time (the property that makes speculation exactly lossless on this backend);
- a missing compiler or a compile error gives a one-line KernelBuildError.
"""
import ctypes

import mindspore as ms
import numpy as np
import pytest
from tiny_engines import tiny_tree

from mindspore_eagle.core.tree import DraftTree, tensorize
from mindspore_eagle.kernels import cpu

# Skipped only where no compiler exists (not Linux, no $CXX / g++); where one exists a failed build fails the tests.
pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C++ compiler here: the CPU kernels cannot build")

TOL = 1e-5          # relative to the reference's largest magnitude (float32 kernels, float64 references)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def call(prim, *arrays):
    """Run a Custom primitive eagerly on numpy inputs -> numpy outputs (a tuple when it has several)."""
    out = prim(*[ms.Tensor(a) for a in arrays])
    return tuple(o.asnumpy() for o in out) if isinstance(out, tuple) else out.asnumpy()


def test_kernels_build_where_a_compiler_exists():
    ok, why = cpu.status()
    assert ok, f"a C++ compiler exists ({cpu.compiler()}) but the CPU kernels did not build: {why}"


@pytest.fixture(scope="module")
def kern(ms_runtime):
    return cpu.CpuKernels()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8, 11, 15, 16, 32])  # every tile mix: 4/2/1-row tiles of
def test_linear(kern, k):                                                   # k < 8, then 8/4/2/1-row tiles
    rng = np.random.default_rng(k)
    K, N = 44, 13           # N = 3 blocks of 4 + 1, 4 blocks of 3 + 1, 13 of 1: full blocks and a one-row tail
    x = rng.normal(size=(k, K)).astype(np.float32)
    w = rng.normal(size=(N, K)).astype(np.float32)
    y = call(kern.linear, x, w)
    assert y.shape == (k, N) and rel(y, cpu.ref_linear(x, w)) < TOL
    assert rel(y, cpu.ref_linear(x, w.reshape(K, N).T)) > 0.1          # a transposed layout is caught
    for r in range(k):                                                  # batch invariance, bitwise
        assert np.array_equal(call(kern.linear, x[r:r + 1], w)[0], y[r])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64])   # 4/2/1-row and 8/4/2/1-row tiles, prefill
def test_packed_linear(kern, k):
    """Matrices packed [N / 16, K, 16] (cpu.pack) run at any row count: the reference's values, every row the bits
    of its one-row call (batch invariance), float16 panels the bits of their widened float32, one thread or two."""
    from mindspore_eagle.kernels import runtime

    rng = np.random.default_rng(100 + k)
    K, N = 44, 16 * 7           # 7 panels: groups of 4 or 3 and single panels, split over two threads
    x = rng.normal(size=(k, K)).astype(np.float32)
    w = rng.normal(size=(N, K)).astype(np.float32)
    wp = cpu.pack(w)
    assert wp.shape == (7, K, 16) and np.array_equal(cpu.unpack(wp), w)
    y = call(kern.linear, x, wp)
    assert y.shape == (k, N) and rel(y, cpu.ref_linear(x, w)) < TOL
    assert rel(y, cpu.ref_linear(x, cpu.unpack(wp.reshape(K, 7, 16).transpose(1, 0, 2).copy()))) > 0.1
    for r in range(k):
        assert np.array_equal(call(kern.linear, x[r:r + 1], wp)[0], y[r])
    half = cpu.pack(w.astype(np.float16))
    assert np.array_equal(call(kern.linear, x, half), call(kern.linear, x, half.astype(np.float32)))
    try:
        cpu.set_threads(1)
        assert np.array_equal(call(kern.linear, x, wp), y)
    finally:
        cpu.set_threads(runtime.kernel_threads())


def test_pack_needs_rows_in_panels():
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.pack(np.zeros((13, 4), np.float32))
    assert cpu.matrix_rows((3, 8, 16)) == 48 and cpu.matrix_rows((13, 4)) == 13
    w = np.random.default_rng(0).normal(size=(16 * 70, 5)).astype(np.float32)   # 70 panels: two blocks of 64
    buf = w.copy()
    inplace = cpu.pack(buf, inplace=True)
    assert np.shares_memory(inplace, buf) and np.array_equal(inplace, cpu.pack(w))
    assert np.array_equal(cpu.rows(inplace, [0, 17, 1119]), w[[0, 17, 1119]])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pack_in_place_by_the_kernels_equals_numpy(kern, monkeypatch, dtype):
    """In place, the kernels' PackInPlace (threads over panels) writes the bytes numpy's transpose writes."""
    cpu.set_threads(2)
    for n, k in ((16, 1), (16 * 70, 5), (48, 577)):
        w = np.random.default_rng(n + k).normal(size=(n, k)).astype(dtype)
        by_kernels = w.copy()
        lib = ctypes.CDLL(str(cpu.library_path()))
        assert lib.PackInPlace(ctypes.c_void_p(by_kernels.ctypes.data), ctypes.c_int64(n), ctypes.c_int64(k),
                               ctypes.c_int(by_kernels.itemsize)) == 0
        assert np.array_equal(cpu.pack(w.copy(), inplace=True).reshape(n, k), by_kernels)
        by_kernels = by_kernels.reshape(n // 16, k, 16)
        with monkeypatch.context() as m:
            m.delitem(cpu._built, "path")                                # as if the library were not loaded
            by_numpy = cpu.pack(w.copy(), inplace=True)
        assert by_kernels.dtype == dtype and np.array_equal(by_kernels, by_numpy)
        assert np.array_equal(by_kernels, np.ascontiguousarray(w.reshape(n // 16, 16, k).transpose(0, 2, 1)))


def test_to_half_by_the_kernels_equals_numpy_rounding(kern, monkeypatch):
    """cpu.to_half (the kernels' ToHalf, one pass over two threads) writes the bytes of numpy's astype(float16) of
    the matrix, packed or not, with and without the library: round to nearest even, overflow to inf (65520 is the
    first float that rounds up to it), subnormal halves, signed zeros; a shape it cannot pack is refused."""
    cpu.set_threads(2)
    rng = np.random.default_rng(5)
    for n, k in ((16, 1), (48, 577), (160, 64)):
        scale = rng.choice([1e-9, 6e-8, 1e-5, 1.0, 300.0, 7e4], size=(n, k))
        w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
        w[0, :1] = np.inf
        if k > 8:
            w[1, :8] = [-np.inf, 65504, 65519.99, 65520, 5.9604645e-08, 2.9802322e-08, -0.0, 1e-45]
        with np.errstate(over="ignore"):
            want = {True: cpu.pack(w).astype(np.float16), False: w.astype(np.float16)}
        for packed in (True, False):
            got = cpu.to_half(w, packed)
            assert got.dtype == np.float16 and got.shape == want[packed].shape
            assert np.array_equal(got.view(np.uint16), want[packed].view(np.uint16))
            with monkeypatch.context() as m:
                m.delitem(cpu._built, "path")                            # as if the library were not loaded
                with np.errstate(over="ignore"):
                    assert np.array_equal(cpu.to_half(w, packed).view(np.uint16), want[packed].view(np.uint16))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.to_half(np.ones((17, 4), np.float32), True)
    assert cpu.to_half(np.ones((17, 4), np.float32), False).shape == (17, 4)
    with pytest.raises(ValueError, match="float32"):
        cpu.to_half(np.ones((16, 4), np.float64), True)


def test_linear_same_bits_with_one_thread_or_two(kern):
    """The threads split the weight rows; each output is computed by one thread with the same operations."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 200)).astype(np.float32)
    w = rng.normal(size=(301, 200)).astype(np.float32)
    try:
        cpu.set_threads(2)
        two = call(kern.linear, x, w)
        cpu.set_threads(1)
        one = call(kern.linear, x, w)
    finally:
        from mindspore_eagle.kernels import runtime

        cpu.set_threads(runtime.kernel_threads())
    assert np.array_equal(one, two) and rel(two, cpu.ref_linear(x, w)) < TOL


def test_add_rms_norm(kern):
    rng = np.random.default_rng(1)
    x, d = rng.normal(size=(2, 5, 44)).astype(np.float32)
    eps = np.array([1e-5], np.float32)
    y, h = call(kern.add_rms_norm, x, d, eps)
    ry, rh = cpu.ref_add_rms_norm(x, d, 1e-5)
    assert np.array_equal(y, x + d) and rel(h, rh) < TOL
    assert rel(h, cpu.ref_add_rms_norm(x, 0 * d, 1e-5)[1]) > 0.1       # the addend is used
    for r in range(5):
        assert np.array_equal(call(kern.add_rms_norm, x[r:r + 1], d[r:r + 1], eps)[1][0], h[r])


@pytest.mark.parametrize("biases", [0, 1, 2])
def test_attn_block(kern, biases):
    """q/k/v projection (+ bias), RoPE, in-place cache write, attention over read rows with a mask, output
    projection (+ bias), residual add and norm, against the composed references; grouped read rows too. Without
    biases the normed input is 2H wide, as the EAGLE-3 drafter's first layer feeds it."""
    from mindspore_eagle.models.llama import rope_tables

    rng = np.random.default_rng(biases)
    nh, nkv, hd, H, R, S, G = 4, 2, 12, 20, 40, 10, 2
    k, Hin = 2 * G, (2 * 20 if biases == 0 else 20)
    x = rng.normal(size=(k, H)).astype(np.float32)
    h = rng.normal(size=(k, Hin)).astype(np.float32)
    wqkv = rng.normal(size=((nh + 2 * nkv) * hd, Hin)).astype(np.float32)
    wo = rng.normal(size=(H, nh * hd)).astype(np.float32)
    bqkv, bo = rng.normal(size=(wqkv.shape[0],)).astype(np.float32), rng.normal(size=(H,)).astype(np.float32)
    cos, sin = rope_tables(hd, 64, 10000.0)
    pos = np.array([5, 6, 9, 10])
    kc0, vc0 = rng.normal(size=(2, R, hd)).astype(np.float32)
    slots = np.array([3, 4, 13, 14])                                    # sequence 0: slots 0..9, sequence 1: 10..19
    write = (slots[:, None] + np.array([0, R // 2])[None]).reshape(-1).astype(np.int32)   # head-major rows
    read = np.stack([np.stack([np.arange(10 * g, 10 * g + S) + j * (R // 2) for j in range(nkv)])
                     for g in range(G)]).astype(np.int32)
    mask = np.full((k, S), -1e9, np.float32)
    for r in range(k):                                                  # causal over the own sequence's slots
        mask[r, : slots[r] % 10 + 1] = 0.0
    eps = np.array([1e-5], np.float32)
    b = (bqkv, bo)[:biases]
    kc, vc = ms.Parameter(ms.Tensor(kc0), name="kc"), ms.Parameter(ms.Tensor(vc0), name="vc")
    args = [ms.Tensor(a) for a in (x, h, wqkv, wo, cos[pos], sin[pos], np.array([nh, nkv], np.int32))]
    args += [kc, vc] + [ms.Tensor(a) for a in (write, read, mask, eps) + b]
    y, hn = (o.asnumpy() for o in kern.attn_block[biases](*args))
    ry, rh, rk, rv = cpu.ref_attn_block(x, h, wqkv, wo, cos[pos], sin[pos], nh, nkv, kc0, vc0, write, read, mask,
                                        1e-5, *b)
    assert rel(y, ry) < TOL and rel(hn, rh) < TOL
    assert rel(kc.asnumpy(), rk) < TOL and rel(vc.asnumpy(), rv) < TOL and not np.allclose(rk, kc0)
    wrong = cpu.ref_attn_block(x, h, wqkv, wo, cos[pos], sin[pos], nh, nkv, kc0, vc0, write + 1, read, mask,
                               1e-5, *b)                                 # an off-by-one write slot is caught
    assert rel(y, wrong[0]) > 1e-3
    if biases:
        assert rel(y, cpu.ref_attn_block(x, h, wqkv, wo, cos[pos], sin[pos], nh, nkv, kc0, vc0, write, read, mask,
                                         1e-5, *b[:-1])[0]) > 1e-3      # the last bias is used


@pytest.mark.parametrize("biases", [0, 1, 2])
@pytest.mark.parametrize("half", [False, True])
def test_decoder_layer_is_attn_block_then_mlp_bit_for_bit(kern, biases, half):
    """DecoderLayer (a teacher layer in one call) = AttnBlock, then MlpAddNorm on its output: outputs and both
    caches bit for bit, float32 and float16 matrices; a row alone equals the same row in the call (batch
    invariance of the fused layer)."""
    from mindspore_eagle.models.llama import rope_tables

    rng = np.random.default_rng(10 + biases)
    nh, nkv, hd, H, F, R, S, k = 4, 2, 12, 20, 26, 40, 10, 3
    wdt = np.float16 if half else np.float32
    x, h = rng.normal(size=(2, k, H)).astype(np.float32)
    wqkv = rng.normal(size=((nh + 2 * nkv) * hd, H)).astype(wdt)
    wo = rng.normal(size=(H, nh * hd)).astype(wdt)
    wgu = (rng.normal(size=(2 * F, H)) * 0.5).astype(wdt)
    wd = rng.normal(size=(H, F)).astype(wdt)
    b = (rng.normal(size=(wqkv.shape[0],)).astype(np.float32), rng.normal(size=(H,)).astype(np.float32))[:biases]
    cos, sin = rope_tables(hd, 64, 10000.0)
    pos = np.array([4, 5, 6])
    kc0, vc0 = rng.normal(size=(2, R, hd)).astype(np.float32)
    write = (np.array([4, 5, 6])[:, None] + np.array([0, R // 2])[None]).reshape(-1).astype(np.int32)
    read = np.stack([np.arange(S) + j * (R // 2) for j in range(nkv)]).astype(np.int32)
    mask = np.full((k, S), -1e9, np.float32)
    for r in range(k):
        mask[r, : 5 + r] = 0.0
    eps = np.array([1e-5], np.float32)

    def run(rows, fused):
        kc, vc = ms.Parameter(ms.Tensor(kc0), name="kc"), ms.Parameter(ms.Tensor(vc0), name="vc")
        args = [ms.Tensor(a) for a in (x[rows], h[rows], wqkv, wo, cos[pos][rows], sin[pos][rows],
                                       np.array([nh, nkv], np.int32))]
        args += [kc, vc] + [ms.Tensor(a) for a in (write.reshape(k, nkv)[rows].reshape(-1), read, mask[rows], eps)
                            + b]
        if fused:
            out = kern.decoder_layer[biases](*args, ms.Tensor(wgu), ms.Tensor(wd))
        else:
            y1, h1 = kern.attn_block[biases](*args)
            out = kern.mlp_add_norm(h1, ms.Tensor(wgu), ms.Tensor(wd), y1, ms.Tensor(eps))
        return [o.asnumpy() for o in out] + [kc.asnumpy(), vc.asnumpy()]

    fused, two = run(slice(None), True), run(slice(None), False)
    for a, c in zip(fused, two):
        assert np.array_equal(a, c)
    assert not np.array_equal(fused[2], kc0)                              # the cache was written
    ry, _, _, _ = cpu.ref_attn_block(x, h, wqkv.astype(np.float32), wo.astype(np.float32), cos[pos], sin[pos], nh,
                                     nkv, kc0, vc0, write, read, mask, 1e-5, *b)
    rh = ry.astype(np.float64) / np.sqrt((ry.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    want = cpu.ref_mlp_add_norm(rh.astype(np.float32), wgu.astype(np.float32), wd.astype(np.float32), ry, 1e-5)
    assert rel(fused[0], want[0]) < TOL and rel(fused[1], want[1]) < TOL
    alone = run(slice(0, 1), True)              # row 0 sees slots 0-4 only: its own write, none of rows 1-2's
    assert np.array_equal(alone[0][0], fused[0][0]) and np.array_equal(alone[1][0], fused[1][0])


def test_mlp_add_norm(kern):
    rng = np.random.default_rng(3)
    k, H, F = 3, 20, 21
    h, resid = rng.normal(size=(2, k, H)).astype(np.float32)
    wgu = (rng.normal(size=(2 * F, H)) * 0.8).astype(np.float32)
    wd = rng.normal(size=(H, F)).astype(np.float32)
    eps = np.array([1e-5], np.float32)
    y, hn = call(kern.mlp_add_norm, h, wgu, wd, resid, eps)
    ry, rh = cpu.ref_mlp_add_norm(h, wgu, wd, resid, 1e-5)
    assert rel(y, ry) < TOL and rel(hn, rh) < TOL
    swapped = np.concatenate([wgu[F:], wgu[:F]])                        # gate / up swapped is caught
    assert rel(y, cpu.ref_mlp_add_norm(h, swapped, wd, resid, 1e-5)[0]) > 0.05
    alone = call(kern.mlp_add_norm, h[1:2], wgu, wd, resid[1:2], eps)
    assert np.array_equal(alone[0][0], y[1]) and np.array_equal(alone[1][0], hn[1])


@pytest.mark.parametrize("k", [1, 2, 3, 8, 11])
def test_half_weights_equal_their_widened_float32(kern, k):
    """Linear, MlpAddNorm and AttnBlock (no bias, both biases) with float16 weights against the float32 kernels on
    w.astype(float32): bit-identical outputs and cache writes, and different from the float32 weights the halves
    were rounded from (the halves are read as halves)."""
    from mindspore_eagle.models.llama import rope_tables

    rng = np.random.default_rng(10 + k)
    H, F, K, N = 20, 21, 44, 10
    x = rng.normal(size=(k, K)).astype(np.float32)
    w = rng.normal(size=(N, K)).astype(np.float32)
    w16 = w.astype(np.float16)
    y16 = call(kern.linear, x, w16)
    assert np.array_equal(y16, call(kern.linear, x, w16.astype(np.float32)))
    assert 1e-6 < rel(y16, cpu.ref_linear(x, w)) < 2e-3

    h, resid = rng.normal(size=(2, k, H)).astype(np.float32)
    wgu, wd = rng.normal(size=(2 * F, H)).astype(np.float16), rng.normal(size=(H, F)).astype(np.float16)
    eps = np.array([1e-5], np.float32)
    half = call(kern.mlp_add_norm, h, wgu, wd, resid, eps)
    full = call(kern.mlp_add_norm, h, wgu.astype(np.float32), wd.astype(np.float32), resid, eps)
    assert all(np.array_equal(a, b) for a, b in zip(half, full))
    with pytest.raises(RuntimeError):                                  # one matrix half, the other float32
        call(kern.mlp_add_norm, h, wgu, wd.astype(np.float32), resid, eps)

    nh, nkv, hd, R, S = 4, 2, 12, 40, 10
    cos, sin = rope_tables(hd, 64, 10000.0)
    pos = np.arange(k) % S
    wqkv = rng.normal(size=((nh + 2 * nkv) * hd, 2 * H)).astype(np.float16)
    wo = rng.normal(size=(H, nh * hd)).astype(np.float16)
    hin = rng.normal(size=(k, 2 * H)).astype(np.float32)
    bqkv, bo = rng.normal(size=(wqkv.shape[0],)).astype(np.float32), rng.normal(size=(H,)).astype(np.float32)
    write = (np.arange(k)[:, None] + np.array([0, R // 2])[None]).reshape(-1).astype(np.int32)
    read = np.stack([np.arange(S) + j * (R // 2) for j in range(nkv)]).astype(np.int32)
    mask = np.where(np.arange(S)[None] <= np.arange(k)[:, None] % S, 0.0, -1e9).astype(np.float32)
    kc0, vc0 = rng.normal(size=(2, R, hd)).astype(np.float32)
    for b in ((), (bqkv, bo)):
        outs = []
        for wq, wout in ((wqkv, wo), (wqkv.astype(np.float32), wo.astype(np.float32))):
            kc, vc = ms.Parameter(ms.Tensor(kc0.copy()), name="kc"), ms.Parameter(ms.Tensor(vc0.copy()), name="vc")
            args = [ms.Tensor(a) for a in (resid, hin, wq, wout, cos[pos], sin[pos], np.array([nh, nkv], np.int32))]
            args += [kc, vc] + [ms.Tensor(a) for a in (write, read, mask, eps) + b]
            outs.append([o.asnumpy() for o in kern.attn_block[len(b)](*args)] + [kc.asnumpy(), vc.asnumpy()])
        assert all(np.array_equal(a, c) for a, c in zip(*outs))


@pytest.mark.parametrize("k,K", [(1, 4), (3, 1), (4, 4), (9, 3)])
def test_head_topk(kern, k, K):
    """Log-softmax and top-K of a draft head in one call against the float64 reference: the same ids in the same
    order (ties: lower index first), log-probs within TOL, ids offset by d2t; each row alone equals
    it in the call; float16 weights equal their widened float32."""
    rng = np.random.default_rng(20 + k)
    H, V = 20, 61                                                       # V not a multiple of 8: the tail
    h = rng.normal(size=(k, H)).astype(np.float32)
    w = rng.normal(size=(V, H)).astype(np.float32)
    w[7] = w[3]                                                         # a tie between index 3 and 7 in every row
    w[3] += 0.5 * np.sign(h[0]) * np.abs(w[3]).mean()                   # ... placed near the top of row 0
    w[7] = w[3]
    d2t = rng.integers(0, 1000, V).astype(np.int32)
    lp, ids = call(kern.head_topk(K), h, w, d2t)
    rlp, rids = cpu.ref_head_topk(h, w, d2t, K)
    assert lp.shape == (k, K) and ids.dtype == np.int32
    assert np.array_equal(ids, rids) and np.abs(lp - rlp).max() < 1e-5 * max(1.0, np.abs(rlp).max())
    assert np.all(np.diff(lp, axis=1) <= 0)
    assert not np.array_equal(ids, cpu.ref_head_topk(h, w, 0 * d2t, K)[1])     # d2t is applied
    for r in range(k):
        alone = call(kern.head_topk(K), h[r:r + 1], w, d2t)
        assert np.array_equal(alone[0][0], lp[r]) and np.array_equal(alone[1][0], ids[r])
    w16 = w.astype(np.float16)
    a, b = call(kern.head_topk(K), h, w16, d2t), call(kern.head_topk(K), h, w16.astype(np.float32), d2t)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_head_topk_ties_keep_index_order(kern):
    """Equal logits come out lowest index first (MindSpore's CPU TopK orders exact ties otherwise, e.g. 2, 5, 17
    here: the two paths may differ on exact ties only); the log-probs equal the graph ops' within 1e-5 (exp8)."""
    from mindspore import ops

    h = np.ones((2, 8), np.float32)
    w = np.zeros((24, 8), np.float32)
    w[[5, 2, 17, 9]] = 1.0                                              # four equal maxima
    lp, ids = call(kern.head_topk(3), h, w, np.zeros(24, np.int32))
    assert ids.tolist() == [[2, 5, 9]] * 2
    ref = ops.topk(ops.log_softmax(ms.Tensor(h @ w.T), -1), 3)[0].asnumpy()
    assert np.allclose(ref, lp, atol=1e-5, rtol=0)


def attention_case(seed, G=1):
    rng = np.random.default_rng(seed)
    nh, nkv, hd, S, R, kg = 4, 2, 12, 20, 64, 3
    k = G * kg
    q = rng.normal(size=(k, nh, hd)).astype(np.float32)
    kc, vc = rng.normal(size=(2, R, hd)).astype(np.float32)
    rows = np.stack([np.stack([rng.permutation(R - 1)[:S] for _ in range(nkv)]) for _ in range(G)]).astype(np.int32)
    mask = np.where(rng.random((k, S)) < 0.6, 0.0, -1e9).astype(np.float32)
    mask[np.arange(k), rng.integers(0, S, k)] = 0.0                     # every row sees something ...
    mask[1] = -1e9                                                      # ... but row 1, which sees nothing
    return q, kc, vc, (rows if G > 1 else rows[0]), mask, np.array([0.3], np.float32)


@pytest.mark.parametrize("G", [1, 2])
def test_paged_attention(kern, G):
    q, kc, vc, rows, mask, scale = attention_case(G, G)
    out = call(kern.paged_attention, q, kc, vc, rows, mask, scale)
    ref = cpu.ref_paged_attention(q, kc, vc, rows, mask, 0.3)
    assert out.shape == (q.shape[0], q.shape[1] * q.shape[2]) and rel(out, ref) < TOL
    assert np.array_equal(out[1], np.zeros_like(out[1]))                # no visible column -> zeros
    assert rel(out, cpu.ref_paged_attention(q, kc, vc, rows + 1, mask, 0.3)) > 0.01      # off-by-one row
    assert rel(out, cpu.ref_paged_attention(q, kc, vc, rows, np.roll(mask, 1, 1), 0.3)) > 0.01  # shifted mask
    kg = q.shape[0] // G
    for r in range(q.shape[0]):                                         # batch invariance, bitwise
        own = rows[r // kg] if G > 1 else rows
        alone = call(kern.paged_attention, q[r:r + 1], kc, vc, own, mask[r:r + 1], scale)
        assert np.array_equal(alone[0], out[r])


@pytest.mark.parametrize("hd", [64, 128])
def test_attention_register_path_same_bits_as_any_head_size(kern, hd):
    # head sizes 64 and 128 run the pairs (row, head) of one KV head together, a block of cache rows at a time, with
    # the query and the accumulators in registers and eight scores folded at once; the same problem padded with
    # zero dimensions (hd + 8) runs the path for any head size, one pair at a time, whose dot products add only
    # exact zeros: the outputs must agree bit for bit (21 and 300 visible columns: blocks of 8 and a tail; 300
    # spans several key blocks), in one group of rows and in two, and each row alone must give its bits again
    rng = np.random.default_rng(hd)
    nh, nkv, R, kg = 6, 2, 400, 5
    for S, G in ((21, 1), (300, 1), (300, 2)):
        k = kg * G
        q = rng.normal(size=(k, nh, hd)).astype(np.float32)
        kc, vc = rng.normal(size=(2, R, hd)).astype(np.float32)
        rows = np.stack([np.stack([rng.permutation(R)[:S] for _ in range(nkv)]) for _ in range(G)]).astype(np.int32)
        rows = rows if G > 1 else rows[0]
        mask = np.where(rng.random((k, S)) < 0.7, rng.normal(size=(k, S)), -1e9).astype(np.float32)
        scale = np.array([0.125], np.float32)
        out = call(kern.paged_attention, q, kc, vc, rows, mask, scale)
        pad = lambda a: np.ascontiguousarray(np.concatenate([a, np.zeros(a.shape[:-1] + (8,), np.float32)], -1))
        wide = call(kern.paged_attention, pad(q), pad(kc), pad(vc), rows, mask, scale)
        wide = wide.reshape(k, nh, hd + 8)
        assert np.array_equal(out.reshape(k, nh, hd), wide[..., :hd]) and not wide[..., hd:].any()
        assert rel(out, cpu.ref_paged_attention(q, kc, vc, rows, mask, 0.125)) < TOL
        for r in range(k):
            own = rows[r // kg] if G > 1 else rows
            assert np.array_equal(call(kern.paged_attention, q[r:r + 1], kc, vc, own, mask[r:r + 1], scale)[0], out[r])


def runner(tiny, backend, mode, host=None):
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    cfg, tensors, _ = tiny
    net = LlamaModel(cfg, 32, 8, 128, ms.float32, attention=backend)
    net.load_hf_weights(tensors)
    assert net.backend.name == backend
    return TeacherRunner(net, 32, 8, 128, mode, 32, host=host)


@pytest.mark.parametrize("biases", [0, 1, 2])
@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_decoder_stack_is_the_layers_bit_for_bit(ms_runtime, tiny, biases, mode):
    """The cpu backend runs a teacher's trunk as one DecoderStack call (embedding rows, first norm, RoPE rows, cache
    rows, every layer); the same model with the stack off runs the graph's own gathers and index ops and one
    DecoderLayer node a layer. Both, through a chunked prefill (32 + 8 rows), decodes, a tree verification and its
    commit, a grouped two-sequence decode and a rollback: logits, aux features and every cache bit for bit, for
    models without biases (Llama), with q/k/v biases (Qwen2) and with q/k/v and o biases (openPangu)."""
    from tiny_engines import tiny_tree

    cfg, tensors, tok = tiny
    cfg = cfg.replace(qkv_bias=biases >= 1, o_bias=biases == 2)
    runners = []
    for stack in (True, False):
        r = runner((cfg, tensors, tok), "cpu", mode, host=False)          # graphs (or PyNative) both
        assert r.model.stack is not None
        if not stack:
            r.model.stack = None
        runners.append(r)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    sids = [[r.new_seq(), r.new_seq()] for r in runners]
    rng = np.random.default_rng(biases)
    calls = 0

    def both(fn):
        nonlocal calls
        a, b = (fn(r, s) for r, s in zip(runners, sids))
        for x, y in zip(a, b):
            assert np.array_equal(x, y)
        calls += 1
        return a

    last, _ = both(lambda r, s: r.prefill(s[0], ids[:40]))
    both(lambda r, s: r.prefill(s[1], ids[:9]))
    for _ in range(2):
        last, _ = both(lambda r, s: r.decode(s[0], int(np.argmax(last))))
    tt = tensorize(tiny_tree(rng, int(np.argmax(last)), 12, 4, cfg.vocab_size), 12, 4)
    both(lambda r, s: r.verify(s[0], tt))
    for r, s in zip(runners, sids):
        r.commit(s[0], max((row[row < 12] for row in tt.retrieve), key=len), 6)
    both(lambda r, s: r.decode_batch(s, [5, 7], 4, with_aux=True))
    both(lambda r, s: r.verify(s[1], tt))
    for r, s in zip(runners, sids):
        r.rollback(s[1])
    both(lambda r, s: r.decode(s[1], 11))
    assert calls == 8
    for (ka, va), (kb, vb) in zip(runners[0].model.caches(), runners[1].model.caches()):
        assert np.array_equal(ka.asnumpy(), kb.asnumpy()) and np.array_equal(va.asnumpy(), vb.asnumpy())
    assert runners[0].model.stack_spec.asnumpy().tolist() == [cfg.num_heads, cfg.num_kv_heads, biases,
                                                              cfg.num_layers, *cfg.aux_layers]


def test_decoder_stack_refuses_indices_out_of_range(ms_runtime, tiny):
    """A token id past the vocabulary, a position past the RoPE table or a block past the cache makes the stack
    call fail (kernel status 3) without writing a cache row."""
    cfg, tensors, tok = tiny
    r = runner(tiny, "cpu", "eager")
    m = r.model
    weights = ()
    for layer in m.layers:
        weights = weights + layer.stack_args()
    good = dict(tokens=[3, 4], positions=[0, 1], slots=[0, 1], table=[0] * 4)
    for field, value in (("tokens", [3, cfg.vocab_size]), ("positions", [0, 128]), ("table", [0, 0, 0, 40])):
        args = dict(good, **{field: value})
        before = [c.asnumpy().copy() for pair in m.caches() for c in pair]
        with pytest.raises(Exception):
            out = m.backend.decoder_stack(
                m.stack, m.stack_spec, *(ms.Tensor(np.asarray(args[f], np.int32)) for f in
                                         ("tokens", "positions", "slots", "table")),
                ms.Tensor(np.zeros((2, 32), np.float32)), m.embed, m.cos, m.sin, m.eps, weights)
            out[0].asnumpy()
        assert all(np.array_equal(c.asnumpy(), b) for c, b in zip((c for pair in m.caches() for c in pair), before))


def test_move_rows_reads_every_source_before_writing(kern):
    """One call moves rows in every cache (src -> dst, overlapping: row 2 is a source and a destination, and a
    chain shifted by one would smear one row forward if written as read); the reference is numpy's fancy
    assignment; an index outside [0, R) fails the call and writes nothing."""
    rng = np.random.default_rng(7)
    caches = [rng.normal(size=(10, 6)).astype(np.float32) for _ in range(3)]
    src, dst = np.array([3, 2, 4, 5], np.int32), np.array([2, 3, 5, 6], np.int32)
    ts = [ms.Tensor(c.copy()) for c in caches]
    out = kern.move_rows(3)(ms.Tensor(src), ms.Tensor(dst), *ts)
    assert out.asnumpy().tolist() == [0.0]
    want = cpu.ref_move_rows(caches, src, dst)
    for t, w, c in zip(ts, want, caches):
        assert np.array_equal(t.asnumpy(), w)
        assert not np.array_equal(w, c)
    assert np.array_equal(want[0][6], caches[0][5]) and np.array_equal(want[0][2], caches[0][3])
    before = [t.asnumpy().copy() for t in ts]
    with pytest.raises(Exception):
        kern.move_rows(3)(ms.Tensor(np.array([1], np.int32)), ms.Tensor(np.array([10], np.int32)), *ts).asnumpy()
    assert all(np.array_equal(t.asnumpy(), b) for t, b in zip(ts, before))


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_cpu_backend_equals_portable(ms_runtime, tiny, mode):
    """Chunked prefill (32 + 8 rows: the 32-row chunk takes the kernel, as do decode and verify), decodes, a tree
    verification, commit of its longest path, rollback of a second one: logits, features and the committed cache
    of the CPU backend against the portable one."""
    cfg, _, tok = tiny
    rp, rc = runner(tiny, "portable", mode), runner(tiny, "cpu", mode)
    sp, sc = rp.new_seq(), rc.new_seq()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    rng = np.random.default_rng(0)
    worst = {}

    def both(name, fn):
        a, b = fn(rp, sp), fn(rc, sc)
        worst[name] = max(worst.get(name, 0.0), max(rel(y, x) for x, y in zip(a, b)))
        return a

    last, _ = both("prefill", lambda r, s: r.prefill(s, ids[:40]))
    for _ in range(3):
        last, _ = both("decode", lambda r, s: r.decode(s, int(np.argmax(last))))
    for stage in ("commit", "rollback"):
        tt = tensorize(tiny_tree(rng, int(np.argmax(last)), 12, 4, cfg.vocab_size), 12, 4)
        both("verify", lambda r, s: r.verify(s, tt))
        for r, s in ((rp, sp), (rc, sc)):
            if stage == "commit":
                r.commit(s, max((row[row < 12] for row in tt.retrieve), key=len), 6)
            else:
                r.rollback(s)
        token = int(rng.integers(3, cfg.vocab_size))
        last, _ = both("decode_after_" + stage, lambda r, s: r.decode(s, token))
    assert set(worst) == {"prefill", "decode", "verify", "decode_after_commit", "decode_after_rollback"}
    assert all(v < TOL for v in worst.values()), worst
    slots = rp.bm.slots(sp, np.arange(rp.length(sp)))
    for (kp, vp), (kc_, vc_) in zip(rp.model.caches(), rc.model.caches()):
        for a, b in ((kp, kc_), (vp, vc_)):
            a, b = a.asnumpy().reshape(cfg.num_kv_heads, -1, cfg.head_dim), b.asnumpy().reshape(
                cfg.num_kv_heads, -1, cfg.head_dim)
            assert rel(b[:, slots], a[:, slots]) < TOL


def _round_matrices(net, names):
    """Round every Parameter of ``net`` whose name ends with one of ``names`` to float16 values (kept float32)."""
    for p in net.get_parameters():
        if p.name.split(".")[-1] in names:
            p.set_data(ms.Tensor(p.asnumpy().astype(np.float16).astype(np.float32)))


@pytest.mark.parametrize("chunk", [32, 64])
def test_half_weight_teacher_equals_float32_on_the_rounded_matrices(ms_runtime, tiny, chunk):
    """LlamaModel(weight_dtype=float16): prefill (a 40-token chunk over CPU_LINEAR_MAX_ROWS takes MatMul on the
    widened matrices at chunk 64), decodes and a tree verification give, bit for bit, the logits and features of the
    float32 model whose folded matrices are rounded to float16 (the embedding itself is float16-exact here, so the
    tied head's own half copy equals it); the matrices are stored as float16, the embedding as float32."""
    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.runners.teacher import TeacherRunner

    cfg, tensors, tok = tiny
    tensors = dict(tensors)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].astype(np.float16).astype(np.float32)
    half = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu", weight_dtype=ms.float16)
    ref = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu")
    for net in (half, ref):
        net.load_hf_weights(tensors)
    _round_matrices(ref, {"wqkv", "wo", "w_gate_up", "w_down", "lm_head", "embed"})
    assert half.layers[0].wqkv.dtype == ms.float16 and half.head_weight().dtype == ms.float16
    assert half.embed.dtype == ms.float32
    rh, rr = (TeacherRunner(n, 32, 8, 128, "fused", chunk) for n in (half, ref))
    sh, sr = rh.new_seq(), rr.new_seq()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " * 3}]))
    a, b = rh.prefill(sh, ids[:40]), rr.prefill(sr, ids[:40])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    last = a[0]
    for _ in range(3):
        token = int(np.argmax(last))
        a, b = rh.decode(sh, token), rr.decode(sr, token)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        last = a[0]
    tt = tensorize(tiny_tree(np.random.default_rng(1), int(np.argmax(last)), 12, 4, cfg.vocab_size), 12, 4)
    assert all(np.array_equal(x, y) for x, y in zip(rh.verify(sh, tt), rr.verify(sr, tt)))
    full = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu")
    full.load_hf_weights(tensors)
    rf = TeacherRunner(full, 32, 8, 128, "fused", chunk)
    logits = rf.prefill(rf.new_seq(), ids[:40])[0]
    assert 0 < np.abs(logits - rh.prefill(rh.new_seq(), ids[:40])[0]).max() < 0.05 * np.abs(logits).max()


def test_half_weight_drafter_equals_float32_on_the_rounded_matrices(ms_runtime, tiny, tmp_path):
    """Eagle3Drafter(weight_dtype=float16): the context pass and an expansion step give, bit for bit, the top-K
    log-probs, ids and hidden rows of the float32 drafter whose folded matrices are rounded to float16; a backend
    without half weights refuses it with the key's name."""
    from tiny_engines import tiny_drafter_dir

    from mindspore_eagle.models.eagle3 import Eagle3Drafter, load_drafter

    tcfg = tiny[0]
    dcfg, t = load_drafter(str(tiny_drafter_dir(tmp_path, tcfg, seed=4)))
    embed = ms.Parameter(ms.Tensor(np.random.default_rng(0).normal(size=(tcfg.vocab_size, tcfg.hidden_size))
                                   .astype(np.float32)), name="e")
    half = Eagle3Drafter(dcfg, embed, 3, 4, 8, 32, attention="cpu", weight_dtype=ms.float16)
    ref = Eagle3Drafter(dcfg, embed, 3, 4, 8, 32, attention="cpu")
    for net in (half, ref):
        net.load_tensors(t)
    _round_matrices(ref, {"fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head"})
    assert half.lm_head.dtype == ms.float16 and half.fc.dtype == ms.float16
    rng = np.random.default_rng(2)
    aux = ms.Tensor(rng.normal(size=(4, 3 * tcfg.hidden_size)).astype(np.float32))
    tokens, positions = ms.Tensor(np.array([5, 9, 2, 7], np.int32)), ms.Tensor(np.arange(4, dtype=np.int32))
    table = ms.Tensor(np.arange(4, dtype=np.int32))
    mask = np.where(np.arange(32)[None] <= np.arange(4)[:, None], 0.0, -1e9).astype(np.float32)
    outs = [net.context(aux, tokens, positions, positions, table, ms.Tensor(mask), ms.Tensor(np.array([3], np.int32)))
            for net in (half, ref)]
    assert all(np.array_equal(x.asnumpy(), y.asnumpy()) for x, y in zip(*outs))
    h = ms.Tensor(np.repeat(outs[0][2].asnumpy(), 3, 0))
    step_mask = np.where(np.arange(32)[None] <= 4, 0.0, -1e9).astype(np.float32).repeat(3, 0)
    slots = ms.Tensor(np.array([4, 5, 6], np.int32))
    outs = [net(h, tokens[:3], ms.Tensor(np.full(3, 4, np.int32)), slots, table, ms.Tensor(step_mask))
            for net in (half, ref)]
    assert all(np.array_equal(x.asnumpy(), y.asnumpy()) for x, y in zip(*outs))
    with pytest.raises(ValueError, match="model.weight_dtype .* needs the cpu backend"):
        Eagle3Drafter(dcfg, embed, 3, 4, 8, 32, attention="portable", weight_dtype=ms.float16)


def test_tree_verification_is_bitwise_decode(ms_runtime, tiny):
    """Tokens t0 t1 t2 decoded one at a time give the same logits and features, bit for bit, as the same tokens
    verified as a root-to-leaf path of a tree whose other branches sit between them (mask columns skipped)."""
    cfg, _, tok = tiny
    r = runner(tiny, "cpu", "fused")
    ids = tok.encode("The quick brown fox jumps over the lazy dog")
    t = [11, 23, 37]
    a = r.new_seq()
    r.prefill(a, ids)
    one = [r.decode(a, x) for x in t]
    b = r.new_seq()
    r.prefill(b, ids)
    # root t0; children 5 and t1; t1's children 9 and t2: the path t0 -> t1 -> t2 is nodes 0, 2, 4
    tree = DraftTree([t[0], 5, t[1], 9, t[2]], [0, 0, 0, 2, 2])
    tt = tensorize(tree, 8, 4)
    path = [0, 2, 4]
    assert list(tt.tokens[path]) == t
    logits, aux = r.verify(b, tt)
    for i, node in enumerate(path):
        assert np.array_equal(logits[node], one[i][0]), f"token {i}"
        assert np.array_equal(aux[node], one[i][1][0])
    r.commit(b, np.array(path), 6)
    nxt = int(np.argmax(one[-1][0]))
    assert np.array_equal(r.decode(b, nxt)[0], r.decode(a, nxt)[0])      # the moved cache is the same too


def test_build_errors_are_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(cpu.KernelBuildError, match=r"^CPU kernels need a C\+\+ compiler: no-such-compiler not found "
                                                   r"on PATH$"):
        cpu._build()
    monkeypatch.delenv("CXX")
    bad = tmp_path / "bad.cc"
    bad.write_text("int broken( {\n")
    monkeypatch.setattr(cpu, "SOURCE", bad)
    with pytest.raises(cpu.KernelBuildError) as e:
        cpu._build()
    msg = str(e.value)
    assert msg.startswith("CPU kernels failed to compile") and "error" in msg and "\n" not in msg
    assert not list((tmp_path / "kernels").glob("*.so"))                 # nothing half-built is left behind
