#!/usr/bin/env bash
# Runs fedge's device-side program checks once under emulated aarch64 (qemu-user), as issue 56 asks.
#
# 1. Installs qemu-user-static and builds an arm64 Python 3.11 sysroot from Debian's arm64 packages (apt-get download
#    + dpkg -x: nothing is installed into the host's Python or dpkg database), then installs the aarch64 wheels of
#    fedge's base dependencies into a target folder with the host's pip (--platform/--target, constraints.txt pins).
# 2. Runs, under `qemu-aarch64-static -L SYSROOT SYSROOT/usr/bin/python3.11`, smallest first and each with a timeout:
#    a. import torch, its CPU capability and oneDNN;
#    b. one training step's loss and gradient on a fixed batch (fedavg_cnn), float32 / float32 without oneDNN /
#       float64, on the host and emulated (scripts/aarch64_check.py loss);
#    c. the stepwise parity gate on eager float32 channels-last as the program (tiny_mlp, then fedavg_cnn).
#
# Idempotent: downloads, extraction and the wheel install are skipped when already done. Prints every command.
# Needs root (apt-get, dpkg --add-architecture) for step 1; the checks run as any user.
#
# Environment:
#   SYSROOT=/opt/fedge-arm64       the arm64 root (debs/ holds the downloaded packages)
#   TARGET=$SYSROOT/site           the aarch64 wheels (PYTHONPATH under emulation)
#   HOST_PYTHON=.venv/bin/python   the x86 Python whose pip downloads the wheels and that runs the host side of (b)
#   TORCH_VERSION=2.10.0           the aarch64 torch wheel (see setup_wheels: newer ones on PyPI are CUDA builds)
#   QEMU_CPU=neoverse-n1           the emulated CPU (qemu-aarch64-static -cpu help). neoverse-n1 (Armv8.2, NEON, no SVE)
#                                  is near a Jetson Orin's Cortex-A78AE and ~7x faster to emulate than `max` (SVE), on
#                                  which torch's float32 convolutions crawl (fedavg_cnn step at batch 5: 4.6 s vs 34 s)
#   CHECKS="import loss gate-tiny gate-cnn"   which checks to run (also gate-cnn-host: the same gate on x86; "": none)
#   GATE_CNN_STEPS=8               steps of the fedavg_cnn gate check (the gate's DRIFT_STEPS; fewer is faster)
#   SKIP_SETUP=1                   run the checks only
#   T_IMPORT=600 T_LOSS=1800 T_GATE_TINY=1800 T_GATE_CNN=5400   per-check timeouts in seconds
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
SYSROOT=${SYSROOT:-/opt/fedge-arm64}
TARGET=${TARGET:-$SYSROOT/site}
HOST_PYTHON=${HOST_PYTHON:-$REPO/.venv/bin/python}
[ -x "$HOST_PYTHON" ] || HOST_PYTHON=python3
QEMU_CPU=${QEMU_CPU:-neoverse-n1}
CHECKS=${CHECKS-import loss gate-tiny gate-cnn}
TORCH_VERSION=${TORCH_VERSION:-2.10.0}
NICE=(nice -n 10)

say() { printf '\n=== %s\n' "$*"; }
run() { printf '+ %s\n' "$*" >&2; "$@"; }

# The arm64 packages the interpreter, its stdlib extension modules and torch's wheel load (found by running: a
# missing one shows as "error while loading shared libraries" or an ImportError of a stdlib module).
ARM64_PACKAGES=(
  libc6 libgcc-s1 libstdc++6 libgomp1 libcrypt1 zlib1g libssl3 libffi8 libexpat1 libbz2-1.0 liblzma5 libzstd1
  libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libdb5.3 libnsl2 libtirpc3
  libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
  libpython3.11-minimal libpython3.11-stdlib python3.11-minimal python3.11
)

