#!/usr/bin/env bash
# Regeneration throughput (new tokens/s) of `python -m mindspore_eagle.train regen` for several batch sizes.
#   bash scripts/bench_regen.sh [SECONDS_EACH=240] [OUT=runs/regen_bench] [BATCHES="8 16 32 48"]
# Run it from the repository's root (OUT is relative to the current folder; runs/ is ignored by git).
# Each batch size answers the same registry prefix (the first 600 prompts, balanced over kinds) into a fresh
# directory for SECONDS_EACH seconds of generation (model load and registry build not counted), max_len 512.
# The "[regen] summary" line of each run has tok_s (new tokens / wall seconds, compile included) and compile_s.
set -euo pipefail
secs=${1:-240}
out=${2:-runs/regen_bench}
batches=${3:-"8 16 32 48"}
mkdir -p "$out"
for b in $batches; do
  rm -rf "$out/b$b"
  python -m mindspore_eagle.train regen --out "$out/b$b" --prompts 600 --max-len 512 --batch "$b" \
    --shard-size 16 --time-limit "$secs" > "$out/b$b.log" 2>&1 || true
  grep -E "^\[regen\] summary" "$out/b$b.log" | tee -a "$out/summary.txt"
done
