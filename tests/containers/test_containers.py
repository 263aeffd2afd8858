"""The container recipes (containers/): the build script's dry run, and what each Dockerfile installs and runs.

No image is built here (no docker daemon on the test machine): the test checks what can be checked without one. The
build script prints the commands it would run; each Dockerfile copies only sources that exist and that .dockerignore
keeps in the context, installs what the documented installs install (the coordinator's extra with the CPU torch; on
a Jetson, NVIDIA's torch and fedge's base without replacing it), runs as the kit's unprivileged service user, and its
example command is one fedge accepts.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from coordinator.kit.services import SERVICE_USER
from fedge_cli.main import build_parser

tomllib = pytest.importorskip("tomllib")  # Python 3.11+: pyproject.toml as pip reads it

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "containers" / "build.sh"
COORDINATOR = ROOT / "containers" / "coordinator.Dockerfile"
CLIENT = ROOT / "containers" / "client-l4t.Dockerfile"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WHEEL = "https://example.org/jp6/torch-2.5.0a0 (jetson).whl"  # a space: quoting is checked too


def build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(BUILD), *args], capture_output=True, text=True, timeout=60)


def test_the_dry_run_prints_one_cross_build_per_image_and_needs_no_docker() -> None:
    done = build("--dry-run", "all", "--torch-wheel", WHEEL)
    assert done.returncode == 0, done.stderr
    coordinator, client = (shlex.split(line) for line in done.stdout.splitlines())
    assert coordinator == [
        *("docker", "buildx", "build", "--platform", "linux/amd64", "--load", "-f", str(COORDINATOR)),
        *("-t", f"fedge-coordinator:{VERSION}", str(ROOT)),
    ]
    assert client[:8] == ["docker", "buildx", "build", "--platform", "linux/arm64", "--load", "-f", str(CLIENT)]
    assert client[client.index("--build-arg") + 1] == f"TORCH_WHEEL={WHEEL}" and client[-1] == str(ROOT)
    assert client[client.index("-t") + 1] == f"fedge-client-l4t:{VERSION}"
    # --tag and --base are carried into the commands.
    base = "nvcr.io/nvidia/l4t-jetpack:r36.3.0"
    done = build("--dry-run", "--tag", "lab-1", "--base", base, "--torch-wheel", "u", "client")
    (line,) = done.stdout.splitlines()
    assert f"BASE={base}" in shlex.split(line) and "fedge-client-l4t:lab-1" in line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--dry-run", "client"), "needs --torch-wheel URL"),
        (("--dry-run", "laptop"), "unknown argument 'laptop'"),
        (("--dry-run",), "Build fedge's container images"),  # no target: the usage
    ],
)
def test_a_build_that_cannot_be_made_says_why(args: tuple[str, ...], said: str) -> None:
    done = build(*args)
    assert done.returncode == 2 and said in done.stderr, done.stderr


def test_without_buildx_or_a_daemon_the_build_stops_with_a_clear_line() -> None:
    probe = subprocess.run(["bash", "-c", "docker buildx version"], capture_output=True, timeout=30)
    if probe.returncode == 0:
        pytest.skip("docker buildx is here: a real build would start")
    done = build("coordinator")
    assert done.returncode == 2 and "needs docker with the buildx plugin" in done.stderr, done.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _ignored(path: str) -> bool:
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    parts = Path(path).parts
    return any(
        fnmatch.fnmatch(path, p) or any(fnmatch.fnmatch(part, p.removeprefix("**/")) for part in parts)
        for p in patterns
    )


@pytest.mark.parametrize("dockerfile", [COORDINATOR, CLIENT], ids=["coordinator", "client"])
def test_each_image_copies_existing_sources_and_runs_as_the_service_user(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    for kind, args in steps:
        if kind == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists() and not _ignored(source), source
    users = [args for kind, args in steps if kind == "USER"]
    assert users[-1] == SERVICE_USER  # never root at run time
    runs = " ".join(args for kind, args in steps if kind == "RUN")
    assert f"useradd --system --create-home --home-dir /var/lib/{SERVICE_USER}" in runs
    assert "fedge --version" in runs  # the image's fedge answers before it is tagged


def _base() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {Requirement(d).name for d in deps}


def test_the_client_keeps_nvidias_torch_and_installs_the_rest_of_fedges_base() -> None:
    runs = [args for kind, args in _instructions(CLIENT) if kind == "RUN"]
    installs = " && ".join(runs)
    assert 'pip install "${TORCH_WHEEL}"' in installs and "pip install --no-deps ." in installs
    after = installs.split("pip install --no-deps .", 1)[1]
    named = {Requirement(m).name for m in re.findall(r'"([A-Za-z0-9_.-]+[<>=][^"]*)"', after)}
    assert named == _base() - {"torch"}  # the whole base but torch, as the documented Jetson install
    assert "--groups video" in installs  # the GPU's device files


def test_the_coordinator_takes_the_cpu_torch_and_its_roles_extra() -> None:
    steps = _instructions(COORDINATOR)
    env = " ".join(args for kind, args in steps if kind == "ENV")
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in env
    runs = " ".join(args for kind, args in steps if kind == "RUN")
    assert "pip install --constraint constraints.txt '.[coordinator]'" in runs
    assert ("ENTRYPOINT", '["fedge"]') in steps


@pytest.mark.parametrize(
    ("dockerfile", "entry"), [(COORDINATOR, []), (CLIENT, ["client"])], ids=["coordinator", "client"]
)
def test_the_example_command_in_each_recipe_is_one_fedge_accepts(dockerfile: Path, entry: list[str]) -> None:
    text = dockerfile.read_text()
    example = re.search(r"#   docker run (.*?)\n(?!#       )", text, re.S)
    assert example is not None
    words = shlex.split(example.group(1).replace("\\\n#", " "))
    image = next(w for w in words if w.startswith("fedge-"))
    args = build_parser().parse_args([*entry, *words[words.index(image) + 1 :]])
    assert args.bundle is not None
