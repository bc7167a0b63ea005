"""Teacher model configuration shared by the loaders, the MindSpore Cells and the numpy reference.

Letter legend (see docs/architecture.md): V = teacher vocab, H = hidden size, L = teacher layers.

`ModelConfig` describes every network this project runs: a pre-norm Llama decoder (RMSNorm, NeoX `rotate_half`
RoPE without scaling, GQA, SwiGLU) with optional bias on q/k/v and on o_proj. Three HF config flavours map onto it:

* openPangu-Embedded (`model_type` "PanguEmbedded"): one `bias` flag sets both `qkv_bias` and `o_bias`;
* Qwen2 (`model_type` "qwen2"): bias on q/k/v only;
* Llama (`model_type` "llama"): `attention_bias` sets both (HF's LlamaAttention applies it to o_proj too).

Errors: every problem with a config raises `CheckpointError` (a ValueError) whose one-line message names the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mindspore_eagle.errors import MsEagleError


class CheckpointError(MsEagleError, ValueError):
    """A checkpoint, config or tokenizer file cannot be used. The message is one line and names the culprit."""


_ARCH_DEFAULTS = {
    # arch: (rope_theta, rms_norm_eps, max_position_embeddings)
    "pangu": (10000.0, 1e-5, 32768),
    "llama": (10000.0, 1e-6, 2048),
    "qwen2": (10000.0, 1e-6, 32768),
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 capture points: the residual-stream *inputs* of layers (2, L//2, L-3).

    See docs/design.md, "Captured features"."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family teacher.

    Fields (all plain Python values):
        vocab_size: V, rows of the embedding / lm_head.
        hidden_size: H.
        intermediate_size: FFN width of gate/up projections.
        num_layers: L.
        num_heads / num_kv_heads: query heads and key/value heads (num_heads % num_kv_heads == 0).
        head_dim: per-head width; q_proj is [num_heads * head_dim, H].
        rope_theta: RoPE base (openPangu-Embedded-1B: 4e6).
        rms_norm_eps: RMSNorm epsilon.
        qkv_bias / o_bias: whether q/k/v_proj and o_proj carry a bias vector.
        tie_word_embeddings: lm_head is the embedding matrix (no `lm_head.weight` tensor).
        max_position_embeddings: trained context length.
        bos_token_id: int or None.
        eos_token_ids: tuple of ints; generation stops on any of them.
        aux_layers: 3 layer indices whose *input* hidden states are concatenated into the EAGLE-3 feature [*, 3H];
            an empty tuple means the default (2, L//2, L-3).
        arch: "pangu", "llama" or "qwen2" (where the config came from; the network is the same).

    Raises:
        CheckpointError: inconsistent values (non-positive sizes, heads not divisible, odd head_dim,
            aux layer out of range).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    aux_layers: tuple = ()
    arch: str = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                                  f"{self.num_kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"config: head_dim {self.head_dim} must be even for rotate_half RoPE")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))
        aux = tuple(int(a) for a in self.aux_layers) or default_aux_layers(self.num_layers)
        if len(aux) != 3 or not all(0 <= a < self.num_layers for a in aux):
            raise CheckpointError(f"config: aux_layers {aux} must be 3 layer indices in [0, {self.num_layers})")
        object.__setattr__(self, "aux_layers", aux)

    @property
    def q_size(self) -> int:
        """Output width of q_proj: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Output width of k_proj and v_proj: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed HF `config.json` dict (openPangu-Embedded, Llama or Qwen2 field names).

        Args:
            cfg: the JSON object. Required keys: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
                num_attention_heads, and model_type or architectures. Optional keys with HF defaults:
                num_key_value_heads (= heads), head_dim (= hidden / heads), rope_theta, rms_norm_eps,
                tie_word_embeddings (False), max_position_embeddings, bos_token_id, eos_token_id (int or list),
                bias (Pangu), attention_bias (Llama), eagle_aux_hidden_state_layer_ids / aux_layers.
        Returns:
            ModelConfig.
        Raises:
            CheckpointError: a required field is missing (the message names it), the model type is unknown, or
                the config asks for something this network does not implement (rope_scaling, a non-SiLU
                activation, MLP bias, sliding-window attention).
        """
        if not isinstance(cfg, dict):
            raise CheckpointError(f"config must be a JSON object, got {type(cfg).__name__}")
        arch = _arch_of(cfg)
        for name in _REQUIRED:
            if cfg.get(name) is None:
                raise CheckpointError(f"config.json: missing required field '{name}'")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (only silu)")
        scaling = cfg.get("rope_scaling")
        if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
            raise CheckpointError(f"config.json: rope_scaling {scaling} is not supported (plain RoPE only)")
        if cfg.get("mlp_bias"):
            raise CheckpointError("config.json: mlp_bias true is not supported")
        if arch == "qwen2" and cfg.get("use_sliding_window"):
            raise CheckpointError("config.json: use_sliding_window true is not supported")
        if arch == "pangu":
            qkv_bias = o_bias = bool(cfg.get("bias", False))
        elif arch == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        theta, eps, max_pos = _ARCH_DEFAULTS[arch]
        heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise CheckpointError(f"config.json: hidden_size {hidden} not divisible by num_attention_heads "
                                      f"{heads} and no head_dim given")
            head_dim = hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        aux = cfg.get("aux_layers") or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
        return cls(
            vocab_size=_int(cfg, "vocab_size"), hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"), num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(head_dim),
            rope_theta=float(cfg.get("rope_theta", theta)), rms_norm_eps=float(cfg.get("rms_norm_eps", eps)),
            qkv_bias=qkv_bias, o_bias=o_bias, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", max_pos)),
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=eos_ids, aux_layers=tuple(aux), arch=arch)

    def to_hf_config(self) -> dict:
        """The inverse of `from_hf_config`: a config.json dict in this arch's field names (Pangu/Llama/Qwen2)."""
        model_type, archs = {"pangu": ("PanguEmbedded", "PanguEmbeddedForCausalLM"),
                             "qwen2": ("qwen2", "Qwen2ForCausalLM")}.get(self.arch, ("llama", "LlamaForCausalLM"))
        d = {"architectures": [archs], "model_type": model_type, "vocab_size": self.vocab_size,
             "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
             "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
             "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "rope_theta": self.rope_theta,
             "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
             "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
             "bos_token_id": self.bos_token_id,
             "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]}
        if self.arch == "pangu":
            if self.qkv_bias != self.o_bias:
                raise CheckpointError("openPangu configs have one bias flag; qkv_bias and o_bias differ")
            d["bias"] = self.qkv_bias
        elif self.arch == "qwen2":
            if not self.qkv_bias or self.o_bias:
                raise CheckpointError("Qwen2 configs imply qkv_bias=True, o_bias=False")
        else:
            if self.qkv_bias != self.o_bias:
                raise CheckpointError("Llama configs have one attention_bias flag; qkv_bias and o_bias differ")
            d["attention_bias"] = self.qkv_bias
        if self.aux_layers != default_aux_layers(self.num_layers):
            d["aux_layers"] = list(self.aux_layers)
        return d


def _arch_of(cfg: dict) -> str:
    model_type = str(cfg.get("model_type") or "")
    archs = [str(a) for a in (cfg.get("architectures") or [])]
    if model_type.lower() in ("pangu_embedded", "panguembedded") or any(a.startswith("PanguEmbedded") for a in archs):
        return "pangu"
    if model_type == "qwen2" or "Qwen2ForCausalLM" in archs:
        return "qwen2"
    if model_type == "llama" or "LlamaForCausalLM" in archs:
        return "llama"
    if not model_type and not archs:
        raise CheckpointError("config.json: missing required field 'model_type' (or 'architectures')")
    raise CheckpointError(f"config.json: unsupported model_type {model_type!r} (architectures {archs}); "
                          "supported: PanguEmbedded, llama, qwen2")


def _int(cfg: dict, name: str) -> int:
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise CheckpointError(f"config.json: field '{name}' must be an integer, got {value!r}")
    return int(value)


def from_hf_config(cfg: dict) -> ModelConfig:
    """Module-level alias of `ModelConfig.from_hf_config` (same arguments, result and errors)."""
    return ModelConfig.from_hf_config(cfg)
