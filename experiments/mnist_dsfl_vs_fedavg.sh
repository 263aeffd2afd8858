#!/usr/bin/env bash
# DS-FL (ERA and SA) vs FedAvg on real MNIST, non-IID (2 label-sorted shards per client, DS-FL 4.1), as accuracy vs
# cumulative communication (DS-FL Fig. 5). DS-FL model and optimizer (sec. 4.1): the DS-FL MNIST CNN, SGD lr 0.1,
# batch 100, I^p = I^o = 20,000, |o_r| = 1,000, ERA T = 0.1. Scaled to what 2 CPU cores allow: 20 clients (not 100),
# all sampled every round, 1 local and 1 distillation epoch per round (not 5).
# Usage: bash experiments/mnist_dsfl_vs_fedavg.sh [ROUNDS] [OUT]
set -euo pipefail
ROUNDS=${1:-20}
OUT=${2:-runs/mnist-dsfl}
DATA=${FEDGE_DATA:-../shared/data/mnist}
common=(--dataset mnist --data-dir "$DATA" --model dsfl_mnist_cnn --num-clients 20 --client-fraction 1.0
        --partition shards --shards-per-client 2 --local-epochs 1 --batch-size 100 --lr 0.1 --momentum 0
        --lr-decay 1.0 --weight-decay 0 --open-size 20000 --private-size 20000 --open-per-round 1000
        --distill-epochs 1 --distill-lr 0.1 --distill-batch-size 100 --rounds "$ROUNDS" --seed 0 --out "$OUT")
fedge sim --algorithm dsfl --aggregation era --name dsfl-era "${common[@]}"
fedge sim --algorithm dsfl --aggregation sa --name dsfl-sa "${common[@]}"
fedge sim --algorithm fedavg --name fedavg "${common[@]}"
fedge report "$OUT"/*-dsfl-era "$OUT"/*-dsfl-sa "$OUT"/*-fedavg --out "$OUT/report"
