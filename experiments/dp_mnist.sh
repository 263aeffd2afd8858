#!/usr/bin/env bash
# Client-level DP (issue 51): FedAvg and FedNTD on MNIST, 1,000 clients of 60 images each (shards, s = 2), 100 expected
# a round (Poisson, q = 0.1), DP-FedAvg with adaptive clipping at Z in {0.5, 1, 2} plus the non-private run; epsilon
# at delta = 1e-5 (RDP). FedNTD's local setup otherwise (FedNTD Appendix B: local epochs 3, batch 50, momentum SGD lr
# 0.01, decay 0.99 a round), the FedAvg CNN.
#
# Resumable: a finished run (summary.json) is skipped, a killed one continues with --resume; runs one at a time.
# Usage: bash experiments/dp_mnist.sh [ROUNDS] [OUT] [ALGORITHMS] [ZS]
#   MODEL=tiny_mlp (default fedavg_cnn): the model; CLIPS="0.1 0.3 1": fixed clips instead of the adaptive one
#   (one run per clip and Z); EVAL_EVERY (default 2).
#   the issue's full experiment: bash experiments/dp_mnist.sh 200 runs/dp-mnist "fedavg fedntd" "0 0.5 1 2"
#   (hours on a laptop CPU; what was run on the 2-core machine so far: experiments/results/dp-mnist/README.md)
set -euo pipefail
ROUNDS=${1:-200}
OUT=${2:-runs/dp-mnist}
ALGORITHMS=${3:-fedavg fedntd}
ZS=${4:-0 0.5 1 2}
DATA=${FEDGE_DATA:-../shared/data/mnist}
FEDGE=${FEDGE:-fedge}
common=(--dataset mnist --data-dir "$DATA" --model "${MODEL:-fedavg_cnn}" --num-clients 1000 --client-fraction 0.1
        --partition shards --shards-per-client 2 --local-epochs 3 --batch-size 50 --lr 0.01 --momentum 0.9
        --rounds "$ROUNDS" --seed 0 --eval-every "${EVAL_EVERY:-2}" --quiet --no-report --out "$OUT")
mkdir -p "$OUT"
source "$(dirname "$0")/resumable.sh"
for algorithm in $ALGORITHMS; do
  for z in $ZS; do
    if [ "$z" = "0" ]; then
      run_resumable "$algorithm-nodp" --algorithm "$algorithm" "${common[@]}"
    elif [ -z "${CLIPS:-}" ]; then
      run_resumable "$algorithm-z$z" --algorithm "$algorithm" "${common[@]}" \
        --dp-noise-multiplier "$z" --dp-clip adaptive --dp-delta 1e-5
    else
      for clip in $CLIPS; do  # fixed clips, against the adaptive clip's run
        run_resumable "$algorithm-z$z-clip$clip" --algorithm "$algorithm" "${common[@]}" \
          --dp-noise-multiplier "$z" --dp-clip "$clip" --dp-delta 1e-5
      done
    fi
  done
done
"$FEDGE" report "$OUT"/*-* --out "$OUT/report"
