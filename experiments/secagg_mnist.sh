#!/usr/bin/env bash
# Issue 50's accuracy check of secure aggregation: FedAvg and FedNTD on real MNIST with FedNTD's setup (100 clients,
# shards s = 2, fedavg_cnn, 3 local epochs, batch 50, momentum SGD lr 0.01), 50 rounds, with and without
# --secure-aggregation (SecAgg+ in process: clipping to --secagg-clip, fixed point in a 2^32 ring, masks), for a cohort
# of 10 (--client-fraction 0.1) and, with COHORTS="10 100", of 100 (1.0: ten times the compute a round).
#
# Resumable: a finished run (summary.json) is skipped, a killed one continues with --resume; runs one at a time.
# Usage: [COHORTS="10 100"] bash experiments/secagg_mnist.sh [ROUNDS] [OUT]
set -euo pipefail
ROUNDS=${1:-50}
OUT=${2:-experiments/results/secagg-mnist}
FEDGE=${FEDGE:-fedge}
DATA=${FEDGE_DATA:-../shared/data/mnist}
COHORTS=${COHORTS:-10}
mkdir -p "$OUT"
source "$(dirname "$0")/resumable.sh"
for cohort in $COHORTS; do
  fraction=$(python3 -c "print($cohort / 100)")
  common=(--dataset mnist --data-dir "$DATA" --model fedavg_cnn --num-clients 100 --client-fraction "$fraction"
          --partition shards --shards-per-client 2 --local-epochs 3 --batch-size 50 --lr 0.01 --momentum 0.9
          --rounds "$ROUNDS" --seed 0 --quiet --no-report --out "$OUT")
  for algorithm in fedavg fedntd; do
    run_resumable "$algorithm-c$cohort-plain" --algorithm "$algorithm" "${common[@]}"
    run_resumable "$algorithm-c$cohort-secagg" --algorithm "$algorithm" --secure-aggregation "${common[@]}"
  done
done
"$FEDGE" report "$OUT"/*-c* --out "$OUT/report"
