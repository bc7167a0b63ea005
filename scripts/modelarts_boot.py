#!/usr/bin/env python
"""ModelArts / msrun boot file: data-parallel batch inference, one process per rank, merged by rank 0; or, with
``--serve``, the OpenAI-compatible HTTP server (a ModelArts real-time service).

    python scripts/modelarts_boot.py --input IN.jsonl --output OUT.jsonl [--config FILE] [--set k=v] ...
    msrun --worker_num 2 --local_worker_num 2 --join True scripts/modelarts_boot.py --input ... --output ...
    python scripts/modelarts_boot.py --serve [--config FILE] [--set k=v] ...      # listens on 0.0.0.0:8080

Environment (set by ModelArts' Ascend jobs per card, or by MindSpore's ``msrun`` per worker process;
docs/design.md, "ModelArts"):
    RANK_ID    this process's rank r (default 0)        RANK_SIZE  number of ranks N (default 1)
    DEVICE_ID  device index; sets context.device_id unless context.device_target is CPU
    MS_ROLE    msrun also runs this file once as its scheduler (MS_ROLE=MS_SCHED); that process exits at once,
               since the ranks exchange nothing but files (no mindspore.communication.init()).

Steps: every rank reads the whole input (so ids are checked the same way everywhere), keeps record i when
i % N == r, and runs it with ``mindspore_eagle.serving.batch_job.run_batch`` to ``OUT.rank{r}.jsonl`` (resumed by default: a
restarted job skips what its shard already holds). Rank 0 then waits until every shard is complete and writes
OUT.jsonl with all records in input order. ``--merge`` only does that last step (e.g. as a separate job step).
Serving (``--serve``): ``mindspore-eagle serve`` on ``$MSEAGLE_HOST`` (default 0.0.0.0: the container's address
the platform routes to) and ``$MSEAGLE_PORT`` (else ``$PORT``, default 8080, the port ModelArts real-time services
call); ``--host`` / ``--port`` win. Only rank 0 serves (other ranks exit 0). The full warm-up runs first (GET
/health answers 503 until it is done, 200 then: the health check to configure); SIGTERM drains and exits 0.

Exit codes: 0 ok, 2 a known error (one line ``error: ...``).
"""
from __future__ import annotations

import argparse
import os
import sys

from mindspore_eagle.cli import _add_config_args, config_from_args, guarded


def rank_env() -> tuple:
    """(rank, size, device_id or None) from RANK_ID / RANK_SIZE / DEVICE_ID.

    Raises:
        mindspore_eagle.serving.batch_job.BatchError: malformed or inconsistent values.
    """
    from mindspore_eagle.serving.batch_job import BatchError

    try:
        rank, size = int(os.environ.get("RANK_ID", 0)), int(os.environ.get("RANK_SIZE", 1))
        device = os.environ.get("DEVICE_ID")
        device = None if device in (None, "") else int(device)
    except ValueError:
        raise BatchError("RANK_ID, RANK_SIZE and DEVICE_ID must be integers") from None
    if size < 1 or not 0 <= rank < size:
        raise BatchError(f"RANK_ID={rank} is out of range for RANK_SIZE={size}")
    return rank, size, device


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelarts_boot.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", metavar="IN.jsonl", help="batch records (see mindspore_eagle.serving.batch_job)")
    p.add_argument("--output", metavar="OUT.jsonl", help="merged output; shards OUT.rank{r}.jsonl")
    p.add_argument("--serve", action="store_true", help="run the OpenAI-compatible server instead of a batch job "
                   "(host $MSEAGLE_HOST or 0.0.0.0, port $MSEAGLE_PORT / $PORT or 8080)")
    p.add_argument("--host", help="--serve: address to bind (default $MSEAGLE_HOST, else 0.0.0.0)")
    p.add_argument("--port", type=int, help="--serve: port (default $MSEAGLE_PORT, else $PORT, else 8080)")
    p.add_argument("--overwrite", action="store_true", help="start this rank's shard afresh instead of resuming")
    p.add_argument("--merge", action="store_true", help="only merge the (complete) shards into OUT.jsonl")
    p.add_argument("--merge-timeout", type=float, default=86400.0, metavar="S",
                   help="rank 0: seconds to wait for the other shards (default 1 day)")
    _add_config_args(p)
    args = p.parse_args(argv)
    if not args.serve and not (args.input and args.output):
        p.error("--input and --output are required (or --serve)")
    return args


def serve_env(args) -> tuple:
    """(host, port) of ``--serve``: the flags, else $MSEAGLE_HOST / $MSEAGLE_PORT / $PORT, else 0.0.0.0:8080.

    Raises:
        mindspore_eagle.config.ConfigError: a port that is not an integer in [0, 65535].
    """
    from mindspore_eagle.config import ConfigError

    host = args.host or os.environ.get("MSEAGLE_HOST") or "0.0.0.0"   # noqa: S104 - a container's service address
    port = args.port if args.port is not None else os.environ.get("MSEAGLE_PORT") or os.environ.get("PORT") or "8080"
    try:
        port = int(port)
    except ValueError:
        raise ConfigError(f"MSEAGLE_PORT / PORT must be an integer port, got {port!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} is out of range: must be an int in [0, 65535]")
    return host, port


def serve(args) -> int:
    """``--serve``: rank 0 runs the HTTP server until SIGTERM; other ranks have nothing to do."""
    from mindspore_eagle.serving.api_server import serve as run_server
    from mindspore_eagle.serving.api_server import serve_config

    rank, _, device = rank_env()
    if rank != 0:
        print(f"rank {rank}: --serve runs on rank 0 only", file=sys.stderr)
        return 0
    cfg = config_from_args(args)
    if device is not None and cfg.context.device_target != "CPU":
        cfg.context.device_id = device
    cfg.serve.host, cfg.serve.port = serve_env(args)
    return run_server(serve_config(cfg.validate()))


def boot(args) -> int:
    """Run this rank's shard, then (rank 0) wait for all shards and merge them."""
    from mindspore_eagle.serving import batch_job as batch
    from mindspore_eagle.serving.pipeline import build_engine

    if args.serve:
        return serve(args)
    rank, size, device = rank_env()
    records = batch.read_input(args.input)
    if args.merge:
        n = batch.merge_shards(records, args.output, size)
        print(f"rank {rank}: merged {n} records from {size} shard(s) -> {args.output}", file=sys.stderr)
        return 0
    cfg = config_from_args(args)
    if device is not None and cfg.context.device_target != "CPU":
        cfg.context.device_id = device
    mine = batch.shard(records, rank, size)
    out = batch.shard_path(args.output, rank) if size > 1 else args.output
    stats = batch.run_batch(lambda: build_engine(cfg), mine, out, cfg.generation,
                            speculative=cfg.model.drafter != "none", resume=not args.overwrite,
                            overwrite=args.overwrite, progress=sys.stderr.isatty())
    print(f"rank {rank}/{size}: {stats.written} written ({stats.errors} with an error), {stats.skipped} already "
          f"done, {stats.total} in shard -> {out} ({stats.seconds:.1f} s)", file=sys.stderr, flush=True)
    if rank == 0 and size > 1:
        n = batch.wait_and_merge(records, args.output, size, timeout_s=args.merge_timeout)
        print(f"rank 0: merged {n} records from {size} shards -> {args.output}", file=sys.stderr, flush=True)
    return 0


def main(argv=None) -> int:
    if os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun's scheduler process: nothing to do
        return 0
    return guarded(lambda: boot(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
