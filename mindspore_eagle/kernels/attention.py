"""Attention backends: how a Cell writes K/V into its paged cache and attends over it.

Legend: k = query rows of one call, nh / n_kv / hd = query heads / KV heads / head dim, NB / B = cache blocks /
block size (block NB is the explicit pad block, so NB + 1 blocks are allocated), w = attended slots of the call
(block-table width x B), P = slots moved by one commit.

One small interface, chosen once per Cell (never a flag inside the math):

    make_cache(name)                          -> cache Parameter (one for K, one for V)
    prepare(slots [k] i32, block_table [w/B] i32, mask [k, w] f32 additive)
                                              -> meta: everything the layers share in one forward
            (backends with ``grouped = True`` also take block_table [G, w/B]: G sequences of k / G rows each,
            every group attending only to its own table; ``TeacherRunner`` batches through it)
    attend(q [k, nh, hd], k [k, n_kv, hd], v [k, n_kv, hd], key_cache, value_cache, meta, scale)
                                              -> context [k, nh * hd]   (writes k / v first)
    move(key_cache, value_cache, src [P] i32, dst [P] i32)  -> outputs to depend on (commit compaction)
    read_keys(key_cache, block_table [w/B] i32) -> keys [n_kv, w, hd]  (read-only inspection)

and the rest of a teacher layer's math (a decoder layer is ``attention_block`` then ``mlp_add_norm``; the norm
weights are folded into the next matmul, so every norm here is unweighted):

    linear(x [k, K], w [N, K]) -> [k, N];  norm(x [k, H], eps) -> rms(x)
    rope_rows(cos [k, hd], sin_signed [k, hd]) -> the backend's form of them, once per forward
    attention_block(x [k, H], h = rms(x), wqkv, bqkv | None, wo, bo | None, cos, sin, key_cache, value_cache, meta,
                    eps) -> (y = x + attention(h) @ wo.T (+ bo), rms(y))   (q/k/v projection, RoPE, cache write,
                    attention, output projection, residual add, norm)
    mlp_add_norm(h [k, H], w_gate_up [2F, H], w_down [H, F], resid [k, H], eps) -> (y = resid + SwiGLU MLP, rms(y))

``PortableBackend`` (CPU, GPU, Ascend): the flat head-major layout of ``kv.make_cache`` written by
``ScatterUpdate`` and read by ``gather``, attention by batched matmuls (``models.pangu.paged_attention``). It is
the path every GPU run and every CPU run without a C++ compiler takes; its layer math is ``dense.py``.

``CpuBackend`` (CPU, float32): the portable cache layout and write, with the layer math and the attention in fused
C++ kernels (``kernels/cpu.py``): a decoder layer is two kernel calls (the attention block, which writes the cache in
place, and the MLP block), 2 graph ops instead of ~37, batch-invariant (a row's logits do not depend on the other
rows of the call; docs/cpu_kernels.md).

``FusedBackend`` (Ascend): MindFormers' paged layout ``[NB + 1, B, n_kv, hd]`` per layer (the layout in the
docstrings of ``ops.auto_generate.ReshapeAndCache`` / ``PagedAttention``; byte-identical to MindFormers'
``[NB, B, n_kv * hd]``, ``modules/paged_attention_mgr.py``, plus our pad block). The write is
``ReshapeAndCache(key [k, n_kv * hd], value, key_cache, value_cache, slot_mapping [k])`` (the op's shape check
counts tokens as the product of all but the last key dimension, so the key is flattened per token, as MindFormers'
[B, S, H] key; the docstring's [T, n_kv, hd] would count T * n_kv tokens; half-precision keys only); the read + attention is one
``PagedAttention(query, key_cache, value_cache, block_tables [batch, w/B], context_lens [batch], None, None,
attn_mask [k, w], q_seq_lens [batch])`` with ``head_num``, ``scale_value`` and ``kv_head_num`` fixed at
construction: the call MindFormers makes for parallel decoding / chunked prefill (``paged_attn`` in
``paged_attention_mgr.py``); it serves calls of at most ``PA_MAX_Q`` = 16 query rows (decode, tree
verification, drafter expansion). Each call is one sequence (batch 1, q_seq_lens = [k]); ``context_lens`` = last
visible column + 1 of the additive mask; the mask is converted to MindFormers' convention: ``bool(hidden) *
-10000`` in the compute dtype (0 = visible). Larger calls (prefill chunks, the drafter's context pass) read the
block table's slots back from the cache (a gather of whole blocks, after the ReshapeAndCache write) and run
``FlashAttentionScore`` (layout BSH, mask uint8 [k, w] with 1 = discard, GQA by head_num) over them, so a chunk
after the first sees the earlier chunks. No index is ever -1: padding rows write into the pad block and block
tables are padded with the pad block id.

The kernels are injected (``kernels`` = a factory ``(head_num, scale_value, kv_head_num) -> object`` with
``reshape_and_cache`` and ``paged_attention``), so the same backend runs Ascend's ops on a device and the numpy
models of their documented semantics on CPU (``tests/ascend_reference.py``, eager mode only: numpy runs on the
host). ``select_backend`` picks by ``context.device_target`` and the dtype (Ascend in half precision -> fused, CPU
in float32 -> cpu when its kernels build, else portable), overridable with
the ``attention`` argument of the Cells or the ``MSEAGLE_ATTENTION`` environment variable (``portable`` /
``fused`` / ``cpu``).
"""
from __future__ import annotations

