#!/usr/bin/env bash
# Compressed transfers against float32 on real MNIST (issue 11): accuracy after the same rounds and the bytes moved.
#  - DS-FL (ERA) with soft labels (uploads and the global broadcast) as float32, float16, int8 with one scale per
#    message (1 byte per value), and top-2 per row with float16 values (index + value + the row's dropped mass);
#    the DS-FL setting of experiments/mnist_dsfl_vs_fedavg.sh scaled to 10 clients and 10 rounds.
#  - FedAvg and FedNTD (FedNTD's setup: 100 clients, 10% sampled, shards s = 2) with uploads as float32, int8 deltas
#    (one scale per tensor, float16 broadcast) and top-5% deltas with error feedback, 20 rounds.
# Usage: bash experiments/compression.sh [OUT] [PART: dsfl|fl|all]
set -euo pipefail
OUT=${1:-runs/compression}
PART=${2:-all}
DATA=${FEDGE_DATA:-../shared/data/mnist}
FEDGE=${FEDGE:-fedge}
EXECUTOR=${EXECUTOR:-auto}
run() {  # name, then flags; skips a run that finished, resumes one that was killed
  local name=$1; shift
  local existing; existing=$(ls -d "$OUT"/*-"$name" 2>/dev/null | head -1 || true)
  if [[ -n $existing && -f $existing/summary.json ]]; then echo "done already: $existing"; return; fi
  if [[ -n $existing ]]; then "$FEDGE" sim --resume "$existing" --executor "$EXECUTOR"; return; fi
  "$FEDGE" sim --name "$name" --out "$OUT" --executor "$EXECUTOR" --seed 0 "$@"
}
if [[ $PART == dsfl || $PART == all ]]; then
  dsfl=(--algorithm dsfl --aggregation era --dataset mnist --data-dir "$DATA" --model dsfl_mnist_cnn --num-clients 10
        --client-fraction 1.0 --partition shards --shards-per-client 2 --local-epochs 1 --batch-size 100 --lr 0.1
        --momentum 0 --lr-decay 1.0 --weight-decay 0 --open-size 20000 --private-size 20000 --open-per-round 1000
        --distill-epochs 1 --distill-lr 0.1 --distill-batch-size 100 --rounds 10)
  run dsfl-float32 "${dsfl[@]}"
  run dsfl-float16 "${dsfl[@]}" --upload-codec float16 --broadcast-codec float16
  run dsfl-int8 "${dsfl[@]}" --upload-codec int8:tensor --broadcast-codec int8:tensor
  run dsfl-top2 "${dsfl[@]}" --upload-codec topk:k=2,side=float16 --broadcast-codec topk:k=2,side=float16
fi
if [[ $PART == fl || $PART == all ]]; then
  fl=(--dataset mnist --data-dir "$DATA" --model fedavg_cnn --num-clients 100 --client-fraction 0.1
      --partition shards --shards-per-client 2 --local-epochs 3 --batch-size 50 --lr 0.01 --momentum 0.9 --rounds 20)
  for algorithm in fedavg fedntd; do
    run "$algorithm-float32" --algorithm "$algorithm" "${fl[@]}"
    run "$algorithm-int8" --algorithm "$algorithm" "${fl[@]}" --upload-codec int8:tensor --broadcast-codec float16
    run "$algorithm-top5" --algorithm "$algorithm" "${fl[@]}" --upload-codec topk:density=0.05
  done
fi
"$FEDGE" report "$OUT"/*-dsfl-* --out "$OUT/report-dsfl" 2>/dev/null || true
"$FEDGE" report "$OUT"/*-fed* --out "$OUT/report-fl" 2>/dev/null || true