setup_sysroot() {
  say "qemu-user-static"
  if ! command -v qemu-aarch64-static >/dev/null 2>&1; then
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static
  fi
  run qemu-aarch64-static --version | sed -n 1p

  say "arm64 sysroot in $SYSROOT"
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    run dpkg --add-architecture arm64
    run apt-get update -q
  elif ! apt-cache show python3.11-minimal:arm64 >/dev/null 2>&1; then
    run apt-get update -q
  fi
  run mkdir -p "$SYSROOT/debs"
  local missing=()
  for p in "${ARM64_PACKAGES[@]}"; do
    compgen -G "$SYSROOT/debs/${p}_*_arm64.deb" >/dev/null || missing+=("$p:arm64")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    (cd "$SYSROOT/debs" && run apt-get download "${missing[@]}")
  fi
  for deb in "$SYSROOT"/debs/*_arm64.deb; do
    local stamp="$SYSROOT/debs/.$(basename "$deb").extracted"
    if [ ! -e "$stamp" ]; then
      run dpkg -x "$deb" "$SYSROOT" && touch "$stamp"
    fi
  done
  # python3.11 is the interpreter's name; a python3 link makes sub-processes that ask for it find the same one.
  [ -e "$SYSROOT/usr/bin/python3" ] || run ln -s python3.11 "$SYSROOT/usr/bin/python3"
}

setup_wheels() {
  say "aarch64 wheels in $TARGET (host pip: $HOST_PYTHON)"
  local packages=(torch numpy safetensors paho-mqtt tabulate cryptography scikit-learn)
  # constraints.txt pins torch==2.13.0, but PyPI's aarch64 wheels of torch 2.11 and later are CUDA 13 builds
  # (Requires-Dist cuda-toolkit, nvidia-cudnn-cu13, ... for Linux on every machine; the cuDNN one has no aarch64
  # release here, so pip cannot resolve them). 2.10.0 is the newest CPU-only aarch64 wheel there (its CUDA
  # requirements are marked platform_machine == "x86_64"). The CPU index (download.pytorch.org) is out of reach here.
  local constraints="$SYSROOT/constraints-aarch64.txt"
  sed -e "s/^torch==.*/torch==$TORCH_VERSION/" -e '/^executorch==/d' "$REPO/constraints.txt" >"$constraints"
  echo "constraints: $(grep -v '^#' "$constraints" | tr '\n' ' ')"
  local stamp="$TARGET/.installed-$(printf '%s ' "${packages[@]}" "$TORCH_VERSION" | md5sum | cut -c1-12)"
  if [ -e "$stamp" ]; then
    echo "already installed: ${packages[*]} ($stamp)"
    return
  fi
  local pip=("${NICE[@]}" "$HOST_PYTHON" -m pip install --quiet --upgrade --target "$TARGET"
    --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64
    --implementation cp --python-version 3.11 --abi cp311 --only-binary=:all: -c "$constraints")
  # pip evaluates environment markers against the host (platform_machine == "x86_64"), so torch's x86-only CUDA
  # requirements would be pulled in: torch goes in without its requirements, which are listed here instead.
  run "${pip[@]}" --no-deps torch
  local rest=()
  for p in "${packages[@]}"; do [ "$p" = torch ] || rest+=("$p"); done
  run "${pip[@]}" "${rest[@]}" filelock typing-extensions sympy networkx jinja2 fsspec
  touch "$stamp"
  ls "$TARGET" | grep -i '\.dist-info$' | sed 's/\.dist-info$//' | sort
}

# ExecuTorch's aarch64 wheel exists, but executorch 1.4.1 requires torch>=2.13, whose aarch64 wheels on PyPI are
# CUDA builds (see above): it is not installed, only looked for, so that the report says whether that has changed.
probe_executorch() {
  local pin
  pin=$(grep -E '^executorch==' "$REPO/constraints.txt" || echo executorch)
  say "executorch: is there an aarch64 wheel of $pin? (downloaded to $SYSROOT/probe, not installed)"
  set +e
  run "${NICE[@]}" "$HOST_PYTHON" -m pip download --quiet --no-deps --platform manylinux_2_28_aarch64 \
    --implementation cp --python-version 3.11 --only-binary=:all: "$pin" -d "$SYSROOT/probe"
  local rc=$?
  set -e
  [ $rc = 0 ] && ls "$SYSROOT/probe" | grep -i executorch || echo "no aarch64 wheel of $pin"
}

