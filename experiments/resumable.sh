# Sourced by the experiment scripts: run_resumable NAME FLAGS... runs `fedge sim --name NAME FLAGS...` into "$OUT"
# unless a run directory of that name has finished there (summary.json: skipped) or was killed (continued with
# --resume from its journal). Uses $OUT and $FEDGE (default: fedge). One run at a time.
run_resumable() {
  local name=$1
  shift
  local existing
  existing=$(ls -d "$OUT"/*-"$name" 2>/dev/null | tail -1 || true)
  if [ -n "$existing" ] && [ -f "$existing/summary.json" ]; then
    echo "done: $existing"
  elif [ -n "$existing" ]; then
    echo "resuming: $existing"
    "${FEDGE:-fedge}" sim --resume "$existing" --quiet --no-report
  else
    echo "starting: $name"
    "${FEDGE:-fedge}" sim --name "$name" "$@"
  fi
}
