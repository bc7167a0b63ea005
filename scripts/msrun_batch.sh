#!/usr/bin/env bash
# Data-parallel batch inference with MindSpore's own launcher, msrun: WORKERS CPU worker processes on this
# machine, each running scripts/modelarts_boot.py on its shard (record i -> rank i % WORKERS); rank 0 merges the
# shards into OUT.jsonl in input order.
#
#   scripts/msrun_batch.sh IN.jsonl OUT.jsonl [modelarts_boot.py options: --config FILE --set k=v ...]
#
# Environment: WORKERS (default 2), MASTER_PORT (msrun scheduler port, default 8118), LOG_DIR (worker logs,
# default ./msrun_log), PYTHON (interpreter msrun starts; default: `python` on PATH).
# msrun exports to each worker MS_ROLE=MS_WORKER, MS_NODE_ID=RANK_ID=<rank>, RANK_SIZE, DEVICE_ID=<local rank>,
# MS_WORKER_NUM, MS_SCHED_HOST/PORT; it also runs the script once as the scheduler (MS_ROLE=MS_SCHED, which
# modelarts_boot.py ignores). Each worker gets one CPU kernel thread (context.threads=1); later --set wins.
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ $# -lt 2 ]]; then usage >&2; exit 2; fi
IN=$1
OUT=$2
shift 2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORKERS=${WORKERS:-2}
LOG_DIR=${LOG_DIR:-msrun_log}
if [[ -n "${PYTHON:-}" ]]; then   # msrun launches `python <script>` from PATH: put a `python` running $PYTHON first
  SHIM=$(mktemp -d)
  trap 'rm -rf "$SHIM"' EXIT
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$PYTHON" > "$SHIM/python"
  chmod +x "$SHIM/python"
  PATH="$SHIM:$PATH"
fi

rc=0
msrun --worker_num "$WORKERS" --local_worker_num "$WORKERS" --master_port "${MASTER_PORT:-8118}" \
  --join True --log_dir "$LOG_DIR" \
  "$HERE/modelarts_boot.py" --input "$IN" --output "$OUT" --set context.threads=1 "$@" || rc=$?
if [[ $rc -ne 0 || ! -s "$OUT" ]]; then
  echo "error: msrun batch failed (exit $rc); worker logs in $LOG_DIR:" >&2
  for f in "$LOG_DIR"/worker_*.log; do
    [[ -f "$f" ]] && { echo "--- $f" >&2; tail -n 5 "$f" >&2; }
  done
  exit 2
fi
echo "merged output: $OUT" >&2