# The emulated interpreter: one thread, no bytecode written into the repository, the wheels then the repository.
EMU=("${NICE[@]}" env PYTHONPATH="$TARGET:$REPO" PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1
  qemu-aarch64-static -cpu "$QEMU_CPU" -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11")
HOST=("${NICE[@]}" env PYTHONPATH="$REPO" PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 "$HOST_PYTHON")
failed=()
timed() {  # timed SECONDS LABEL CMD...: runs CMD under timeout, prints its wall time and exit status
  local limit=$1 label=$2 start rc
  shift 2
  printf '+ [timeout %ss] %s\n' "$limit" "$*"
  start=$(date +%s%N)
  set +e
  timeout "$limit" "$@"
  rc=$?
  set -e
  [ "$rc" = 0 ] || failed+=("$label")
  local ms=$((($(date +%s%N) - start) / 1000000))
  printf -- '--- %s: exit %s in %d.%d s%s\n' "$label" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) \
    "$([ "$rc" = 124 ] && echo ' (timed out)')"
}

if [ "${SKIP_SETUP:-0}" != 1 ]; then
  setup_sysroot
  setup_wheels
  probe_executorch
fi

say "checks (qemu -cpu $QEMU_CPU; $(qemu-aarch64-static --version | sed -n 1p))"
for check in $CHECKS; do
  case $check in
    import)
      say "a. import torch under emulation"
      timed "${T_IMPORT:-600}" import "${EMU[@]}" -c 'import platform, time; t = time.time(); import torch
print("machine", platform.machine(), "python", platform.python_version(), "torch", torch.__version__)
print("cpu capability", torch.backends.cpu.get_cpu_capability(), "mkldnn", torch.backends.mkldnn.is_available(),
      "acl", getattr(torch.backends.mkldnn, "is_acl_available", lambda: None)())
print("import s %.1f" % (time.time() - t)); print(torch.__config__.show())'
      ;;
    loss)
      say "b. first training step's loss on a fixed batch: host x86 then emulated aarch64"
      timed "${T_LOSS:-1800}" loss-host "${HOST[@]}" "$REPO/scripts/aarch64_check.py" loss
      timed "${T_LOSS:-1800}" loss-emulated "${EMU[@]}" "$REPO/scripts/aarch64_check.py" loss
      ;;
    gate-tiny)
      say "c. stepwise gate, eager float32 channels-last as the program, tiny_mlp 1x8x8, emulated"
      timed "${T_GATE_TINY:-1800}" gate-tiny "${EMU[@]}" "$REPO/scripts/aarch64_check.py" gate tiny_mlp
      ;;
    gate-cnn)
      say "c. stepwise gate, eager float32 channels-last as the program, fedavg_cnn 1x28x28, emulated"
      timed "${T_GATE_CNN:-5400}" gate-cnn "${EMU[@]}" "$REPO/scripts/aarch64_check.py" gate fedavg_cnn \
        ${GATE_CNN_STEPS:+--steps "$GATE_CNN_STEPS"}
      ;;
    gate-cnn-host)
      say "c. the same fedavg_cnn gate check on the host (x86), for comparison"
      timed "${T_GATE_CNN:-5400}" gate-cnn-host "${HOST[@]}" "$REPO/scripts/aarch64_check.py" gate fedavg_cnn \
        ${GATE_CNN_STEPS:+--steps "$GATE_CNN_STEPS"}
      ;;
    *) echo "unknown check $check" >&2; exit 2 ;;
  esac
done
say "done: ${failed[*]:-every check ran} $([ ${#failed[@]} -gt 0 ] && echo 'exited non-zero')"
[ ${#failed[@]} -eq 0 ]
