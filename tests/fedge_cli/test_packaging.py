"""`pip install fedge[client]` is all a device needs.

A fresh virtual environment is given exactly the distributions that fedge's base and its ``client`` extra require
(the installed metadata, made from pyproject.toml), and what those require in turn (linked from this environment's
site-packages, so nothing is downloaded), plus fedge's own source. In it: the packages of the other roles are absent;
three clients train a FedNTD run over a real broker to the in-process simulator's model; another role's command
names the extra it lacks.
"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from safetensors.torch import load_file

from fedge.config import RunConfig, TrainConfig
from sim.laptop import run_over_mqtt
from sim.run import run_inprocess

ROOT = Path(__file__).resolve().parents[2]
OTHER_ROLES = ("matplotlib", "sklearn", "amqtt", "tqdm", "onnx", "onnxruntime", "executorch", "ray")


def client_distributions() -> set[str]:
    """fedge's requirements with the client extra, and theirs, recursively, as installed here (markers evaluated)."""
    todo = [(Requirement(r), "client") for r in metadata.requires("fedge") or []]
    found: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = metadata.distribution(req.name).metadata["Name"]
        if name in found:
            continue
        found.add(name)
        todo += [(Requirement(r), "") for r in metadata.requires(name) or []]
    return found


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python whose importable packages are the client extra's closure and fedge's source, nothing else."""
    root = tmp_path_factory.mktemp("client-env")
    venv.create(root / "env", with_pip=False, symlinks=True)
    site = root / "site"
    site.mkdir()
    for name in client_distributions():
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if not (site / top).exists() and (base / top).exists():
                (site / top).symlink_to(base / top)
    purelib = subprocess.run(
        [str(root / "env" / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "fedge-client.pth").write_text(f"{site}\n{ROOT}\n")
    return root / "env" / "bin" / "python"


def test_the_client_extra_holds_the_base_and_nothing_of_the_other_roles() -> None:
    names = {n.lower() for n in client_distributions()}
    # cryptography: secure aggregation's client half (key agreement, share encryption, masks) runs on every device.
    assert {"torch", "numpy", "safetensors", "paho-mqtt", "cryptography"} <= names
    assert not names & {"matplotlib", "scikit-learn", "amqtt", "tqdm", "onnx", "onnxruntime"}


def test_a_client_only_environment_trains_a_run_over_the_broker(client_python: Path, tmp_path: Path) -> None:
    probe = f"import importlib.util as u; print(' '.join(m for m in {OTHER_ROLES!r} if u.find_spec(m)))"
    absent = subprocess.run([str(client_python), "-c", probe], capture_output=True, text=True, check=True)
    assert absent.stdout.strip() == "", f"the client environment can import {absent.stdout.strip()}"

    config = RunConfig(
        algorithm="fedntd", dataset="digits", model="tiny_mlp", num_clients=3, rounds=2, train=TrainConfig()
    )
    result = run_over_mqtt(
        config,
        tmp_path / "mqtt",
        round_timeout=120,
        client_pythons=dict.fromkeys(("c000", "c001", "c002"), str(client_python)),
    )
    assert all(r.replied == ("c000", "c001", "c002") for r in result.rounds)
    run_inprocess(config, tmp_path / "inprocess")
    a = load_file(tmp_path / "mqtt" / "global_model.safetensors")
    b = load_file(tmp_path / "inprocess" / "global_model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def refused_in_client_env(client_python: Path, cwd: Path, *args: str) -> str:
    """``fedge ARGS`` in the client-only environment: refused with exit 2 and no traceback; its stderr."""
    done = subprocess.run(
        [str(client_python), "-m", "fedge_cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    return done.stderr


def test_another_roles_command_names_the_extra_it_needs(client_python: Path, tmp_path: Path) -> None:
    err = refused_in_client_env(
        client_python, tmp_path, "provision", "--out", str(tmp_path / "fleet"), "--dataset", "digits"
    )
    assert "pip install 'fedge[coordinator]'" in err, err


def test_a_client_only_environment_holds_what_secure_aggregation_needs(client_python: Path) -> None:
    probe = "import fedge.secagg.keys, fedge.secagg.protocol; print('ok')"
    done = subprocess.run([str(client_python), "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
