#!/usr/bin/env bash
# FedNTD Table 1's MNIST column at the paper's scale: 100 clients, 10% sampled per round, 200 rounds, sharding s = 2
# and LDA alpha = 0.1, local epochs 3, batch 50, momentum SGD lr 0.01 (decay 0.99 per round, weight decay 1e-5), the
# FedAvg CNN (Appendix B). One run per (partition, algorithm); a killed run is resumed from its journal when the
# script is started again with the same OUT (fedge sim --resume), so it can be spread over several sittings.
# Usage: bash experiments/fedntd_table1_mnist.sh [ROUNDS] [OUT] [PARTITIONS] [ALGORITHMS]
#   e.g. bash experiments/fedntd_table1_mnist.sh 200 runs/fedntd-table1 "shards dirichlet" "fedavg fedntd"
# The paper's data pipeline (appendix B.2-B.3: 50,000 training images; random crop, flip and Cutout, fedge.data.augment):
#   AUGMENT=paper TRAIN_SIZE=50000 bash experiments/fedntd_table1_mnist.sh 200 runs/fedntd-table1-augmented
# Another seed (partition, initial model, client sampling, batch order and augmentation all follow it; the run's name
# gets a -seedN suffix so seed 0's runs are not resumed by mistake):
#   SEED=1 AUGMENT=paper TRAIN_SIZE=50000 bash experiments/fedntd_table1_mnist.sh 200 runs/fedntd-table1-augmented shards fedavg
# Algorithms beyond the default four: fednova, feddyn (alpha 0.1, the authors' setting), fedadam, fedcurv (lambda 1,
# 500 Fisher samples: the authors' config/fedcurv.json, fedge's defaults), moon (mu 1, tau 0.5: FedNTD Table 5, fedge's
# defaults).
set -euo pipefail
ROUNDS=${1:-200}
OUT=${2:-runs/fedntd-table1}
PARTITIONS=${3:-shards dirichlet}
ALGORITHMS=${4:-fedavg fedntd fedprox scaffold}
DATA=${FEDGE_DATA:-../shared/data/mnist}
FEDGE=${FEDGE:-fedge}
EXECUTOR=${EXECUTOR:-auto}   # sequential when two runs share the machine
AUGMENT=${AUGMENT:-none}     # none (the first runs) | paper
TRAIN_SIZE=${TRAIN_SIZE:-0}  # 0: all 60,000 training images
SEED=${SEED:-0}
for partition in $PARTITIONS; do
  for algorithm in $ALGORITHMS; do
    name="$partition-$algorithm"
    [[ $SEED != 0 ]] && name+="-seed$SEED"
    extra=()
    [[ $algorithm == fedprox ]] && extra+=(--prox-mu 0.1)        # FedNTD Table 5
    [[ $algorithm == feddyn ]] && extra+=(--dyn-alpha 0.1)       # the FedNTD authors' config/feddyn.json
    existing=$(ls -d "$OUT"/*-"$name" 2>/dev/null | head -1 || true)
    if [[ -n $existing && -f $existing/summary.json ]]; then
      echo "done already: $existing"
    elif [[ -n $existing ]]; then
      "$FEDGE" sim --resume "$existing" --executor "$EXECUTOR"
    else
      "$FEDGE" sim --algorithm "$algorithm" --name "$name" --dataset mnist --data-dir "$DATA" --model fedavg_cnn \
        --num-clients 100 --client-fraction 0.1 --partition "$partition" --shards-per-client 2 \
        --dirichlet-alpha 0.1 --local-epochs 3 --batch-size 50 --lr 0.01 --momentum 0.9 --rounds "$ROUNDS" \
        --seed "$SEED" --eval-every 5 --augment "$AUGMENT" --train-size "$TRAIN_SIZE" --executor "$EXECUTOR" --out "$OUT" \
        "${extra[@]}"
    fi
  done
done
