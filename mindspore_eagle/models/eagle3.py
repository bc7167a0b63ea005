"""EAGLE-3 drafter Cell, its config, and the SpecForge / EAGLE-3 checkpoint format.

Legend: k = query rows, K = top_k, H = drafter hidden, Ht = teacher hidden, Vd = draft vocab, V = teacher
vocab, S = drafter cache slots of one sequence, nh / n_kv / hd = heads / KV heads / head dim.

Architecture (docs/design.md, "Drafter architecture"; reference E ``eagle/model/cnets.py``, SF
``specforge/modeling/draft/llama3_eagle.py``):
- ``fc``: Linear(3 Ht -> H), no bias, fuses the three captured teacher hidden states (low, mid, high).
- one decoder layer ("midlayer") whose attention input is ``concat(input_layernorm(embed(token)),
  hidden_norm(feature))`` (2H wide, embedding first); residual = feature; Llama GQA attention, SiLU MLP.
- ``norm`` then ``lm_head`` (H -> Vd); logits index draft ids; ``d2t`` int64 [Vd] holds **offsets**:
  ``target_id = draft_id + d2t[draft_id]`` (the identity is zeros: docs/design.md, "Vocabulary map").
- the token embedding is the teacher's (shared, never saved); RoPE theta from the *drafter* config (10000
  when absent).
- optional later decoder layers (``num_hidden_layers`` > 1; vLLM ``llama_eagle3.py``: layer 0 takes the 2H
  concat, layers 1.. are plain Llama pre-norm layers over the H-wide residual stream, keys ``layers.{i}.*``).
- the output fed back as the next feature is the **pre-norm** output of the last layer.

Checkpoint (directory): ``config.json`` + ``model.safetensors`` with keys ``fc.weight [H, 3Ht]``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``, ``norm.weight``,
``lm_head.weight [Vd, H]``, ``d2t [Vd] int64``, ``t2d [V] bool``; per later layer i >= 1
``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (q/k/v input H), ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindspore_eagle.errors import MsEagleError
from mindspore_eagle.kernels.attention import CPU_LINEAR_MAX_ROWS, check_weight_dtype, make_backend
from mindspore_eagle.kernels.dense import rms_norm
from mindspore_eagle.models.llama import (
    RMSNorm,
    apply_rope,
    rope_swap_index,
    rope_tables,
)


class DrafterCheckpointError(MsEagleError, ValueError):
    """A drafter checkpoint is missing, malformed, or does not fit the teacher."""


# config.json fields of SpecForge / vLLM / SGLang drafters that change the function (docs/design.md, "Drafter
# architecture"): field -> (the values that need code this module does not have, what they mean)
UNSUPPORTED = {
    "rope_scaling": (lambda v: v is not None, "scaled RoPE in the drafter"),
    "norm_output": (lambda v: v is False, "logits from the un-normed hidden state"),
    "norm_before_residual": (lambda v: bool(v), "residual taken after hidden_norm"),
    "bias": (lambda v: bool(v), "biases in fc / the projections"),
}


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters, in SpecForge ``config.json`` field names where they exist.

    Attributes:
        hidden_size: H (must equal the teacher's hidden size: the embedding is shared).
        target_hidden_size: Ht of the teacher whose 3 layers are fused by ``fc``.
        aux_layers: teacher layers whose *inputs* are captured (docs/design.md, "Captured features": inputs, not
        outputs). draft_vocab_size: Vd; vocab_size: V (teacher vocabulary).
        num_hidden_layers: decoder layers (1 = the EAGLE-3 drafter; more = vLLM's multi-layer layout above).
        fc_norm: one RMSNorm per captured layer (weights ``fc_norm.{0,1,2}.weight`` [Ht]) on the three chunks of
        the features before ``fc`` (SF ``project_hidden_states``, config field ``fc_norm``; off in EAGLE-3).
    Raises:
        DrafterCheckpointError: num_hidden_layers < 1.
    """
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    aux_layers: tuple = ()
    num_hidden_layers: int = 1
    fc_norm: bool = False

    def __post_init__(self):
        if int(self.num_hidden_layers) < 1:
            raise DrafterCheckpointError(f"drafter num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        self.num_hidden_layers = int(self.num_hidden_layers)
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        self.fc_norm = bool(self.fc_norm)

    def to_json(self) -> dict:
        """config.json content in the SpecForge / EAGLE-3 layout."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": self.num_hidden_layers, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": "float16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layers]},
        } | ({"fc_norm": True} if self.fc_norm else {})

    @classmethod
    def from_json(cls, d: dict) -> "DrafterConfig":
        """Read a SpecForge / EAGLE-3 config.json (aux ids there are layer *outputs*: +1 gives our inputs).

        Raises:
            DrafterCheckpointError: a missing field, or a field that changes the drafter's function in a way this
                implementation does not compute (``UNSUPPORTED``: loading it anyway would draft from another
                function without any error).
        """
        for name, (is_set, what) in UNSUPPORTED.items():
            if name in d and is_set(d[name]):
                raise DrafterCheckpointError(f"drafter config.json sets {name} = {d[name]!r} ({what}); "
                                             "this drafter implementation does not support it")
        try:
            aux = d.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
            return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                       num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
                       vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size", d["vocab_size"]),
                       target_hidden_size=d.get("target_hidden_size", d["hidden_size"]),
                       head_dim=d.get("head_dim") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-5),
                       rope_theta=d.get("rope_theta", 10000.0),
                       max_position_embeddings=d.get("max_position_embeddings", 2048),
                       aux_layers=tuple(i + 1 for i in aux) if aux else (),
                       num_hidden_layers=d.get("num_hidden_layers", 1), fc_norm=bool(d.get("fc_norm", False)))
        except KeyError as e:
            raise DrafterCheckpointError(f"drafter config.json is missing field {e.args[0]!r}") from None


def drafter_tensor_shapes(cfg: DrafterConfig) -> dict:
    """Expected SpecForge key -> shape for ``cfg`` (t2d / d2t included; later layers ``layers.{i}.*``; with
    ``cfg.fc_norm`` the three ``fc_norm.{c}.weight`` [Ht], last)."""
    H, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qo, kvo = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    later = {}
    for i in range(1, cfg.num_hidden_layers):
        p = f"layers.{i}."
        later.update({
            p + "self_attn.q_proj.weight": (qo, H), p + "self_attn.k_proj.weight": (kvo, H),
            p + "self_attn.v_proj.weight": (kvo, H), p + "self_attn.o_proj.weight": (H, qo),
            p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
    return {
        "fc.weight": (H, 3 * cfg.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (qo, 2 * H), "midlayer.self_attn.k_proj.weight": (kvo, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kvo, 2 * H), "midlayer.self_attn.o_proj.weight": (H, qo),
        "midlayer.mlp.gate_proj.weight": (F, H), "midlayer.mlp.up_proj.weight": (F, H),
        "midlayer.mlp.down_proj.weight": (H, F),
        "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,), "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H), "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
    } | later | ({f"fc_norm.{c}.weight": (cfg.target_hidden_size,) for c in range(3)} if cfg.fc_norm else {})


def init_drafter_tensors(cfg: DrafterConfig, seed: int = 0, used_ids: np.ndarray | None = None) -> dict:
    """Randomly initialised drafter tensors (normal std 0.02, norms 1), SpecForge keys.

    ``used_ids`` (sorted int [Vd]) defines the draft vocabulary; default the first Vd teacher ids. The output
    projections (o_proj, down_proj) of layers 1.. start at zero, so each later layer starts as the identity on the
    residual stream (a drafter grown from a 1-layer checkpoint starts as that checkpoint; zero-init residual
    branches as in Goyal et al. 2017, "Accurate, Large Minibatch SGD"). Layer 0's tensors do not depend on
    ``num_hidden_layers``.
    """
    rng = np.random.default_rng(seed)
    out = {}
    shapes = drafter_tensor_shapes(cfg)
    for key, shape in shapes.items():                      # layer 0's keys first: its draws match a 1-layer config
        if key in ("d2t", "t2d"):
            continue
        if key.endswith("norm.weight") or key.startswith("fc_norm."):
            out[key] = np.ones(shape, np.float32)
        elif key.startswith("layers.") and key.endswith(("o_proj.weight", "down_proj.weight")):
            out[key] = np.zeros(shape, np.float32)
        else:
            out[key] = (rng.normal(size=shape) * 0.02).astype(np.float32)
    used = np.arange(cfg.draft_vocab_size) if used_ids is None else np.asarray(used_ids, np.int64)
    out.update(vocab_maps(used, cfg.vocab_size))
    return out


def vocab_maps(used_ids: np.ndarray, vocab_size: int) -> dict:
    """``d2t`` offsets int64 [Vd] and ``t2d`` bool [V] from the sorted draft vocabulary.

    See docs/design.md, "Vocabulary map"."""
    used = np.asarray(used_ids, np.int64)
    if np.any(np.diff(used) <= 0) or used[0] < 0 or used[-1] >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be sorted, distinct, in [0, {vocab_size})")
    t2d = np.zeros(vocab_size, bool)
    t2d[used] = True
    return {"d2t": used - np.arange(len(used)), "t2d": t2d}


def save_drafter(path: str, cfg: DrafterConfig, tensors: dict, dtype=np.float16) -> None:
    """Write ``config.json`` + ``model.safetensors`` (float weights as ``dtype``; d2t int64, t2d bool)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_json(), f, indent=2)
    out = {k: (np.ascontiguousarray(v.astype(dtype)) if v.dtype.kind == "f" else np.ascontiguousarray(v))
           for k, v in tensors.items() if k != "embed_tokens.weight"}
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def load_drafter(path: str) -> tuple[DrafterConfig, dict]:
    """Read a drafter directory; float tensors come back as float32.

    Raises:
        DrafterCheckpointError: missing files, pickle checkpoints, missing tensors or wrong shapes (named), an
            unsupported config field (:meth:`DrafterConfig.from_json`), or a bias / ``fc_norm`` tensor that the
            config does not use.
    """
    from safetensors.numpy import load_file

    cfg_path, st_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not os.path.isdir(path) or not os.path.exists(cfg_path):
        raise DrafterCheckpointError(f"drafter checkpoint {path!r}: no config.json there")
    if not os.path.exists(st_path):
        pickles = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = f" (found pickle file {pickles[0]}: convert it to safetensors; pickle is refused)" if pickles else ""
        raise DrafterCheckpointError(f"drafter checkpoint {path!r}: no model.safetensors{hint}")
    with open(cfg_path) as f:
        cfg = DrafterConfig.from_json(json.load(f))
    try:
        raw = load_file(st_path)
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise DrafterCheckpointError(f"drafter checkpoint {st_path!r} is unreadable: {e}") from None
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in raw.items()}
    extra = sorted(k for k in tensors if k.endswith(".bias") or (k.startswith("fc_norm.") and not cfg.fc_norm))
    if extra:
        raise DrafterCheckpointError(f"drafter checkpoint has tensor {extra[0]}, which its config.json does not "
                                     "use (" + ("no fc_norm" if extra[0].startswith("fc_norm.") else "no biases")
                                     + "); refusing to load it as another function")
    if "d2t" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:
        tensors.update(vocab_maps(np.arange(cfg.vocab_size), cfg.vocab_size))
    for key, shape in drafter_tensor_shapes(cfg).items():
        if key not in tensors:
            raise DrafterCheckpointError(f"drafter checkpoint is missing tensor {key}")
        if tuple(tensors[key].shape) != tuple(shape):
            raise DrafterCheckpointError(f"drafter tensor {key} has shape {tuple(tensors[key].shape)}, "
                                         f"config expects {tuple(shape)}")
    out = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in tensors.items()}
    out["d2t"] = out["d2t"].astype(np.int64)
    out["t2d"] = out["t2d"].astype(bool)
    return cfg, out


