#!/usr/bin/env bash
# DS-FL Table IV (sec. 4, "Model poisoning") scaled to a 2-core machine: one malicious client among 10, IID MNIST,
# backdoor task Fashion-MNIST. FL (mean with and without fedge's update bound, a bound-aware attacker, median, trimmed
# mean, norm clipping) and DS-FL (SA, ERA); see experiments/poisoning.py. About 20 minutes on one core.
# Usage: bash experiments/poisoning.sh [OUT]   (the data root holds mnist/ and fashion_mnist/: FEDGE_DATA)
set -euo pipefail
OUT=${1:-experiments/results/poisoning}
export OMP_NUM_THREADS=1
${PYTHON:-python} experiments/poisoning.py --data-dir "${FEDGE_DATA:-../shared/data}" \
  --clients 10 --rounds 10 --attack-every 5 --private-size 5000 --open-size 10000 --open-per-round 500 \
  --local-epochs 1 --batch-size 50 --wx-samples 10000 --wx-epochs 2 --eval-samples 1000 --probe-samples 1000 \
  --seed 0 --runs runs/poisoning --out "$OUT"
