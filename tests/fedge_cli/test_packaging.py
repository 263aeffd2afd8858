"""`pip install fedge[client]` is all a device needs; `pip install fedge[coordinator]` all a coordinator host needs.

A fresh virtual environment is given exactly the distributions that fedge's base and one extra require (read from
pyproject.toml, as pip reads them), and what those require in turn (linked from this environment's site-packages, so
nothing is downloaded), plus fedge's own source. In the client's: the packages of the other roles are absent; three
clients train a FedNTD run over a real broker to the in-process simulator's model; another role's command names the
extra it lacks, in one line and before it writes anything. In the coordinator's: that role's commands, run as a user
runs them (``provision`` with a fleet kit, ``coordinator`` with clients over the kit's mosquitto, ``status``,
``report``), each succeed, so every package they import is in the extra.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import shlex
import subprocess
import venv
from pathlib import Path

import pytest
from mqtt_support import require_mosquitto
from packaging.requirements import Requirement
from safetensors.torch import load_file

from fedge.config import RunConfig, TrainConfig
from fedge.wire.protocol import Topics
from fedge.wire.run_status import encode_run_status, run_status
from fedge_io.credentials import load_bundle
from fedge_io.mqtt import MqttLink
from sim.brokers import fleet_mosquitto, free_port
from sim.laptop import client_processes, run_over_mqtt
from sim.run import run_inprocess

tomllib = pytest.importorskip("tomllib")  # Python 3.11+: pyproject.toml as pip reads it

ROOT = Path(__file__).resolve().parents[2]
OTHER_ROLES = ("matplotlib", "sklearn", "amqtt", "tqdm", "onnx", "onnxruntime", "executorch", "ray")


def extra_requirements(extra: str) -> list[Requirement]:
    """What ``pip install 'fedge[EXTRA]'`` asks for, read from pyproject.toml: the base and the extra, with the
    extras it names (``fedge[coordinator]``) expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            for req in map(Requirement, project["optional-dependencies"][name]):
                todo += sorted(req.extras) if req.name == "fedge" else []
                found += [] if req.name == "fedge" else [req]
    return found


def role_distributions(extra: str) -> set[str]:
    """The distributions ``fedge[EXTRA]`` installs, recursively, as installed here (markers and the extras each
    requirement asks for, such as ``pwdlib[argon2]``, evaluated)."""
    todo = [(req, frozenset(req.extras)) for req in extra_requirements(extra)]
    done: dict[str, set[frozenset[str]]] = {}
    while todo:
        req, extras = todo.pop()
        name = metadata.distribution(req.name).metadata["Name"]
        if extras in done.setdefault(name, set()):
            continue
        done[name].add(extras)
        for sub in map(Requirement, metadata.requires(name) or []):
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((sub, frozenset(sub.extras)))
    return set(done)


def client_distributions() -> set[str]:
    """What ``pip install 'fedge[client]'`` installs."""
    return role_distributions("client")


def role_python(root: Path, extra: str) -> Path:
    """A Python whose importable packages are ``fedge[EXTRA]``'s closure and fedge's source, nothing else."""
    venv.create(root / "env", with_pip=False, symlinks=True)
    site = root / "site"
    site.mkdir()
    for name in role_distributions(extra):
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
    (Path(purelib) / f"fedge-{extra}.pth").write_text(f"{site}\n{ROOT}\n")
    return root / "env" / "bin" / "python"


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python whose importable packages are the client extra's closure and fedge's source, nothing else."""
    return role_python(tmp_path_factory.mktemp("client-env"), "client")


@pytest.fixture(scope="module")
def coordinator_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same for the coordinator extra."""
    return role_python(tmp_path_factory.mktemp("coordinator-env"), "coordinator")


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