def load_fused_weights(cell, t: dict) -> None:
    """Set a drafter Cell's fused Parameters from SpecForge-keyed tensors (any float dtype -> float32).

    The one place that knows the fused layout shared by :class:`Eagle3Drafter` (inference) and
    ``train.ttt.TTTDrafter`` (training): ``wqkv`` = concat(q, k, v) rows, ``w_gate_up`` = concat(gate, up) rows,
    HF [out, in] layout; ``cell`` needs Parameters fc, wqkv, wo, w_gate_up, w_down, lm_head, RMSNorm Cells
    hidden_norm, input_layernorm, post_attention_layernorm, norm, and ``blocks`` (:class:`DraftBlock` per layer
    1..). Raises KeyError naming a missing tensor.
    """
    f32 = lambda name: np.asarray(t[name], np.float32)
    dt = cell.fc.dtype                                    # the matrices' compute dtype; norm weights stay float32
    T = Tensor if dt == ms.float32 else (lambda arr: Tensor(arr, dt))

    def layer(c, p):
        c.wqkv.set_data(T(np.concatenate([f32(p + "self_attn.q_proj.weight"), f32(p + "self_attn.k_proj.weight"),
                                          f32(p + "self_attn.v_proj.weight")], 0)))
        c.wo.set_data(T(f32(p + "self_attn.o_proj.weight")))
        c.w_gate_up.set_data(T(np.concatenate([f32(p + "mlp.gate_proj.weight"), f32(p + "mlp.up_proj.weight")], 0)))
        c.w_down.set_data(T(f32(p + "mlp.down_proj.weight")))
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(c, name).weight.set_data(Tensor(f32(p + name + ".weight")))

    cell.fc.set_data(T(f32("fc.weight")))
    if getattr(cell, "fc_norm", None) is not None:
        cell.fc_norm.set_data(Tensor(np.concatenate([f32(f"fc_norm.{c}.weight") for c in range(3)])))
    layer(cell, "midlayer.")
    cell.hidden_norm.weight.set_data(Tensor(f32("midlayer.hidden_norm.weight")))
    for i, block in enumerate(cell.blocks, 1):
        layer(block, f"layers.{i}.")
    cell.norm.weight.set_data(Tensor(f32("norm.weight")))
    cell.lm_head.set_data(T(f32("lm_head.weight")))


