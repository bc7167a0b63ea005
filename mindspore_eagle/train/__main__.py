"""``python -m mindspore_eagle.train``: data -> teacher features -> draft vocab -> TTT training -> SpecForge export.

``python -m mindspore_eagle.train regen --out DIR ...`` writes the teacher's replies to the prompt registry into
resumable shards (train/regen_run.py); ``--regen-dir DIR`` makes the features stage train on them.

Every stage resumes: samples are written once to ``<features-dir>/samples.npz``, feature shards are skipped when
listed in the manifest, and ``--resume`` continues training from ``<out>/resume/`` (see trainer.py).

Data-parallel training: the same command under ``msrun --worker_num W --local_worker_num W python -m
mindspore_eagle.train ... --stage train --batch-size G`` (G a multiple of W, no --pack-len;
docs/training_distributed.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspore-eagle train-drafter", description=__doc__)
    p.add_argument("--teacher", default=None, help="teacher checkpoint (GGUF or HF dir); default: embedded SmolLM2")
    p.add_argument("--out", required=True, help="drafter output directory (config.json + model.safetensors)")
    p.add_argument("--features-dir", default=None, help="feature shards (default <out>/../features)")
    p.add_argument("--samples", type=int, default=256, help="training conversations to use")
    p.add_argument("--max-len", type=int, default=256, help="tokens per sample (truncation); also T of a batch")
    p.add_argument("--vd", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--steps", type=int, default=1000, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=1,
                   help="rows per optimiser step over all msrun ranks (one sample per row; several when packed,"
                        " one process only); a multiple of the ranks; the loss is the mean of the per-sample"
                        " losses")
    p.add_argument("--pack-len", type=int, default=0,
                   help="0 = one sample per row padded to --max-len; N >= --max-len = pack whole samples into"
                        " rows of N tokens (block-diagonal attention, per-sample positions; not under msrun)")
    p.add_argument("--init", choices=("random", "teacher"), default="random",
                   help="drafter init: random, or lm_head / final norm from the teacher's head / final norm")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 3%% of --steps)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--argmax-weight", type=float, default=0.0,
                   help="share of the loss target on the teacher's argmax token (0..1; 0 = the EAGLE-3 loss)")
    p.add_argument("--intermediate", type=int, default=None, help="drafter MLP width (default: teacher's)")
    p.add_argument("--num-layers", type=int, default=1,
                   help="drafter decoder layers (EAGLE-3: 1); with --init-from a drafter of fewer layers, the new"
                        " layers start as the identity")
    p.add_argument("--regenerate", type=int, default=0, help="answer the first N prompts with the teacher itself")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature for --regenerate")
    p.add_argument("--regen-batch", type=int, default=16,
                   help="sequences decoded together by --regenerate (0 = one at a time)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/resume")
    p.add_argument("--stop-at", type=int, default=None,
                   help="end after this many steps, as if interrupted (checkpoint written; the learning-rate"
                        " schedule still spans --steps); continue later with --resume")
    p.add_argument("--init-from", default=None,
                   help="fine-tune this SpecForge drafter directory (keeps its draft vocabulary; --vd must match)")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="steps between checkpoints; each checkpoint also scores the held-out samples")
    p.add_argument("--n-eval", type=int, default=32,
                   help="held-out samples (the last ones; at most a quarter of the samples; 0 = none)")
    p.add_argument("--stage", choices=("all", "features", "train"), default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("CPU", "Ascend", "GPU"), default="CPU",
                   help="device target; the device index is $DEVICE_ID (msrun: the local rank), default 0")
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--regen-dir", default=None,
                   help="samples from a `regen` shard directory (teacher replies) instead of ShareGPT text")
    p.add_argument("--fc-norm", action="store_true",
                   help="one RMSNorm per captured teacher layer before fc (SpecForge's fc_norm; EAGLE-3: off)")
    p.add_argument("--regen-skip", type=int, default=0,
                   help="with --regen-dir: pass over its first N records in shard order (replies a drafter "
                        "already saw; after an earlier features run: its data_stats.json skipped + read)")
    a = p.parse_args(argv)
    for name, val, lo in (("--batch-size", a.batch_size, 1), ("--ttt-length", a.ttt_length, 1),
                          ("--steps", a.steps, 1), ("--checkpoint-every", a.checkpoint_every, 1),
                          ("--max-len", a.max_len, 8), ("--n-eval", a.n_eval, 0), ("--num-layers", a.num_layers, 1),
                          ("--regen-skip", a.regen_skip, 0)):
        if val < lo:
            p.error(f"{name} must be >= {lo}, got {val}")
    if not 0.0 <= a.argmax_weight <= 1.0:
        p.error(f"--argmax-weight must be in [0, 1], got {a.argmax_weight}")
    if a.stop_at is not None and a.stop_at < 1:
        p.error(f"--stop-at must be >= 1, got {a.stop_at}")
    if a.pack_len and a.pack_len < a.max_len:
        p.error(f"--pack-len must be 0 (off) or >= --max-len {a.max_len}, got {a.pack_len}")
    return a


def features_dir(args) -> str:
    """--features-dir, default ``<parent of --out>/features``."""
    return args.features_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "features")


def prepare_features(args, cfg, tensors, tok) -> str:
    """Build samples (once) and the missing feature shards; returns the features directory."""
    from tqdm import tqdm

    from mindspore_eagle.train.data import build_samples, load_samples, save_samples
    from mindspore_eagle.train.features import build_runner, extract_features, head_weight

    fdir = features_dir(args)
    os.makedirs(fdir, exist_ok=True)
    spath = os.path.join(fdir, "samples.npz")
    runner = None
    if os.path.exists(spath):
        samples, stats = load_samples(spath)
        if args.regen_dir and int(stats.get("skipped", 0)) != args.regen_skip:
            raise ValueError(f"--regen-skip {args.regen_skip}: {spath} was built with --regen-skip "
                             f"{int(stats.get('skipped', 0))}; use that value or another --features-dir")
        print(f"[data] {len(samples)} samples from {spath}", flush=True)
    elif args.regen_dir:
        from mindspore_eagle.train.shards import samples_from_shards

        samples, stats = samples_from_shards(args.regen_dir, args.max_len, args.samples, skip=args.regen_skip)
        stats["regen_dir"] = os.path.abspath(args.regen_dir)
        save_samples(spath, samples, stats)
        print(f"[data] {json.dumps(stats)}", flush=True)
    else:
        from mindspore_eagle.evalsets import sharegpt_conversations

        t0 = time.time()
        convs = sharegpt_conversations(int(args.samples * 1.5) + 200)
        regen_runner, rbar = None, None
        if args.regenerate:
            if args.regen_batch:
                from mindspore_eagle.train.regen import build_batch_runner

                regen_runner, _ = build_batch_runner(cfg, tensors, args.max_len, args.regen_batch)
                rbar = tqdm(total=args.regenerate, desc="regenerate", unit="reply")
            else:
                regen_runner = runner = build_runner(cfg, tensors, args.max_len)[0]

        def regen_progress(done, total, new_tokens):
            rbar.n = done
            rbar.set_postfix(new_tokens=new_tokens)
            rbar.refresh()

        bar = tqdm(total=args.samples, desc="tokenise", unit="conv")
        samples, st = build_samples(tok, convs, args.samples, args.max_len, regenerate=args.regenerate,
                                    runner=regen_runner, temperature=args.temperature,
                                    progress=lambda k, r: bar.update(1), regen_batch=args.regen_batch,
                                    regen_progress=regen_progress if rbar is not None else None)
        if rbar is not None:
            rbar.close()
        regen_runner = None
        bar.close()
        stats = st.as_dict()
        stats["seconds"] = round(time.time() - t0, 1)
        save_samples(spath, samples, st)
        print(f"[data] {json.dumps(stats)}", flush=True)
    with open(os.path.join(fdir, "data_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    if runner is None:
        runner, _ = build_runner(cfg, tensors, args.max_len)
    bar = tqdm(total=len(samples), desc="features", unit="sample")
    last = [0]

    def progress(n, toks, sec):
        bar.update(n - last[0])
        last[0] = n
        bar.set_postfix(tok_s=f"{toks / max(sec, 1e-9):.0f}")

    t0 = time.time()
    meta = {"teacher": str(args.teacher), "max_len": args.max_len, "aux_layers": list(cfg.aux_layers)}
    man = extract_features(runner, head_weight(cfg, tensors), samples, fdir, args.shard_size, meta, progress,
                           greedy_replies=bool(args.regen_dir) and _greedy_regen(args.regen_dir, args.teacher))
    bar.close()
    print(f"[features] {len(man['shards'])} shards, {sum(s['tokens'] for s in man['shards'])} tokens, "
          f"{time.time() - t0:.0f} s this run", flush=True)
    return fdir


def _greedy_regen(regen_dir: str, teacher: str) -> bool:
    """True when ``regen_dir``'s replies were decoded greedily by this teacher (its manifest's meta,
    ``regen_run.teacher_identity``), so a reply token is the teacher's argmax before it."""
    from mindspore_eagle.train.regen_run import teacher_identity

    try:
        with open(os.path.join(regen_dir, "manifest.json"), encoding="utf-8") as f:
            meta = json.load(f).get("meta", {})
        return float(meta.get("temperature", 1.0)) == 0.0 and meta.get("teacher") == teacher_identity(teacher)
    except (OSError, ValueError, TypeError):
        return False


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["regen"]:
        from mindspore_eagle.train.regen_run import main as regen_main

        return regen_main(argv[1:])
    args = parse_args(argv)
    from mindspore_eagle.kernels import runtime

    try:     # msrun / ModelArts: DEVICE_ID = the local rank's NPU (unused on CPU)
        device_id = int(os.environ.get("DEVICE_ID") or 0) if args.device != "CPU" else 0
    except ValueError:
        print(f"error: DEVICE_ID must be an integer, got {os.environ['DEVICE_ID']!r}", file=sys.stderr)
        return 2
    runtime.configure(device_target=args.device, device_id=device_id)
    from mindspore_eagle.train.distributed import DistError, check_batch, init_from_env

    try:
        dist = init_from_env()
        check_batch(args.batch_size, dist.world, args.pack_len)      # before the teacher loads
    except DistError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist.scheduler:       # msrun's scheduler process: init() served the cluster, nothing to train
        return 0
    if dist.world > 1 and args.stage != "train":
        print("error: --stage must be 'train' under msrun (build features once, in one process, first)",
              file=sys.stderr)
        return 2
    from mindspore_eagle.models.checkpoints import load_teacher

    if args.teacher is None:
        from mindspore_eagle.models.fetch import embedded_teacher_path

        args.teacher = str(embedded_teacher_path())
    cfg, tensors, tok = load_teacher(args.teacher)
    print(f"[teacher] {args.teacher}: L={cfg.num_layers} H={cfg.hidden_size} V={cfg.vocab_size} "
          f"aux={cfg.aux_layers}", flush=True)
    try:
        fdir = features_dir(args) if args.stage == "train" else prepare_features(args, cfg, tensors, tok)
    except ValueError as e:                            # a features directory built with other options
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.stage == "features":
        return 0
    from mindspore_eagle.train.trainer import TrainConfig, train

    tc = TrainConfig(out=args.out, features_dir=fdir, vd=args.vd, ttt_length=args.ttt_length, steps=args.steps,
                     lr=args.lr, warmup=args.warmup, schedule=args.schedule, max_len=args.max_len,
                     intermediate=args.intermediate, seed=args.seed, checkpoint_every=args.checkpoint_every,
                     init_from=args.init_from, batch_size=args.batch_size, pack_len=args.pack_len,
                     init=args.init, n_eval=args.n_eval, stop_at=args.stop_at, num_layers=args.num_layers,
                     argmax_weight=args.argmax_weight, fc_norm=args.fc_norm,
                     command=" ".join(["python -m mindspore_eagle.train"] + list(sys.argv[1:] if argv is None
                                                                                  else argv)))
    try:
        train(tc, cfg, tensors, resume=args.resume, dist=dist)
    except (ValueError, FileNotFoundError) as e:       # DistError is a ValueError: every one-line option error
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
