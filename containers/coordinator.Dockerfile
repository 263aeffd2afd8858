# fedge coordinator for x86-64 (linux/amd64): `fedge coordinator`, `fedge provision`, `fedge status`, `fedge report`.
# Built by containers/build.sh (see docs/deployment.md, "Containers"); the build context is the repository root.
#
#   docker run --rm -v /srv/fleet:/fleet fedge-coordinator:0.1.0 \
#       coordinator --bundle /fleet/kit/coordinator --config /fleet/config.json --run-dir /fleet/runs/lab
#   docker stop -t 330 ...   # a SIGTERM lets the round under way finish first (the default round timeout is 300 s;
#                            # 1230 under --secure-aggregation, whose round has four deadlines)
ARG PYTHON=3.11
FROM python:${PYTHON}-slim-bookworm

# The CPU build of torch: PyPI's x86 wheel is the CUDA one (several GB of NVIDIA libraries a coordinator never uses).
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY fedge ./fedge
COPY fedge_io ./fedge_io
COPY fedge_cli ./fedge_cli
COPY coordinator ./coordinator
COPY edge_client ./edge_client
COPY export ./export
COPY sim ./sim
# The versions the test suite ran (constraints.txt), the coordinator's extra, and nothing of the simulator's.
RUN pip install --constraint constraints.txt '.[coordinator]' && fedge --version

# Never root: the same unprivileged user as the kit's systemd units (coordinator/kit/services.py). Its home keeps the
# journal key (~/.config/fedge/journal.key): mount a volume there, or the key dies with the container and a resumed
# run is refused (docs/deployment.md, "If the coordinator dies").
RUN useradd --system --create-home --home-dir /var/lib/fedge --shell /usr/sbin/nologin fedge \
    && install -d -o fedge -g fedge /fleet
USER fedge
WORKDIR /fleet
VOLUME ["/var/lib/fedge"]
ENTRYPOINT ["fedge"]
CMD ["--help"]