import os

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindspore_eagle.kernels import dense
from mindspore_eagle.kernels.kv import PortableKVOps, cache_index_constants, make_cache

MASKED_SCORE = -10000.0
"""The additive value PagedAttention's mask carries for a hidden key (MindFormers: ``bool(mask) * -10000``)."""

BACKENDS = ("portable", "fused", "cpu")

_BMM_T = ops.BatchMatMul(transpose_b=True)


def paged_attention(q, k, v, key_cache, value_cache, write_idx, read_idx, mask, scale=None):
    """Write k/v into the paged caches, then attend from q over the sequence's slots.

    q [k, nh, hd] (RoPE applied), k/v [k, n_kv, hd] (RoPE on k), caches [n_kv * slots, hd], all in the compute
    dtype (float32 / float16 / bfloat16); write_idx [k * n_kv] i32 and read_idx [n_kv, S] i32
    (:meth:`PortableKVOps.indices`), mask [k, S] f32 additive, scale: the score factor 1/sqrt(hd), or None when
    q already carries it (the teacher folds it into its q weights) -> context [k, nh * hd] in the compute dtype.
    Scores are cast to float32 before the mask and the softmax (MindFormers' ``softmax_compute_type``), and in
    half precision the value matmul runs in float32 too (values upcast, the context rounded once to the compute
    dtype, as the fused kernels accumulate): a tree node's ancestors sit at tree slots with masked columns between
    them where one-token decoding has them contiguous, and a half-precision P V sum grouped differently flipped a
    greedy token (docs/ascend.md). float32 takes no cast.
    GQA: each KV head serves nh / n_kv query heads through one batched matmul. This is the portable stand-in for
    Ascend's ReshapeAndCache + PagedAttention pair (docs/design.md, "MindFormers KV-cache API").

    Grouped call (several sequences in one forward, each over its own slots): read_idx [G, n_kv, S] from a block
    table [G, S/B]; the k = G * kg query rows are G consecutive groups of kg rows, group g attends only to its
    own S slots with mask rows [g * kg, (g + 1) * kg) — so a batch of G sequences costs G x S scores per row
    group, not (G x S) per row as one concatenated table would.
    """
    k_len, nh, hd = q.shape
    nkv = k.shape[1]
    group = nh // nkv
    k_out = PortableKVOps.write(key_cache, write_idx, k)
    v_out = PortableKVOps.write(value_cache, write_idx, v)
    keys = PortableKVOps.read(ops.depend(key_cache, k_out), read_idx)        # [(G,) n_kv, S, hd]
    vals = PortableKVOps.read(ops.depend(value_cache, v_out), read_idx)
    G = read_idx.shape[0] if read_idx.ndim == 3 else 1
    kg = k_len // G                                                          # query rows per group
    if read_idx.ndim == 3:
        keys = keys.reshape(G * nkv, -1, hd)
        vals = vals.reshape(G * nkv, -1, hd)
    if kg == 1:                                                              # decode rows: no transpose needed
        q = q.reshape(G * nkv, group, hd)
    else:
        q = q.reshape(G, kg, nkv, group, hd).transpose(0, 2, 3, 1, 4).reshape(G * nkv, group * kg, hd)
    scores = _BMM_T(q, keys)                                                 # [G*n_kv, g*kg, S]
    if scale is not None:
        scores = scores * scale
    if scores.dtype != ms.float32:                                           # softmax in float32
        scores = scores.astype(ms.float32)
    if G == 1:
        scores = scores.reshape(nkv, group, kg, -1) + mask
    else:
        scores = scores.reshape(G, nkv, group, kg, -1) + mask.reshape(G, 1, 1, kg, -1)
    probs = ops.softmax(scores, -1).reshape(G * nkv, group * kg, -1)
    if vals.dtype != ms.float32:          # half precision: P V accumulates in float32, rounded once at the end
        ctx = ops.bmm(probs, vals.astype(ms.float32)).astype(vals.dtype)
    else:
        ctx = ops.bmm(probs, vals)                                           # [G*n_kv, g*kg, hd]
    if kg == 1:
        return ctx.reshape(G, nh * hd)
    return ctx.reshape(G, nkv, group, kg, hd).transpose(0, 3, 1, 2, 4).reshape(k_len, nh * hd)


