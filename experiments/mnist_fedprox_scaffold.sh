#!/usr/bin/env bash
# FedProx and SCAFFOLD next to FedAvg and FedNTD on real MNIST with FedNTD's setup (Appendix B; Table 1's MNIST
# column): 100 clients, sharding s = 2, 10% sampled per round, local epochs 3, batch 50, momentum SGD lr 0.01 (decay
# 0.99 per round, weight decay 1e-5), the FedAvg CNN (B.1); FedProx mu = 0.1 (FedNTD Table 5), SCAFFOLD lr_g = 1.
# FedAvg and FedNTD come from experiments/mnist_fedntd_vs_fedavg.sh (same settings and seed).
# Usage: bash experiments/mnist_fedprox_scaffold.sh [ROUNDS] [OUT]
set -euo pipefail
ROUNDS=${1:-40}
OUT=${2:-runs/mnist-fl-baselines}
DATA=${FEDGE_DATA:-../shared/data/mnist}
common=(--dataset mnist --data-dir "$DATA" --model fedavg_cnn --num-clients 100 --client-fraction 0.1
        --partition shards --shards-per-client 2 --local-epochs 3 --batch-size 50 --lr 0.01 --momentum 0.9
        --rounds "$ROUNDS" --seed 0 --out "$OUT")
fedge sim --algorithm fedprox --prox-mu 0.1 --name fedprox "${common[@]}"
fedge sim --algorithm scaffold --name scaffold "${common[@]}"
