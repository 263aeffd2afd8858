"""The fleet kit's systemd units: valid for systemd, and each ExecStart a command fedge accepts.

`fedge provision --fleet-broker` writes the broker, coordinator and client-template units; `systemd-analyze verify`
(which also checks that each command exists and is executable) accepts them with no warning, the device's layout
made as the kit's README says. The restart behaviour they rely on (`fedge coordinator --run-dir`: start, resume
after a kill, leave a finished run alone) is tested in test_resume.py.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kit_support import USER_PATH, fedge_command, fedge_provision, open_dir, printed_commands, start_as_printed  # noqa: F401

from coordinator.broker_setup import broker_plan
from coordinator.kit.services import CLIENT_FINAL_EXITS, SERVICE_USER
from fedge.config import RunConfig
from fedge_cli.main import build_parser, main
from sim.brokers import free_port, stop_process

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
USER = "fedge-lab"  # a service user other than the default, made (and removed) by the test that runs as it
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


def test_the_units_run_as_the_fedge_user_unless_provision_names_another_and_never_as_root(
    kit: tuple[Path, Path], tmp_path: Path
) -> None:
    units, _ = kit
    for unit in ("fedge-lab-coordinator.service", "fedge-lab-client@.service"):
        assert f"User={SERVICE_USER}\nGroup={SERVICE_USER}\n" in (units / unit).read_text()
    assert "useradd --system" in (units / "README.txt").read_text()
    for bad in ("root", "Fedge", "-x", "a" * 33):
        with pytest.raises(SystemExit):  # refused by the parser, before anything is written
            main(["provision", "--out", str(tmp_path / bad), "--fleet-broker", "127.0.0.1", "--service-user", bad])
        assert not (tmp_path / bad).exists()


def _readme_block(readme: str, first: str, last: str) -> list[str]:
    """The commands README.txt lists between the line starting with ``first`` and the one containing ``last``."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    return [line.strip() for line in lines[start + 1 : end]]


@pytest.mark.broker
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root and useradd")
def test_the_coordinator_unit_runs_as_its_unprivileged_user_set_up_as_the_readme_says(
    open_dir: Path,  # noqa: F811 - a fixture
) -> None:
    """With a service user of its own (``--service-user``), the README's service-user commands run verbatim (as
    root); then the unit's ExecStart, as that user with the environment systemd gives it (its HOME, a plain PATH),
    reads its 0600 password, reaches the kit's broker over TLS and writes under runs/: it waits for clients, which
    is as far as a run without devices goes."""
    port = free_port()
    out = fedge_provision(
        [
            *("--out", str(open_dir / "fleet"), "--run", "lab", "--fleet-broker", "127.0.0.1"),
            *("--fleet-bind", "127.0.0.1", "--fleet-port", str(port)),
            *("--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "2", "--service-user", USER),
        ]
    )
    units = open_dir / "fleet" / "kit" / "systemd"
    coordinator_unit = (units / "fedge-lab-coordinator.service").read_text()
    assert (
        f"User={USER}\n" in coordinator_unit and f"User={USER}\n" in (units / "fedge-lab-client@.service").read_text()
    )
    setup = _readme_block((units / "README.txt").read_text(), "coordinator:", "then systemctl enable")
    assert setup and all(line in out for line in setup)  # fedge provision printed them too
    existed = subprocess.run(["id", "-u", USER], capture_output=True).returncode == 0
    broker = start_as_printed(printed_commands(out), port)
    try:
        for command in setup:
            subprocess.run(["bash", "-c", command], check=True, timeout=60)
        home = Path(pwd.getpwnam(USER).pw_dir)
        # This machine's fedge lies in a venv whose interpreter may sit under /root: a fedge that user can run.
        bin_dir = open_dir / "bin"
        bin_dir.mkdir()
        extra = [f"{k}={v}" for k, v in fedge_command(bin_dir, USER).items()]
        env = ["env", "-i", f"HOME={home}", f"USER={USER}", f"PATH={USER_PATH}", *extra]  # as systemd sets
        command = [str(bin_dir / "fedge"), *exec_start(units / "fedge-lab-coordinator.service")[1:]]
        command += ["--join-timeout", "3", "--no-report"]
        done = subprocess.run(
            ["runuser", "-u", USER, "--", *env, *command],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert "only 0 of 2 clients joined run 'lab'" in done.stderr, done.stderr[-3000:]
        assert "Permission denied" not in done.stderr and "Traceback" not in done.stderr
        assert "coordinator connected to mqtts://127.0.0.1" in done.stderr  # its 0600 password read, TLS checked
    finally:
        stop_process(broker)
        if not existed:
            subprocess.run(["userdel", "--remove", USER], capture_output=True)


def test_a_secure_aggregation_kits_coordinator_unit_waits_for_the_whole_secure_round_on_stop(tmp_path: Path) -> None:
    # A SIGTERM during a round finishes it; a secure round has four deadlines (training, share, upload, unmask) of the
    # round timeout each, so systemd must not kill the coordinator after one.
    def stop_s(*flags: str) -> int:
        out = tmp_path / ("secure" if flags else "plain")
        args = ["provision", "--out", str(out), "--run", "lab", "--fleet-broker", "127.0.0.1", "--dataset", "digits"]
        assert main([*args, "--num-clients", "3", *flags]) == 0
        unit = (out / "kit" / "systemd" / "fedge-lab-coordinator.service").read_text()
        return int(next(ln for ln in unit.splitlines() if ln.startswith("TimeoutStopSec=")).split("=")[1])

    assert stop_s() == 330
    assert stop_s("--secure-aggregation") == 4 * 300 + 30