def export_fused_weights(cell) -> dict:
    """Inverse of :func:`load_fused_weights` for the trained tensors: SpecForge-keyed float32 numpy arrays (no
    embedding, no d2t / t2d)."""
    nq, nk, F = cell.nh * cell.hd, cell.nkv * cell.hd, cell.ffn

    def layer(c, p):
        qkv, gu = c.wqkv.asnumpy().astype(np.float32), c.w_gate_up.asnumpy().astype(np.float32)
        return {p + "self_attn.q_proj.weight": qkv[:nq], p + "self_attn.k_proj.weight": qkv[nq:nq + nk],
                p + "self_attn.v_proj.weight": qkv[nq + nk:], p + "self_attn.o_proj.weight": c.wo.asnumpy(),
                p + "mlp.gate_proj.weight": gu[:F], p + "mlp.up_proj.weight": gu[F:],
                p + "mlp.down_proj.weight": c.w_down.asnumpy(),
                p + "input_layernorm.weight": c.input_layernorm.weight.asnumpy(),
                p + "post_attention_layernorm.weight": c.post_attention_layernorm.weight.asnumpy()}

    out = {"fc.weight": cell.fc.asnumpy(), "midlayer.hidden_norm.weight": cell.hidden_norm.weight.asnumpy(),
           "norm.weight": cell.norm.weight.asnumpy(), "lm_head.weight": cell.lm_head.asnumpy()}
    out.update(layer(cell, "midlayer."))
    for i, block in enumerate(cell.blocks, 1):
        out.update(layer(block, f"layers.{i}."))
    if getattr(cell, "fc_norm", None) is not None:
        out.update({f"fc_norm.{c}.weight": g for c, g in enumerate(np.split(cell.fc_norm.asnumpy(), 3))})
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def _zeros(shape, dtype) -> Tensor:
    """A zero Tensor of ``shape`` in ``dtype`` (float16 storage for half dtypes)."""
    if dtype == ms.float32:
        return Tensor(np.zeros(shape, np.float32))
    return Tensor(np.zeros(shape, np.float16), dtype)


