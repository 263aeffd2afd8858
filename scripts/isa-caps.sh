#!/usr/bin/env bash
# The kernel choices `make test-isa` runs on this CPU, one per line as VAR=VALUE.
# ONEDNN_MAX_CPU_ISA is a cap (oneDNN never goes above what the CPU has), but ATEN_CPU_CAPABILITY is taken as given:
# PyTorch does not check it against the CPU, so avx2/avx512 on a CPU without them would die of an illegal
# instruction. Those are listed only where /proc/cpuinfo shows the instructions PyTorch's kernels use.
set -euo pipefail
echo "ATEN_CPU_CAPABILITY=default"
[ "$(uname -m)" = x86_64 ] || exit 0  # oneDNN's x86 caps mean nothing elsewhere
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
has avx2 fma && echo "ATEN_CPU_CAPABILITY=avx2"
has avx512f avx512bw avx512vl avx512dq && echo "ATEN_CPU_CAPABILITY=avx512"
echo "ONEDNN_MAX_CPU_ISA=SSE41"
echo "ONEDNN_MAX_CPU_ISA=AVX2"
echo "ONEDNN_MAX_CPU_ISA=AVX512_CORE"
