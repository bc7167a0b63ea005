"""Dense layer math of the portable backend, in plain MindSpore ops (CPU, GPU, Ascend): matmul forms, RoPE,
unweighted RMSNorm, the SwiGLU MLP.

Legend: k = rows of one call, K / N = input / output features, H = hidden, F = MLP width, nh / n_kv / hd = query
heads / KV heads / head dim.

These are the ops ``attention.PortableBackend`` (and ``FusedBackend``) give the teacher's layers; the CPU backend
replaces them by fused kernels (``kernels/cpu.py``). models/llama.py re-exports ``linear``, ``apply_rope``,
``rope_swap_index`` and ``WEIGHT_LEFT_ROWS``.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

WEIGHT_LEFT_ROWS = (8, 32)
"""Row counts k (inclusive range) for which :func:`linear` puts the weight on the left (see there)."""

_MM = ops.MatMul()
_MM_T = ops.MatMul(transpose_b=True)


def linear(x, w):
    """x [k, K] f32 @ w.T for a weight w [N, K] f32 in HF [out, in] layout -> [k, N] f32.

    Two formulations of the same product, chosen by the static row count k (each jitted shape bucket gets one):
    ``(w @ x.T).T``, the weight as the left operand, for k in WEIGHT_LEFT_ROWS (tree verification, batched
    regeneration); ``MatMul(transpose_b)(x, w)`` otherwise (the CPU kernel's fast matrix-vector path at k = 1, and
    the faster GEMM for prefill chunks). The teacher's whole matmul stack (30 layers + the 49k-row head), graph
    mode, 2-core CPU, MindSpore 2.9.0, ms per call:

        k              1    2    4    8   16   32   64  128  256
        x @ w.T       30   31   47   54   65   73  101  156  256
        (w @ x.T).T   48   43   47   46   49   61  104  213  496

    (docs/design.md, "Measurements behind the design: Matmul formulations by row count"; both forms give the
    same values up to float rounding.)
    """
    if _weight_left(x.shape[0], x.dtype):
        return _MM(w, x.T).T
    return _MM_T(x, w)


def _weight_left(k: int, dtype=ms.float32) -> bool:
    """True when k query rows (static) take the weight-left form (WEIGHT_LEFT_ROWS), in float32 only.

    Half precision always takes ``x @ w.T``: the weight-left product is rounded to the half type after a
    different accumulation order, one half ulp (1e-3 relative in float16) away from the k = 1 decode's row, which
    flipped greedy near-ties between tree verification and teacher-only decoding on the embedded teacher
    (bench/micro/dtype_agreement.py); ``x @ w.T`` gives a row the same value at k = 1 and k = M.
    """
    return dtype == ms.float32 and WEIGHT_LEFT_ROWS[0] <= k <= WEIGHT_LEFT_ROWS[1]


def rope_swap_index(head_dim: int) -> Tensor:
    """int32 [hd]: the permutation that swaps the two halves of a head (the gather inside apply_rope)."""
    half = head_dim // 2
    return Tensor(np.concatenate([np.arange(half, head_dim), np.arange(half)]).astype(np.int32))


def apply_rope(x, cos, sin_signed, swap):
    """x [..., hd]; cos / sin_signed float32 broadcastable to x (rope_tables); swap = rope_swap_index(hd) ->
    rotated x in x's dtype.

    One gather instead of slice / slice / neg / concat: the same values, three fewer graph ops per call. A
    half-precision x is rotated in float32 and cast back (MindFormers' ``rotary_dtype: float32``); float32 x
    takes no cast.
    """
    dt = x.dtype
    if dt != ms.float32:
        x = x.astype(ms.float32)
    y = x * cos + ops.gather(x, swap, x.ndim - 1) * sin_signed
    if dt != ms.float32:
        y = y.astype(dt)
    return y



def rms_norm(x, eps: float):
    """x [..., H] -> x / sqrt(mean(x^2) + eps) (no weight), computed in float32 and returned in x's dtype
    (MindFormers' ``layernorm_compute_type: float32``); float32 input takes no cast."""
    dt = x.dtype
    if dt != ms.float32:
        x = x.astype(ms.float32)
    y = x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + eps)
    if dt != ms.float32:
        y = y.astype(dt)
    return y


def swiglu_mlp(x, w_gate_up, w_down, ffn: int):
    """SwiGLU MLP with gate and up fused: x [k, H], w_gate_up [2F, H], w_down [H, F] (HF layout) -> [k, H].

    In the weight-left row range (see :func:`linear`) the product stays transposed between the two matmuls."""
    if _weight_left(x.shape[0], x.dtype):
        gate, up = ops.split(_MM(w_gate_up, x.T), ffn, 0)                             # [F, k] each
        return _MM(w_down, ops.silu(gate) * up).T
    gate, up = ops.split(_MM_T(x, w_gate_up), ffn, -1)
    return _MM_T(ops.silu(gate) * up, w_down)