PA_MAX_Q = 16
"""Most query rows per sequence that go to PagedAttention (decode, tree verification, drafter expansion); larger
static row counts (prefill chunks, the drafter's context pass) go to FlashAttention. 16 = the cap vllm-ascend
documents for its fused attention with speculative masks (num_speculative_tokens + 1 <= 16)."""


class AscendKernels(nn.Cell):
    """The real Ascend kernels; constructible anywhere, runnable on Ascend (Atlas A2 for FlashAttentionScore) only.

    ``reshape_and_cache`` / ``paged_attention``: ``mindspore.ops.auto_generate.ReshapeAndCache`` /
    ``PagedAttention(head_num, scale_value, kv_head_num)``; ``flash_attention(query [1, S1, nh * hd], key /
    value [1, S2, n_kv * hd], attn_mask uint8 [S1, S2] (1 = discard)) -> [1, S1, nh * hd]``:
    ``ops.flash_attention_score`` in layout BSH, sparse_mode 0 (the prefill call of MindFormers'
    ``InferAttention`` in PyNative, ``modules/infer_attention.py``).

    Args: head_num (nh), scale_value (score factor; 1.0 when q already carries 1/sqrt(hd)), kv_head_num (n_kv).
    """

    def __init__(self, head_num: int, scale_value: float, kv_head_num: int):
        from mindspore.ops import auto_generate as gen

        super().__init__()                # a Cell, so that graph mode resolves its primitives and methods
        self.head_num, self.scale_value = head_num, scale_value
        self.reshape_and_cache = gen.ReshapeAndCache()
        self.paged_attention = gen.PagedAttention(head_num, scale_value, kv_head_num)

    def flash_attention(self, query, key, value, attn_mask):
        return ops.flash_attention_score(query, key, value, self.head_num, attn_mask=attn_mask,
                                         scalar_value=self.scale_value, input_layout="BSH")


def select_backend(attention: str = "auto", dtype=ms.float16) -> str:
    """Backend name for ``attention`` = auto | portable | fused | cpu.

    auto: $MSEAGLE_ATTENTION when set, else fused on Ascend in a half dtype, else cpu on a CPU device in float32
    when the CPU kernels build here (``cpu.status``; if not, one line on stderr says why, once, and portable is
    used), else portable. fused needs a half dtype (ReshapeAndCache takes float16 / bfloat16 / int8 / uint8 keys
    only, per its type check in MindSpore 2.9); cpu needs float32 and the kernels.
    Raises:
        ValueError: an unknown name, fused with float32, cpu with a half dtype or without its kernels (names the
            allowed values or the reason).
    """
    name = attention
    if name == "auto":
        name = os.environ.get("MSEAGLE_ATTENTION", "")
        if not name:
            device = ms.get_context("device_target")
            if device == "Ascend" and dtype != ms.float32:
                name = "fused"
            elif device == "CPU" and dtype == ms.float32 and _cpu_kernels_ok():
                name = "cpu"
            else:
                name = "portable"
    if name not in BACKENDS:
        raise ValueError(f"attention backend = {name!r}: must be auto, portable, fused or cpu")
    if name == "fused" and dtype == ms.float32:
        raise ValueError("attention backend = 'fused' needs model.dtype float16 or bfloat16 (ReshapeAndCache takes "
                         "no float32)")
    if name == "cpu":
        if dtype != ms.float32:
            raise ValueError("attention backend = 'cpu' needs model.dtype float32 (its kernels are float32)")
        from mindspore_eagle.kernels import cpu

        ok, why = cpu.status()
        if not ok:
            raise ValueError(f"attention backend = 'cpu' is not available here: {why}")
    return name


_cpu_note = []


def _cpu_kernels_ok() -> bool:
    """True when the CPU kernels build and load here; else prints the reason once (stderr) and returns False."""
    import sys

    from mindspore_eagle.kernels import cpu

    ok, why = cpu.status()
    if not ok and not _cpu_note:
        _cpu_note.append(why)
        print(f"[mindspore_eagle] {why}; using the portable backend (slower)", file=sys.stderr)
    return ok


def make_backend(attention, num_blocks: int, block_size: int, n_kv: int, nh: int, hd: int, dtype, scale: float,
                 kernels=None):
    """The backend Cell for one model's cache geometry.

    Args:
        attention: auto | portable | fused | cpu (see :func:`select_backend`), or an already built backend
            (returned).
        scale: the score factor the fused kernel applies (1.0 when q carries 1/sqrt(hd)); the portable and cpu
            paths take it per call.
        kernels: factory for the fused backend (default :class:`AscendKernels`).
    """
    if isinstance(attention, (PortableBackend, FusedBackend)):
        return attention
    name = select_backend(attention, dtype)
    if name == "portable":
        return PortableBackend(num_blocks, block_size, n_kv, hd, dtype)
    if name == "cpu":
        return CpuBackend(num_blocks, block_size, n_kv, nh, hd)
    return FusedBackend(num_blocks, block_size, n_kv, nh, hd, dtype, scale, kernels or AscendKernels)