def _declare_layer(cell, cfg: DrafterConfig, dtype, in_width: int) -> None:
    """Zero Parameters of one decoder layer on ``cell``: ``wqkv`` [(nh + 2 n_kv) hd, in_width], ``wo`` [H, nh hd],
    ``w_gate_up`` [2F, H], ``w_down`` [H, F] in ``dtype`` (float16 storage for half dtypes), RMSNorms
    ``input_layernorm`` / ``post_attention_layernorm`` (float32)."""
    H, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    z = lambda *s: _zeros(s, dtype)  # noqa: E731
    cell.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
    cell.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
    cell.wqkv = Parameter(z((nh + 2 * nkv) * hd, in_width), name="wqkv")
    cell.wo = Parameter(z(H, nh * hd), name="wo")
    cell.w_gate_up = Parameter(z(2 * F, H), name="w_gate_up")
    cell.w_down = Parameter(z(H, F), name="w_down")


def declare_drafter_weights(cell, cfg: DrafterConfig, dtype, backend=None) -> None:
    """The drafter's zero Parameters on ``cell``, shared by :class:`Eagle3Drafter` and ``train.ttt.TTTDrafter``
    (the layout :func:`load_fused_weights` fills): ``fc`` [H, 3Ht], ``fc_norm`` float32 [3Ht] (the three
    chunks' RMSNorm weights end to end; None without ``cfg.fc_norm``), layer 0 (:func:`_declare_layer`, input 2H)
    with ``hidden_norm``, final ``norm``, ``lm_head`` [Vd, H], and ``blocks``, one :class:`DraftBlock` per
    layer 1.. (with a KV cache each when ``backend`` is given)."""
    H = cfg.hidden_size
    z = lambda *s: _zeros(s, dtype)  # noqa: E731
    cell.fc = Parameter(z(H, 3 * cfg.target_hidden_size), name="fc")
    cell.fc_norm = (Parameter(Tensor(np.ones(3 * cfg.target_hidden_size, np.float32)), name="fc_norm")
                    if cfg.fc_norm else None)
    _declare_layer(cell, cfg, dtype, 2 * H)
    cell.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
    cell.norm = RMSNorm(H, cfg.rms_norm_eps)
    cell.lm_head = Parameter(z(cfg.draft_vocab_size, H), name="lm_head")
    cell.blocks = nn.CellList([DraftBlock(cfg, dtype, i, backend) for i in range(1, cfg.num_hidden_layers)])


