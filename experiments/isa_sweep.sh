#!/usr/bin/env bash
# Issue 56: the parity gate's verdict on correct programs under other CPU kernel choices than this machine's own.
# For each kernel cap, `fedge export` writes and gates the training programs of fedavg_cnn and dsfl_mnist_cnn (fresh
# seed-0 weights, ce and ntd, batch bound 64); its exit status is the gate's verdict (0: every program passed).
# Resumable: a (cap, model, objective) already recorded with exit 0 is skipped. CPU-bound (minutes per program on
# one core): run it niced.  Usage: nice -n 19 bash experiments/isa_sweep.sh [OUT]   (default runs/isa-sweep)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/isa-sweep}
mkdir -p "$out"
caps=${CAPS:-"ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 native"}
for cap in $caps; do
  for model in fedavg_cnn dsfl_mnist_cnn; do
    for objective in ce ntd; do
      name="${cap//=/-}-$model-$objective"
      if grep -q "^$name 0 " "$out/results.txt" 2>/dev/null; then continue; fi
      env_args=(); [ "$cap" != native ] && env_args=("$cap")
      start=$(date +%s)
      env "${env_args[@]}" .venv/bin/fedge export --model "$model" --input-shape 1,28,28 --seed 0 --format pte-train \
        --objective "$objective" --max-batch 64 --out "$out/$name" > "$out/$name.log" 2>&1
      rc=$?
      echo "$name $rc $(( $(date +%s) - start ))s" | tee -a "$out/results.txt"
    done
  done
done
