"""Contract tests of the CPU kernels (kernels/cpu.py, cpu_kernels.cc).

- each kernel against its float64 numpy reference (shapes with tails: K and hd not multiples of 8, N not a
  multiple of 4, odd row counts), and each contract shown able to fail: a transposed weight, a wrong RoPE sign,
  an off-by-one cache row, a shifted mask all differ from the reference beyond the tolerance;
- batch invariance: every row of a k-row call equals, bit for bit, the same row computed alone;
- float16 weights: a call with half-float matrices equals, bit for bit, the float32 call on the same weights
  widened (a half converts to exactly one float), and a half weight is really read as half (not as float bits);
- a missing compiler or a compile error gives a one-line KernelBuildError.

The teacher on the CPU backend (against the portable backend, its trunk in one kernel call, half weights, tree
verification against decoding) is tested in tests/models/test_llama.py, the drafter's half weights in
tests/models/test_eagle3.py.
"""
import ctypes

import mindspore as ms
import numpy as np
import pytest
from tiny_engines import TOL, rel

from mindspore_eagle.kernels import cpu

# Skipped only where no compiler exists (not Linux, no $CXX / g++); where one exists a failed build fails the tests.
pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C++ compiler here: the CPU kernels cannot build")


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
