"""The fleet kit's systemd units: valid for systemd, and each ExecStart a command fedge accepts.

`fedge provision --fleet-broker` writes the broker, coordinator and client-template units; `systemd-analyze verify`
(which also checks that each command exists and is executable) accepts them with no warning, the device's layout
made as the kit's README says. The restart behaviour they rely on (`fedge coordinator --run-dir`: start, resume
after a kill, leave a finished run alone) is tested in test_resume.py.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kit_support import fedge_provision

from coordinator.broker_setup import broker_plan
from coordinator.kit.services import CLIENT_FINAL_EXITS
from fedge.config import RunConfig
from fedge_cli.main import build_parser, main
from sim.brokers import free_port

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
ROOT = Path(__file__).resolve().parents[2]
WINE_PLUGIN = ROOT / "examples" / "custom_model" / "wine_plugin.py"


def exec_start(unit: Path, instance: str = "") -> list[str]:
    (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart=").replace("%i", instance))


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("services")
    device_root = root / "device"
    args = ["provision", "--out", str(root / "fleet"), "--run", "lab", "--fleet-broker", "127.0.0.1"]
    args += ["--fleet-device-root", str(device_root), "--dataset", "digits", "--num-clients", "3"]
    assert main(args) == 0
    return root / "fleet" / "kit" / "systemd", device_root


def test_every_exec_start_is_a_command_fedge_and_mosquitto_accept(kit: tuple[Path, Path]) -> None:
    units, device_root = kit
    coordinator = exec_start(units / "fedge-lab-coordinator.service")
    args = build_parser().parse_args(coordinator[coordinator.index("coordinator") :])
    assert args.run_dir == units.parent.parent / "runs" / "lab" and args.bundle == units.parent / "coordinator"
    assert Path(args.config).is_file()
    client = exec_start(units / "fedge-lab-client@.service", "c001")
    assert client[0] == str(device_root / "venv" / "bin" / "fedge")
    args = build_parser().parse_args(client[1:])
    assert (args.bundle, Path(args.data)) == (
        device_root / "lab" / "c001" / "bundle",
        device_root / "lab" / "c001" / "c001.safetensors",
    )
    broker = exec_start(units / "fedge-lab-broker.service")
    conf_dir = broker_plan(units.parent / "broker", run="lab").conf_dir  # where the printed commands put the files
    assert broker[1:] == ["-c", str(conf_dir / "mosquitto.conf")]
    assert "systemctl enable --now fedge-lab-client@<id>" in (units / "README.txt").read_text()


def printed_line(out: str, start: str) -> list[str]:
    """The one printed command line that begins with ``start``, as words."""
    (line,) = [x.strip() for x in out.splitlines() if x.strip().startswith(start)]
    return shlex.split(line)


def test_a_plugins_run_names_its_plugin_in_every_printed_command_unit_and_config(tmp_path: Path) -> None:
    """A model from ``--plugin``: the coordinator, clients and units need it too (without it they cannot build the
    model), and the kit's config.json records it."""
    out, device_root = tmp_path / "fleet", tmp_path / "device"
    argv = ["--out", str(out), "--run", "lab", "--plugin", str(WINE_PLUGIN), "--dataset", "wine"]
    argv += ["--algorithm", "fedavg", "--num-clients", "2", "--partition", "iid", "--fleet-broker", "127.0.0.1"]
    printed = fedge_provision([*argv, "--fleet-device-root", str(device_root)])
    parser = build_parser()

    coordinator = parser.parse_args(printed_line(printed, "fedge coordinator")[1:])
    assert coordinator.plugin == [str(WINE_PLUGIN)]
    assert coordinator.run_dir == out.absolute() / "runs" / "lab"  # the form that also continues a stopped run
    assert Path(coordinator.config) == out.absolute() / "config.json"
    client = parser.parse_args([w.replace("<id>", "c000") for w in printed_line(printed, "fedge client")[1:]])
    assert client.plugin == [WINE_PLUGIN.name]  # beside its data file on the device, as the printed line says
    assert f"c000.safetensors, {WINE_PLUGIN.name}" in printed.replace("<id>", "c000")

    units = out / "kit" / "systemd"
    unit = exec_start(units / "fedge-lab-coordinator.service")
    assert parser.parse_args(unit[unit.index("coordinator") :]).plugin == [str(WINE_PLUGIN)]
    unit = exec_start(units / "fedge-lab-client@.service", "c001")
    assert parser.parse_args(unit[1:]).plugin == [str(device_root / "lab" / "c001" / WINE_PLUGIN.name)]
    assert f"c001.safetensors, {WINE_PLUGIN.name}" in (units / "README.txt").read_text().replace("<id>", "c001")

    recorded = json.loads((out / "config.json").read_text())
    assert recorded["fedge"]["plugins"] == [str(WINE_PLUGIN)]
    assert RunConfig.from_dict(recorded).dataset == "wine"  # the record is not a setting


def test_a_device_that_boots_before_its_broker_is_restarted_and_a_refused_one_is_not(kit: tuple[Path, Path]) -> None:
    units, _ = kit
    client = (units / "fedge-lab-client@.service").read_text()
    assert f"RestartPreventExitStatus={' '.join(map(str, CLIENT_FINAL_EXITS))}" in client and "Restart=always" in client
    assert "RestartPreventExitStatus" not in (units / "fedge-lab-coordinator.service").read_text()
    fleet = units.parent.parent
    closed = f"mqtts://127.0.0.1:{free_port()}"  # nobody listens: the broker is not up yet
    args = ["client", "--bundle", str(units.parent / "clients" / "c000"), "--data", str(fleet / "c000.safetensors")]
    done = subprocess.run(
        [sys.executable, "-m", "fedge_cli.main", *args, "--broker", closed, "--connect-timeout", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and done.returncode not in CLIENT_FINAL_EXITS, (done.returncode, done.stderr[-500:])
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is absent (apt-get install systemd)")
def test_systemd_analyze_verifies_every_unit_without_a_warning(kit: tuple[Path, Path], tmp_path: Path) -> None:
    units, device_root = kit
    # The device as the kit's README says to set it up: fedge in DEVICE_ROOT/venv, the files in DEVICE_ROOT/lab/<id>.
    (device_root / "venv" / "bin").mkdir(parents=True)
    (device_root / "venv" / "bin" / "fedge").symlink_to(Path(sys.executable).with_name("fedge"))
    check = tmp_path / "units"
    shutil.copytree(units, check)
    (check / "fedge-lab-client@c001.service").symlink_to(check / "fedge-lab-client@.service")
    names = ["fedge-lab-broker.service", "fedge-lab-coordinator.service", "fedge-lab-client@c001.service"]
    done = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", "--man=no", *(str(check / n) for n in names)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr + done.stdout
    # And it does check: a command that is not there fails the verification.
    (device_root / "venv" / "bin" / "fedge").unlink()
    done = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", "--man=no", str(check / "fedge-lab-client@c001.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "is not executable" in done.stderr
