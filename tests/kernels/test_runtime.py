"""kernels/runtime.py: CompiledFn's graphs, run after their first call straight through MindSpore's graph executor
(``graph_runner``): the same outputs as ``mindspore.jit`` call for call on new inputs, in-place Parameter writes
kept, one compile per input signature, and ``mindspore.jit`` kept where no direct run can be made."""
import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindspore_eagle.kernels import runtime


class Accumulate(nn.Cell):
    """out = x @ w + total, then total[row] += x.sum() in place (a Parameter written inside the graph)."""

    def __init__(self):
        super().__init__()
        self.w = ms.Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), name="w")
        self.total = ms.Parameter(ms.Tensor(np.zeros((2, 4), np.float32)), name="total")
        self.update = ops.ScatterAdd()

    def construct(self, x, row):
        out = ops.matmul(x, self.w) + self.total[0]
        self.update(self.total, row, ops.broadcast_to(x.sum().reshape(1, 1), (1, 4)))
        return out, x * 2


def test_direct_runs_equal_jit_calls_and_keep_parameter_writes(ms_runtime):
    cells = [Accumulate(), Accumulate()]
    direct, jitted = runtime.CompiledFn(cells[0].construct, "fused"), runtime.CompiledFn(cells[1].construct, "fused")
    rng = np.random.default_rng(0)
    want_total = np.zeros((2, 4), np.float32)
    for i in range(6):
        x = rng.normal(size=(2, 3)).astype(np.float32)
        row = np.array([i % 2], np.int32)
        args = (ms.Tensor(x), ms.Tensor(row))
        jitted._runs.clear()                                    # this one keeps mindspore.jit on every call
        a, b = direct(*args), jitted(*args)
        for u, v in zip(a, b):
            assert np.array_equal(u.asnumpy(), v.asnumpy())
        np.testing.assert_allclose(a[0].asnumpy(), x @ cells[0].w.asnumpy() + want_total[0], rtol=1e-5, atol=1e-5)
        want_total[row[0]] += x.sum()
        np.testing.assert_allclose(cells[0].total.asnumpy(), want_total, rtol=1e-5)
        assert np.array_equal(cells[0].total.asnumpy(), cells[1].total.asnumpy())
    sig = tuple((tuple(a.shape), str(a.dtype)) for a in args)
    assert direct._runs[sig] is not None                        # later calls took the direct run
    assert direct.compiles == 1 and jitted.compiles == 1        # one graph each, never compiled again
    out = direct(ms.Tensor(np.ones((5, 3), np.float32)), ms.Tensor(np.array([0], np.int32)))   # a new signature
    assert out[0].shape == (5, 4) and direct.compiles == 2


def test_no_direct_run_for_a_plain_function(ms_runtime):
    """A function that is no Cell method keeps ``mindspore.jit`` (graph_runner answers None) and still runs."""

    def double(x):
        return x * 2

    fn = runtime.CompiledFn(double, "fused")
    x = ms.Tensor(np.arange(4, dtype=np.float32))
    for _ in range(3):
        assert np.array_equal(fn(x).asnumpy(), np.arange(4) * 2)
    assert list(fn._runs.values()) == [None]


class TwoMethods(nn.Cell):
    """Two jitted methods of one Cell with different arities (as the drafter's context pass and expansion step)."""

    def construct(self, x, y):
        return x + y

    def three(self, x, y, z):
        return x * y + z


def test_methods_of_one_cell_with_different_arities_interleave(ms_runtime):
    """MindSpore keeps the flags of a Cell's latest compile on the Cell; a direct run must use its own graph's:
    compiling ``construct`` (2 inputs) after ``three`` (3 inputs) must not make ``three`` drop its third input."""
    cell = TwoMethods()
    two, three = runtime.CompiledFn(cell.construct, "fused"), runtime.CompiledFn(cell.three, "fused")
    x, y, z = (ms.Tensor(np.full((2,), v, np.float32)) for v in (2.0, 3.0, 4.0))
    for _ in range(3):
        assert np.array_equal(three(x, y, z).asnumpy(), [10.0, 10.0])
        assert np.array_equal(two(x, y).asnumpy(), [5.0, 5.0])
    assert all(r is not None for r in list(two._runs.values()) + list(three._runs.values()))
