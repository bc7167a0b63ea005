#!/usr/bin/env python
"""MindFormers-style entry point: ``run_mindformer.py`` arguments, EAGLE-3 speculative decoding underneath.

    python scripts/run_eagle.py --config configs/default.yaml --run_mode predict \
        --predict_data "What is the capital of France?"
    python scripts/run_eagle.py --config configs/openpangu_embedded_7b.yaml --run_mode predict \
        --predict_data prompts.txt --load_checkpoint /path/to/openPangu-Embedded-7B --device_id 0

Arguments (MindFormers' run_mindformer.py names; docs/design.md, "MindFormers configuration and entry point"):
    --config             our YAML (configs/*.yaml; repeatable to add a preset). Default: built-in defaults.
    --run_mode           only ``predict`` (drafters are trained with ``mindspore-eagle train-drafter``).
    --predict_data       one or more texts, or a file: ``.txt`` = one prompt per line, ``.jsonl`` = batch records
                         ({"id", "prompt" | "messages" | "turns"}, see mindspore_eagle/serving/batch_job.py).
    --load_checkpoint / --pretrained_model_dir   teacher path (overrides model.teacher).
    --device_id          context.device_id.  --mode 0|1   context.mode (1 = PyNative, eager).
    --use_parallel       True: data parallel over RANK_SIZE processes (RANK_ID from ModelArts or msrun), record
                         i on rank i % RANK_SIZE, rank 0 merges and writes the result file.
    --predict_batch_size accepted; records run one after another (one sequence per step).
    --set section.key=value   our config overrides.   --output_dir DIR  where result files go (default ./output).
Other MindFormers options (``--auto_trans_ckpt`` ...) are accepted and ignored with a note.

Output: each answer on stdout; ``text_generation_result.txt`` gets one line per prompt in MindFormers' format
``{'text_generation_text': [answer]}``, and ``text_generation_result.jsonl`` the full batch records (token
counts, tok/s, mean accept length). Exit codes: 0 ok, 2 a known error or a prompt that failed (``error: ...``).
"""
from __future__ import annotations

import argparse
import os
import sys

from mindspore_eagle.cli import guarded

RESULT_TXT = "text_generation_result.txt"


def str2bool(text: str) -> bool:
    """MindFormers' boolean flags: True/False (any case), 1/0, yes/no."""
    t = str(text).strip().lower()
    if t in ("true", "1", "yes"):
        return True
    if t in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="run_eagle.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--config", action="append", default=[], metavar="FILE")
    p.add_argument("--run_mode", default="predict")
    p.add_argument("--predict_data", nargs="+", required=True, metavar="TEXT_OR_FILE")
    p.add_argument("--load_checkpoint", "--pretrained_model_dir", dest="teacher", metavar="PATH")
    p.add_argument("--device_id", type=int)
    p.add_argument("--mode", type=int, choices=(0, 1))
    p.add_argument("--use_parallel", type=str2bool, default=False)
    p.add_argument("--predict_batch_size", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--output_dir", default="./output", metavar="DIR",
                   help="where text_generation_result.txt / .jsonl go (created; MindFormers' default ./output)")
    args, unknown = p.parse_known_args(argv)
    ignored = [a for a in unknown if a.startswith("--")]
    if ignored:
        print(f"note: ignoring MindFormers options not used here: {' '.join(ignored)}", file=sys.stderr)
    return args


def build_records(predict_data: list) -> list:
    """InputRecords from ``--predict_data``: texts, a .txt file (one prompt per line) or a .jsonl batch file.

    Raises:
        BatchError: an empty file or prompt, a bad .jsonl file (see ``batch.read_input``).
    """
    from mindspore_eagle.serving.batch_job import BatchError, InputRecord, read_input

    if len(predict_data) == 1 and os.path.isfile(predict_data[0]):
        path = predict_data[0]
        if path.endswith(".jsonl"):
            return read_input(path)
        with open(path, encoding="utf-8") as f:
            texts = [line.strip() for line in f if line.strip()]
        if not texts:
            raise BatchError(f"predict_data file {path!r} is empty: expected one prompt per line")
    else:
        texts = [t for t in predict_data if t.strip()]
        if not texts:
            raise BatchError("predict_data is empty: give a prompt text or a .txt / .jsonl file")
    return [InputRecord(line=i + 1, index=i, id=i, kind="prompt", payload=t) for i, t in enumerate(texts)]


def predict(args) -> int:
    """Run ``--predict_data`` and write the MindFormers-style result files (rank 0 only when parallel)."""
    from mindspore_eagle.config import ConfigError, load_config

    if args.run_mode != "predict":
        raise ConfigError(f"run_mode {args.run_mode!r} is not supported by run_eagle.py: only 'predict' "
                          "(train drafters with mindspore-eagle train-drafter)")
    from mindspore_eagle.serving import batch_job as batch
    from mindspore_eagle.serving.pipeline import build_engine

    overrides = list(args.set)
    cfg = load_config(args.config or None, overrides)
    if args.teacher:
        cfg.model.teacher = args.teacher
    if args.device_id is not None:
        cfg.context.device_id = args.device_id
    if args.mode is not None:
        cfg.context.mode = args.mode
    cfg.validate()
    if args.predict_batch_size > 1:
        print(f"note: predict_batch_size {args.predict_batch_size}: records run one after another",
              file=sys.stderr)
    records = build_records(args.predict_data)
    rank, size = 0, 1
    if args.use_parallel:
        rank, size = int(os.environ.get("RANK_ID", 0)), int(os.environ.get("RANK_SIZE", 1))
    os.makedirs(args.output_dir, exist_ok=True)
    out = os.path.join(args.output_dir, "text_generation_result.jsonl")
    mine = batch.shard(records, rank, size)
    stats = batch.run_batch(lambda: build_engine(cfg), mine, batch.shard_path(out, rank) if size > 1 else out,
                            cfg.generation, speculative=cfg.model.drafter != "none", overwrite=True,
                            progress=False)
    if size > 1:
        if rank != 0:
            return 0
        batch.wait_and_merge(records, out, size)
    results = batch.read_results(out)
    failed = 0
    with open(os.path.join(args.output_dir, RESULT_TXT), "w", encoding="utf-8") as f:
        for r in results:
            if "error" in r:
                failed += 1
                print(f"error: {r['error']}", file=sys.stderr)
                continue
            f.write(str({"text_generation_text": r["text"] if isinstance(r["text"], list) else [r["text"]]})
                    + "\n")
            texts = r["text"] if isinstance(r["text"], list) else [r["text"]]
            print("\n".join(texts), flush=True)
            accept = f", mean L_k {r['mean_accept_len']:.2f}" if cfg.model.drafter != "none" else ""
            print(f"[{r['new_tokens']} new tokens, {r['tok_per_s']:.2f} tok/s{accept}]", file=sys.stderr, flush=True)
    print(f"results: {os.path.join(args.output_dir, RESULT_TXT)} ({len(results) - failed} ok, {failed} failed; "
          f"{stats.seconds:.1f} s)", file=sys.stderr)
    return 2 if failed else 0


def main(argv=None) -> int:
    if os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun's scheduler process
        return 0
    return guarded(lambda: predict(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
