#!/usr/bin/env bash
# Copy the small files of finished or running experiment runs into experiments/results/ (no model weights) and
# write a combined report there. Usage: bash experiments/collect.sh SRC_DIR NAME
set -euo pipefail
SRC=$1
NAME=$2
DEST=experiments/results/$NAME
mkdir -p "$DEST"
runs=()
for run in "$SRC"/*/; do
  [ -f "$run/metrics.jsonl" ] || continue
  r=$(basename "$run")
  mkdir -p "$DEST/$r"
  for f in config.json partition.json metrics.jsonl summary.json ledger.csv; do
    [ -f "$run/$f" ] && cp "$run/$f" "$DEST/$r/"
  done
  runs+=("$DEST/$r")
done
fedge report "${runs[@]}" --out "$DEST/report"
