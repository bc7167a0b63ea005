"""models/eagle3_host.py and kernels/host.py: the drafter's small calls on the host equal its graphs bit for bit.

- HostDrafter.context / construct against the jitted Eagle3Drafter with the same weights: top-K log-probs, ids,
  hidden rows and the K/V caches, bit for bit, float32 and float16 matrices, one and two decoder layers, one and
  two sequences per call (grouped block tables);
- host calls and graph calls on one Cell share its caches (a graph call sees what a host call wrote and back);
- reloading the weights (load_tensors) is seen by the host path; a refused shape is a HostKernelError naming the
  kernel; a backend other than cpu is refused;
- DrafterRunner with and without the host path drafts the same trees, so an engine decodes the same steps.
"""
import mindspore as ms
import numpy as np
import pytest
from tiny_engines import PROMPTS, tiny_drafter_dir, tiny_engine

from mindspore_eagle.kernels import cpu

# Skipped only where no compiler exists (not Linux, no $CXX / g++); where one exists a failed build fails the tests.
pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C++ compiler here: the CPU kernels cannot build")

B, NB, S = 8, 6, 48          # block size, blocks, slots per sequence


def _pair(tiny, tmp_path, layers=1, weight_dtype=None, seed=4, fc_norm=False):
    """Two drafters with the same weights and their own caches: (graph Cell, Cell run by a HostDrafter, host)."""
    from mindspore_eagle.models.eagle3 import Eagle3Drafter, load_drafter
    from mindspore_eagle.models.eagle3_host import HostDrafter

    tcfg = tiny[0]
    dcfg, t = load_drafter(str(tiny_drafter_dir(tmp_path, tcfg, seed=seed, layers=layers, fc_norm=fc_norm)))
    embed = ms.Parameter(ms.Tensor(np.random.default_rng(0).normal(size=(tcfg.vocab_size, tcfg.hidden_size))
                                   .astype(np.float32)), name="e")
    cells = [Eagle3Drafter(dcfg, embed, 3, NB, B, S, attention="cpu", weight_dtype=weight_dtype) for _ in range(2)]
    for c in cells:
        c.load_tensors(t)
    return cells[0], cells[1], HostDrafter(cells[1]), dcfg


def _mask(rows_visible, width=S):
    """float32 [k, width]: row r sees the columns in rows_visible[r]."""
    m = np.full((len(rows_visible), width), -1e9, np.float32)
    for r, cols in enumerate(rows_visible):
        m[r, list(cols)] = 0.0
    return m


def _calls(H3, H):
    """A context pass of 5 pairs, one of 1 pair, then an expansion step of 3 frontier rows (one sequence,
    block table = blocks 0..5)."""
    rng = np.random.default_rng(7)
    table = np.arange(NB, dtype=np.int32)
    i32 = lambda *v: np.array(v, np.int32)     # noqa: E731
    ctx5 = ("context", rng.normal(size=(5, H3)).astype(np.float32), i32(5, 9, 2, 7, 11), i32(0, 1, 2, 3, 4),
            i32(0, 1, 2, 3, 4), table, _mask([range(r + 1) for r in range(5)]), i32(4))
    ctx1 = ("context", rng.normal(size=(1, H3)).astype(np.float32), i32(3), i32(5), i32(5), table,
            _mask([range(6)]), i32(0))
    step = ("construct", rng.normal(size=(3, H)).astype(np.float32), i32(4, 8, 1), i32(6, 6, 6), i32(6, 7, 8), table,
            _mask([[*range(6), 6 + r] for r in range(3)]))
    return [ctx5, ctx1, step]


def _graph(cell, which, *args):
    fn = ms.jit(cell.context if which == "context" else cell.construct)
    return tuple(o.asnumpy() for o in fn(*(ms.Tensor(a) for a in args)))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layers,half,fc_norm", [(1, False, False), (1, True, False), (2, True, False),
                                                  (1, True, True)])
def test_host_calls_equal_the_graph_bit_for_bit(ms_runtime, tiny, tmp_path, layers, half, fc_norm):
    """Each call's outputs and, afterwards, every K/V cache of every layer: bit for bit (also with ``fc_norm``:
    the context pass's chunk-wise norm before fc)."""
    g, c, host, dcfg = _pair(tiny, tmp_path, layers, ms.float16 if half else None, fc_norm=fc_norm)
    if half:
        assert host.lm_head.dtype == np.float16 and host.layers[0][0].dtype == np.float16
    for which, *args in _calls(3 * dcfg.target_hidden_size, dcfg.hidden_size):
        want, got = _graph(g, which, *args), getattr(host, which)(*args)
        assert [x.shape for x in got] == [x.shape for x in want] and _same(got, want), which
        assert got[1].dtype == np.int32 and np.all(got[0][:, :-1] >= got[0][:, 1:])     # top-K, best first
    caches = lambda cell: [cell.key_cache, cell.value_cache] + [x for b in cell.blocks      # noqa: E731
                                                               for x in (b.key_cache, b.value_cache)]
    assert len(caches(c)) == 2 * layers
    for x, y in zip(caches(g), caches(c)):
        assert np.array_equal(x.asnumpy(), y.asnumpy()) and np.abs(x.asnumpy()).max() > 0


