#!/usr/bin/env bash
# Build fedge's container images: the x86-64 coordinator and the arm64 (L4T) Jetson client.
#
#   containers/build.sh [--dry-run] [--tag TAG] coordinator
#   containers/build.sh [--dry-run] [--tag TAG] --torch-wheel URL [--base IMAGE] client
#   containers/build.sh [--dry-run] ... all
#
# --dry-run prints the docker commands instead of running them (no docker needed). The client image is cross-built
# with `docker buildx` (on an x86 host it needs QEMU's arm64 emulation: docker run --privileged --rm
# tonistiigi/binfmt --install arm64) or built natively on the board. TAG defaults to fedge's version.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
dry_run=0
tag=""
torch_wheel=""
base=""
targets=()

usage() {
    sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --tag) tag="${2:?--tag needs a value}"; shift ;;
        --torch-wheel) torch_wheel="${2:?--torch-wheel needs a value}"; shift ;;
        --base) base="${2:?--base needs a value}"; shift ;;
        -h|--help) usage ;;
        coordinator|client) targets+=("$1") ;;
        all) targets+=(coordinator client) ;;
        *) echo "build.sh: unknown argument '$1' (want coordinator, client or all)" >&2; exit 2 ;;
    esac
    shift
done
[ ${#targets[@]} -gt 0 ] || usage

if [ -z "$tag" ]; then
    tag="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n 1)"
fi

q() { printf '%q' "$1"; }
commands=()
for target in "${targets[@]}"; do
    case "$target" in
        coordinator)
            commands+=("docker buildx build --platform linux/amd64 --load -f $(q "$here/coordinator.Dockerfile") -t $(q "fedge-coordinator:$tag") $(q "$root")")
            ;;
        client)
            if [ -z "$torch_wheel" ]; then
                echo "build.sh: the client image needs --torch-wheel URL: NVIDIA's PyTorch wheel for the board's JetPack release" >&2
                exit 2
            fi
            args="--build-arg TORCH_WHEEL=$(q "$torch_wheel")"
            [ -z "$base" ] || args="$args --build-arg BASE=$(q "$base")"
            commands+=("docker buildx build --platform linux/arm64 --load -f $(q "$here/client-l4t.Dockerfile") $args -t $(q "fedge-client-l4t:$tag") $(q "$root")")
            ;;
    esac
done

if [ "$dry_run" = 1 ]; then
    printf '%s\n' "${commands[@]}"
    exit 0
fi
if ! docker buildx version >/dev/null 2>&1; then
    echo "build.sh: needs docker with the buildx plugin and a running daemon (--dry-run prints the commands)" >&2
    exit 2
fi
for command in "${commands[@]}"; do
    echo "+ $command" >&2
    eval "$command"
done