class DraftBlock(nn.Cell):
    """The weights of one drafter decoder layer after the first (plain Llama pre-norm layer over H;
    :func:`_declare_layer` with input H). With ``backend`` (inference) it also owns the layer's paged KV cache
    ``key_cache`` / ``value_cache`` (named ``draft_{key,value}_cache_{index}``). Holds no computation:
    :class:`Eagle3Drafter` and ``train.ttt.TTTDrafter`` run it with their own attention.
    """

    def __init__(self, cfg: DrafterConfig, dtype, index: int, backend=None):
        super().__init__()
        _declare_layer(self, cfg, dtype, cfg.hidden_size)
        if backend is not None:
            self.key_cache = backend.make_cache(f"draft_key_cache_{index}")
            self.value_cache = backend.make_cache(f"draft_value_cache_{index}")


class Eagle3Drafter(nn.Cell):
    """The drafter network with its own paged KV cache (accepted context + per-round tree scratch).

    Calls (fixed shapes; the engine jits them from outside):
        fuse(aux [k, 3Ht] f32) -> [k, H]                         (``fc``)
        construct(h [k, H], tokens [k] i32, positions [k] i32, slots [k] i32, block_table [S/B] i32,
                  mask [k, S] f32) -> (top_logp [k, K] f32, top_ids [k, K] i32 teacher ids, h_out [k, H])
        context(aux [k, 3Ht] f32, tokens, positions, slots, block_table, mask as above, pick [r] i32)
                  -> (top_logp [r, K], top_ids [r, K], h_out [r, H]) at the rows ``pick`` only
    With ``num_hidden_layers`` L > 1 every call runs the L layers in turn, each with its own cache (``blocks``);
    ``context`` is ``fuse`` + ``construct`` in one call with the head applied to the ``pick`` rows alone: a context
    pass needs the prediction of its last pair only (of each sequence's last pair when batched), and the 8192-row
    head is about half of a row's multiply-adds (docs/design.md, "Measurements behind the design: The drafter's context
    pass").
    ``top_logp`` are log-softmax values over the draft vocabulary in fp32 (docs/design.md, "Tree expansion"),
    ``top_ids`` already mapped to teacher ids through d2t. ``h`` / ``h_out`` are in the compute dtype.

    Compute dtype = the shared embedding's dtype (``model.dtype``): matmuls, residual and KV cache in it, the
    matrices too unless ``weight_dtype`` says otherwise; RMSNorm, RoPE, softmax and the logits in float32 (as the
    teacher, models/llama.py); float32 adds no cast.

    The layer math is the backend's, as in the teacher's decoder layer (``attention.py``: ``attention_block`` then
    ``mlp_add_norm``, one C++ kernel call each on the CPU backend), so the weights are held as the teacher holds
    its own (:func:`fold_drafter_tensors`): every RMSNorm weight folded into the columns of the matmul that
    follows it and 1/sqrt(hd) into the q rows; the norms themselves run unweighted.

    Args:
        cfg: drafter config; embed: the teacher's embedding Parameter [V, H] (shared, not copied; its dtype is
        the drafter's compute dtype);
        top_k: K; num_blocks / block_size / max_seq_len: the drafter cache geometry;
        attention: cache / attention backend (``attention.py``): auto | portable | fused | a built backend.
        weight_dtype: storage dtype of the matrices (fc, q/k/v, o, gate/up, down, lm_head); None = the compute
            dtype. float16 under float32 compute on the cpu backend: each folded matrix is rounded once to float16
            and the kernels widen it exactly as they read it (float32 arithmetic, half the bytes a draft call
            reads; the committed drafter is a float16 checkpoint).
    Raises:
        ValueError: a ``weight_dtype`` the backend cannot hold (``attention.check_weight_dtype``).
    """

    def __init__(self, cfg: DrafterConfig, embed: Parameter, top_k: int, num_blocks: int, block_size: int,
                 max_seq_len: int, attention="auto", weight_dtype=None):
        super().__init__()
        hd = cfg.head_dim
        self.cfg, self.top_k = cfg, top_k
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.group = self.nh // self.nkv
        dt = self.dtype = embed.dtype
        self.embed = embed
        self.d2t = Parameter(Tensor(np.zeros(cfg.draft_vocab_size, np.int32)), name="d2t", requires_grad=False)
        self.eps = cfg.rms_norm_eps
        # score factor 1: q carries 1/sqrt(hd) (fold_drafter_tensors), as the teacher's q does
        self.backend = make_backend(attention, num_blocks, block_size, self.nkv, self.nh, hd, dt, 1.0)
        self.weight_dtype = dt if weight_dtype is None else weight_dtype
        check_weight_dtype(self.backend, self.weight_dtype, dt)
        declare_drafter_weights(self, cfg, self.weight_dtype, self.backend)
        self.head_kernel = self.backend.head_kernel(top_k)        # the head, log-softmax and top-K in one call
        self.key_cache = self.backend.make_cache("draft_key_cache")
        self.value_cache = self.backend.make_cache("draft_value_cache")
        cos, sin = rope_tables(hd, max_seq_len, cfg.rope_theta)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        self.swap = rope_swap_index(hd)
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.weights_version = 0                                  # bumped by load_tensors (eagle3_host.py)

    def fuse(self, aux):
        """aux f32 [k, 3Ht] -> fc(aux) [k, H] in the compute dtype; with ``cfg.fc_norm`` each Ht-wide chunk is
        RMS-normed first (unweighted: the weights are folded into ``fc``'s columns, :func:`fold_drafter_tensors`)."""
        if self.cfg.fc_norm:                         # [k, 3Ht] -> [3k, Ht]: row 3i + c is chunk c of row i (float32)
            k, w = aux.shape
            aux = self.backend.norm(aux.reshape(3 * k, w // 3), self.eps).reshape(k, w)
        if aux.dtype != self.dtype:
            aux = aux.astype(self.dtype)
        return self.backend.linear(aux, self.fc)

    def construct(self, h, tokens, positions, slots, block_table, mask):
        h_out, h_normed = self._layer(h, tokens, positions, slots, block_table, mask)
        top_logp, top_ids = self._top(h_normed)
        return top_logp, top_ids, h_out

    def context(self, aux, tokens, positions, slots, block_table, mask, pick):
        h_out, h_normed = self._layer(self.fuse(aux), tokens, positions, slots, block_table, mask)
        top_logp, top_ids = self._top(ops.gather(h_normed, pick, 0))
        return top_logp, top_ids, ops.gather(h_out, pick, 0)

    def _layer(self, h, tokens, positions, slots, block_table, mask):
        """All decoder layers over k rows: each writes its K/V at ``slots``; returns (h_out [k, H] pre-norm,
        rms(h_out) [k, H] unweighted: the final norm's weight is folded into ``lm_head``)."""
        e = self.backend.embed_rows(self.embed, tokens)
        be, eps = self.backend, self.eps
        x = ops.concat((be.norm(e, eps), be.norm(h, eps)), -1)              # [k, 2H]; weights folded into wqkv
        cos, sin = be.rope_rows(ops.gather(self.cos, positions, 0), ops.gather(self.sin, positions, 0))
        meta = be.prepare(slots, block_table, mask)
        h, x = be.attention_block(h, x, self.wqkv, None, self.wo, None, cos, sin, self.key_cache, self.value_cache,
                                  meta, eps)
        h, x = be.mlp_add_norm(x, self.w_gate_up, self.w_down, h, eps)
        for block in self.blocks:
            h, x = be.attention_block(h, x, block.wqkv, None, block.wo, None, cos, sin, block.key_cache,
                                      block.value_cache, meta, eps)
            h, x = be.mlp_add_norm(x, block.w_gate_up, block.w_down, h, eps)
        return h, x

    def _top(self, h_normed):
        """rms(h_out) [r, H] -> (top_logp [r, K] f32 log-softmax over Vd, top_ids [r, K] i32 teacher ids via d2t)."""
        if self.head_kernel is not None and h_normed.shape[0] <= CPU_LINEAR_MAX_ROWS:
            return self.head_kernel(h_normed, self.lm_head, self.d2t)
        return self.backend.head_topk(h_normed, self.lm_head, self.d2t, self.top_k)

    def attention_probs(self, h, tokens, positions, block_table, mask):
        """Attention weights [k, S] (mean over heads) of the first layer for ``h``/``tokens`` against its cache.

        Read-only (writes nothing); used by the benchmark's draft-attention evidence (paper Figure 7).
        """
        k_len = h.shape[0]
        e = self.backend.embed_rows(self.embed, tokens)
        x = ops.concat((rms_norm(e, self.eps), rms_norm(h, self.eps)), -1)
        nq = self.nh * self.hd
        q = self.matmul_t(x, self.wqkv[:nq].astype(x.dtype))                     # carries 1/sqrt(hd)
        cos = ops.gather(self.cos, positions, 0).expand_dims(1)
        sin = ops.gather(self.sin, positions, 0).expand_dims(1)
        q = apply_rope(q.reshape(k_len, self.nh, self.hd), cos, sin, self.swap)
        keys = self.backend.read_keys(self.key_cache, block_table)                # [n_kv, S, hd]
        q = q.reshape(k_len, self.nkv, self.group, self.hd).transpose(1, 2, 0, 3).reshape(
            self.nkv, self.group * k_len, self.hd)
        scores = ops.bmm(q, keys.transpose(0, 2, 1)).astype(ms.float32)
        scores = scores.reshape(self.nkv, self.group, k_len, -1) + mask
        return ops.softmax(scores, -1).mean((0, 1))

    def load_tensors(self, t: dict) -> None:
        """Copy SpecForge-keyed float32 tensors into the fused Parameters, norms folded
        (:func:`fold_drafter_tensors`; shapes checked by load_drafter), and bump ``weights_version`` (host views of
        the Parameters, ``eagle3_host.HostDrafter``, are taken again)."""
        load_fused_weights(self, fold_drafter_tensors(self.cfg, t))
        self.d2t.set_data(Tensor(np.asarray(t["d2t"]).astype(np.int32)))
        self.weights_version += 1


def fold_drafter_tensors(cfg: DrafterConfig, t: dict) -> dict:
    """SpecForge-keyed drafter tensors with every RMSNorm weight folded into the matmul after it, and the score
    factor 1/sqrt(hd) into the q rows; the norm weights become ones.

    rms_w(x) @ W.T = rms(x) @ (W * w).T for a norm weight w over W's input columns, so the folded drafter computes
    the same function with unweighted norms (the teacher holds its weights the same way, models/llama.py
    ``load_hf_weights``). Folded: layer 0's q/k/v columns [:H] by ``input_layernorm`` (the embedding half) and [H:]
    by ``hidden_norm`` (the feature half), gate/up by ``post_attention_layernorm``; each later layer's q/k/v by its
    ``input_layernorm`` and gate/up by its ``post_attention_layernorm``; ``lm_head`` by the final ``norm``; with
    ``cfg.fc_norm`` the columns of ``fc`` by the three ``fc_norm.{c}.weight`` end to end.
    Returns a new dict (float32 arrays; d2t / t2d and anything else passed through). Raises KeyError naming a
    missing tensor.
    """
    f32 = lambda name: np.asarray(t[name], np.float32)      # noqa: E731
    H, scale = cfg.hidden_size, 1.0 / float(np.sqrt(cfg.head_dim))
    out = dict(t)

    def fold_layer(p, in_weight):
        for name in ("q_proj", "k_proj", "v_proj"):
            w = f32(p + f"self_attn.{name}.weight") * in_weight
            out[p + f"self_attn.{name}.weight"] = w * scale if name == "q_proj" else w
        post = f32(p + "post_attention_layernorm.weight")
        for name in ("gate_proj", "up_proj"):
            out[p + f"mlp.{name}.weight"] = f32(p + f"mlp.{name}.weight") * post
        out[p + "post_attention_layernorm.weight"] = np.ones_like(post)

    fold_layer("midlayer.", np.concatenate([f32("midlayer.input_layernorm.weight"),
                                            f32("midlayer.hidden_norm.weight")]))
    out["midlayer.input_layernorm.weight"] = np.ones(H, np.float32)
    out["midlayer.hidden_norm.weight"] = np.ones(H, np.float32)
    for i in range(1, cfg.num_hidden_layers):
        p = f"layers.{i}."
        fold_layer(p, f32(p + "input_layernorm.weight"))
        out[p + "input_layernorm.weight"] = np.ones(H, np.float32)
    out["lm_head.weight"] = f32("lm_head.weight") * f32("norm.weight")
    out["norm.weight"] = np.ones(H, np.float32)
    if cfg.fc_norm:
        out["fc.weight"] = f32("fc.weight") * np.concatenate([f32(f"fc_norm.{c}.weight") for c in range(3)])
        out.update({f"fc_norm.{c}.weight": np.ones(cfg.target_hidden_size, np.float32) for c in range(3)})
    return out
