"""Command line: ``mindspore-eagle`` (console script) = ``python -m mindspore_eagle``.

Sub-commands::

    generate       chat with the teacher (+ EAGLE-3 drafter), streaming tokens as they are committed
    batch          JSONL prompts in, JSONL results out; resumable after a kill (--resume)
    serve          OpenAI-compatible HTTP server (chat / completions, streaming, metrics)
    inspect        architecture of a teacher (HF dir / GGUF) or drafter directory, and what it fits
    bench          delegated to mindspore_eagle.bench.cli_main(argv); ``bench serve`` to
                   mindspore_eagle.bench.serving.main (the serving benchmark)
    train-drafter  delegated to mindspore_eagle.train.__main__.main(argv)

Configuration: ``--config FILE`` (repeatable: a deployment then a preset, merged key by key), ``--set
section.key=value`` (repeatable), then the shorthand flags (``--mode``, ``--max-new-tokens``, ``--baseline``,
``--trace``), which win. Without ``--config`` the built-in defaults (= configs/default.yaml) apply.

Every known error (a subclass of ``errors.MsEagleError``: ConfigError, CheckpointError, GenerationError, ...
docs/errors.md) is printed as one line ``error: ...`` on stderr with exit code 2, never a traceback.
The answer goes to stdout; summaries, prompts and progress bars go to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from mindspore_eagle.config import LOG_LEVELS, Config, ConfigError, load_config
from mindspore_eagle.errors import MsEagleError
from mindspore_eagle.models.model_config import CheckpointError
from mindspore_eagle.serving.batch_job import BatchError

EXIT_ERROR = 2


def known_errors() -> tuple:
    """Exception classes reported as ``error: ...`` (exit 2): every :class:`~mindspore_eagle.errors.MsEagleError`
    (config, checkpoint, asset, batch input, generation, cache, distributed-launch errors)."""
    return (MsEagleError,)


def one_line(e: BaseException) -> str:
    """The exception message on one line (whitespace runs collapsed)."""
    return " ".join(str(e).split()) or type(e).__name__


# --------------------------------------------------------------------------------------------- config flags --
def _add_config_args(p: argparse.ArgumentParser, generation: bool = True) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config; repeat to merge (e.g. configs/default.yaml configs/presets/chain.yaml)")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set speculative.M=32 (repeatable)")
    g.add_argument("--chat-template", metavar="FILE.jinja",
                   help="a Jinja chat template replacing the checkpoint's (model.chat_template)")
    if generation:
        g.add_argument("--mode", choices=("fused", "eager"),
                       help="fused = compiled graphs (context.mode 0), eager = PyNative with per-step checks")
        g.add_argument("--max-new-tokens", type=int, metavar="N", help="generation.max_new_tokens")
        g.add_argument("--baseline", action="store_true",
                       help="teacher-only decoding (no drafter is loaded): the reference for speed and output")
        g.add_argument("--trace", metavar="FILE.jsonl", help="append per-step / per-turn traces (speculative.trace)")


def config_from_args(args) -> Config:
    """The validated Config of ``--config`` / ``--set`` plus the shorthand flags.

    Raises:
        ConfigError: as :func:`mindspore_eagle.config.load_config`, or a flag value out of range.
    """
    cfg = load_config(args.config or None, args.set)
    if getattr(args, "mode", None):
        cfg.speculative.mode = args.mode
        cfg.context.mode = 0 if args.mode == "fused" else 1
    if getattr(args, "max_new_tokens", None) is not None:
        cfg.generation.max_new_tokens = args.max_new_tokens
    if getattr(args, "chat_template", None):
        cfg.model.chat_template = args.chat_template
    if getattr(args, "baseline", False):      # teacher-only: no drafter, and no suffix drafting either
        cfg.model.drafter = "none"
        cfg.serve.speculative = cfg.batch.speculative = False
    if getattr(args, "trace", None):
        cfg.speculative.trace = args.trace
    if getattr(args, "max_batch", None) is not None:
        cfg.batch.max_batch = args.max_batch
    return cfg.validate()


def _engine(cfg: Config, warmup: str = "none", log=None):
    """Build the engine of ``cfg`` and warm it up (``warmup``: full | short | none, see mindspore_eagle.runners.warmup);
    progress (downloads, warm-up, graphs compiled on first use) goes to ``log`` (default: a line on stderr)."""
    from mindspore_eagle.runners.warmup import report_compiles, stderr_log
    from mindspore_eagle.serving.pipeline import prepare
    from mindspore_eagle.serving.pipeline import build_engine

    log = log or stderr_log
    engine = build_engine(cfg)
    prepare(engine, cfg, cfg.generation, warmup, log, graph_cache=cfg.context.graph_cache)
    report_compiles(log)
    return engine


def line_breaking_log(current, same_terminal: bool, log=None):
    """A progress ``log`` for ``generate``: where stdout and stderr are one terminal (``same_terminal``), a line
    logged while ``current()`` (the answer's :class:`Streamer`, or None) stands mid-line starts on a line of its
    own; elsewhere lines pass through unchanged. stdout's text is never changed."""
    from mindspore_eagle.runners.warmup import stderr_log

    log = log or stderr_log

    def emit(line: str) -> None:
        s = current()
        log((s.break_line() if same_terminal and s is not None else "") + line)

    return emit


def _add_warmup_arg(p: argparse.ArgumentParser, default: str, note: str) -> None:
    p.add_argument("--warmup", choices=("auto", "full", "short", "none") if default == "auto" else
                   ("full", "short", "none"), default=default,
                   help="compile graphs before the first token: full = every shape a chat or job can reach (then "
                        "nothing compiles later; the graphs are kept in $MSEAGLE_CACHE/graphs and loaded by later "
                        "runs with the same configuration), short = the shapes of one short reply, none = compile "
                        "each shape on first use. " + note)


# ----------------------------------------------------------------------------------------------- generate --
class Streamer:
    """``on_token`` callback printing committed text as it becomes final.

    EOS tokens are not printed; text that could still turn into a stop string (the last max(len(stop)) - 1
    characters) is held back until it cannot, so what is printed is always a prefix of ``Generation.text``.
    ``mid_line`` says whether the last character written is not a newline (see :meth:`break_line`).
    """

    def __init__(self, tokenizer, eos_ids, stop, out=None):
        from mindspore_eagle.models.tokenizer import IncrementalDecoder

        self.decoder, self.eos, self.stop = IncrementalDecoder(tokenizer), set(eos_ids), list(stop)
        self.out = out or sys.stdout
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.printed, self.stopped = "", 0, False
        self.mid_line = False

    def write(self, text: str) -> None:
        """Write ``text`` to the output now (flushed), e.g. a chat label before the answer."""
        if text:
            self.out.write(text)
            self.out.flush()
            self.mid_line = not text.endswith("\n")

    def break_line(self) -> str:
        """``"\n"`` if the output stands mid-line (then it counts as at a line start), else ``""``: what a
        progress line on the same terminal (a graph compiled mid-answer) prints first, so that it gets a line of
        its own instead of cutting into the answer's text. The output itself is not changed."""
        brk, self.mid_line = ("\n" if self.mid_line else ""), False
        return brk

    def __call__(self, token: int) -> None:
        if token in self.eos or self.stopped:
            return
        self.text += self.decoder.push([token])
        cut = min((self.text.find(s) for s in self.stop if s in self.text), default=-1)
        if cut >= 0:
            self.stopped = True
            self._emit(cut)
        else:
            self._emit(len(self.text) - self.hold)

    def _emit(self, upto: int) -> None:
        if upto > self.printed:
            self.write(self.text[self.printed:upto])
            self.printed = upto

    def finish(self, final_text: str) -> None:
        """Print the rest of the turn's final text and a newline."""
        shown = self.text[:self.printed]
        rest = final_text[len(shown):] if final_text.startswith(shown) else "\n" + final_text
        self.write(rest + "\n")


def turn_summary(g, mode: str, speculative: bool) -> str:
    """One line: new tokens, tok/s (wall, prefill included), mean accept length L_k (bonus counted; only when
    the turn had speculative steps), compiles.

    When graphs compiled during the turn, tok/s is also given without the compiling calls (first runs).
    """
    t = g.turn
    how = "speculative" if speculative else "teacher-only"
    rate = f"{t.tok_per_s:.2f} tok/s"
    if t.compile_count:
        run_s = (t.prefill_ms + t.decode_ms - t.compile_ms) / 1e3
        rate += (f" ({t.new_tokens / run_s:.2f} tok/s without the {t.compile_ms / 1e3:.1f} s of compiling calls)"
                 if run_s > 0 else "")
    tree = sum(1 for st in g.steps if st.budget != 1)
    plain = f" (+{len(g.steps) - tree} plain)" if len(g.steps) > tree else ""
    accept = f"mean L_k {t.mean_accept_len:.2f} over {tree} steps{plain}, " if g.steps else ""
    return (f"[{t.new_tokens} new tokens, {rate}, {accept}{t.compile_count} compiles, {mode}, {how}, "
            f"stop: {g.stop_reason}]")


def logprob_lines(entries: list, tokenizer, eos) -> list[str]:
    """What ``generate`` prints after an answer when ``generation.logprobs`` is set: a heading, then one line per
    generated token (EOS left out) with its log-probability, its text as a JSON string and the most likely
    alternatives, from the server's chat ``logprobs`` entries of the turn (``openai_protocol.chat_logprobs`` of
    ``Generation.logprobs``: the same tokens, values and order)."""
    from mindspore_eagle.serving.openai_protocol import chat_logprobs

    def tok(t):
        return json.dumps(t, ensure_ascii=False)

    out = ["logprobs: token log-probability, token, most likely alternatives"]
    for e in chat_logprobs(entries, tokenizer, eos)["content"]:
        top = ", ".join(f"{tok(a['token'])} {a['logprob']:.4f}" for a in e["top_logprobs"])
        out.append(f"{e['logprob']:10.4f}  {tok(e['token'])}" + (f"  | {top}" if top else ""))
    return out


def _stdin_turns(prompt_tty: bool):
    while True:
        if prompt_tty:
            sys.stderr.write("you> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return
        line = line.strip()
        if line in ("/exit", "/quit"):
            return
        if line:
            yield line


def cmd_generate(args) -> int:
    """``generate``: one prompt, a multi-turn chat (repeated --prompt), or interactive --chat on stdin."""
    if not args.prompt and not args.chat:
        raise ConfigError("generate needs --prompt TEXT (repeatable for a multi-turn chat) or --chat")
    cfg = config_from_args(args)
    multi = args.chat or len(args.prompt) > 1
    live = {"streamer": None}
    log = line_breaking_log(lambda: live["streamer"], sys.stdout.isatty() and sys.stderr.isatty())
    engine = _engine(cfg, ("full" if multi else "none") if args.warmup == "auto" else args.warmup, log)
    speculative = engine.speculates and not args.baseline      # suffix-only engines speculate without a drafter
    gen, steps, turns = cfg.generation, [], []
    turns_in = args.prompt if args.prompt else _stdin_turns(sys.stdin.isatty())
    labelled = args.chat or len(args.prompt) > 1
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for i, text in enumerate(turns_in):
        if args.chat and text == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": text})
        streamer = live["streamer"] = Streamer(engine.tokenizer, engine.eos, gen.stop)
        if labelled and not args.chat:
            streamer.write(f"user: {text}\nassistant: ")
        try:
            g = engine.generate(messages, gen, speculative, turn_id=str(i), on_token=streamer)
        except known_errors() as e:  # interactive: report (e.g. context full) and keep the session
            if not args.chat:
                raise
            messages.pop()
            print(f"\nerror: {one_line(e)} (/reset starts a new conversation)", file=sys.stderr, flush=True)
            continue
        streamer.finish(g.text)
        if gen.logprobs is not None:
            streamer.write("\n".join(logprob_lines(g.logprobs, engine.tokenizer, engine.eos)) + "\n")
        messages.append({"role": "assistant", "content": g.text})
        print(turn_summary(g, cfg.exec_mode, speculative), file=sys.stderr, flush=True)
        steps += g.steps
        turns.append(g.turn)
    if args.stats and turns:
        from mindspore_eagle.core.trace import format_summary

        print(format_summary(steps, turns), file=sys.stderr)
    return 0


# -------------------------------------------------------------------------------------------------- batch --
def _parse_shard(text: str) -> tuple:
    try:
        rank, size = (int(x) for x in text.split("/"))
    except ValueError:
        raise BatchError(f"--shard expects RANK/SIZE, e.g. 0/2, got {text!r}") from None
    if size < 1 or not 0 <= rank < size:
        raise BatchError(f"--shard {text}: rank must be in [0, {size - 1}]")
    return rank, size


def _batch_speculates(cfg: Config, args) -> bool:
    """Whether a ``batch`` job drafts: never with ``--baseline``; a batched job (``batch.max_batch`` > 1) only with
    ``batch.speculative``; else whenever the engine has something to draft with (a drafter, or suffix candidates
    with ``speculative.method: suffix``, which needs no drafter)."""
    if getattr(args, "baseline", False):
        return False
    return cfg.batch.max_batch == 1 or cfg.batch.speculative


def cmd_batch(args) -> int:
    """``batch``: run a JSONL file (see mindspore_eagle.serving.batch_job), one result line per record."""
    from mindspore_eagle.serving import batch_job as batch

    cfg = config_from_args(args)
    records = batch.read_input(args.input, args.format)
    model = None
    if records[0].fmt == "openai":                  # bodies name the served model, as the server's requests do
        from mindspore_eagle.serving.api_server import model_name

        model = model_name(cfg)
    if cfg.batch.max_batch > 1:
        cfg = batch.batched_config(cfg)
    if args.shard:
        records = batch.shard(records, *_parse_shard(args.shard))
    stats = batch.run_batch(lambda: _engine(cfg, args.warmup), records, args.output, cfg.generation,
                            speculative=_batch_speculates(cfg, args), resume=args.resume, overwrite=args.overwrite,
                            progress=not args.no_progress, max_batch=cfg.batch.max_batch, model=model)
    print(f"batch: {stats.written} record(s) written ({stats.errors} with an error), {stats.skipped} already done, "
          f"{stats.total} in total -> {args.output} in {stats.seconds:.1f} s", file=sys.stderr)
    return 0


# -------------------------------------------------------------------------------------------------- serve --
SERVE_FLAGS = (("host", "host"), ("port", "port"), ("api_key", "api_key"), ("serve_max_batch", "max_batch"),
               ("cors_origin", "cors_origins"), ("access_log", "access_log"), ("log_level", "log_level"),
               ("request_timeout", "request_timeout_s"))
"""``serve`` flags (argparse dest) and the ``serve.`` key each one overrides when given."""


def serve_config_from_args(args) -> Config:
    """The validated Config of ``serve``'s ``--config`` / ``--set`` with its flags (:data:`SERVE_FLAGS`) applied.

    Raises:
        ConfigError: as :func:`config_from_args`; a flag value out of range is named by its key
            (``serve.request_timeout_s = -1.0 is out of range: ...``).
    """
    cfg = config_from_args(args)
    for flag, key in SERVE_FLAGS:
        if getattr(args, flag, None) is not None:
            setattr(cfg.serve, key, getattr(args, flag))
    return cfg.validate()


def cmd_serve(args) -> int:
    """``serve``: the OpenAI-compatible HTTP server (mindspore_eagle.serving.api_server) until SIGTERM."""
    from mindspore_eagle.serving.api_server import serve, serve_config

    return serve(serve_config(serve_config_from_args(args)), warmup=args.warmup)


# ------------------------------------------------------------------------------------------------ inspect --
def _safetensors_params(files) -> tuple:
    n_params = n_tensors = 0
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                n_tensors += 1
                n = 1
                for s in meta["shape"]:
                    n *= s
                n_params += n
    return n_params, n_tensors


def _is_drafter_config(d: dict) -> bool:
    archs = " ".join(d.get("architectures") or [])
    return "Eagle" in archs or "eagle_config" in d or "draft_vocab_size" in d or "target_hidden_size" in d


def describe_teacher(path) -> dict:
    """Architecture facts of a teacher checkpoint, read from metadata only (no weights loaded).

    Raises:
        CheckpointError: missing path, pickle checkpoint, unreadable config / GGUF metadata.
    """
    from pathlib import Path

    from mindspore_eagle.models.checkpoints import (
        _read_json,
        _resolve,
        gguf_config,
        open_gguf,
    )
    from mindspore_eagle.models.model_config import ModelConfig
    from mindspore_eagle.models.tokenizer import Tokenizer

    p = _resolve(path)
    if p.suffix.lower() == ".gguf":
        reader = open_gguf(p)
        cfg = gguf_config(reader)
        n_params = sum(int(t.n_elements) for t in reader.tensors)
        fmt = f"GGUF ({cfg.arch}, {len(reader.tensors)} tensors, types " \
              f"{', '.join(sorted({t.tensor_type.name for t in reader.tensors}))})"
        tok = lambda: Tokenizer.from_gguf(reader)  # noqa: E731
    else:
        cfg = ModelConfig.from_hf_config(_read_json(Path(p) / "config.json"))
        n_params, n_tensors = _safetensors_params(sorted(Path(p).glob("*.safetensors")))
        fmt = f"HF safetensors directory ({cfg.arch}, {n_tensors} tensors)"
        tok = lambda: Tokenizer.from_hf_dir(p)  # noqa: E731
    try:
        t = tok()
        tok_info = f"vocab {t.vocab_size}, chat template {'yes' if t.chat_template else 'no'}"
    except CheckpointError as e:
        tok_info = f"unusable ({one_line(e)})"
    return {"kind": "teacher", "path": str(p), "format": fmt, "parameters": n_params, "config": cfg,
            "tokenizer": tok_info}


def cmd_inspect(args) -> int:
    """``inspect``: print a checkpoint's architecture and what it is compatible with; ``inspect costs``: the
    speculation policy's cost table measured on this machine for ``--config`` / ``--set``."""
    from pathlib import Path

    from mindspore_eagle.serving.pipeline import EMBEDDED_DRAFTER, embedded_choice, resolve_teacher

    if args.path == "costs":
        return _inspect_costs(args)
    path = (resolve_teacher("embedded") if args.path == "embedded"             # fetch only when asked for
            else EMBEDDED_DRAFTER if args.path == "embedded-drafter" else args.path)
    cfg_json = Path(path) / "config.json"
    if Path(path).is_dir() and cfg_json.is_file():
        from mindspore_eagle.models.checkpoints import _read_json

        if _is_drafter_config(_read_json(cfg_json)):
            return _inspect_drafter(path, args.teacher)
    info = describe_teacher(path)
    c = info["config"]
    print(f"teacher: {info['path']}\n  format: {info['format']}\n"
          f"  parameters: {info['parameters'] / 1e6:.1f} M\n"
          f"  architecture: {c.arch} decoder, {c.num_layers} layers, hidden {c.hidden_size}, intermediate "
          f"{c.intermediate_size}, heads {c.num_heads} (kv {c.num_kv_heads}, head_dim {c.head_dim}), vocab "
          f"{c.vocab_size}, rope_theta {c.rope_theta:g}, qkv_bias {c.qkv_bias}, o_bias {c.o_bias}, tied embeddings "
          f"{c.tie_word_embeddings}, context {c.max_position_embeddings}\n"
          f"  tokenizer: {info['tokenizer']}; bos {c.bos_token_id}, eos {list(c.eos_token_ids)}\n"
          f"  EAGLE-3 capture layers (inputs of): {list(c.aux_layers)}\n"
          f"  compatible drafters: EAGLE-3 with hidden_size = target_hidden_size = {c.hidden_size}, vocab_size = "
          f"{c.vocab_size} (any draft_vocab_size), trained on capture layers {list(c.aux_layers)}")
    drafter, why = embedded_choice(args.path, c)
    print(f"  model.drafter: embedded gives: {drafter}" if drafter else
          f"  model.drafter: embedded gives: no drafter ({why}): copies of earlier text alone "
          f"(speculative.method=suffix)")
    return 0


def _inspect_costs(args) -> int:
    """Build the engine of the config (policy forced to adaptive, so every budget 2, 4, ..., M is timed), measure
    its CostTable (Engine.measure_costs) and print it."""
    cfg = config_from_args(args)
    if cfg.model.drafter == "none":
        raise ConfigError("inspect costs needs a drafter: model.drafter is 'none'")
    cfg.speculative.policy = "adaptive"
    eng = _engine(cfg)
    print(f"speculation cost table (M <= {cfg.speculative.M}, D_max {cfg.speculative.D_max}, top_k "
          f"{cfg.speculative.top_k}; ms, medians, this machine):", file=sys.stderr)
    print(eng.measure_costs().describe())
    return 0


def _inspect_drafter(path, teacher) -> int:
    from mindspore_eagle.models.eagle3 import load_drafter
    from mindspore_eagle.serving.pipeline import check_drafter_fits, resolve_teacher

    d, tensors = load_drafter(path)
    n = sum(int(v.size) for k, v in tensors.items() if k not in ("d2t", "t2d"))
    aux = list(d.aux_layers) or "teacher default (2, L//2, L-3)"
    print(f"drafter: {path}\n  format: EAGLE-3 / SpecForge directory (config.json + model.safetensors)\n"
          f"  parameters: {n / 1e6:.1f} M (embedding shared with the teacher, not stored)\n"
          f"  architecture: {d.num_hidden_layers} decoder layer{'s' * (d.num_hidden_layers > 1)}, "
          f"hidden {d.hidden_size}, intermediate {d.intermediate_size}, heads "
          f"{d.num_attention_heads} (kv {d.num_key_value_heads}, head_dim {d.head_dim}), draft vocab "
          f"{d.draft_vocab_size} of {d.vocab_size}, rope_theta {d.rope_theta:g}\n"
          f"  fuses 3 x {d.target_hidden_size} teacher features from layers (inputs of): {aux}"
          f"{', each chunk RMS-normed first (fc_norm)' if d.fc_norm else ''}\n"
          f"  compatible teachers: hidden_size {d.hidden_size}, vocab_size {d.vocab_size}"
          + (f", capture layers {list(d.aux_layers)}" if d.aux_layers else ""))
    if teacher:
        t = describe_teacher(resolve_teacher(teacher))["config"]
        check_drafter_fits(d, t)
        print(f"  fits teacher {teacher}: yes")
    return 0


# ------------------------------------------------------------------------------------------ delegations --
def _delegate(command: str, argv: list) -> int:
    import importlib

    module, func = {"bench": ("mindspore_eagle.bench", "cli_main"),
                    "train-drafter": ("mindspore_eagle.train.__main__", "main")}[command]
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError):
        raise BatchError(f"'{command}' is not available in this installation ({module}.{func} is missing)") from None
    rc = fn(argv)
    return int(rc or 0)


# ------------------------------------------------------------------------------------------------ parser --
def build_parser() -> argparse.ArgumentParser:
    """The argparse tree (``--help`` on every sub-command)."""
    p = argparse.ArgumentParser(prog="mindspore-eagle", description="EAGLE-3 tree speculative decoding on "
                                "MindSpore (SmolLM2 on CPU by default; openPangu on Ascend).",
                                epilog="Errors are one line 'error: ...' on stderr, exit code 2.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="chat with the model, streaming the answer",
                       description="Generate an answer (streamed to stdout as tokens are committed), then print a "
                       "one-line summary on stderr: new tokens, tok/s, mean accepted length L_k, compile count.")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="user message; repeat for a multi-turn chat (each turn sees the previous answers)")
    g.add_argument("--chat", action="store_true", help="interactive: read user turns from stdin (/reset, /exit)")
    g.add_argument("--system", metavar="TEXT", help="system message")
    g.add_argument("--stats", action="store_true", help="print the per-step timing table at the end (stderr)")
    _add_warmup_arg(g, "auto", "Default auto: full for a chat (several --prompt, or --chat), none for one prompt.")
    _add_config_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("batch", help="JSONL in, JSONL out (resumable)",
                       description="Run every record of a JSONL file ({'id', 'prompt' | 'messages' | 'turns'}) and "
                       "append one result line per record (text, token counts, tok/s, mean L_k, stop_reason, or "
                       "error); or an OpenAI Batch API file ({'custom_id', 'method', 'url', 'body'}), answered in "
                       "OpenAI's batch output format with the server's response bodies. Each line is flushed and "
                       "fsync'd: after a kill, --resume continues without losing or duplicating a record.")
    b.add_argument("--input", required=True, metavar="IN.jsonl")
    b.add_argument("--output", required=True, metavar="OUT.jsonl")
    b.add_argument("--format", choices=("auto", "native", "openai"), default="auto",
                   help="input format: native records, OpenAI Batch API lines, or auto (default: openai when the "
                        "first JSON object has 'custom_id' and 'body')")
    b.add_argument("--resume", action="store_true", help="continue OUT: cut a partial last line, skip done ids")
    b.add_argument("--overwrite", action="store_true", help="start OUT afresh if it exists")
    b.add_argument("--shard", metavar="RANK/SIZE", help="only records i with i %% SIZE == RANK (data parallel)")
    b.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    b.add_argument("--max-batch", type=int, metavar="N", help="sequences per teacher forward (continuous "
                   "batching; = --set batch.max_batch=N; records are written as they finish)")
    _add_warmup_arg(b, "full", "Default full: the first record pays no compiling.")
    _add_config_args(b)
    b.set_defaults(func=cmd_batch)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve POST /v1/chat/completions and /v1/completions (streamed or not), POST "
                       "/tokenize and /detokenize, GET /v1/models, /health and /metrics, with continuous batching "
                       "of concurrent requests. "
                       "Compiles every shape at start (GET /health answers 503 until then); SIGTERM drains and "
                       "exits 0. Defaults and more keys: the config's serve section.")
    s.add_argument("--host", help="address to bind (serve.host, default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, help="TCP port (serve.port, default 8000; 0 = any free port)")
    s.add_argument("--max-batch", type=int, dest="serve_max_batch", metavar="N",
                   help="sequences per teacher forward (serve.max_batch, default 16)")
    s.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize "
                   "and /detokenize (serve.api_key; also read from MSEAGLE_API_KEY)")
    s.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let browser pages of ORIGIN (e.g. https://example.com; '*' = any) call the server: CORS "
                        "headers (serve.cors_origins; repeatable; default none: no CORS headers)")
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                   help="uvicorn's access log, one line per request on stdout (serve.access_log, default off)")
    s.add_argument("--log-level", choices=LOG_LEVELS, help="uvicorn's log level (serve.log_level, default warning)")
    s.add_argument("--request-timeout", type=float, metavar="SECONDS",
                   help="cancel a chat or completion request running longer and answer 504 "
                        "(serve.request_timeout_s, default 0: no limit)")
    _add_warmup_arg(s, "full", "Default full: no request ever waits for a compile.")
    _add_config_args(s)
    s.set_defaults(func=cmd_serve)

    i = sub.add_parser("inspect", help="print a checkpoint's architecture and compatibility",
                       description="Describe a teacher (HF/openPangu directory, .gguf file, 'embedded') or an "
                       "EAGLE-3 drafter directory ('embedded-drafter'), from metadata, and what it fits.")
    i.add_argument("path", help="checkpoint path, 'embedded' or 'embedded-drafter'; or 'costs': time the calls of "
                   "a speculative step for --config (the adaptive policy's cost table)")
    i.add_argument("--teacher", help="for a drafter: check that it fits this teacher (path or 'embedded')")
    _add_config_args(i, generation=False)
    i.set_defaults(func=cmd_inspect)

    sub.add_parser("bench", help="benchmarks (mindspore_eagle.bench; see 'bench --help')", add_help=False)
    sub.add_parser("train-drafter", help="train an EAGLE-3 drafter (see 'train-drafter --help')", add_help=False)
    return p


