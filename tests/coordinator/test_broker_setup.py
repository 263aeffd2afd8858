"""The deployment path as printed: ``fedge provision`` prints the commands that start the kit's mosquitto, and those
commands, run exactly as printed, start a broker that reads the kit's passwords, ACL and keys and writes its
persistence database: as root (mosquitto then runs as user ``mosquitto``), with the kit where that user can and
cannot reach it, and as an unprivileged user."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from kit_support import (  # noqa: F401 - a fixture
    USER_PATH,
    fedge_provision,
    open_dir,
    printed_commands,
    start_as_printed,
)
from mqtt_support import require_mosquitto

from coordinator.broker_setup import BROKER_USER, blocked_by, broker_plan, mosquitto_command
from coordinator.kit.accounts import FleetSpec
from coordinator.kit.writer import generate_fleet_kit
from fedge.wire.protocol import Topics
from fedge_io.credentials import load_bundle
from fedge_io.mqtt import MqttLink
from sim.brokers import free_port, stop_process

pytestmark = pytest.mark.broker

AS_ROOT = os.geteuid() == 0 and shutil.which("runuser") is not None
MOSQUITTO = mosquitto_command()  # by full path: /usr/sbin is not on a normal user's PATH
needs_root = pytest.mark.skipif(not AS_ROOT, reason="needs root (mosquitto dropping to its own user)")


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def provision(out: Path, port: int, run: str, *extra: str) -> str:
    argv = ["--out", str(out), "--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "2", "--run", run]
    argv += ["--fleet-broker", "127.0.0.1", "--fleet-port", str(port), "--fleet-bind", "127.0.0.1", *extra]
    return fedge_provision(argv)


def assert_logins_work(kit: Path, run: str) -> None:
    """The coordinator and a client log in with their bundles and exchange a message through the ACL."""
    t = Topics(run)
    coordinator, client = load_bundle(kit / "coordinator"), load_bundle(kit / "clients" / "c000")
    with (
        MqttLink(coordinator.address, coordinator.username, subscriptions=[(t.all_updates, 1)]).start(10) as coord,
        MqttLink(client.address, client.username, subscriptions=[(t.task("c000"), 1)]).start(10) as dev,
    ):
        dev.publish(t.update("c000"), b"update")
        got = coord.get(10)
        assert got is not None and got.payload == b"update"


def stop(broker: subprocess.Popen[bytes]) -> None:
    # As root, `bash -c` execs mosquitto (one simple command), so the PID is the broker's own; it saves its
    # persistence database on SIGTERM.
    assert stop_process(broker) == 0


@needs_root
def test_provision_as_root_prints_commands_that_start_mosquitto_as_its_own_user(open_dir: Path) -> None:  # noqa: F811
    require_mosquitto()
    if not _has_user(BROKER_USER):
        pytest.skip(f"no user {BROKER_USER} on this machine")
    port, run = free_port(), "lab"
    out = provision(open_dir / "fleet", port, run)
    commands = printed_commands(out)
    broker_dir = open_dir / "fleet" / "kit" / "broker"
    assert commands == [f"chown -R mosquitto:mosquitto {broker_dir}", f"{MOSQUITTO} -c {broker_dir}/mosquitto.conf"]
    # provision already handed the files over: the broker's user owns them, the devices' secrets stay root's.
    account = pwd.getpwnam(BROKER_USER)
    assert (broker_dir / "passwd").stat().st_uid == account.pw_uid
    assert (open_dir / "fleet" / "kit" / "coordinator" / "password").stat().st_uid == 0
    assert oct((open_dir / "fleet" / "kit" / "clients").stat().st_mode & 0o777) == "0o700"
    broker = start_as_printed(commands, port)
    try:
        assert_logins_work(open_dir / "fleet" / "kit", run)
    finally:
        stop(broker)
    db = broker_dir / "mosquitto.db"  # persistence written as user mosquitto into the kit's broker directory
    assert db.exists() and db.stat().st_uid == account.pw_uid


@needs_root
def test_a_kit_the_broker_user_cannot_reach_is_copied_to_its_home(tmp_path: Path) -> None:
    """pytest's tmp_path lies under a 0700 directory of root's, like /root: the printed commands copy the broker's
    files to ~mosquitto/fedge-<run>, which mosquitto.conf names."""
    require_mosquitto()
    if not _has_user(BROKER_USER):
        pytest.skip(f"no user {BROKER_USER} on this machine")
    home = Path(pwd.getpwnam(BROKER_USER).pw_dir)
    if not home.is_dir() or blocked_by(home, BROKER_USER) is not None:
        pytest.skip(f"{BROKER_USER}'s home {home} is not usable here")
    assert blocked_by(tmp_path, BROKER_USER) is not None
    port, run = free_port(), f"t{uuid.uuid4().hex[:10]}"
    target = home / f"fedge-{run}"
    try:
        out = provision(tmp_path / "fleet", port, run)
        assert f"user {BROKER_USER} cannot enter" in out
        commands = printed_commands(out)
        assert commands[-1] == f"{MOSQUITTO} -c {target}/mosquitto.conf"
        assert f"password_file {target}/passwd" in (tmp_path / "fleet/kit/broker/mosquitto.conf").read_text()
        broker = start_as_printed(commands, port)
        try:
            assert_logins_work(tmp_path / "fleet" / "kit", run)
        finally:
            stop(broker)
        assert (target / "mosquitto.db").exists()
    finally:
        shutil.rmtree(target, ignore_errors=True)


@needs_root
def test_fleet_broker_dir_prints_the_copy_to_that_directory(tmp_path: Path, open_dir: Path) -> None:  # noqa: F811
    require_mosquitto()
    port, run = free_port(), "lab"
    target = open_dir / "etc" / "fedge-lab"
    out = provision(tmp_path / "fleet", port, run, "--fleet-broker-dir", str(target))
    commands = printed_commands(out)
    assert commands[0] == f"install -d -m 0700 -o mosquitto -g mosquitto {target}"
    broker = start_as_printed(commands, port)
    try:
        assert_logins_work(tmp_path / "fleet" / "kit", run)
    finally:
        stop(broker)


@pytest.mark.skipif(not AS_ROOT or not _has_user("nobody"), reason="needs root to act as user nobody")
def test_an_unprivileged_user_starts_the_broker_as_printed(open_dir: Path) -> None:  # noqa: F811
    """What provision prints for a user who is not root, run by such a user (nobody) on a kit it owns."""
    require_mosquitto()
    nobody = pwd.getpwnam("nobody")
    port, run = free_port(), "lab"
    kit_dir = open_dir / "kit"
    plan = broker_plan(kit_dir / "broker", run=run, as_root=False)
    assert plan.commands == (f"{MOSQUITTO} -c {kit_dir}/broker/mosquitto.conf",)
    spec = FleetSpec(run, ("c000", "c001"), ("127.0.0.1",), 50_000, port=port, bind_address="127.0.0.1")
    generate_fleet_kit(spec, kit_dir, broker_config_dir=plan.conf_dir)
    for path in [open_dir, *open_dir.rglob("*")]:  # as if nobody had made the kit
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    broker = start_as_printed(plan.commands, port, user="nobody")
    try:
        assert_logins_work(kit_dir, run)
    finally:
        stop_process(broker)
    assert (kit_dir / "broker" / "mosquitto.db").stat().st_uid == nobody.pw_uid


def test_the_plan_for_a_user_who_is_not_root_and_paths_that_need_quoting(tmp_path: Path) -> None:
    kit = tmp_path / "my fleet" / "kit" / "broker"
    target = tmp_path / "srv dir" / "fedge"
    plan = broker_plan(kit, run="lab", conf_dir=target, as_root=False)
    assert plan.conf_dir == target and plan.note == ""
    assert plan.commands == (
        f"install -d -m 0700 '{target}'",
        f"cp -a '{kit}'/. '{target}'/",
        f"{MOSQUITTO} -c '{target}/mosquitto.conf'",
    )
    # Run by a user who is not root, mosquitto stays that user: nothing to hand over, wherever the kit is.
    assert broker_plan(kit, run="lab", as_root=False).commands == (f"{MOSQUITTO} -c '{kit}/mosquitto.conf'",)


def test_the_printed_mosquitto_is_found_by_full_path_without_sbin_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user who is not root has no /usr/sbin on PATH: a bare `mosquitto -c ...` is `command not found` there."""
    require_mosquitto()
    monkeypatch.setenv("PATH", USER_PATH)
    binary = mosquitto_command()
    assert Path(binary).is_absolute() and os.access(binary, os.X_OK), binary
    (command,) = broker_plan(Path("/srv/kit/broker"), run="lab", as_root=False).commands
    assert command == f"{binary} -c /srv/kit/broker/mosquitto.conf"
    done = subprocess.run(["bash", "-c", f"{binary} -h"], capture_output=True, text=True, env={"PATH": USER_PATH})
    assert "mosquitto version" in done.stdout + done.stderr