def test_a_fleet_kit_without_the_coordinator_extra_is_refused_before_anything_is_written(
    client_python: Path, tmp_path: Path
) -> None:
    """The synthetic data needs nothing outside the base, so the kit's own packages are what is missing: one line
    naming the extra, and no data file, config.json or half a kit left behind."""
    out = tmp_path / "fleet"
    argv = ["provision", "--out", str(out), "--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "2"]
    err = refused_in_client_env(client_python, tmp_path, *argv, "--fleet-broker", "127.0.0.1")
    assert len(err.strip().splitlines()) == 1 and "pip install 'fedge[coordinator]'" in err, err
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def test_the_coordinator_extra_holds_its_commands_packages_and_none_of_the_simulators() -> None:
    names = {n.lower() for n in role_distributions("coordinator")}
    assert {"matplotlib", "scikit-learn", "pwdlib", "argon2-cffi", "cryptography", "paho-mqtt"} <= names
    assert not names & {"amqtt", "tqdm", "onnx", "onnxruntime", "executorch", "ray"}


def in_env(python: Path, *args: str, cwd: Path, timeout: float = 300) -> str:
    """``fedge ARGS`` with ``python``: exit status 0 asserted; its output."""
    done = subprocess.run(
        [str(python), "-m", "fedge_cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.broker
def test_a_coordinator_only_environment_provisions_runs_watches_and_reports(
    coordinator_python: Path, tmp_path: Path
) -> None:
    """The coordinator host's four commands in an environment with only the coordinator extra: a fleet kit (with
    the embedded broker's Argon2 password lines), a run over the kit's mosquitto (its clients in this environment),
    the run status through the monitor login, and the report."""
    require_mosquitto()
    probe = f"import importlib.util as u; print(' '.join(m for m in {OTHER_ROLES!r} if u.find_spec(m)))"
    present = subprocess.run([str(coordinator_python), "-c", probe], capture_output=True, text=True, check=True)
    assert set(present.stdout.split()) == {"matplotlib", "sklearn"}, present.stdout

    run, port, out = "lab", free_port(), tmp_path / "fleet"
    argv = ["provision", "--out", str(out), "--run", run, "--dataset", "digits", "--model", "tiny_mlp"]
    argv += ["--num-clients", "2", "--rounds", "1", "--local-epochs", "1", "--batch-size", "32"]
    kit = out / "kit"
    argv += ["--fleet-broker", "127.0.0.1", "--fleet-port", str(port), "--fleet-broker-dir", str(kit / "broker")]
    in_env(coordinator_python, *argv, cwd=tmp_path)
    assert (kit / "broker" / "amqtt-passwd").read_text().count("$argon2") == 11  # coordinator, 8 monitors, 2 clients

    run_dir = tmp_path / "runs" / run
    with fleet_mosquitto(kit / "broker") as url:
        files = {c: out / f"{c}.safetensors" for c in ("c000", "c001")}
        bundles = {c: kit / "clients" / c for c in files}
        with client_processes(files, url, run, log_dir=tmp_path / "logs", bundles=bundles):
            coordinator = ["coordinator", "--bundle", str(kit / "coordinator"), "--config", str(out / "config.json")]
            said = in_env(coordinator_python, *coordinator, "--run-dir", str(run_dir), cwd=tmp_path)
        assert "report: " in said, said[-2000:]  # the end-of-run report drew its plots
        assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 1

        # The monitor login, once a coordinator has published the run status (retained) there.
        owner = load_bundle(kit / "coordinator")
        status = encode_run_status(run_status(run, "s1", "finished", round=1, rounds=1))
        with MqttLink(owner.address, owner.username).start(10) as link:
            link.publish(Topics(run).run_status, status, retain=True).wait_for_publish(10)
        shown = in_env(coordinator_python, "status", "--bundle", str(kit / "monitor"), "--once", cwd=tmp_path)
        assert "finished after round 1 of 1" in shown, shown

    report = in_env(coordinator_python, "report", str(run_dir), "--out", str(tmp_path / "report"), cwd=tmp_path)
    assert (tmp_path / "report" / "report.md").is_file(), report


def test_a_client_only_environment_holds_what_secure_aggregation_needs(client_python: Path) -> None:
    probe = "import fedge.secagg.keys, fedge.secagg.protocol; print('ok')"
    done = subprocess.run([str(client_python), "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`]+)`")
_PIP_VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-f"}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def pip_installs(code: str) -> list[tuple[set[str], bool]]:
    """Each ``pip install`` command in a piece of shell: (the distributions it names, whether it brings their
    dependencies). fedge itself is named ``fedge`` whether given by name, by path or as ``.``; a wheel file by its
    distribution's name."""
    found = []
    for command in re.split(r"&&|\|\||;|\n", code.replace("\\\n", " ")):
        try:
            words = shlex.split(command, comments=True)
        except ValueError:
            continue
        starts = [i for i, w in enumerate(words[:-1]) if Path(w).name in ("pip", "pip3") and words[i + 1] == "install"]
        if not starts:
            continue
        args, names, skip = words[starts[0] + 2 :], set(), False
        for word in args:
            if skip or word in _PIP_VALUE_OPTIONS:
                skip = not skip
                continue
            if word.startswith("-"):
                continue
            if word.endswith(".whl"):
                names.add(_name(Path(word).name.split("-")[0]))
            elif word.startswith((".", "/")) or "fedge" in Path(word.split("[")[0]).name:
                names.add("fedge")  # a checkout (., /path/to/fedge) or fedge[...] by name
            else:
                names.add(_name(Requirement(word).name))
        found.append((names, "--no-deps" not in args))
    return found


def doc_sections(doc: Path) -> dict[str, str]:
    """A Markdown file's sections (by heading) and their code: fenced blocks and inline spans."""
    sections: dict[str, str] = {}
    heading, lines, fenced = doc.name, [], False
    for line in [*doc.read_text().splitlines(), "# end"]:
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            text = "\n".join(lines)
            sections[heading] = "\n".join([*_FENCED.findall(text), *_INLINE.findall(_FENCED.sub("", text))])
            heading, lines = f"{doc.name}: {line.strip('# ')}", []
        else:
            lines.append(line)
    return sections


def test_every_documented_install_brings_fedges_whole_base() -> None:
    """An install that takes fedge without its dependencies (a Jetson keeps NVIDIA's torch: ``--no-deps``) must name
    every other package of the base (pyproject.toml's ``dependencies``) in the same section of the docs; one that
    left ``tabulate`` out made every ``fedge`` command a traceback on the board."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_name(Requirement(r).name) for r in project["dependencies"]}
    assert {"torch", "numpy", "tabulate", "paho-mqtt"} <= base
    checked = []
    for doc in DOCS:
        for heading, code in doc_sections(doc).items():
            installs = pip_installs(code)
            if not any("fedge" in names and not deps for names, deps in installs):
                continue  # fedge with its dependencies (or not at all): pip brings the base
            named = set().union(*(names for names, _ in installs))
            assert base <= named, f"{heading}: installs fedge --no-deps but not {sorted(base - named)}"
            checked.append(heading)
    assert any("Jetson" in h for h in checked), checked  # the parser still finds the board's install


def test_the_install_parser_reads_what_pip_would() -> None:
    code = (
        "python3 -m venv /opt/fedge/venv && /opt/fedge/venv/bin/pip install 'fedge[client]'\n"
        'pip install --no-deps -e /path/to/fedge && pip install "numpy>=1.24" paho_mqtt -c constraints.txt\n'
        "pip install torch-2.5.0a0+872d972e41.nv24.08-cp310-cp310-linux_aarch64.whl"
    )
    assert pip_installs(code) == [
        ({"fedge"}, True),
        ({"fedge"}, False),
        ({"numpy", "paho-mqtt"}, True),
        ({"torch"}, True),
    ]
