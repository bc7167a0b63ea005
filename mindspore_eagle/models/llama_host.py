"""The teacher's calls on the host: :class:`LlamaModel`'s forward as two C++ kernel calls on numpy arrays.

Legend as in ``llama.py``: k = query rows, m = rows that get logits, H = hidden, V = vocab, S = attended slots,
G = sequences of a grouped call.

On the cpu backend a teacher forward is, inside its graph, one ``DecoderStack`` kernel call (the embedding rows,
the first norm, the RoPE and cache rows, every layer), the final norm (the stack's rms times the norm weight) and
one ``Linear`` call (the head). Around those ~20 ms of kernels a 135M decode spent ~2 ms in MindSpore's graph
launch and runtime (docs/cpu_kernels.md, "Host work around a forward"). :class:`HostTeacher` makes the same two
kernel calls from numpy (``kernels/host.py``), so its outputs equal the graph's bit for bit (tested): the gather of
``out_rows`` and the multiply by the norm weight are single float operations in numpy as in the graph.

It works on the Cell's own storage: weights, RoPE tables and the paged K/V caches are read through
``Parameter.asnumpy()``, which on CPU is a view of the memory the graphs use, so host calls and graph calls (a
prefill chunk over 32 rows on unpacked matrices stays a graph) share one cache. :meth:`LlamaModel.load_hf_weights`
bumps ``weights_version`` and the views are taken again on the next call; after any other ``set_data`` call
:meth:`HostTeacher.refresh`.
"""
from __future__ import annotations

import numpy as np

from mindspore_eagle.kernels.host import HostKernels
from mindspore_eagle.kernels.kv import PortableKVOps

METHODS = ("construct", "hidden", "logits_hidden")
"""The :class:`LlamaModel` methods :meth:`HostTeacher.run` computes."""


class HostTeacher:
    """:meth:`LlamaModel.construct`, ``hidden`` and ``logits_hidden`` on numpy arrays, for the calls whose trunk
    runs as one ``DecoderStack`` call (:meth:`LlamaModel._stacked`), and the K/V moves of a commit.

    Args:
        model: a :class:`LlamaModel` on the cpu backend (``model.stack`` set: float32 compute, matrices float32
            or float16).
    Raises:
        ValueError: the model has no stack kernel (another backend).
        cpu.KernelBuildError: the kernels cannot be loaded.
    """

    def __init__(self, model):
        if getattr(model, "stack", None) is None:
            raise ValueError(f"HostTeacher needs the cpu attention backend, the teacher has "
                             f"{getattr(model.backend, 'name', type(model.backend).__name__)!r}")
        self.model = model
        self.kernels = HostKernels()
        self.eps = np.array([model.eps], np.float32)
        self.spec = model.stack_spec.asnumpy()
        self.head_base = model.backend.head_base.asnumpy().astype(np.int32)     # first cache row of each KV head
        self._version = None
        self.refresh()

    def refresh(self) -> None:
        """Take the views of the Cell's Parameters again (after a ``set_data`` on any of them)."""
        m = self.model
        view = lambda p: p.asnumpy()       # noqa: E731  (CPU: shares the Parameter's memory)
        self.embed, self.head, self.norm_w = view(m.embed), view(m.head_weight()), view(m.norm.weight)
        self.cos, self.sin = m.cos.asnumpy(), m.sin.asnumpy()
        self.weights = [view(p) for layer in m.layers for p in layer.stack_args()]
        self.caches = [view(c) for pair in m.caches() for c in pair]
        # DecoderStack(spec, tokens, positions, slots, table, mask, embed, cos, sin, eps, *weights, x, hn, aux):
        # the per-call arguments (None) are indices 1-5 and the three outputs
        self.stack_call = self.kernels.prepared("DecoderStack", [self.spec, None, None, None, None, None, self.embed,
                                                                 self.cos, self.sin, self.eps, *self.weights,
                                                                 None, None, None])
        self._version = m.weights_version

    def takes(self, rows: int) -> bool:
        """True when a call of ``rows`` query rows runs as one DecoderStack call (so the host can make it)."""
        return self.model.stacked_rows(rows)

    def run(self, method: str, tokens, positions, slots, block_table, mask, out_rows) -> tuple:
        """``LlamaModel.<method>`` (one of :data:`METHODS`) on numpy: tokens / positions / slots int [k],
        block_table int [(G,) S/B], mask float32 [k, S], out_rows int [m] -> the method's outputs as float32
        arrays: construct (logits [m, V], aux [k, 3H]); hidden (hidden [m, H], aux); logits_hidden (logits,
        hidden [k, H] of every row, aux). Writes the rows' K/V into the caches.

        Raises:
            ValueError: an unknown method, or a call the stack does not take (:meth:`takes`).
            HostKernelError: shapes the kernels refuse, or an index out of range (nothing written then).
        """
        if method not in METHODS:
            raise ValueError(f"HostTeacher.run: method must be one of {METHODS}, got {method!r}")
        k = len(tokens)
        if not self.takes(k):
            raise ValueError(f"HostTeacher.run: a call of {k} rows does not run as one DecoderStack call")
        if self._version != self.model.weights_version:
            self.refresh()
        i32 = lambda a: np.ascontiguousarray(a, np.int32)     # noqa: E731
        H = self.embed.shape[1]
        x, hn, aux = np.empty((k, H), np.float32), np.empty((k, H), np.float32), np.empty((k, 3 * H), np.float32)
        out = 10 + len(self.weights)
        self.stack_call({1: i32(tokens), 2: i32(positions), 3: i32(slots), 4: i32(block_table),
                         5: np.ascontiguousarray(mask, np.float32), out: x, out + 1: hn, out + 2: aux})
        rows = i32(out_rows)
        normed = hn[rows] * self.norm_w                       # LlamaModel._normed: one float multiply a value
        if method == "hidden":
            return normed, aux
        logits = self.kernels.linear(normed, self.head)
        if method == "logits_hidden":
            return logits, hn * self.norm_w, aux
        return logits, aux

    def move(self, src, dst) -> None:
        """Copy K/V slots ``src`` -> ``dst`` (int [P]) in every layer's caches, every source read before any is
        written (``KVCompactor`` on the host: the same MoveRows kernel).
        Raises:
            HostKernelError: a slot outside the caches (nothing written then)."""
        src_rows, dst_rows = (np.ascontiguousarray(PortableKVOps.write_rows(np.asarray(s, np.int32), self.head_base))
                              for s in (src, dst))
        self.kernels.call("MoveRows", src_rows, dst_rows, *self.caches, np.empty(1, np.float32))
