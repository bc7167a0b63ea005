"""YAML configuration: one dataclass per section, strict loading, ``--set section.key=value`` overrides.

Sections mirror MindFormers' predict YAMLs (docs/design.md, "MindFormers configuration and entry point"): ``context`` (mode, device_target),
``model`` (teacher / drafter paths and dtype), ``speculative`` (tree budget M, D_max, top_k, window W, execution
mode, trace path), ``generation`` (max_new_tokens, sampling), ``cache`` (block_size, num_blocks, max_seq_len),
``batch`` (continuous batching of the batch job), ``serve`` (the OpenAI-compatible HTTP server).

Every problem raises :class:`ConfigError` with the key path and the allowed range, e.g.
``speculative.M = 1 is out of range: must be an int in [2, 512]``.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from mindspore_eagle.errors import MsEagleError


def cache_dir() -> Path:
    """Where this package keeps what it fetches or builds (wheels, compiled graphs, cost tables): $MSEAGLE_CACHE,
    default ~/.cache/mindspore_eagle (not created here)."""
    return Path(os.environ.get("MSEAGLE_CACHE") or Path.home() / ".cache" / "mindspore_eagle").expanduser()


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats: PyYAML (YAML 1.1) needs a dot, so ``1e-6`` or
    ``5E-1`` would load as strings and a numeric key would refuse them. Used for config files and ``--set``."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def yaml_load(text_or_stream):
    """Parse YAML with :class:`YamlLoader` (safe; exponent floats without a dot are numbers)."""
    return yaml.load(text_or_stream, Loader=YamlLoader)  # noqa: S506 - YamlLoader is a SafeLoader


class ConfigError(MsEagleError, ValueError):
    """A configuration value is missing, unknown, of the wrong type, or out of range (message names the key)."""


def range_words(kind: str, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False) -> str:
    """The allowed range in the words every error message uses: ``kind`` ("an int" / "a number") then "in [lo, hi]"
    (round brackets for open ends), ">= lo" / "> lo" without ``hi``, "<= hi" / "< hi" without ``lo``; bounds as
    ``str`` gives them."""
    if hi is None:
        return f"{kind} {'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"{kind} {'<' if hi_open else '<='} {hi}"
    return f"{kind} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _check_int(path: str, v, lo: int, hi: int | None = None):
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise ConfigError(f"{path} = {v!r} is out of range: must be {range_words('an int', lo, hi)}")


def _check_float(path: str, v, lo: float, hi: float, lo_open: bool = False):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise ConfigError(f"{path} = {v!r} is out of range: must be {range_words('a number', lo, hi, lo_open)}")


@dataclass
class ContextConfig:
    """MindSpore context: ``mode`` 0 = GRAPH_MODE (our ``fused``), 1 = PYNATIVE (``eager``), as MindFormers."""
    mode: int = 0
    device_target: str = "CPU"
    device_id: int = 0
    threads: int = 0          # CPU kernel threads; 0 = min(cpu_count, 8)
    graph_cache: bool = True  # a full warm-up saves / loads compiled graphs in $MSEAGLE_CACHE/graphs

    def validate(self):
        _check_int("context.mode", self.mode, 0, 1)
        if self.device_target not in ("CPU", "GPU", "Ascend"):
            raise ConfigError(f"context.device_target = {self.device_target!r}: must be CPU, GPU or Ascend")
        _check_int("context.device_id", self.device_id, 0)
        _check_int("context.threads", self.threads, 0, 256)
        if not isinstance(self.graph_cache, bool):
            raise ConfigError("context.graph_cache must be true or false")


WEIGHT_DTYPES = ("auto", "float32", "float16")   # model.weight_dtype


@dataclass
class ModelSection:
    """Teacher and drafter locations. ``teacher: embedded`` / ``drafter: embedded`` are the shipped defaults
    (SmolLM2-135M-Instruct GGUF fetched from PyPI, and the drafter trained for it in mindspore_eagle/assets);
    ``drafter: none`` disables speculative decoding; ``drafter: random`` is an untrained drafter (lossless but slow).
    ``dtype``: the compute dtype. ``weight_dtype``: how the matrices are stored on the CPU kernels (compute stays
    float32): float32 | float16 (teacher and drafter; the teacher's logits move by the rounding, so its tokens
    may differ from a float32 teacher's; speculation stays exact against the teacher as loaded) | auto (the
    drafter's matrices float16, the teacher's float32: drafts only, output unchanged); other backends hold them
    in ``dtype`` (``serving.pipeline.weight_dtypes``). ``chat_template``: "" = the checkpoint's own; else a
    Jinja chat template replacing it (a file path, or the template text itself when it holds ``{%`` or ``{{``),
    for a model that has none or a wrong one.
    """
    teacher: str = "embedded"
    drafter: str = "embedded"
    dtype: str = "float32"
    weight_dtype: str = "auto"
    chat_template: str = ""

    def validate(self):
        if not isinstance(self.teacher, str) or not self.teacher:
            raise ConfigError("model.teacher must be a path, 'embedded' or 'qwen2.5-coder-0.5b-instruct'")
        if not isinstance(self.drafter, str) or not self.drafter:
            raise ConfigError("model.drafter must be a path, 'embedded', 'random' or 'none'")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"model.dtype = {self.dtype!r}: must be float32, float16 or bfloat16")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"model.weight_dtype = {self.weight_dtype!r}: must be one of {', '.join(WEIGHT_DTYPES)}")
        if not isinstance(self.chat_template, str):
            raise ConfigError("model.chat_template must be a string: a Jinja file path or the template text")
        if self.weight_dtype == "float16" and self.dtype != "float32":
            raise ConfigError(f"model.weight_dtype = float16 needs model.dtype float32 (the CPU kernels widen half "
                              f"weights into float32 arithmetic), got model.dtype {self.dtype}")


METHODS = ("eagle3", "suffix", "hybrid")     # speculative.method


@dataclass
class SpeculativeConfig:
    """Tree budget and execution. M: tokens verified per step, root included; D_max: max draft depth
    (root depth 0); top_k: children per expanded node and frontier width; window: drafter attends to the
    last W context tokens (0 = all); mode: fused (jit) | eager (PyNative + invariant checks each step);
    policy: adaptive (the default: M, D_max are ceilings; each step picks plain decoding or a compiled budget
    2, 4, ..., M by expected tokens per ms, policy.py) | fixed (every step drafts D_max deep and verifies M tokens,
    the paper's behaviour); method: where draft tokens come from: hybrid (the default: the drafter's tree and
    suffix candidates merged into one tree) | eagle3 (the drafter's tree alone) | suffix (copies of earlier text
    only: the sequence's prompt and output and the process's earlier outputs, core/suffix.py; no drafter needed); suffix_tokens: the most tokens of earlier outputs the
    process keeps for suffix candidates (oldest outputs dropped first; the index takes ~1.7 KB a token, measured
    with tracemalloc on 65,536 tokens: 111 MB). hybrid needs a drafter: with
    ``model.drafter: none`` it decodes teacher-only, as eagle3 does; suffix drafts copies with or without one.
    batch_tree_rows: continuous batching: a step of n sequences (row bucket b >= n) grows the drafter's trees
    m_b - 1 deep at most, m_b = ``runners.shapes.batch_budget(b, M, batch_tree_rows)`` = max(2, min(M,
    batch_tree_rows // b)) (each level one drafter call); a batched verification that runs as a graph (not on the
    host) holds b x m_b rows in all. Which nodes are verified is measured, not configured
    (``core.policy.allot_rows``: docs/performance.md, "Continuous batching")."""
    M: int = 16
    D_max: int = 5
    top_k: int = 4
    window: int = 0
    mode: str = "fused"
    policy: str = "adaptive"
    validate_tree: bool = False
    trace: str = ""
    method: str = "hybrid"
    suffix_tokens: int = 16384
    batch_tree_rows: int = 16

    def validate(self):
        _check_int("speculative.M", self.M, 2, 512)
        _check_int("speculative.D_max", self.D_max, 1, 64)
        _check_int("speculative.top_k", self.top_k, 1, 64)
        if self.top_k > self.M:
            raise ConfigError(f"speculative.top_k = {self.top_k} is out of range: must be <= speculative.M = {self.M}")
        _check_int("speculative.window", self.window, 0)
        if self.mode not in ("fused", "eager"):
            raise ConfigError(f"speculative.mode = {self.mode!r}: must be 'fused' or 'eager'")
        if self.policy not in ("fixed", "adaptive"):
            raise ConfigError(f"speculative.policy = {self.policy!r}: must be 'fixed' or 'adaptive'")
        if self.method not in METHODS:
            raise ConfigError(f"speculative.method = {self.method!r}: must be one of {', '.join(METHODS)}")
        _check_int("speculative.suffix_tokens", self.suffix_tokens, 1, 1 << 26)
        _check_int("speculative.batch_tree_rows", self.batch_tree_rows, 2, 8192)
        if not isinstance(self.validate_tree, bool):
            raise ConfigError("speculative.validate_tree must be true or false")


@dataclass
class GenerationConfig:
    """Decoding controls. temperature 0 = greedy; top_p in (0, 1]; top_k 0 = off; stop: stop strings;
    logprobs: None = off, n in [0, 20] = each emitted token's log-probability under the teacher and the n most
    likely alternatives (log-softmax of the raw logits, before temperature / top-k / top-p; the server's
    ``logprobs`` / ``top_logprobs``)."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list = field(default_factory=list)
    logprobs: int | None = None

    def validate(self):
        _check_int("generation.max_new_tokens", self.max_new_tokens, 1, 1 << 20)
        _check_float("generation.temperature", self.temperature, 0.0, 100.0)
        _check_float("generation.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("generation.top_k", self.top_k, 0)
        _check_int("generation.seed", self.seed, 0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError("generation.stop must be a list of non-empty strings")
        if self.logprobs is not None:
            _check_int("generation.logprobs", self.logprobs, 0, MAX_LOGPROBS)


MAX_LOGPROBS = 20
"""Most alternatives per token ``generation.logprobs`` may ask for (OpenAI's top_logprobs limit)."""


@dataclass
class CacheConfig:
    """Paged KV cache: block_size tokens per block, num_blocks in the pool, max_seq_len slots per sequence
    (prompt + generated; a multiple of block_size). MindFormers names (block_size, num_blocks, seq_length)."""
    block_size: int = 16
    num_blocks: int = 64      # one sequence of max_seq_len (writes are in place: a larger pool costs memory only)
    max_seq_len: int = 1024
    prefill_chunk: int = 128

    def validate(self):
        _check_int("cache.block_size", self.block_size, 1, 4096)
        _check_int("cache.max_seq_len", self.max_seq_len, 16)
        if self.max_seq_len % self.block_size:
            raise ConfigError(f"cache.max_seq_len = {self.max_seq_len} is out of range: must be a multiple of "
                              f"cache.block_size = {self.block_size}")
        _check_int("cache.num_blocks", self.num_blocks, self.max_seq_len // self.block_size)
        if self.prefill_chunk not in (16, 32, 64, 128, 256, 512):
            raise ConfigError(f"cache.prefill_chunk = {self.prefill_chunk}: must be one of 16, 32, ..., 512")


@dataclass
class BatchSection:
    """Serving many sequences at once (``scheduler.py``). max_batch: sequences sharing one teacher forward (the
    ``batch`` job and ``bench --max-batch``; 1 = one record at a time, speculative). The KV pool
    (``cache.num_blocks``) must hold the sequences that run together: each admitted turn reserves
    ceil((prompt + max_new_tokens) / block_size) blocks and waits while the pool is full. speculative: with
    max_batch > 1, draft a tree (the fixed budget speculative.M, D_max, top_k) for every sequence and verify all
    trees in one forward; off by default: on a CPU, batching alone gives more tokens per second than trees in a
    batch (``bench --batch-sizes`` measures both)."""
    max_batch: int = 1
    speculative: bool = False

    def validate(self):
        _check_int("batch.max_batch", self.max_batch, 1, 256)
        if not isinstance(self.speculative, bool):
            raise ConfigError("batch.speculative must be true or false")


@dataclass
class ServeSection:
    """The OpenAI-compatible HTTP server (``mindspore-eagle serve``, ``serving/api_server.py``).

    host: address to bind (127.0.0.1 = this machine only; 0.0.0.0 = every interface). port: TCP port (0 = any
    free port, printed at start). api_key: when set, every ``/v1`` request needs ``Authorization: Bearer KEY``
    (also read from the environment variable ``MSEAGLE_API_KEY``). model_name: the model id clients send
    ("" = derived from ``model.teacher``). max_batch: sequences sharing one teacher forward (continuous
    batching). speculative: draft trees (a drafter's, or suffix candidates alone with ``speculative.method:
    suffix``), each step gated by measured tokens per
    ms for the batch size. max_queue: requests waiting for a row before new ones get 429. max_body_bytes: largest
    request body (bytes; larger: 413). drain_timeout_s: on SIGTERM, seconds in-flight requests get to finish
    before they are cancelled. cors_origins: origins a browser page may call the server from (CORS headers;
    ``"*"`` = any; [] = no CORS headers). access_log: uvicorn's access log (one line per request, stdout).
    log_level: uvicorn's log level (:data:`LOG_LEVELS`). request_timeout_s: a request running longer (from its
    arrival, queueing included) is cancelled and answered 504 (0 = no limit)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    model_name: str = ""
    max_batch: int = 16
    speculative: bool = True
    max_queue: int = 256
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    cors_origins: list = field(default_factory=list)
    access_log: bool = False
    log_level: str = "warning"
    request_timeout_s: float = 0.0

    def validate(self):
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError("serve.host must be a host name or address, e.g. 127.0.0.1")
        _check_int("serve.port", self.port, 0, 65535)
        if not isinstance(self.api_key, str) or any(c.isspace() for c in self.api_key):
            raise ConfigError("serve.api_key must be a string without whitespace (\"\" = no key)")
        if not isinstance(self.model_name, str) or any(c.isspace() for c in self.model_name):
            raise ConfigError("serve.model_name must be a string without whitespace (\"\" = from model.teacher)")
        _check_int("serve.max_batch", self.max_batch, 1, 256)
        if not isinstance(self.speculative, bool):
            raise ConfigError("serve.speculative must be true or false")
        _check_int("serve.max_queue", self.max_queue, 0, 1 << 20)
        _check_int("serve.max_body_bytes", self.max_body_bytes, 1024, 1 << 30)
        _check_float("serve.drain_timeout_s", self.drain_timeout_s, 0.0, 86400.0)
        if not isinstance(self.cors_origins, list):
            raise ConfigError(f"serve.cors_origins = {self.cors_origins!r} must be a list of origins, e.g. "
                              "[\"https://example.com\"] ([] = no CORS headers)")
        for i, o in enumerate(self.cors_origins):
            if not isinstance(o, str) or not _ORIGIN.fullmatch(o):
                raise ConfigError(f"serve.cors_origins[{i}] = {o!r} must be \"*\" or an origin "
                                  "scheme://host[:port] without a path, e.g. https://example.com")
        if not isinstance(self.access_log, bool):
            raise ConfigError("serve.access_log must be true or false")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"serve.log_level = {self.log_level!r}: must be one of {', '.join(LOG_LEVELS)}")
        _check_float("serve.request_timeout_s", self.request_timeout_s, 0.0, 86400.0)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""``serve.log_level`` values: uvicorn's level names, most to least severe."""
_ORIGIN = re.compile(r"\*|[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+")


@dataclass
class Config:
    context: ContextConfig = field(default_factory=ContextConfig)
    model: ModelSection = field(default_factory=ModelSection)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    batch: BatchSection = field(default_factory=BatchSection)
    serve: ServeSection = field(default_factory=ServeSection)

    def validate(self) -> "Config":
        for f in fields(self):
            getattr(self, f.name).validate()
        if self.model.dtype == "bfloat16" and self.context.device_target == "CPU":
            raise ConfigError("model.dtype = 'bfloat16' needs context.device_target: Ascend (MindSpore 2.9's CPU "
                              "backend has no bfloat16 MatMul); use float16 or float32 on CPU")
        return self

    @property
    def exec_mode(self) -> str:
        """fused | eager: ``speculative.mode``, forced to eager by ``context.mode: 1`` (PyNative)."""
        return "eager" if self.context.mode == 1 else self.speculative.mode

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _section_from_dict(cls, path: str, d):
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must be a mapping, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {path}.{unknown[0]}; allowed keys: {', '.join(known)}")
    obj = cls()
    for k, v in d.items():
        default = getattr(obj, k)
        if isinstance(default, bool) and not isinstance(v, bool):
            raise ConfigError(f"{path}.{k} must be true or false, got {v!r}")
        if isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(default, str) and not isinstance(v, str):
            raise ConfigError(f"{path}.{k} must be a string, got {v!r}")
        setattr(obj, k, v)
    return obj


def from_dict(d: dict) -> Config:
    """Build and validate a Config from a parsed YAML mapping (unknown sections/keys rejected)."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError("the config file must hold a mapping of sections")
    known = {f.name: f for f in fields(Config)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r}; allowed sections: {', '.join(known)}")
    cfg = Config(**{name: _section_from_dict(f.default_factory().__class__, name, d.get(name))
                    for name, f in known.items()})
    return cfg.validate()


def parse_override(text: str) -> tuple[str, str, object]:
    """``"speculative.M=32"`` -> ("speculative", "M", 32) (value parsed as YAML)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, value = text.split("=", 1)
    section, name = key.strip().split(".", 1)
    try:
        parsed = yaml_load(value) if value.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"--set {key}: value {value!r} is not valid YAML") from None
    return section, name, parsed


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path!r} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections")
    return data


def load_config(path, overrides: list[str] = ()) -> Config:
    """Read YAML config(s), apply ``--set`` overrides, validate.

    Args:
        path: None (all defaults), one YAML path, or a list of paths merged in order, key by key within each
            section (a later file wins), e.g. ``["configs/default.yaml", "configs/presets/chain.yaml"]``.
        overrides: ``section.key=value`` strings applied last (value parsed as YAML).
    Raises:
        ConfigError: missing file, malformed YAML (with line), unknown key, wrong type, out-of-range value.
    """
    paths = [] if not path else [path] if isinstance(path, (str, os.PathLike)) else list(path)
    data: dict = {}
    for p in paths:
        for section, values in _read_yaml(os.fspath(p)).items():
            if isinstance(values, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
    for text in overrides:
        section, name, value = parse_override(text)
        if data.get(section) is None:
            data[section] = {}
        if not isinstance(data[section], dict):
            raise ConfigError(f"{section} must be a mapping")
        data[section][name] = value
    return from_dict(data)