class PortableLayerMath:
    """The teacher layer's math in plain MindSpore ops (``dense.py``), for the portable and fused backends.

    Needs ``self.n_kv`` / ``self.hd`` / ``self.swap`` (= ``dense.rope_swap_index(hd)``) on the backend."""

    def linear(self, x, w):
        """x [k, K] @ w [N, K].T -> [k, N] (``dense.linear``: the matmul form by row count)."""
        return dense.linear(x, w)

    def matrix_shape(self, n: int, k: int) -> tuple:
        """Shape of the Parameter holding a [n, k] matrix on this backend (the CPU kernels' may be packed)."""
        return (n, k)

    def embed_rows(self, table, ids):
        """Rows ``ids`` int32 [k] of an embedding table held as :meth:`matrix_shape` -> [k, H]."""
        return ops.gather(table, ids, 0)

    def pack(self, w: np.ndarray, inplace: bool = False) -> np.ndarray:
        """A [n, k] numpy matrix in the layout of :meth:`matrix_shape` (here: w as it is)."""
        return w

    def norm(self, x, eps: float):
        """rms(x) [k, H], no weight (``dense.rms_norm``)."""
        return dense.rms_norm(x, eps)

    def head_topk(self, h, w, d2t, K: int):
        """A draft head's K best log-probs: h [r, H] (normed rows), w [V, H], d2t [V] i32 -> (top_logp [r, K] f32,
        log-softmax over V in float32, descending; top_ids [r, K] i32 = index + d2t[index]). ``self.linear``, then
        log_softmax, topk and the d2t gather as graph ops."""
        logits = self.linear(h, w)
        if logits.dtype != ms.float32:
            logits = logits.astype(ms.float32)
        top_logp, top_idx = ops.topk(ops.log_softmax(logits, -1), K)
        return top_logp, top_idx + ops.gather(d2t, top_idx.reshape(-1), 0).reshape(top_idx.shape)

    def head_kernel(self, K: int):
        """A primitive computing :meth:`head_topk` for K in one call, or None (graph ops only)."""
        return None

    def rope_rows(self, cos, sin):
        """cos / sin_signed [k, hd] -> [k, 1, hd] (broadcast over heads)."""
        return cos.expand_dims(1), sin.expand_dims(1)

    def attention_block(self, x, h, wqkv, bqkv, wo, bo, cos, sin, key_cache, value_cache, meta, eps: float):
        """(y = x + attention(h) @ wo.T (+ bo), rms(y)) [k, H] each, for x [k, H] the residual stream and h
        [k, Hin] the normed input (Hin = H in the teacher, 2 H in the drafter's first layer); writes the rows' K/V
        (``attend``). q carries the score factor (folded into wqkv, as the backend's callers do)."""
        q, k, v = self.qkv_rope(h, wqkv, bqkv, cos, sin)
        out = dense.linear(self.attend(q, k, v, key_cache, value_cache, meta), wo)
        if bo is not None:
            out = out + bo
        y = x + out
        return y, dense.rms_norm(y, eps)

    def qkv_rope(self, x, wqkv, bqkv, cos, sin):
        """x [k, H] -> (q [k, nh, hd], k [k, n_kv, hd] with RoPE, v [k, n_kv, hd]); q and k rotated together in one
        gather (``dense.apply_rope``)."""
        qkv = dense.linear(x, wqkv)
        if bqkv is not None:
            qkv = qkv + bqkv
        k_len, nkv, hd = qkv.shape[0], self.n_kv, self.hd
        nh = qkv.shape[1] // hd - 2 * nkv
        qk, v = ops.split(qkv, ((nh + nkv) * hd, nkv * hd), -1)
        qk = dense.apply_rope(qk.reshape(k_len, nh + nkv, hd), cos, sin, self.swap)
        q, k = ops.split(qk, (nh, nkv), 1)
        return q, k, v.reshape(k_len, nkv, hd)

    def decoder_layer(self, x, h, wqkv, bqkv, wo, bo, w_gate_up, w_down, cos, sin, key_cache, value_cache, meta,
                      eps: float):
        """A whole teacher layer: this backend's :meth:`attention_block`, then its :meth:`mlp_add_norm` on the
        result -> (y, rms(y)) [k, H] each (the cpu backend does both in one kernel call)."""
        x, h = self.attention_block(x, h, wqkv, bqkv, wo, bo, cos, sin, key_cache, value_cache, meta, eps)
        return self.mlp_add_norm(h, w_gate_up, w_down, x, eps)

    def mlp_add_norm(self, h, w_gate_up, w_down, resid, eps: float):
        """(y = resid + SwiGLU MLP(h), rms(y)) [k, H] each (``dense.swiglu_mlp``)."""
        y = resid + dense.swiglu_mlp(h, w_gate_up, w_down, w_down.shape[1])
        return y, dense.rms_norm(y, eps)