def guarded(fn, *args) -> int:
    """Run ``fn(*args)`` and map known errors to one line ``error: ...`` on stderr and exit code 2.

    KeyboardInterrupt gives exit code 130; any other exception keeps its traceback (a bug, not a user error).
    Used by :func:`main` and the scripts/ entry points.
    """
    os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++/Python log: errors only (before mindspore is imported)
    try:
        return int(fn(*args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - known errors become one line, others keep their traceback
        if isinstance(e, known_errors()):
            print(f"error: {one_line(e)}", file=sys.stderr)
            return EXIT_ERROR
        raise


def _dispatch(argv: list) -> int:
    if argv[:2] == ["bench", "serve"]:
        from mindspore_eagle.bench.serving import main as bench_serve

        return bench_serve(argv[2:])
    if argv[:2] == ["bench", "gguf"]:
        from mindspore_eagle.bench.llama_server import gguf_main

        return gguf_main(argv[2:])
    if argv and argv[0] in ("bench", "train-drafter"):
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_ERROR
    return args.func(args)


def main(argv=None) -> int:
    """Entry point of ``mindspore-eagle`` / ``python -m mindspore_eagle``.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
    Returns:
        exit code: 0 ok, 2 a known error (printed as ``error: ...``) or bad arguments, 130 interrupted.
    """
    return guarded(_dispatch, list(sys.argv[1:] if argv is None else argv))


__all__ = ["main", "guarded", "build_parser", "cmd_serve", "config_from_args", "known_errors", "Streamer",
           "describe_teacher", "serve_config_from_args", "SERVE_FLAGS"]
