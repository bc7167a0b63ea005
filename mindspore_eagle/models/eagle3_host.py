"""The EAGLE-3 drafter's small calls run on the host: :class:`Eagle3Drafter`'s math, one C++ kernel call per step.

Legend as in ``eagle3.py``: k = query rows (at most ``CPU_LINEAR_MAX_ROWS``), K = top_k, H = hidden, Ht = teacher
hidden, Vd = draft vocab, S = attended slots, G = sequences of a grouped call.

A draft step on the CPU backend calls the drafter three times or so (a context pass, then one call per expansion
step) on 1-16 rows. Each call's kernels take ~1-1.6 ms; as a MindSpore graph it took ~0.8-1.6 ms more (graph
launch with 6-7 inputs, ~20 small ops, output copies; docs/cpu_kernels.md, "Host calls"). :class:`HostDrafter`
computes the same thing with the same kernels called from numpy (``kernels/host.py``), so its outputs equal the
Cell's bit for bit (tested): the embedding rows and RoPE rows are gathered by numpy, the norms, the layers and the
head are the kernels the Cell's graph runs, in the same order on the same arrays.

It works on the Cell's own storage: every weight, the RoPE tables and the paged K/V caches are read through
``Parameter.asnumpy()``, which on CPU is a view of the memory the graphs use, so host calls and graph calls (a
long context pass over the prompt stays a graph: MatMul is faster over many rows) share one cache. A ``set_data``
replaces a Parameter's storage: :meth:`Eagle3Drafter.load_tensors` bumps ``weights_version`` and the views are
taken again on the next call; after any other ``set_data`` call :meth:`HostDrafter.refresh`.
"""
from __future__ import annotations

import numpy as np

from mindspore_eagle.kernels import cpu
from mindspore_eagle.kernels.attention import CPU_LINEAR_MAX_ROWS
from mindspore_eagle.kernels.host import HostKernels
from mindspore_eagle.kernels.kv import PortableKVOps


class HostDrafter:
    """:meth:`Eagle3Drafter.context` and :meth:`Eagle3Drafter.construct` on numpy arrays, for calls of at most
    ``CPU_LINEAR_MAX_ROWS`` rows on the cpu backend.

    Args:
        drafter: an :class:`Eagle3Drafter` on the cpu backend (float32 compute; matrices float32 or float16).
    Raises:
        ValueError: the drafter's backend is not the cpu backend.
        cpu.KernelBuildError: the kernels cannot be loaded.
    """

    max_rows = CPU_LINEAR_MAX_ROWS

    def __init__(self, drafter):
        if getattr(drafter.backend, "name", None) != "cpu":
            raise ValueError(f"HostDrafter needs the cpu attention backend, the drafter has "
                             f"{getattr(drafter.backend, 'name', type(drafter.backend).__name__)!r}")
        self.cell, self.K = drafter, int(drafter.top_k)
        self.kernels = HostKernels()
        cfg = drafter.cfg
        self.heads = np.array([cfg.num_attention_heads, cfg.num_key_value_heads], np.int32)
        self.eps = np.array([cfg.rms_norm_eps], np.float32)
        backend = drafter.backend
        self.offsets = backend.offsets.asnumpy().astype(np.int32)              # arange(B)
        self.head_base = backend.head_base.asnumpy().astype(np.int32)          # first row of each KV head
        self._version = None
        self.refresh()

    def refresh(self) -> None:
        """Take the views of the Cell's Parameters again (after a ``set_data`` on any of them)."""
        c = self.cell
        view = lambda p: p.asnumpy()       # noqa: E731  (CPU: shares the Parameter's memory)
        layer = lambda b: (view(b.wqkv), view(b.wo), view(b.w_gate_up), view(b.w_down),      # noqa: E731
                           view(b.key_cache), view(b.value_cache))
        self.embed, self.fc, self.lm_head = view(c.embed), view(c.fc), view(c.lm_head)
        self.d2t = view(c.d2t)
        self.cos, self.sin = c.cos.asnumpy(), c.sin.asnumpy()
        self.layers = [layer(c)] + [layer(b) for b in c.blocks]
        self._version = c.weights_version

    def _check(self) -> None:
        if self._version != self.cell.weights_version:
            self.refresh()

    def _layers(self, h, tokens, positions, slots, block_table, mask):
        """``Eagle3Drafter._layer`` on numpy: (h_out [k, H] pre-norm, rms(h_out) [k, H])."""
        k = self.kernels
        x = np.concatenate([k.norm(cpu.rows(self.embed, tokens), self.eps), k.norm(h, self.eps)], -1)
        cos, sin = self.cos[positions], self.sin[positions]
        write, read = PortableKVOps.indices(slots, block_table, self.offsets, self.head_base)   # numpy in, numpy out
        write, read = np.ascontiguousarray(write, np.int32), np.ascontiguousarray(read, np.int32)
        for wqkv, wo, wgu, wd, kc, vc in self.layers:
            h, x = k.attn_block(h, x, wqkv, wo, cos, sin, self.heads, kc, vc, write, read, mask, self.eps)
            h, x = k.mlp_add_norm(x, wgu, wd, h, self.eps)
        return h, x

    def construct(self, h, tokens, positions, slots, block_table, mask):
        """An expansion step: h float32 [k, H], tokens / positions / slots int32 [k], block_table int32 [(G,) S/B],
        mask float32 [k, S] -> (top_logp float32 [k, K], top_ids int32 [k, K] teacher ids, h_out float32 [k, H])
        (as :meth:`Eagle3Drafter.construct`). Raises HostKernelError on shapes the kernels refuse."""
        self._check()
        h_out, hn = self._layers(np.ascontiguousarray(h, np.float32), tokens, positions, slots, block_table, mask)
        lp, ids = self.kernels.head_topk(hn, self.lm_head, self.d2t, self.K)
        return lp, ids, h_out

    def context(self, aux, tokens, positions, slots, block_table, mask, pick):
        """A context pass: aux float32 [k, 3Ht], the rest as :meth:`construct`, pick int32 [r] -> the outputs at the
        rows ``pick`` only (as :meth:`Eagle3Drafter.context`)."""
        self._check()
        aux = np.ascontiguousarray(aux, np.float32)
        if self.cell.cfg.fc_norm:                    # chunk-wise rms, as Eagle3Drafter.fuse
            aux = self.kernels.norm(aux.reshape(3 * aux.shape[0], -1), self.eps).reshape(aux.shape)
        h = self.kernels.linear(aux, self.fc)
        h_out, hn = self._layers(h, tokens, positions, slots, block_table, mask)
        lp, ids = self.kernels.head_topk(np.ascontiguousarray(hn[pick]), self.lm_head, self.d2t, self.K)
        return lp, ids, np.ascontiguousarray(h_out[pick])
