#!/usr/bin/env bash
# Copy the small files of finished or running experiment runs into experiments/results/ (no model weights) and
# write a combined report there. A run that has not finished keeps its journal too (journal*.json and the tensor
# files they name; up to MAX_JOURNAL_MB, default 200), so a later sitting on another machine continues it:
# `fedge sim --resume` on a copy of the folder. Usage: bash experiments/collect.sh SRC_DIR NAME [MORE_SRC_DIRS...]
# (more source folders: runs of the same experiment made elsewhere, e.g. brought back from a GPU machine)
set -euo pipefail
SRC=$1
NAME=$2
shift 2
DEST=experiments/results/$NAME
mkdir -p "$DEST"
runs=()
dirs=("$SRC"/*/)
for more in "$@"; do dirs+=("$more"/*/); done
for run in "${dirs[@]}"; do
  [ -f "$run/metrics.jsonl" ] || continue
  r=$(basename "$run")
  mkdir -p "$DEST/$r"
  for f in config.json partition.json metrics.jsonl summary.json ledger.csv; do
    [ -f "$run/$f" ] && cp "$run/$f" "$DEST/$r/"
  done
  if [ ! -f "$run/summary.json" ]; then
    # A journal holds the server's state, and FedCurv's keeps two values per parameter for each client it heard
    # from (1.3 GB at 100 clients on fedavg_cnn): over MAX_JOURNAL_MB it stays behind, and the run can only be
    # resumed where it ran.
    size_mb=$( (du -smc --apparent-size "$run"/journal-*.safetensors "$run/clients" 2>/dev/null || true) | tail -1 | cut -f1)
    if [ "${size_mb:-0}" -gt "${MAX_JOURNAL_MB:-200}" ]; then
      echo "collect.sh: $r is unfinished and its journal and client states take ${size_mb} MB (over" \
        "MAX_JOURNAL_MB=${MAX_JOURNAL_MB:-200}): left out; resume it in $run" >&2
    else
      cp "$run"/journal*.json "$run"/journal-*.safetensors "$DEST/$r/" 2>/dev/null || true
      [ -d "$run/clients" ] && cp -r "$run/clients" "$DEST/$r/"
    fi
  fi
  runs+=("$DEST/$r")
done
fedge report "${runs[@]}" --out "$DEST/report"
