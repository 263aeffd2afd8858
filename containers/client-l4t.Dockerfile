# fedge client for a Jetson board (linux/arm64, L4T): `fedge client` on the board's GPU.
# Built by containers/build.sh (see docs/deployment.md, "Containers"); the build context is the repository root.
#
# PyTorch for Jetson is NVIDIA's wheel for the board's JetPack release, not PyPI's (whose aarch64 wheel has no CUDA
# for Jetson's GPU): give its URL as TORCH_WHEEL (NVIDIA's "PyTorch for Jetson" page and the Jetson AI Lab index list
# them). BASE must be the L4T image of the same JetPack release as the board.
#
#   docker run --rm --runtime nvidia -v /opt/fedge/lab/c003:/device fedge-client-l4t:0.1.0 \
#       --bundle /device/bundle --data /device/c003.safetensors --device auto
ARG BASE=nvcr.io/nvidia/l4t-jetpack:r36.4.0
FROM ${BASE}
ARG TORCH_WHEEL
RUN test -n "${TORCH_WHEEL}" || { echo "TORCH_WHEEL: give NVIDIA's torch wheel for this JetPack release" >&2; exit 1; }

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip libopenblas-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m pip install "${TORCH_WHEEL}" \
    && python3 -c "import torch; print('torch', torch.__version__)"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY fedge ./fedge
COPY fedge_io ./fedge_io
COPY fedge_cli ./fedge_cli
COPY coordinator ./coordinator
COPY edge_client ./edge_client
COPY export ./export
COPY sim ./sim
# fedge without letting pip replace NVIDIA's torch, then the rest of its base: the install of docs/deployment.md's
# Jetson section, step 4.
RUN python3 -m pip install --no-deps . \
    && python3 -m pip install "numpy>=1.24" "safetensors>=0.4" "paho-mqtt>=2.0" "tabulate>=0.9" "cryptography>=42" \
    && fedge --version

# Never root: the kit's client unit's user, in group video (the GPU's device files on L4T).
RUN useradd --system --create-home --home-dir /var/lib/fedge --shell /usr/sbin/nologin --groups video fedge \
    && install -d -o fedge -g fedge /device
USER fedge
WORKDIR /device
ENTRYPOINT ["fedge", "client"]
CMD ["--help"]
