#!/usr/bin/env bash
# DS-FL Table III (a) / Fig. 5 (a), MNIST, I^o = 20,000, at the paper's scale: 100 clients (all of them every round),
# non-IID (two label-sorted shards of I^p / 2K = 100 images each), I^p = I^o = 20,000, |o_r| = 1,000, SGD lr 0.1,
# batch 100, 5 epochs of local update and 5 of distillation per round (sec. 4.1), ERA T = 0.1, the DS-FL MNIST CNN.
# One run per method; a killed run is resumed from its journal when the script is started again with the same OUT.
# On a 2-core machine a round of 100 DS-FL clients takes minutes: spread it over several sittings. On a GPU machine
# start NVIDIA MPS first (nvidia-cuda-mps-control -d), then DEVICE=cuda WORKERS=<cores - 1>: 2.5 s a round on an H200.
# Usage: [EXECUTOR=auto] [WORKERS=N] [DEVICE=cpu|cuda] bash experiments/dsfl_mnist_paper_scale.sh [ROUNDS] [OUT] [METHODS]
#   e.g. bash experiments/dsfl_mnist_paper_scale.sh 40 runs/dsfl-paper "era sa fedavg"
set -euo pipefail
ROUNDS=${1:-40}
OUT=${2:-runs/dsfl-paper}
METHODS=${3:-era sa fedavg}
DATA=${FEDGE_DATA:-../shared/data/mnist}
FEDGE=${FEDGE:-fedge}
EXECUTOR=${EXECUTOR:-auto}
runner=(--executor "$EXECUTOR" --device "${DEVICE:-cpu}")
[[ -n ${WORKERS:-} ]] && runner+=(--workers "$WORKERS")
common=(--dataset mnist --data-dir "$DATA" --model dsfl_mnist_cnn --num-clients 100 --client-fraction 1.0
        --partition shards --shards-per-client 2 --local-epochs 5 --batch-size 100 --lr 0.1 --momentum 0
        --lr-decay 1.0 --weight-decay 0 --open-size 20000 --private-size 20000 --rounds "$ROUNDS" --seed 0)
dsfl=(--open-per-round 1000 --distill-epochs 5 --distill-lr 0.1 --distill-batch-size 100)
for method in $METHODS; do
  name="paper-$method"
  case $method in
    era|sa) flags=(--algorithm dsfl --aggregation "$method" "${dsfl[@]}") ;;
    fedavg) flags=(--algorithm fedavg) ;;
    *) echo "unknown method $method (era, sa, fedavg)" >&2; exit 2 ;;
  esac
  existing=$(ls -d "$OUT"/*-"$name" 2>/dev/null | head -1 || true)
  if [[ -n $existing && -f $existing/summary.json ]]; then
    echo "done already: $existing"
  elif [[ -n $existing ]]; then
    "$FEDGE" sim --resume "$existing" "${runner[@]}"
  else
    "$FEDGE" sim "${flags[@]}" --name "$name" "${common[@]}" "${runner[@]}" --out "$OUT"
  fi
done