def test_grouped_host_call_equals_the_graph(ms_runtime, tiny, tmp_path):
    """Two sequences in one expansion call (block table [2, S/B]: each group over its own blocks)."""
    g, c, host, dcfg = _pair(tiny, tmp_path)
    for which, *args in _calls(3 * dcfg.target_hidden_size, dcfg.hidden_size)[:2]:
        _graph(g, which, *args), getattr(host, which)(*args)                 # context in sequence 0
    rng = np.random.default_rng(1)
    table = np.stack([np.arange(3, dtype=np.int32), np.arange(3, 6, dtype=np.int32)])
    mask = _mask([[*range(6), 6], [*range(6), 7], [0], [0, 1]], 24)    # columns of each group's own table
    args = (rng.normal(size=(4, dcfg.hidden_size)).astype(np.float32), np.array([4, 8, 1, 2], np.int32),
            np.array([6, 6, 1, 1], np.int32), np.array([6, 7, 24, 25], np.int32), table, mask)
    assert _same(host.construct(*args), _graph(g, "construct", *args))


def test_host_and_graph_calls_share_the_cache(ms_runtime, tiny, tmp_path):
    """On one Cell, graph and host calls in turn give what graph calls alone give: each sees the other's K/V."""
    g, c, host, dcfg = _pair(tiny, tmp_path)
    for i, (which, *args) in enumerate(_calls(3 * dcfg.target_hidden_size, dcfg.hidden_size)):
        want = _graph(g, which, *args)
        got = getattr(host, which)(*args) if i % 2 else _graph(c, which, *args)
        assert _same(got, want), (i, which)


def test_reloaded_weights_reach_the_host_path(ms_runtime, tiny, tmp_path):
    """load_tensors replaces the Parameters' storage: the host path takes the new views (weights_version)."""
    from mindspore_eagle.models.eagle3 import load_drafter

    g, c, host, dcfg = _pair(tiny, tmp_path)
    which, *args = _calls(3 * dcfg.target_hidden_size, dcfg.hidden_size)[0]
    before = host.context(*args)
    _, t2 = load_drafter(str(tiny_drafter_dir(tmp_path, tiny[0], seed=9)))
    for cell in (g, c):
        cell.load_tensors(t2)
    after = host.context(*args)
    assert not _same(after, before) and _same(after, _graph(g, which, *args))


def test_refused_shapes_and_backends(ms_runtime, tiny, tmp_path):
    from mindspore_eagle.kernels.host import HostKernelError
    from mindspore_eagle.models.eagle3 import Eagle3Drafter
    from mindspore_eagle.models.eagle3_host import HostDrafter

    g, c, host, dcfg = _pair(tiny, tmp_path)
    which, *args = _calls(3 * dcfg.target_hidden_size, dcfg.hidden_size)[2]
    args[-1] = np.ascontiguousarray(args[-1][:, :40])              # mask narrower than the block table's slots
    with pytest.raises(HostKernelError, match="AttnBlock refused its arguments"):
        host.construct(*args)
    portable = Eagle3Drafter(dcfg, c.embed, 3, NB, B, S, attention="portable")
    with pytest.raises(ValueError, match="HostDrafter needs the cpu attention backend.*'portable'"):
        HostDrafter(portable)


@pytest.mark.slow
def test_runner_drafts_the_same_trees_with_and_without_the_host_path(ms_runtime, tiny_dir, tmp_path, tiny):
    """Two engines, one drafting on the host: the same tokens and, step by step, the same accepted lengths."""
    d = tiny_drafter_dir(tmp_path, tiny[0])
    extra = ["speculative.M=8", "speculative.D_max=4", "generation.max_new_tokens=24"]
    eng_h, cfg = tiny_engine(tiny_dir, d, "fused", extra)
    eng_g, _ = tiny_engine(tiny_dir, d, "fused", extra)
    eng_g.drafter.host = None
    assert eng_h.drafter.host is not None
    for prompt in PROMPTS:
        a, b = eng_h.generate(prompt, cfg.generation), eng_g.generate(prompt, cfg.generation)
        assert a.token_ids == b.token_ids
        assert [s.accept_len for s in a.steps] == [s.accept_len for s in b.steps]
        assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
    assert eng_h.drafter.compiles == 0 < eng_g.drafter.compiles
