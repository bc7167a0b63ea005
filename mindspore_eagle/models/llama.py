"""Teacher Cell: the openPangu-Embedded dense decoder (Llama family) over a paged KV cache.

Legend: k = query tokens in one call, m = rows that get logits, S = slots addressed by the block table,
H = hidden, nh / n_kv = query / KV heads, hd = head dim, V = vocab, L = layers, NB / B = cache blocks / block size.

openPangu-Embedded = Llama + bias on q/k/v **and** o (one ``bias: true`` flag); Qwen2 = bias on q/k/v only;
Llama / SmolLM2 = no bias (docs/design.md, "openPangu-Embedded"). Pre-RMSNorm blocks, NeoX (rotate_half) RoPE with the
config's theta, GQA, SwiGLU MLP, final norm, tied or separate lm_head.

One forward serves prefill, single-token decode and tree verification:

    construct(tokens [k] i32, positions [k] i32, slots [k] i32, block_table [S/B] i32,
              mask [k, S] f32 additive, out_rows [m] i32) -> (logits [m, V] f32, aux [k, 3H] f32)

``slots`` says where each query token's K/V is written (padding rows point into the pad block); the K/V of
the whole sequence are then read through ``block_table`` and the additive ``mask`` (0 visible, -1e9 hidden)
decides what each query sees, so the same code handles a causal prefill, a decode step and a tree.
``aux`` is the concatenation of the residual stream entering layers ``aux_layers`` (EAGLE-3 captures; docs/design.md,
"Captured features": inputs of layers 2, L//2, L-3 by default).

Weights are fused at load time (q/k/v into one [ (nh + 2 n_kv) hd, H ] matrix, gate/up into one [2F, H]) and
kept in HF layout [out, in] with ``transpose_b`` matmuls: on the 2-core CPU that layout is 1.5x faster at k = 8
than pre-transposed weights (docs/design.md, "Matmul formulations on CPU"). Three per-layer elementwise ops are folded
into those matrices at load, since each graph op costs ~10 us of launch overhead on the CPU
(docs/design.md, "Measurements behind the design: Graph-op overhead"):
the input / post-attention RMSNorm weights g scale the input columns of ``wqkv`` / ``w_gate_up``
(norm(x) * g @ W.T == norm(x) @ (W * g).T), and the attention scale 1/sqrt(hd) scales the q rows of ``wqkv`` and
``bqkv`` (RoPE is linear, so scaling q before it is exact up to float rounding).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero

from mindspore_eagle.models.checkpoints import LazyTensors
from mindspore_eagle.kernels.attention import (  # noqa: F401  (paged_attention re-exported)
    check_weight_dtype, make_backend, paged_attention)
from mindspore_eagle.kernels.dense import (  # noqa: F401  (re-exported: the portable forms of the layer math)
    WEIGHT_LEFT_ROWS,
    apply_rope,
    linear,
    rope_swap_index,
)

if TYPE_CHECKING:  # pragma: no cover
    from mindspore_eagle.models.model_config import ModelConfig


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """NeoX RoPE tables float32 [max_pos, head_dim]: ``cos`` and ``sin_signed`` (computed in float64).

    ``sin_signed`` carries the sign of HF's ``rotate_half`` (-sin on the first half, +sin on the second), so that
    ``x * cos + swap_halves(x) * sin_signed`` equals HF's ``x * cos + rotate_half(x) * sin`` (see apply_rope).
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    sign = np.concatenate([-np.ones(head_dim // 2), np.ones(head_dim // 2)])
    return np.cos(ang).astype(np.float32), (np.sin(ang) * sign).astype(np.float32)


class RMSNorm(nn.Cell):
    """y = x / sqrt(mean(x^2) + eps) * w, always computed in float32 (``ops.rms_norm`` is Ascend-only).

    x [..., dim] f32 / f16 / bf16 -> same shape and dtype: a half-precision x is cast to float32 first and the
    result cast back (MindFormers' ``layernorm_compute_type: float32``); float32 input takes no cast.
    ``weighted=False`` drops ``* w`` (no Parameter): for norms whose weight is folded into the next matmul (see
    the module docstring). The weight stays float32.
    """

    def __init__(self, dim: int, eps: float, weighted: bool = True):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight") if weighted else None
        self.eps = eps

    def construct(self, x):
        dt = x.dtype
        if dt != ms.float32:
            x = x.astype(ms.float32)
        var = ops.mean(x * x, -1, keep_dims=True)
        y = x * ops.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if dt != ms.float32:
            y = y.astype(dt)
        return y


COMPUTE_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
"""``model.dtype`` names -> MindSpore dtypes of weights, matmuls, residual stream and KV cache."""


def zeros_param(shape, dtype, name: str) -> Parameter:
    """A zero Parameter of ``shape`` in ``dtype``, allocated only when used before ``load_hf_weights`` sets its data
    (MindSpore's lazy initialiser), so a model being loaded never holds its weights twice (docs/models.md, "Memory")."""
    return Parameter(Tensor(shape=tuple(shape), dtype=dtype, init=Zero()), name=name)


class DecoderLayer(nn.Cell):
    """Pre-norm block: GQA self-attention over the paged cache (optional bias on qkv and on o) and the SwiGLU MLP
    (gate and up fused into one [2F, H] weight); both norm weights live folded in the next matmul
    (``load_hf_weights``).

    construct(x [k, H] residual stream, h [k, H] = rms(x) unweighted, cos, sin, meta) -> (x', rms(x')): each
    residual add is fused with the norm that follows it, so a layer hands the next one its normed input. The
    backend does the math (``attention.py``, ``decoder_layer``): the attention block (which writes the cache), then
    the MLP block (one kernel call for both on the cpu backend).
    """

    def __init__(self, cfg: ModelConfig, backend, layer: int, dtype=ms.float32, weight_dtype=None):
        super().__init__()
        self.backend = backend
        self.eps = cfg.rms_norm_eps
        nh, nkv, hd, H, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        qkv_out = (nh + 2 * nkv) * hd
        wdt = dtype if weight_dtype is None else weight_dtype       # the matrices; biases in the compute dtype
        mat = backend.matrix_shape                  # [out, in], or the CPU kernels' packed layout
        self.wqkv = zeros_param(mat(qkv_out, H), wdt, "wqkv")
        self.bqkv = zeros_param((qkv_out,), dtype, "bqkv") if cfg.qkv_bias else None
        self.wo = zeros_param(mat(H, nh * hd), wdt, "wo")
        self.bo = zeros_param((H,), dtype, "bo") if cfg.o_bias else None
        self.w_gate_up = zeros_param(mat(2 * F, H), wdt, "w_gate_up")
        self.w_down = zeros_param(mat(H, F), wdt, "w_down")
        self.key_cache = backend.make_cache(f"key_cache_{layer}")
        self.value_cache = backend.make_cache(f"value_cache_{layer}")

    def stack_args(self) -> tuple:
        """(wqkv, wo, [bqkv, [bo,]] w_gate_up, w_down, key_cache, value_cache): this layer's part of a
        ``decoder_stack`` call (``attention.CpuBackend.decoder_stack``)."""
        biases = () if self.bqkv is None else ((self.bqkv,) if self.bo is None else (self.bqkv, self.bo))
        return (self.wqkv, self.wo) + biases + (self.w_gate_up, self.w_down, self.key_cache, self.value_cache)

    def construct(self, x, h, cos, sin, meta):
        return self.backend.decoder_layer(x, h, self.wqkv, self.bqkv, self.wo, self.bo, self.w_gate_up, self.w_down,
                                          cos, sin, self.key_cache, self.value_cache, meta, self.eps)


class LlamaModel(nn.Cell):
    """The teacher network with its KV cache Parameters (see the module docstring for the call contract).

    Args:
        cfg: model configuration (models/model_config.py).
        num_blocks: KV blocks in the pool (the pad block is added on top).
        block_size: tokens per block.
        max_seq_len: RoPE table length; positions must be < max_seq_len.
        dtype: compute dtype (``COMPUTE_DTYPES``: mindspore float32, float16 or bfloat16) of the weights, the
            matmuls, the residual stream and the KV cache. RMSNorm, RoPE, the softmax and the returned logits /
            features are float32 whatever ``dtype`` (MindFormers' layernorm_compute_type / rotary_dtype /
            softmax_compute_type). In half precision the lm_head matmul runs in float32 (the final-normed rows and
            the head weight upcast per call): float16 logits tie too often for greedy decoding to be reproducible
            across call shapes. float32 adds no cast anywhere.
        attention: the backend of the layer math, cache write / read and attention (``attention.py``): auto
            (fused kernels on Ascend in half precision, the CPU kernels on CPU in float32 when they build, else
            portable), portable, fused, cpu, or a built backend Cell.
            The fused backend's PagedAttention gets ``scale_value`` 1.0: the q weights carry 1/sqrt(hd).
        weight_dtype: storage dtype of the matrices (q/k/v, o, gate/up, down, the head); None = ``dtype``.
            float16 under float32 compute on the cpu backend (``attention.CpuBackend``): each matrix is rounded
            once to float16 and the kernels widen it exactly as they read it, so a decode reads half the bytes and
            computes in float32; the embedding stays in ``dtype`` (rows are gathered, not streamed; the drafter
            shares it), and a tied head gets its own float16 copy.
    Raises:
        ValueError: a ``weight_dtype`` the backend cannot hold (``attention.check_weight_dtype``).
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, max_seq_len: int, dtype=ms.float32,
                 attention="auto", weight_dtype=None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.weight_dtype = dtype if weight_dtype is None else weight_dtype
        self.backend = make_backend(attention, num_blocks, block_size, cfg.num_kv_heads, cfg.num_heads,
                                    cfg.head_dim, dtype, 1.0)
        check_weight_dtype(self.backend, self.weight_dtype, dtype)
        self.eps = cfg.rms_norm_eps
        V, H = cfg.vocab_size, cfg.hidden_size
        # a tied head is the embedding itself, held in the head's layout (packed for the CPU kernels; its rows
        # gathered from that layout, backend.embed_rows), unless the head is stored in another dtype (its own copy)
        own_head = not cfg.tie_word_embeddings or self.weight_dtype != dtype
        self.embed = zeros_param((V, H) if own_head else self.backend.matrix_shape(V, H), dtype, "embed")
        self.layers = nn.CellList([DecoderLayer(cfg, self.backend, i, dtype, self.weight_dtype)
                                   for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = zeros_param(self.backend.matrix_shape(V, H), self.weight_dtype, "lm_head") if own_head \
            else None
        cos, sin = rope_tables(cfg.head_dim, max_seq_len, cfg.rope_theta)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        self.aux_layers = tuple(int(i) for i in cfg.aux_layers)
        self.weights_version = 0        # bumped by every load: host views of the Parameters (llama_host.py) renew
        # all layers in one kernel call where the backend has one (the cpu backend: ``CpuBackend.decoder_stack``)
        biases = int(cfg.qkv_bias) + int(cfg.o_bias)
        self.stack = self.stack_spec = None
        self.kernel_norm = hasattr(self.backend, "stack_kernel")      # the final norm by the cpu backend's kernel
        if hasattr(self.backend, "stack_kernel") and (cfg.o_bias <= cfg.qkv_bias):
            self.stack = self.backend.stack_kernel(10 + cfg.num_layers * (6 + biases))
            self.stack_spec = Tensor(np.array([cfg.num_heads, cfg.num_kv_heads, biases, cfg.num_layers,
                                               *self.aux_layers], np.int32))

    def head_weight(self):
        return self.embed if self.lm_head is None else self.lm_head

    def construct(self, tokens, positions, slots, block_table, mask, out_rows):
        x, hn, aux = self._trunk(tokens, positions, slots, block_table, mask)
        return self._logits(self._normed(x, hn, out_rows)), self._f32(aux)

    def hidden(self, tokens, positions, slots, block_table, mask, out_rows):
        """Like ``construct`` but returns the final-normed hidden rows f32 [m, H] instead of logits [m, V]."""
        x, hn, aux = self._trunk(tokens, positions, slots, block_table, mask)
        return self._f32(self._normed(x, hn, out_rows)), self._f32(aux)

    def logits_hidden(self, tokens, positions, slots, block_table, mask, out_rows):
        """``construct`` plus the final-normed hidden states of every row (regeneration that writes training
        features as it decodes, train/regen.py).

        Returns:
            (logits f32 [m, V] of ``out_rows``, computed exactly as ``construct`` computes them, hidden f32 [k, H]
            of all k rows, aux f32 [k, 3H]).
        """
        x, hn, aux = self._trunk(tokens, positions, slots, block_table, mask)
        logits = self._logits(self._normed(x, hn, out_rows))
        return logits, self._f32(self._normed(x, hn, None)), self._f32(aux)

    def _normed(self, x, hn, rows):
        """The final norm of the rows ``rows`` int32 [m] (all k rows when None) of x [k, H]: from the stack's
        rms(x) ``hn`` [k, H] times the norm weight when the trunk ran as one DecoderStack call (the host calls of
        ``models/llama_host.py`` compute exactly this; on the cpu backend a layer-by-layer trunk takes the same
        norm kernel, so both trunks give the same logits bit for bit), else :class:`RMSNorm`."""
        if hn is not None:
            return (hn if rows is None else ops.gather(hn, rows, 0)) * self.norm.weight
        y = x if rows is None else ops.gather(x, rows, 0)
        if self.kernel_norm:                   # the layer-by-layer trunk on the cpu backend: the same norm kernel
            return self.backend.norm(y, self.eps) * self.norm.weight
        return self.norm(y)

    def _f32(self, t):
        """``t`` in float32 (no cast op when the compute dtype is float32)."""
        return t if self.dtype == ms.float32 else t.astype(ms.float32)

    def _logits(self, h):
        """Logits f32 [m, V] of final-normed rows h [m, H] (compute dtype)."""
        if self.dtype == ms.float32:
            return self.backend.linear(h, self.head_weight())
        # half precision: the head runs in float32 (hidden rows and head weight upcast), so logits keep float32
        # resolution: float16 logits are quantised to 1/64 near 20 and tie often, and a tie is decided by rounding
        # noise from upstream (docs/ascend.md, "Measured: float16 against float32")
        return linear(h.astype(ms.float32), self.head_weight().astype(ms.float32))

    def _stacked(self, tokens) -> bool:
        """True when this call's layers take the one-call stack: the layer kernels take its rows on these
        matrices (``CpuBackend._fused``; always for the packed matrices of every teacher here)."""
        l0 = self.layers[0]
        return self.backend._fused(tokens, l0.wqkv, l0.wo, l0.w_gate_up, l0.w_down)

    def stacked_rows(self, rows: int) -> bool:
        """:meth:`_stacked` for a call of ``rows`` query rows, on the host (no tensor needed)."""
        return self.stack is not None and self._stacked(np.empty((rows, 0), np.int32))

    def _trunk(self, tokens, positions, slots, block_table, mask):
        """(x, hn, aux): the residual stream after the last layer [k, H] (before the final norm), its unweighted
        rms [k, H] when the trunk ran as one DecoderStack call (else None), the captured features [k, 3H]; in the
        compute dtype."""
        if self.stack is not None and self._stacked(tokens):
            weights = ()
            for layer in self.layers:
                weights = weights + layer.stack_args()
            return self.backend.decoder_stack(self.stack, self.stack_spec, tokens, positions, slots, block_table, mask,
                                              self.embed, self.cos, self.sin, self.eps, weights)
        x = self.backend.embed_rows(self.embed, tokens)
        cos, sin = self.backend.rope_rows(ops.gather(self.cos, positions, 0), ops.gather(self.sin, positions, 0))
        meta = self.backend.prepare(slots, block_table, mask)
        h = self.backend.norm(x, self.eps)
        inputs = ()                                    # residual stream entering each layer
        for layer in self.layers:
            inputs = inputs + (x,)
            x, h = layer(x, h, cos, sin, meta)
        a0, a1, a2 = self.aux_layers
        aux = ops.concat((inputs[a0], inputs[a1], inputs[a2]), -1)
        return x, None, aux

    # ------------------------------------------------------------------ weights
    def load_hf_weights(self, tensors) -> None:
        """Take HF-named float32 numpy tensors (a dict, or a ``checkpoints.LazyTensors`` read one tensor at a time)
        into the fused Parameters, folding the per-layer norm weights and the attention scale into ``wqkv`` /
        ``bqkv`` / ``w_gate_up`` (module docstring). The model holds one copy of its weights: a dict's arrays are
        copied (the caller keeps them), a LazyTensors' arrays and every fused matrix are taken over.

        Folding is done in float32; each fused matrix is then rounded once to the compute dtype (norm weights stay
        float32).
        Raises:
            ValueError: a tensor is missing or its shape differs from the config (names the tensor, both shapes).
        """
        cfg, dt = self.cfg, self.dtype
        self.weights_version += 1
        # A Parameter takes over (Tensor.from_numpy) an array made here or handed out by a LazyTensors (each read
        # a new array), never one the caller keeps, so the weights are held once: T / W take a new array (a fused
        # matrix, a rounding), Tin / Win one of ``tensors``.
        T = Tensor.from_numpy if dt == ms.float32 else (lambda arr: ms.Tensor(arr, dt))   # one rounding to dt
        fresh = isinstance(tensors, LazyTensors)
        Tin = (lambda arr: Tensor.from_numpy(arr if fresh else np.array(arr, np.float32))) if dt == ms.float32 else T
        pack = self.backend.pack      # the backend's matrix layout: in place for an array made here or handed out
        W = lambda arr: T(pack(arr, True))            # noqa: E731  (arr made here: fused matrices)
        packs = lambda arr: self.backend.matrix_shape(*arr.shape) != arr.shape    # noqa: E731
        # arr of ``tensors``: packed in place when fresh, into a new array when the caller keeps it, else as before
        Win = lambda arr: T(pack(arr, fresh)) if packs(arr) else Tin(arr)         # noqa: E731
        if self.weight_dtype != dt:   # half matrices: rounded once and laid out in one pass, into a new array
            W = Win = lambda arr: Tensor.from_numpy(self.backend.half_matrix(arr))   # noqa: E731

        def get(name, shape):
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name}")
            arr = np.asarray(tensors[name], dtype=np.float32)
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"tensor {name} has shape {tuple(arr.shape)}, config expects {tuple(shape)}")
            return arr

        stacked = lambda parts, g: _stacked(tensors, get, parts, g)     # noqa: E731

        H, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        qo, kvo = cfg.num_heads * hd, cfg.num_kv_heads * hd
        embed = get("model.embed_tokens.weight", (cfg.vocab_size, H))
        self.embed.set_data(Tin(embed) if self.lm_head is not None else Win(embed))   # tied: the head's layout
        self.norm.weight.set_data(ms.Tensor(get("model.norm.weight", (H,))))
        if self.lm_head is not None:
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            self.lm_head.set_data(Win(get(head, (cfg.vocab_size, H))))
        scale = np.float32(1.0 / np.sqrt(hd))           # softmax(q k^T / sqrt(hd)): folded into q
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer
            g_in = get(p + "input_layernorm.weight", (H,))
            g_post = get(p + "post_attention_layernorm.weight", (H,))
            a.wqkv.set_data(W(stacked([(p + "self_attn.q_proj.weight", (qo, H), scale),
                                       (p + "self_attn.k_proj.weight", (kvo, H), None),
                                       (p + "self_attn.v_proj.weight", (kvo, H), None)], g_in)))
            if a.bqkv is not None:
                a.bqkv.set_data(T(np.concatenate([get(p + "self_attn.q_proj.bias", (qo,)) * scale,
                                                       get(p + "self_attn.k_proj.bias", (kvo,)),
                                                       get(p + "self_attn.v_proj.bias", (kvo,))], 0)))
            a.wo.set_data(Win(get(p + "self_attn.o_proj.weight", (H, qo))))
            if a.bo is not None:
                a.bo.set_data(Tin(get(p + "self_attn.o_proj.bias", (H,))))
            layer.w_gate_up.set_data(W(stacked([(p + "mlp.gate_proj.weight", (F, H), None),
                                                (p + "mlp.up_proj.weight", (F, H), None)], g_post)))
            layer.w_down.set_data(Win(get(p + "mlp.down_proj.weight", (H, F))))

    def caches(self) -> list:
        """[(key_cache, value_cache)] per layer: the Parameters the cache manager compacts on commit."""
        return [(layer.key_cache, layer.value_cache) for layer in self.layers]


def _stacked(tensors, get, parts, g) -> np.ndarray:
    """``concat([get(name, shape) (* scale) for name, shape, scale in parts], 0) * g`` as one new float32 matrix,
    with the same float operations (so the same bits), each tensor of a ``LazyTensors`` read straight into its rows
    (no temporaries: a repeat load of the 0.5B teacher reads 2.5 GB once instead of allocating it ~3 times).
    ``get(name, shape)`` reads and checks a tensor (raises ValueError on a missing name or another shape)."""
    out = np.empty((sum(shape[0] for _, shape, _ in parts), parts[0][1][1]), np.float32)
    r = 0
    for name, shape, sc in parts:
        rows = out[r:r + shape[0]]
        if isinstance(tensors, LazyTensors) and name in tensors and tensors.shape(name) == tuple(shape):
            tensors.into(name, rows)
        else:
            rows[...] = get(name, shape)
        if sc is not None:
            rows *= sc
        r += shape[0]
    out *= g
    return out


class KVCompactor(nn.Cell):
    """Move K/V slots inside paged caches: gather every source slot into a temporary, then write it at dst.

    construct(src [P] i32, dst [P] i32) slots -> a dummy (the caches update in place). Each slot is moved for every
    KV head: on the cpu backend by one kernel call for all layers (``backend.move_all``), elsewhere layer by layer
    through ``backend.move`` (portable: row gather + ScatterUpdate; fused: gather + ReshapeAndCache). Reading
    every source before writing makes overlapping source / destination ranges safe (docs/design.md, "Commit").

    Args:
        caches: [(key_cache, value_cache)] per layer; backend: the caches' attention backend (``attention.py``).
    """

    def __init__(self, caches: list, backend):
        super().__init__()
        self.keys = ms.ParameterTuple([k for k, _ in caches])
        self.values = ms.ParameterTuple([v for _, v in caches])
        self.backend = backend
        self.mover = backend.move_kernel(2 * len(caches)) if hasattr(backend, "move_kernel") else None

    def construct(self, src, dst):
        if self.mover is not None:
            return self.backend.move_all(self.mover, self.keys, self.values, src, dst)
        outs = ()
        for kc, vc in zip(self.keys, self.values):
            outs = outs + self.backend.move(kc, vc, src, dst)
        return outs[0].reshape(-1)[0]