class PortableBackend(PortableLayerMath, nn.Cell):
    """Flat head-major cache ``[n_kv * (NB + 1) * B, hd]``, ScatterUpdate write, gather read (``kv.py``)."""

    name = "portable"
    grouped = True          # block_table [G, w/B]: G sequences per call, each over its own slots

    def __init__(self, num_blocks: int, block_size: int, n_kv: int, hd: int, dtype=ms.float32):
        super().__init__()
        self.num_blocks, self.block_size, self.n_kv, self.hd, self.dtype = num_blocks, block_size, n_kv, hd, dtype
        self.offsets, self.head_base = cache_index_constants(num_blocks, block_size, n_kv)
        self.swap = dense.rope_swap_index(hd)

    def make_cache(self, name: str):
        """Zero cache Parameter [n_kv * (NB + 1) * B, hd] in the compute dtype."""
        return make_cache(self.num_blocks, self.block_size, self.n_kv, self.hd, self.dtype, name)

    def prepare(self, slots, block_table, mask):
        """(write rows [k * n_kv], read rows [(G,) n_kv, w], mask [k, w]) (``PortableKVOps.indices``)."""
        write_idx, read_idx = PortableKVOps.indices(slots, block_table, self.offsets, self.head_base)
        return write_idx, read_idx, mask

    def attend(self, q, k, v, key_cache, value_cache, meta, scale=None):
        """``models.pangu.paged_attention`` (write, gather, matmul attention) -> [k, nh * hd]."""
        write_idx, read_idx, mask = meta
        return paged_attention(q, k, v, key_cache, value_cache, write_idx, read_idx, mask, scale)

    def move(self, key_cache, value_cache, src, dst):
        """Copy slots src -> dst for every head (gather into a temporary first, so overlaps are safe)."""
        src_rows = PortableKVOps.write_rows(src, self.head_base)
        dst_rows = PortableKVOps.write_rows(dst, self.head_base)
        k_out = PortableKVOps.write(key_cache, dst_rows, ops.gather(key_cache, src_rows, 0))
        v_out = PortableKVOps.write(value_cache, dst_rows, ops.gather(value_cache, src_rows, 0))
        return k_out, v_out

    def read_keys(self, key_cache, block_table):
        """keys [n_kv, w, hd] of the block table's slots."""
        return PortableKVOps.read(key_cache, PortableKVOps.read_rows(block_table, self.offsets, self.head_base))


class FusedBackend(PortableLayerMath, nn.Cell):
    """MindFormers layout ``[NB + 1, B, n_kv, hd]``; ReshapeAndCache + PagedAttention (see the module docstring).

    Args:
        num_blocks / block_size / n_kv / nh / hd: geometry; dtype: compute dtype of the cache and the query;
        scale: PagedAttention's ``scale_value``; kernels: factory ``(head_num, scale_value, kv_head_num)``.
    """

    name = "fused"
    grouped = False         # one sequence per call: batches go through one concatenated block table

    def __init__(self, num_blocks: int, block_size: int, n_kv: int, nh: int, hd: int, dtype, scale: float,
                 kernels=AscendKernels):
        super().__init__()
        self.num_blocks, self.block_size, self.n_kv, self.nh, self.hd = num_blocks, block_size, n_kv, nh, hd
        self.dtype = dtype
        self.kernels = kernels(nh, float(scale), n_kv)
        self.cols = ms.Tensor(np.arange(1, 1 << 16, dtype=np.int32))     # column index + 1 (context length)
        self.swap = dense.rope_swap_index(hd)

    def make_cache(self, name: str):
        """Zero cache Parameter [NB + 1, B, n_kv, hd] in the compute dtype (block NB = pad block)."""
        shape = (self.num_blocks + 1, self.block_size, self.n_kv, self.hd)
        zeros = np.zeros(shape, np.float32 if self.dtype == ms.float32 else np.float16)
        return ms.Parameter(ms.Tensor(zeros, self.dtype), name=name, requires_grad=False)

    def prepare(self, slots, block_table, mask):
        """(slot_mapping [k], block_tables [1, w/B], context_lens [1], attn_mask [k, w] compute dtype,
        q_seq_lens [1]) for one sequence; context_lens = 1 + the last column any row may see."""
        k_len, w = mask.shape
        visible = (mask > MASKED_SCORE).astype(ms.int32)                 # 0 / 1 [k, w]
        context_lens = (visible * self.cols[:w].reshape(1, -1)).max().reshape(1)
        attn_mask = (mask <= MASKED_SCORE).astype(self.dtype) * MASKED_SCORE
        q_seq_lens = ops.ones((1,), ms.int32) * k_len
        return slots, block_table.reshape(1, -1), context_lens, attn_mask, q_seq_lens

    def attend(self, q, k, v, key_cache, value_cache, meta, scale=None):
        """ReshapeAndCache(k, v), then PagedAttention(q) for k <= PA_MAX_Q rows, else FlashAttention over the
        block table's slots read back from the cache -> [k, nh * hd] (``scale`` is the kernels', fixed)."""
        slot_mapping, block_tables, context_lens, attn_mask, q_seq_lens = meta
        k_len = q.shape[0]
        written = self.kernels.reshape_and_cache(k.reshape(k_len, -1), v.reshape(k_len, -1), key_cache,
                                                 value_cache, slot_mapping)
        q = ops.depend(q, written)
        if k_len <= PA_MAX_Q:
            out = self.kernels.paged_attention(q, key_cache, value_cache, block_tables, context_lens, None, None,
                                               attn_mask, q_seq_lens)
            return out.reshape(k_len, self.nh * self.hd)
        keys = ops.gather(ops.depend(key_cache, written), block_tables.reshape(-1), 0)      # [w/B, B, n_kv, hd]
        vals = ops.gather(ops.depend(value_cache, written), block_tables.reshape(-1), 0)
        width = keys.shape[0] * keys.shape[1]
        discard = (attn_mask < 0).astype(ms.uint8)                                           # 1 = discard
        out = self.kernels.flash_attention(q.reshape(1, k_len, self.nh * self.hd),
                                           keys.reshape(1, width, self.n_kv * self.hd),
                                           vals.reshape(1, width, self.n_kv * self.hd), discard)
        return out.reshape(k_len, self.nh * self.hd)

    def move(self, key_cache, value_cache, src, dst):
        """Gather slots ``src`` [P, n_kv * hd] from both caches, then ReshapeAndCache them at ``dst``."""
        keys = ops.gather(key_cache.reshape(-1, self.n_kv * self.hd), src, 0)
        vals = ops.gather(value_cache.reshape(-1, self.n_kv * self.hd), src, 0)
        out = self.kernels.reshape_and_cache(keys, vals, key_cache, value_cache, dst)
        return out, out

    def read_keys(self, key_cache, block_table):
        """keys [n_kv, w, hd] of the block table's slots."""
        keys = ops.gather(key_cache, block_table, 0)                      # [w/B, B, n_kv, hd]
        return keys.reshape(-1, self.n_kv, self.hd).transpose(1, 0, 2)


