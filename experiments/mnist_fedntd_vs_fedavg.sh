#!/usr/bin/env bash
# FedNTD vs FedAvg on real MNIST with FedNTD's setup (Appendix B): 100 clients, sharding s = 2, 10% sampled per round,
# local epochs 3, batch 50, momentum SGD lr 0.01 (decay 0.99 per round, weight decay 1e-5), the FedAvg CNN (B.1).
# Usage: bash experiments/mnist_fedntd_vs_fedavg.sh [ROUNDS] [OUT]
set -euo pipefail
ROUNDS=${1:-40}
OUT=${2:-runs/mnist-fedntd}
DATA=${FEDGE_DATA:-../shared/data/mnist}
common=(--dataset mnist --data-dir "$DATA" --model fedavg_cnn --num-clients 100 --client-fraction 0.1
        --partition shards --shards-per-client 2 --local-epochs 3 --batch-size 50 --lr 0.01 --momentum 0.9
        --rounds "$ROUNDS" --seed 0 --out "$OUT")
fedge sim --algorithm fedavg --name fedavg "${common[@]}"
fedge sim --algorithm fedntd --name fedntd "${common[@]}"
fedge report "$OUT"/*-fedavg "$OUT"/*-fedntd --out "$OUT/report"
