"""``python -m mindspore_eagle.train regen``: the teacher's greedy replies to the prompt registry, into shards.

Reads the prompts of ``train.prompts.build_registry`` (balanced over kinds, evaluation prompts excluded), skips
those already in ``--out`` (``train.shards.ShardStore``), and answers the rest with continuous batching
(``regen.generate_stream``), writing a shard every ``--shard-size`` finished replies. Stop it at any time
(SIGTERM / Ctrl-C flush the finished replies; SIGKILL loses at most one unflushed shard) and start the same
command again to go on. A later training run reads the directory with ``--regen-dir`` (``--stage features``).

With ``--features-dir F`` the teacher's training features (aux, final-normed hidden, argmax; train/features.py)
of every kept sample are taken from the very calls that decode it and written to F, one feature shard per reply
shard (``features.RegenFeatureWriter``), so F trains directly (``--stage train --features-dir F``) without a
separate feature pass (which costs about a third of the data compute: docs/training_data.md).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

# the fastest of 8 / 16 / 32 at max_len 512, grouped attention (docs/training_data.md, "Throughput")
DEFAULT_BATCH = 32


class _Stop(Exception):
    """SIGTERM received: flush and leave."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mindspore_eagle.train regen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="shard directory (created; reused and extended on rerun)")
    p.add_argument("--teacher", default=None, help="teacher checkpoint (GGUF or HF dir) or a named teacher "
                                                   "(qwen2.5-coder-0.5b-instruct); default: embedded SmolLM2")
    p.add_argument("--prompts", type=int, default=None, help="use the first N registry prompts (default: all)")
    p.add_argument("--sources", default=None, help="comma-separated registry sources (default: all)")
    p.add_argument("--max-len", type=int, default=512, help="prompt + reply tokens (the training truncation)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="sequences decoded together (1..256)")
    p.add_argument("--shard-size", type=int, default=64, help="replies per shard file (1..100000)")
    p.add_argument("--min-reply", type=int, default=16, help="skip prompts leaving fewer reply tokens than this")
    p.add_argument("--time-limit", type=float, default=None, help="stop (and flush) after this many seconds")
    p.add_argument("--status", action="store_true", help="print the progress of --out and exit (no model loaded)")
    p.add_argument("--features-dir", default=None,
                   help="also write the teacher's training features of the new replies here, as they decode")
    p.add_argument("--width-step", type=int, default=512,
                   help="decode width padding in KV slots (a multiple of 16; one compiled graph per width)")
    args = p.parse_args(argv)
    for name, lo, hi in (("batch", 1, 256), ("shard_size", 1, 100000), ("max_len", 32, 32768),
                         ("min_reply", 1, 32768), ("width_step", 16, 65536)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            p.error(f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {v}")
    if args.prompts is not None and args.prompts < 1:
        p.error(f"--prompts must be >= 1, got {args.prompts}")
    if args.width_step % 16:
        p.error(f"--width-step must be a multiple of 16 (the KV block size), got {args.width_step}")
    if args.min_reply >= args.max_len:
        p.error(f"--min-reply ({args.min_reply}) must be below --max-len ({args.max_len})")
    return args


def make_record(p, prompt_ids, reply_ids, stop, end_id) -> dict:
    """A shard record (``train.shards`` field list) for registry prompt ``p``."""
    return {"prompt_id": p.prompt_id, "source": p.source, "kind": p.kind, "prompt_ids": [int(x) for x in prompt_ids],
            "reply_ids": [int(x) for x in reply_ids], "stop": stop, "end_id": None if end_id is None else int(end_id)}


def teacher_identity(path: str) -> str:
    """How a shard directory names its teacher: the checkpoint's file (or directory) name and its size in bytes
    (a directory's files summed), not its absolute path, so a directory committed to the repository
    (``data/regen/``) extends on any machine and cache location. Raises OSError when ``path`` is missing."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    else:
        size = os.path.getsize(path)
    return f"{os.path.basename(path)} ({size} bytes)"


class _RegenRun:
    """The state of one :func:`regenerate_to_shards` call: the prompts to do, the finished records not yet in a
    shard (``pending``) with the feature columns of the kept ones, the counters, and the SIGTERM flags (a signal
    during a shard write waits for the write to end)."""

    def __init__(self, runner, tok, store, done: set, todo: list, max_len: int, min_reply: int,
                 time_limit: float | None, log, features):
        self.runner, self.tok, self.store, self.done, self.todo = runner, tok, store, done, todo
        self.max_len, self.min_reply, self.time_limit, self.log, self.features = (max_len, min_reply, time_limit,
                                                                                  log, features)
        self.feats = {}                     # prompt id -> stored feature columns of a pending kept sample
        self.pending, self.fed = [], []
        self.stats = {"prompts_done": 0, "generated": 0, "new_tokens": 0}
        self.t0, self.c0, self.cpu0 = time.monotonic(), runner.compile_ms, time.process_time()
        self.sig = {"writing": False, "stop": False}
        self.counts = {"decoded": 0}

    def flush(self) -> None:
        """Write the pending records as one shard (after their feature shard) and log one progress line."""
        pending, stats, features, store = self.pending, self.stats, self.features, self.store
        if pending:
            self.sig["writing"] = True      # a SIGTERM now waits: the shard and the manifest are written together
            if features is not None:        # the feature shard first: a kill between the two leaves an orphan
                features[0].write(store.next_name(), [self.feats[r["prompt_id"]] for r in pending
                                                      if r["prompt_id"] in self.feats])
            store.write(pending)
            stats["prompts_done"] += len(pending)
            pending.clear()
            self.feats.clear()
            self.sig["writing"] = False
            sec, dec = time.monotonic() - self.t0, self.counts["decoded"]
            self.log(f"[regen] {len(store.manifest['shards'])} shards, {len(self.done) + stats['prompts_done']} "
                     f"prompts done ({stats['prompts_done']} this run, {len(self.todo) - stats['prompts_done']} "
                     f"left); {dec} tokens decoded in {sec:.0f} s = {dec / max(sec, 1e-9):.1f} tok/s (compile "
                     f"{(self.runner.compile_ms - self.c0) / 1e3:.0f} s, CPU {time.process_time() - self.cpu0:.0f} s)")

    def items(self):
        """(prompt ids, reply budget) of the prompts to do, lazily tokenised; too-long prompts become records
        without a run."""
        for p in self.todo:
            ids = self.tok.encode_chat([{"role": "user", "content": p.text}], add_generation_prompt=True)
            if len(ids) + self.min_reply > self.max_len:
                self.pending.append(make_record(p, ids, [], "prompt_too_long", None))
                continue
            self.fed.append((p, ids))
            yield ids, self.max_len - len(ids)

    def on_term(self, signum, frame) -> None:
        self.sig["stop"] = True
        if not self.sig["writing"]:
            raise _Stop()

    def out_of_time(self) -> bool:
        return self.time_limit is not None and time.monotonic() - self.t0 >= self.time_limit

    def result(self) -> dict:
        """The return value of :func:`regenerate_to_shards` (counters, rates and prompts left)."""
        sec, comp = time.monotonic() - self.t0, (self.runner.compile_ms - self.c0) / 1e3
        cpu, dec = time.process_time() - self.cpu0, self.counts["decoded"]
        return {**self.stats, "decoded_tokens": dec, "seconds": round(sec, 1), "tok_s": round(dec / max(sec, 1e-9), 2),
                "compile_s": round(comp, 1), "tok_s_excl_compile": round(dec / max(sec - comp, 1e-9), 2),
                "cpu_s": round(cpu, 1), "tok_per_cpu_s": round(dec / max(cpu, 1e-9), 2),
                "left": len(self.todo) - self.stats["prompts_done"]}


def regenerate_to_shards(runner, tok, prompts: list, store, max_len: int, batch: int, shard_size: int = 64,
                         min_reply: int = 16, time_limit: float | None = None, log=print,
                         width_step: int = 512, features=None) -> dict:
    """Answer the prompts not yet in ``store`` and write their records in shards of ``shard_size``.

    Args:
        runner: TeacherRunner from ``regen.build_batch_runner(cfg, tensors, max_len, batch)``; tok: its Tokenizer.
        prompts: list of ``prompts.Prompt`` (registry order). store: ``shards.ShardStore``.
        time_limit: seconds after which no more replies are taken (the finished ones are flushed).
        log: callable(str) for one progress line per shard. width_step: see ``regen.generate_stream``.
        features: None, or (``features.RegenFeatureWriter``, teacher lm_head float32 [V, H]): each reply shard's
            kept samples (``shards.keep_sample``) get a feature shard, written just before the reply shard.
    Returns:
        {"prompts_done": records written this run, "generated": of which the teacher answered, "new_tokens":
         reply tokens in those records, "decoded_tokens": reply tokens decoded this run (rows cut off by the time
         limit or a signal included), "seconds" (wall, this call), "tok_s" (decoded tokens / seconds),
         "compile_s" (seconds in calls that compiled a graph), "tok_s_excl_compile" (decoded tokens / (seconds -
         compile_s)), "cpu_s" (CPU seconds of this process, all threads), "tok_per_cpu_s", "left": prompts still
         to do}.
        On a shared machine wall-clock rates depend on the other jobs; tokens per CPU second much less so.
    """
    from mindspore_eagle.train.features import sample_columns
    from mindspore_eagle.train.regen import generate_stream
    from mindspore_eagle.train.shards import keep_sample, record_sample

    done = store.done_ids()
    run = _RegenRun(runner, tok, store, done, [p for p in prompts if p.prompt_id not in done], max_len, min_reply,
                    time_limit, log, features)
    try:
        old = signal.signal(signal.SIGTERM, run.on_term)
    except ValueError:                  # not the main thread: no handler, SIGTERM acts as SIGKILL would
        old = None
    gen = generate_stream(runner, run.items(), tok.eos_token_ids, batch, width_step=width_step, counts=run.counts,
                          should_stop=run.out_of_time, features=features is not None)
    try:
        for j, reply, stop, end, *fx in gen:
            p, ids = run.fed[j]
            rec = make_record(p, ids, reply, stop, end)
            if fx:                      # stored columns now, outside the SIGTERM-deferred write
                sample, mask = record_sample(rec, max_len)
                if keep_sample(rec, mask):
                    run.feats[p.prompt_id] = sample_columns(sample, mask, *fx[0], features[1],
                                                            next_from=len(ids) - 1)
            run.pending.append(rec)
            run.stats["generated"] += 1
            run.stats["new_tokens"] += len(reply)
            if len(run.pending) >= shard_size:
                run.flush()
            if run.sig["stop"]:
                raise _Stop()
    except (_Stop, KeyboardInterrupt):
        log("[regen] interrupted: flushing the finished replies")
    finally:
        gen.close()
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        run.flush()
    return run.result()


def status(out_dir: str) -> dict:
    """Progress of a shard directory from its manifest and shards: {"shards", "prompts", "generated", "new_tokens",
    "kinds": {kind: records}, "stops": {stop: records}}.

    Raises:
        FileNotFoundError: no manifest in ``out_dir``.
    """
    from mindspore_eagle.train.shards import iter_records

    st = {"shards": 0, "prompts": 0, "generated": 0, "new_tokens": 0, "kinds": {}, "stops": {}}
    with open(f"{out_dir}/manifest.json", encoding="utf-8") as f:
        st["shards"] = len(json.load(f)["shards"])
    for r in iter_records(out_dir):
        st["prompts"] += 1
        st["generated"] += r["stop"] != "prompt_too_long"
        st["new_tokens"] += len(r["reply_ids"])
        st["kinds"][r["kind"]] = st["kinds"].get(r["kind"], 0) + 1
        st["stops"][r["stop"]] = st["stops"].get(r["stop"], 0) + 1
    return st


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.status:
        try:
            print(json.dumps(status(args.out)))
        except FileNotFoundError:
            print(f"error: --out {args.out} holds no regeneration manifest (nothing run there yet)", file=sys.stderr)
            return 2
        return 0
    from mindspore_eagle.kernels import runtime
    from mindspore_eagle.train.prompts import build_registry
    from mindspore_eagle.train.shards import ShardStore

    t0 = time.time()
    reg = build_registry(args.sources.split(",") if args.sources else None)
    prompts = reg.prompts[:args.prompts]
    counts = reg.counts()
    print(f"[registry] {len(reg.prompts)} prompts ({time.time() - t0:.0f} s), using {len(prompts)}; "
          f"excluded as evaluation prompts: {len(reg.excluded)}; duplicates: {reg.duplicates}; "
          f"counts {json.dumps(counts)}", flush=True)
    runtime.configure()
    from mindspore_eagle.models.checkpoints import load_teacher
    from mindspore_eagle.train.regen import build_batch_runner

    from mindspore_eagle.serving.pipeline import resolve_teacher

    args.teacher = resolve_teacher(args.teacher or "embedded")     # a name of models.fetch.NAMED_TEACHERS too
    cfg, tensors, tok = load_teacher(args.teacher)
    meta = {"teacher": teacher_identity(args.teacher), "max_len": args.max_len, "temperature": 0.0,
            "min_reply": args.min_reply, "registry": reg.meta}
    store = ShardStore(args.out, meta)
    runner, _ = build_batch_runner(cfg, tensors, args.max_len, args.batch)
    features = None
    if args.features_dir:
        from mindspore_eagle.train.features import RegenFeatureWriter, head_weight

        fmeta = {"teacher": args.teacher, "max_len": args.max_len, "aux_layers": list(cfg.aux_layers),
                 "regen_dir": os.path.abspath(args.out)}
        try:
            writer = RegenFeatureWriter(args.features_dir, {s["file"] for s in store.manifest["shards"]}, fmeta)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        features = (writer, head_weight(cfg, tensors))
    print(f"[regen] {len(store.done_ids())} prompts already in {args.out}; batch {args.batch}, max_len "
          f"{args.max_len}, shard size {args.shard_size}", flush=True)
    res = regenerate_to_shards(runner, tok, prompts, store, args.max_len, args.batch, args.shard_size,
                               args.min_reply, args.time_limit, log=lambda s: print(s, flush=True),
                               width_step=args.width_step, features=features)
    print("[regen] summary " + json.dumps({"batch": args.batch, "width_step": args.width_step, **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