CPU_LINEAR_MAX_ROWS = 32
"""Most rows a :class:`CpuBackend` call on unpacked matrices sends through the C++ kernels; larger calls (prefill
chunks) take MindSpore's MatMul and the portable ops around it. Calls on packed matrices (every matrix whose rows are
a multiple of 16) take the kernels at any row count (docs/cpu_kernels.md, "What runs")."""


def _wide(w):
    """A float16 matrix widened to float32 (MatMul and the portable ops take one dtype); float32 as it is."""
    return w.astype(ms.float32) if w.dtype == ms.float16 else w


def check_weight_dtype(backend, weight_dtype, dtype) -> None:
    """Raise ValueError unless ``backend`` can hold matrices in ``weight_dtype`` under compute ``dtype``: the same
    dtype always; float16 under float32 on a backend with ``half_weights`` (the CPU kernels)."""
    if weight_dtype == dtype:
        return
    if not (weight_dtype == ms.float16 and dtype == ms.float32 and getattr(backend, "half_weights", False)):
        raise ValueError(f"model.weight_dtype {weight_dtype} under model.dtype {dtype} needs the cpu backend "
                         f"(float16 under float32 only), this model runs on the {backend.name} backend")


class CpuBackend(PortableBackend):
    """The portable cache layout and write, with the layer math and attention in the C++ kernels of ``cpu.py``.

    float32 compute. The matrices may be held in float16 (``half_weights``; a model's ``weight_dtype``): the
    kernels widen each half weight to exactly one float as they read it, so the arithmetic is that of the float32
    kernels on the widened weights and a decode reads half the bytes. A matrix whose row count is a multiple of 16
    is held packed (:meth:`matrix_shape`, ``cpu.pack``) and every call on it runs in the kernels; a call of over
    CPU_LINEAR_MAX_ROWS rows on an unpacked matrix widens it and takes MatMul. Kernel calls are batch-invariant
    end to end (every row's result is the same whatever the other rows). Args: geometry as
    :class:`PortableBackend`, plus nh (query heads).
    Raises:
        KernelBuildError: the kernels cannot be built here (``select_backend`` checks first).
    """

    name = "cpu"
    half_weights = True     # matrices may be float16 under float32 compute (``cpu_kernels.cc``, load8w)

    def __init__(self, num_blocks: int, block_size: int, n_kv: int, nh: int, hd: int):
        from mindspore_eagle.kernels import cpu, runtime

        super().__init__(num_blocks, block_size, n_kv, hd, ms.float32)
        self.nh = nh
        self.kernels = cpu.CpuKernels()
        self.heads = ms.Tensor(np.array([nh, n_kv], np.int32))
        self.mm_t = ops.MatMul(transpose_b=True)
        cpu.set_threads(runtime.kernel_threads())

    def matrix_shape(self, n: int, k: int) -> tuple:
        """[n / 16, k, 16] (packed, ``cpu.pack``) when n is a multiple of 16, else [n, k]."""
        from mindspore_eagle.kernels import cpu

        return (n // cpu.PANEL, k, cpu.PANEL) if cpu.packable((n, k)) else (n, k)

    def pack(self, w: np.ndarray, inplace: bool = False) -> np.ndarray:
        """w [n, k] in the layout of :meth:`matrix_shape` (``cpu.pack`` when n is a multiple of 16; ``inplace``:
        in w's own buffer)."""
        from mindspore_eagle.kernels import cpu

        return cpu.pack(w, inplace) if cpu.packable(w.shape) else w

    def half_matrix(self, w: np.ndarray) -> np.ndarray:
        """w [n, k] float32 rounded to float16 (nearest even) in the layout of :meth:`matrix_shape`, a new array
        (``cpu.to_half``: one pass in the kernels' threads)."""
        from mindspore_eagle.kernels import cpu

        return cpu.to_half(w, cpu.packable(w.shape))

    def embed_rows(self, table, ids):
        """Rows ``ids`` int32 [k] of ``table`` [V, H], or of a packed [V / 16, H, 16] one (a tied head: row n at
        [n // 16, :, n % 16]: the rows' panels gathered, then each row's lane; a flat view of the table made
        MindSpore copy it on every call) -> [k, H] (``cpu.rows`` is the numpy form)."""
        if len(table.shape) == 2:
            return ops.gather(table, ids, 0)
        _, H, L = table.shape
        panels = ops.gather(table, ids // L, 0)                                  # [k, H, 16]: the rows' panels
        lane = (ids % L).reshape(-1, 1, 1).broadcast_to((ids.shape[0], H, 1))
        return ops.gather_elements(panels, 2, lane).reshape(-1, H)

    def _fused(self, x, *mats) -> bool:
        """True when a call of x's rows on ``mats`` takes the kernels: at most CPU_LINEAR_MAX_ROWS rows, or any of
        them packed (MatMul and the portable ops cannot read a packed matrix; the kernels take either layout),
        else MatMul and the portable ops (prefill on unpacked matrices)."""
        packed = False
        for w in mats:                                 # a loop: graph mode (jit) compiles no generator expression
            packed = packed or len(w.shape) == 3
        return x.shape[0] <= CPU_LINEAR_MAX_ROWS or packed

    def linear(self, x, w):
        """x [k, K] @ w [N, K].T -> [k, N] (w as :meth:`matrix_shape`): the C++ kernel (see :meth:`_fused`), else
        MatMul."""
        return self.kernels.linear(x, w) if self._fused(x, w) else self.mm_t(x, _wide(w))

    def head_kernel(self, K: int):
        """The one-call form of :meth:`PortableLayerMath.head_topk` for K (``cpu.ref_head_topk``: the same ids and
        order, log-probs within float rounding), for calls of at most CPU_LINEAR_MAX_ROWS rows; made outside any
        graph (a model's ``__init__``)."""
        return self.kernels.head_topk(K)

    def norm(self, x, eps: float):
        """rms(x) [k, H] (the add + norm kernel with a zero addend: y = 0 + x = x exactly)."""
        return self.kernels.add_rms_norm(ops.zeros_like(x), x, ops.scalar_to_tensor(eps, ms.float32))[1]

    def rope_rows(self, cos, sin):
        """The kernels take [k, hd] rows as they are."""
        return cos, sin

    def attention_block(self, x, h, wqkv, bqkv, wo, bo, cos, sin, key_cache, value_cache, meta, eps: float):
        """One kernel call, which writes the K/V rows in place (``cpu.ref_attn_block``); prefill chunks over
        CPU_LINEAR_MAX_ROWS rows take MatMul and the portable composition."""
        if not self._fused(h, wqkv, wo):
            return PortableLayerMath.attention_block(self, x, h, _wide(wqkv), bqkv, _wide(wo), bo, cos.expand_dims(1),
                                                     sin.expand_dims(1), key_cache, value_cache, meta, eps)
        write_idx, read_idx, mask = meta
        args = (x, h, wqkv, wo, cos, sin, self.heads, key_cache, value_cache, write_idx, read_idx, mask,
                ops.scalar_to_tensor(eps, ms.float32))
        if bqkv is None:
            return self.kernels.attn_block[0](*args)
        if bo is None:
            return self.kernels.attn_block[1](*args, bqkv)
        return self.kernels.attn_block[2](*args, bqkv, bo)

    def decoder_layer(self, x, h, wqkv, bqkv, wo, bo, w_gate_up, w_down, cos, sin, key_cache, value_cache, meta,
                      eps: float):
        """:meth:`attention_block` then :meth:`mlp_add_norm` in one kernel call (bit for bit the two calls);
        prefill chunks over CPU_LINEAR_MAX_ROWS rows take the two portable paths."""
        if not self._fused(h, wqkv, wo, w_gate_up, w_down):
            return PortableLayerMath.decoder_layer(self, x, h, wqkv, bqkv, wo, bo, w_gate_up, w_down, cos, sin,
                                                   key_cache, value_cache, meta, eps)
        write_idx, read_idx, mask = meta
        args = (x, h, wqkv, wo, cos, sin, self.heads, key_cache, value_cache, write_idx, read_idx, mask,
                ops.scalar_to_tensor(eps, ms.float32))
        if bqkv is None:
            return self.kernels.decoder_layer[0](*args, w_gate_up, w_down)
        if bo is None:
            return self.kernels.decoder_layer[1](*args, bqkv, w_gate_up, w_down)
        return self.kernels.decoder_layer[2](*args, bqkv, bo, w_gate_up, w_down)

    def stack_kernel(self, inputs: int):
        """The kernel that runs every decoder layer of a model in one call (``cpu.CpuKernels.decoder_stack`` for a
        call of ``inputs`` inputs), for :meth:`decoder_stack`; made outside any graph (a model's ``__init__``)."""
        return self.kernels.decoder_stack(inputs)

    def decoder_stack(self, kernel, spec, tokens, positions, slots, block_table, mask, embed, cos, sin, eps: float,
                      weights):
        """A teacher's trunk in one call of ``kernel`` (:meth:`stack_kernel`; ``cpu_kernels.cc`` DecoderStack): the
        embedding rows of ``tokens`` [k] (``embed`` as :meth:`embed_rows` reads it), their norm, the RoPE rows of
        ``positions`` [k] from the tables ``cos`` / ``sin`` [P, hd], the cache rows of ``slots`` [k] and
        ``block_table`` ([S/B], or [G, S/B]) as :meth:`prepare`, then every layer's :meth:`decoder_layer`, bit
        for bit what those calls compute. ``spec`` int32 [7] = (nh, n_kv, biases, L, a0, a1, a2), ``weights``
        each layer's (wqkv, wo, [bqkv, [bo,]] w_gate_up, w_down, key_cache, value_cache) in layer order
        -> (x [k, H] after the last layer, rms(x) [k, H], aux [k, 3H]: the residual stream entering layers
        a0, a1, a2). One graph node instead of ~45 takes ~1 ms of MindSpore's host work off a forward of the
        135M teacher (docs/cpu_kernels.md, "Host work around a forward")."""
        return kernel(spec, tokens, positions, slots, block_table, mask, embed, cos, sin,
                      ops.scalar_to_tensor(eps, ms.float32), *weights)

    def mlp_add_norm(self, h, w_gate_up, w_down, resid, eps: float):
        """One kernel call (``cpu.ref_mlp_add_norm``); MatMul + portable ops over CPU_LINEAR_MAX_ROWS rows."""
        if not self._fused(h, w_gate_up, w_down):
            return PortableLayerMath.mlp_add_norm(self, h, _wide(w_gate_up), _wide(w_down), resid, eps)
        return self.kernels.mlp_add_norm(h, w_gate_up, w_down, resid, ops.scalar_to_tensor(eps, ms.float32))

    def move_kernel(self, caches: int):
        """The kernel that moves rows in ``caches`` caches in one call (``cpu.CpuKernels.move_rows``), for
        :meth:`move_all`; made outside any graph (``models.llama.KVCompactor.__init__``)."""
        return self.kernels.move_rows(caches)

    def move_all(self, kernel, keys, values, src, dst):
        """Copy slots src -> dst [P] i32 for every head in every cache of ``keys`` and ``values`` (tuples of
        [R, hd] caches) with one call of ``kernel`` (:meth:`move_kernel` of their count; every cache read before
        any is written) -> a dummy f32 [1]. With per-layer gathers and scatters (:meth:`move`, ~300 graph ops) a
        commit of the 135M teacher took 3.7-4.2 ms, with this call 2.4-2.5 ms (docs/cpu_kernels.md)."""
        src_rows = PortableKVOps.write_rows(src, self.head_base)
        dst_rows = PortableKVOps.write_rows(dst, self.head_base)
        return kernel(src_rows, dst_rows, *keys, *values)

    def attend(self, q, k, v, key_cache, value_cache, meta, scale=None):
        """ScatterUpdate k / v into the caches, then the attention kernel over the block table's rows (hidden
        columns skipped) -> [k, nh * hd]."""
        write_idx, read_idx, mask = meta
        PortableKVOps.write(key_cache, write_idx, k)
        PortableKVOps.write(value_cache, write_idx, v)
        factor = ops.scalar_to_tensor(1.0 if scale is None else scale, ms.float32)
        # no depend on the writes' outputs: MindSpore orders a Parameter's reads after its in-place writes by
        # itself (auto-monad), and using a ScatterUpdate's output made it materialise a copy of the whole cache
        # (~60 us per layer and cache at 1,040 slots; docs/cpu_kernels.md)
        return self.kernels.paged_attention(q, key_cache, value_cache, read_idx, mask, factor)
