#!/usr/bin/env bash
# The kernel choices `make test-isa` runs on this CPU: one run per line, its environment as VAR=VALUE words.
# Each line pairs an ATen dispatch choice with a oneDNN cap of the same level (scalar with SSE4.1, AVX2 with AVX2,
# AVX-512 with AVX512_CORE), so every choice of each library is run once in three runs rather than six.
# ONEDNN_MAX_CPU_ISA is a cap (oneDNN never goes above what the CPU has), but ATEN_CPU_CAPABILITY is taken as given:
# PyTorch does not check it against the CPU, so avx2/avx512 on a CPU without them would die of an illegal
# instruction. Those are listed only where /proc/cpuinfo shows the instructions PyTorch's kernels use; the oneDNN cap
# of their level then runs beside ATen's default.
set -euo pipefail
if [ "$(uname -m)" != x86_64 ]; then  # oneDNN's x86 caps mean nothing elsewhere
  echo "ATEN_CPU_CAPABILITY=default"
  exit 0
fi
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
echo "ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41"
if has avx2 fma; then aten=avx2; else aten=default; fi
echo "ATEN_CPU_CAPABILITY=$aten ONEDNN_MAX_CPU_ISA=AVX2"
if has avx512f avx512bw avx512vl avx512dq; then aten=avx512; else aten=default; fi
echo "ATEN_CPU_CAPABILITY=$aten ONEDNN_MAX_CPU_ISA=AVX512_CORE"
