#!/usr/bin/env bash
# Data-parallel drafter training with MindSpore's launcher, msrun: WORKERS processes on this node run the same
# `python -m mindspore_eagle.train --stage train` command; gradients are all-reduced (mean) every optimiser step
# (mccl on CPU, hccl on Ascend; mindspore_eagle/train/distributed.py), rank 0 writes OUT.
#
#   scripts/msrun_train.sh OUT FEATURES_DIR [train options: --steps N --batch-size G --lr X --resume ...]
#
# --batch-size G (rows per optimiser step over all workers; each worker runs one batched step of G / WORKERS
# rows) defaults to WORKERS and must be a multiple of it; --pack-len is refused (one process only).
# Environment: WORKERS (total workers, default 2), LOCAL_WORKERS (on this node, default WORKERS), DEVICE (CPU,
# Ascend; default CPU), THREADS (CPU kernel threads per worker, default nproc / LOCAL_WORKERS, at least 1),
# MASTER_ADDR (scheduler host, default 127.0.0.1), MASTER_PORT (default 8119), NODE_RANK (multi-node: this node's
# index, default -1 = automatic), LOG_DIR (worker logs, default ./msrun_train_log), PYTHON (interpreter msrun
# starts; default `python` on PATH). FEATURES_DIR and OUT must be the same paths on every node (resume reads
# OUT/resume/state.npz, which only rank 0 writes).
set -euo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ $# -lt 2 ]]; then usage >&2; exit 2; fi
OUT=$1
FEATURES=$2
shift 2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORKERS=${WORKERS:-2}
LOCAL_WORKERS=${LOCAL_WORKERS:-$WORKERS}
DEVICE=${DEVICE:-CPU}
LOG_DIR=${LOG_DIR:-msrun_train_log}
THREADS=${THREADS:-$(( $(nproc) / LOCAL_WORKERS ))}
(( THREADS >= 1 )) || THREADS=1
export MSEAGLE_THREADS=$THREADS
export PYTHONPATH="$(dirname "$HERE")${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's mindspore_eagle
if [[ -n "${PYTHON:-}" ]]; then   # msrun launches `python` from PATH: put a `python` running $PYTHON first
  SHIM=$(mktemp -d)
  trap 'rm -rf "$SHIM"' EXIT
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$PYTHON" > "$SHIM/python"
  chmod +x "$SHIM/python"
  PATH="$SHIM:$PATH"
fi

rc=0
msrun --worker_num "$WORKERS" --local_worker_num "$LOCAL_WORKERS" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
  --master_port "${MASTER_PORT:-8119}" --node_rank "${NODE_RANK:--1}" --join True --log_dir "$LOG_DIR" \
  python -m mindspore_eagle.train --out "$OUT" --features-dir "$FEATURES" --stage train --device "$DEVICE" \
  --batch-size "$WORKERS" "$@" || rc=$?
if [[ $rc -ne 0 ]]; then
  echo "error: msrun training failed (exit $rc); worker logs in $LOG_DIR:" >&2
  for f in "$LOG_DIR"/worker_*.log; do
    [[ -f "$f" ]] && { echo "--- $f" >&2; tail -n 8 "$f" >&2; }
  done
  exit 2
fi
echo "drafter: $OUT (log $OUT/train_log.jsonl, summary $OUT/summary.json)" >&2
