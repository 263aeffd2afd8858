#!/usr/bin/env bash
# The scaled-down version of experiments/dp_mnist.sh that fits a 2-core machine (minutes, not hours): scikit-learn's
# bundled 8x8 digits, 300 clients (shards, s = 2: about 5 images each), 60 expected a round (Poisson, q = 0.2), the
# tiny MLP, FedAvg and FedNTD, DP-FedAvg with adaptive clipping at Z in {0.5, 1, 2} plus the non-private run, and for
# FedAvg at Z = 1 three fixed clips beside the adaptive one; epsilon at delta = 1e-5 (RDP); noise seeded for
# reproducibility (--dp-noise-seed 0).
#
# Resumable: a finished run (summary.json) is skipped, a killed one continues with --resume; runs one at a time.
# Usage: bash experiments/dp_digits.sh [ROUNDS] [OUT]
set -euo pipefail
ROUNDS=${1:-100}
OUT=${2:-experiments/results/dp-digits}
FEDGE=${FEDGE:-fedge}
common=(--dataset digits --model tiny_mlp --num-clients 300 --client-fraction 0.2 --partition shards
        --shards-per-client 2 --local-epochs 3 --batch-size 10 --lr 0.05 --momentum 0.9 --rounds "$ROUNDS" --seed 0
        --executor sequential --quiet --no-report --out "$OUT")
mkdir -p "$OUT"
source "$(dirname "$0")/resumable.sh"
dp=(--dp-delta 1e-5 --dp-noise-seed 0)
for algorithm in fedavg fedntd; do
  run_resumable "$algorithm-nodp" "${common[@]}" --algorithm "$algorithm"
  for z in 0.5 1 2; do
    run_resumable "$algorithm-z$z" "${common[@]}" --algorithm "$algorithm" --dp-noise-multiplier "$z" --dp-clip adaptive "${dp[@]}"
  done
done
for clip in 0.3 1 3; do
  run_resumable "fedavg-z1-clip$clip" "${common[@]}" --algorithm fedavg --dp-noise-multiplier 1 --dp-clip "$clip" "${dp[@]}"
done
run_resumable "fedavg-z1-secagg" "${common[@]}" --algorithm fedavg --dp-noise-multiplier 1 --dp-clip adaptive --secure-aggregation "${dp[@]}"
"$FEDGE" report "$OUT"/*-fedavg-* --out "$OUT/report-fedavg"
"$FEDGE" report "$OUT"/*-fedntd-* --out "$OUT/report-fedntd"
