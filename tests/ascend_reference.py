"""numpy models of the Ascend kernels behind ``attention.FusedBackend``, from their documented semantics.

Sources: the docstrings of ``mindspore.ops.auto_generate.ReshapeAndCache`` / ``PagedAttention`` (MindSpore 2.9:
key / value ``(num_tokens, num_head, head_dim)``, caches ``(num_blocks, block_size, num_head, head_dim)``,
``slot_mapping (num_tokens,)``, ``block_tables (batch, max_num_blocks_per_batch)``, ``context_lens (batch,)``,
``attn_mask (num_tokens, max_context_lens)``, ``q_seq_lens (batch,)``, output shaped like the query) and
MindFormers' use of them (``modules/paged_attention_mgr.py``: the mask is ``bool(mask) * -10000`` in the query
dtype, i.e. additive, 0 = visible). Semantics modelled:

* ReshapeAndCache: ``key_cache[s // B, s % B] = key[t]`` for slot ``s = slot_mapping[t]`` (same for values).
* FlashAttentionScore (``ops.flash_attention_score`` docstring, layout BSH, sparse_mode 0): query [B, S1, N1 D],
  key / value [B, S2, N2 D], attn_mask [S1, S2] bool / uint8 with 1 = discard; softmax(scale q k^T, masked) V;
  N2 divides N1 (query head h reads KV head h // (N1 / N2)).
* PagedAttention: the query rows are split into sequences by ``q_seq_lens``; sequence b attends to its first
  ``context_lens[b]`` cached tokens, token j read from block ``block_tables[b, j // B]`` offset ``j % B``; scores =
  ``scale_value * q . k`` + ``attn_mask[row, j]``, softmax over j (float32), times V; GQA: query head h reads KV head
  ``h // (head_num / kv_head_num)``.

Measured on MindSpore 2.9 CPU (the ops have shape / type inference there but no kernel): ReshapeAndCache counts
tokens as the product of all but the last key dimension, so the key is [T, n_kv * hd] (MindFormers passes
[B, S, H]), not the docstring's [T, n_kv, hd]; it takes float16 / bfloat16 / int8 / uint8 keys only. With
``infer_check=True`` every call is first handed to the real MindSpore primitive with the very same arguments:
its inference must accept them and stop only at "kernel ... unregistered" (CPU), else KernelContractError.

Every call checks that each index it is handed is in range (slots in [0, (NB + 1) B), block ids in [0, NB],
context_lens <= table width x B, q_seq_lens summing to the query rows, mask shaped [rows, table width x B]) and
logs the shapes it saw (``calls``), so tests can assert static shapes per bucket.

``mutation`` builds a deliberately wrong kernel, used to show that the contract tests fail on it:
``transposed_layout`` (cache read / written as ``[blocks, n_kv, B, hd]``), ``mask_inverted`` (treats the mask
as 1 = visible: adds -10000 where the mask is 0), ``slot_off_by_one`` (writes at slot + 1, wrapping inside the
cache).

These run on the host through ``asnumpy`` / ``set_data``, so only in PyNative (eager) mode.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np

from mindspore_eagle.kernels.attention import (
    AscendKernels as _REAL_KERNELS,  # bound now: tests monkeypatch the name
)

MUTATIONS = ("transposed_layout", "mask_inverted", "slot_off_by_one")


class KernelContractError(AssertionError):
    """An index or shape handed to a kernel breaks the documented contract."""


class ReferenceKernels:
    """ReshapeAndCache + PagedAttention in numpy (see the module docstring).

    Args: head_num, scale_value, kv_head_num (as the Ascend primitives); mutation: None or one of MUTATIONS;
    calls: a shared list the kernels append ``(op, {name: shape})`` records to.
    """

    def __init__(self, head_num: int, scale_value: float, kv_head_num: int, mutation: str | None = None,
                 calls: list | None = None, infer_check: bool = False):
        if mutation not in (None,) + MUTATIONS:
            raise ValueError(f"mutation must be one of {MUTATIONS}, got {mutation!r}")
        self.nh, self.scale, self.nkv, self.mutation = head_num, float(scale_value), kv_head_num, mutation
        self.calls = calls if calls is not None else []
        self.real = None
        if infer_check:
            self.real = _REAL_KERNELS(head_num, scale_value, kv_head_num)

    @staticmethod
    def factory(mutation: str | None = None, calls: list | None = None, infer_check: bool = False):
        """A kernels factory for ``attention.FusedBackend(kernels=...)``."""
        return lambda nh, scale, nkv: ReferenceKernels(nh, scale, nkv, mutation, calls, infer_check)

    def _infer(self, name: str, *args):
        """Hand the call to the real primitive: its shape / type inference must pass (CPU has no kernel)."""
        if self.real is None:
            return
        try:
            getattr(self.real, name)(*args)
        except RuntimeError as e:
            if "unregistered" in str(e):
                return
            raise KernelContractError(f"{name}: MindSpore's inference refused the call: {str(e).splitlines()[0]}")
        except (TypeError, ValueError) as e:
            raise KernelContractError(f"{name}: MindSpore's inference refused the call: {str(e).splitlines()[0]}")
        raise KernelContractError(f"{name} ran on this device: the reference is meant for CPU only")

    # ------------------------------------------------------------------ layout helpers
    def _slots_view(self, cache: np.ndarray) -> np.ndarray:
        """[NB + 1, B, n_kv, hd] -> a writable [slots, n_kv, hd] view in the kernel's (maybe mutated) layout."""
        if self.mutation == "transposed_layout":
            nb, b, nkv, hd = cache.shape
            return cache.reshape(nb, nkv, b, hd).transpose(0, 2, 1, 3).reshape(nb * b, nkv, hd)  # copy
        return cache.reshape(-1, cache.shape[2], cache.shape[3])

    def _store(self, cache: np.ndarray, flat: np.ndarray) -> np.ndarray:
        if self.mutation == "transposed_layout":
            nb, b, nkv, hd = cache.shape
            return flat.reshape(nb, b, nkv, hd).transpose(0, 2, 1, 3).reshape(cache.shape)
        return flat.reshape(cache.shape)

    # ------------------------------------------------------------------ kernels
    def flash_attention(self, query, key, value, attn_mask):
        """query [1, S1, nh hd], key / value [1, S2, n_kv hd], attn_mask uint8 [S1, S2] -> [1, S1, nh hd]."""
        self._infer("flash_attention", query, key, value, attn_mask)
        q, k, v = (t.asnumpy().astype(np.float32) for t in (query, key, value))
        m = attn_mask.asnumpy()
        self.calls.append(("flash_attention", {"query": q.shape, "key": k.shape, "attn_mask": m.shape}))
        if q.ndim != 3 or q.shape[0] != 1 or k.shape != v.shape or k.shape[0] != 1 or m.shape != (q.shape[1],
                                                                                                   k.shape[1]):
            raise KernelContractError(f"query {q.shape} / key {k.shape} / value {v.shape} / mask {m.shape}")
        if m.dtype not in (np.uint8, np.bool_) or q.shape[2] % self.nh or k.shape[2] % self.nkv:
            raise KernelContractError(f"mask dtype {m.dtype} or hidden sizes {q.shape[2]} / {k.shape[2]}")
        discard = (m == 0) if self.mutation == "mask_inverted" else (m != 0)
        hd = q.shape[2] // self.nh
        qh = q[0].reshape(-1, self.nh, hd)
        kh, vh = k[0].reshape(-1, self.nkv, hd), v[0].reshape(-1, self.nkv, hd)
        group = self.nh // self.nkv
        out = np.zeros_like(qh)
        for h in range(self.nh):
            s = self.scale * qh[:, h] @ kh[:, h // group].T
            s = np.where(discard, -np.inf, s)
            s = s - s.max(-1, keepdims=True)
            p = np.exp(s)
            out[:, h] = (p / p.sum(-1, keepdims=True)) @ vh[:, h // group]
        return ms.Tensor(out.reshape(1, q.shape[1], -1), query.dtype)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """key / value [T, n_kv * hd], caches [NB + 1, B, n_kv, hd] (updated in place), slot_mapping int32 [T]."""
        self._infer("reshape_and_cache", key, value, key_cache, value_cache, slot_mapping)
        k, v, slots = key.asnumpy(), value.asnumpy(), slot_mapping.asnumpy()
        kc, vc = key_cache.asnumpy().copy(), value_cache.asnumpy().copy()
        n_slots = kc.shape[0] * kc.shape[1]
        self.calls.append(("reshape_and_cache", {"key": k.shape, "cache": kc.shape, "slot_mapping": slots.shape}))
        if slots.dtype != np.int32:
            raise KernelContractError(f"slot_mapping must be int32, got {slots.dtype}")
        if k.ndim != 2 or k.shape[1] != kc.shape[2] * kc.shape[3] or v.shape != k.shape or \
                slots.shape != (k.shape[0],):
            raise KernelContractError(f"key {k.shape} / value {v.shape} / slots {slots.shape} vs cache {kc.shape}")
        k, v = k.reshape(k.shape[0], kc.shape[2], kc.shape[3]), v.reshape(v.shape[0], kc.shape[2], kc.shape[3])
        if slots.min() < 0 or slots.max() >= n_slots:
            raise KernelContractError(f"slot_mapping outside [0, {n_slots}): {slots.min()}..{slots.max()}")
        if self.mutation == "slot_off_by_one":
            slots = (slots + 1) % n_slots
        fk, fv = self._slots_view(kc), self._slots_view(vc)
        fk[slots], fv[slots] = k.astype(kc.dtype), v.astype(vc.dtype)
        key_cache.set_data(ms.Tensor(self._store(kc, fk), key_cache.dtype))
        value_cache.set_data(ms.Tensor(self._store(vc, fv), value_cache.dtype))
        return key

    def paged_attention(self, query, key_cache, value_cache, block_tables, context_lens, antiquant_scale=None,
                        antiquant_offset=None, attn_mask=None, q_seq_lens=None):
        """query [T, nh, hd] -> [T, nh, hd] in the query dtype (module docstring for the semantics)."""
        self._infer("paged_attention", query, key_cache, value_cache, block_tables, context_lens, antiquant_scale,
                    antiquant_offset, attn_mask, q_seq_lens)
        q = query.asnumpy().astype(np.float32)
        kc, vc = key_cache.asnumpy(), value_cache.asnumpy()
        tables, ctx_lens = block_tables.asnumpy(), context_lens.asnumpy()
        mask = attn_mask.asnumpy().astype(np.float32)
        q_lens = q_seq_lens.asnumpy()
        nb, B = kc.shape[0], kc.shape[1]
        self.calls.append(("paged_attention", {"query": q.shape, "block_tables": tables.shape, "mask": mask.shape,
                                               "context_lens": ctx_lens.shape, "q_seq_lens": q_lens.shape}))
        if q.ndim != 3 or q.shape[1] != self.nh:
            raise KernelContractError(f"query must be [T, {self.nh}, hd], got {q.shape}")
        if tables.dtype != np.int32 or ctx_lens.dtype != np.int32 or q_lens.dtype != np.int32:
            raise KernelContractError("block_tables / context_lens / q_seq_lens must be int32")
        if tables.min() < 0 or tables.max() >= nb:
            raise KernelContractError(f"block_tables outside [0, {nb}): {tables.min()}..{tables.max()}")
        if q_lens.sum() != q.shape[0] or len(q_lens) != tables.shape[0] or len(ctx_lens) != tables.shape[0]:
            raise KernelContractError(f"q_seq_lens {q_lens} / context_lens {ctx_lens} vs {q.shape[0]} rows and "
                                      f"{tables.shape[0]} tables")
        if mask.shape != (q.shape[0], tables.shape[1] * B):
            raise KernelContractError(f"attn_mask must be [{q.shape[0]}, {tables.shape[1] * B}], got {mask.shape}")
        if ctx_lens.min() < 1 or ctx_lens.max() > tables.shape[1] * B:
            raise KernelContractError(f"context_lens outside [1, {tables.shape[1] * B}]: {ctx_lens}")
        if self.mutation == "mask_inverted":
            mask = np.where(mask == 0, -10000.0, 0.0).astype(np.float32)
        fk = self._slots_view(kc.copy()).astype(np.float32)
        fv = self._slots_view(vc.copy()).astype(np.float32)
        group = self.nh // self.nkv
        out = np.zeros_like(q)
        row = 0
        for b, (n_q, n_ctx) in enumerate(zip(q_lens, ctx_lens)):
            j = np.arange(n_ctx)
            slots = tables[b, j // B].astype(np.int64) * B + j % B
            keys, vals = fk[slots], fv[slots]                                   # [n_ctx, n_kv, hd]
            for h in range(self.nh):
                qs = q[row:row + n_q, h]                                        # [n_q, hd]
                s = self.scale * qs @ keys[:, h // group].T + mask[row:row + n_q, :n_ctx]
                s = s - s.max(-1, keepdims=True)
                p = np.exp(s)
                p /= p.sum(-1, keepdims=True)
                out[row:row + n_q, h] = p @ vals[:, h // group]
            row += n_q
        return ms.Tensor(out, query.dtype)
