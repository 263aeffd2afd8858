"""Devices come and go in a live fleet (issue 55): during a run over the kit's mosquitto, `fedge kit add-client`
issues a new device that logs in without a broker restart and is given tasks; `fedge kit revoke` refuses a device's
login, drops its open connection and the coordinator stops sampling it; both are recorded in the kit."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from kit_support import fedge_provision, open_dir, printed_commands, start_as_printed  # noqa: F401 - a fixture
from mqtt_support import require_mosquitto

from coordinator.kit.membership import ROSTER_FILE, add_client, revoke_client
from coordinator.kit.roster import Roster
from coordinator.run import COORDINATOR_LOG, run_coordinator
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge_cli.main import main
from fedge_io.credentials import load_bundle
from fedge_io.experiment import prepare
from sim.brokers import free_port, stop_process
from sim.laptop import client_processes

pytestmark = pytest.mark.broker


def _wait_for(path: Path, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never said {text!r}:\n{path.read_text(errors='replace')[-3000:]}")


def test_add_client_and_revoke_during_a_live_run_over_mosquitto(
    open_dir: Path,  # noqa: F811 - a fixture
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_mosquitto()
    caplog.set_level(logging.INFO)  # what `fedge coordinator` logs, so that coordinator.log has it too
    port = free_port()
    fleet = open_dir / "fleet"
    out = fedge_provision(
        [
            *("--out", str(fleet), "--run", "lab", "--fleet-broker", "127.0.0.1", "--fleet-bind", "127.0.0.1"),
            *("--fleet-port", str(port), "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "2"),
            *("--rounds", "3", "--local-epochs", "1"),
        ]
    )
    kit = fleet / "kit"
    broker = start_as_printed(printed_commands(out), port)
    bundle = load_bundle(kit / "coordinator")
    config = RunConfig.from_json_file(fleet / "config.json")
    round_one, go = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold_after_round_one(r: RoundRecord) -> None:  # the fleet changes between rounds 1 and 2
        if r.round == 1:
            round_one.set()
            go.wait(300)

    def coordinator() -> None:
        try:
            outcome["result"] = run_coordinator(
                config,
                open_dir / "run",
                broker=bundle.address,
                run=bundle.run,
                provisioned=bundle.clients,
                roster=Roster(kit / "coordinator"),
                experiment=prepare(config),
                round_timeout=60,
                join_timeout=120,
                on_round=hold_after_round_one,
            )
        except BaseException as exc:  # reported by the test's own thread
            outcome["error"] = exc

    logs = open_dir / "logs"
    files = {c: fleet / f"{c}.safetensors" for c in ("c000", "c001")}
    bundles = {c: kit / "clients" / c for c in ("c000", "c001", "c002")}
    try:
        with client_processes(files, bundle.address.url, "lab", log_dir=logs, bundles=bundles):
            thread = threading.Thread(target=coordinator, daemon=True)
            thread.start()
            assert round_one.wait(240), outcome
            capsys.readouterr()
            assert main(["kit", "add-client", "c002", "--kit", str(kit), "--data-from", "c000"]) == 0
            said = capsys.readouterr().out
            assert "client c002 added" in said and "broker reloaded (SIGHUP to mosquitto, pid " in said
            new = {"c002": fleet / "c002.safetensors"}
            with client_processes(new, bundle.address.url, "lab", log_dir=logs, bundles=bundles):
                _wait_for(logs / "c002.log", "waiting for tasks")  # its login was accepted: no broker restart
                assert main(["kit", "revoke", "c001", "--kit", str(kit), "--reason", "stolen"]) == 0
                assert "client c001 revoked" in capsys.readouterr().out
                # Its open connection dropped, and its login refused from then on.
                _wait_for(logs / "c001.log", "refused user 'fedge-lab-c001'")
                go.set()
                thread.join(300)
                _wait_for(logs / "c002.log", "round 3: sent update")
    finally:
        go.set()
        stop_process(broker)
    assert "error" not in outcome, outcome.get("error")
    rounds = outcome["result"].rounds  # type: ignore[attr-defined]
    assert [r.sampled for r in rounds] == [("c000", "c001"), ("c000", "c002"), ("c000", "c002")]
    assert all(r.aggregated for r in rounds)
    logged = (open_dir / "run" / COORDINATOR_LOG).read_text()
    assert "client c002 was added to the fleet" in logged and "client c002 online" in logged
    assert "client c001 was revoked from the fleet (fedge kit revoke): stolen" in logged
    # Recorded in the kit: the history, the broker's logins, the coordinator's list; the revoked secret is gone.
    events = json.loads((kit / ROSTER_FILE).read_text())["events"]
    assert [(e["action"], e["client"]) for e in events] == [("add-client", "c002"), ("revoke", "c001")]
    assert events[0]["data_from"] == "c000" and events[1]["reason"] == "stolen"
    users = {line.split(":", 1)[0] for line in (kit / "broker" / "passwd").read_text().splitlines()}
    assert "fedge-lab-c002" in users and "fedge-lab-c001" not in users
    assert "user fedge-lab-c001" not in (kit / "broker" / "acl").read_text()
    coordinator_bundle = json.loads((kit / "coordinator" / "bundle.json").read_text())
    assert coordinator_bundle["clients"] == ["c000", "c002"] and coordinator_bundle["revoked"] == {"c001": "stolen"}
    assert not (kit / "clients" / "c001" / "password").exists()
    # A revoked id is never issued again; an unknown one cannot be revoked.
    with pytest.raises(ConfigError, match="never issued again"):
        add_client(kit, "c001")
    with pytest.raises(ConfigError, match="not in the fleet"):
        revoke_client(kit, "c009", reason="")


def test_without_a_broker_on_this_machine_the_kit_changes_and_says_what_is_left_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryptography import x509

    from coordinator.kit.accounts import FleetSpec
    from coordinator.kit.writer import generate_fleet_kit

    spec = FleetSpec("lab", ("c000", "c001"), ("127.0.0.1",), 100_000, port=free_port(), client_certificates=True)
    kit = generate_fleet_kit(spec, tmp_path / "kit").root
    assert main(["kit", "add-client", "c002", "--kit", str(kit)]) == 0
    said = capsys.readouterr().out
    assert "to do: no mosquitto started with" in said and "systemctl reload fedge-lab-broker" in said
    # A certificate kit: the new device gets its own certificate from the kit's CA, named for its login.
    cert = x509.load_pem_x509_certificate((kit / "clients" / "c002" / "client.crt").read_bytes())
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "fedge-lab-c002"
    assert (kit / "clients" / "c002" / "client.key").stat().st_mode & 0o777 == 0o600
    assert json.loads((kit / "clients" / "c002" / "bundle.json").read_text())["cert_file"] == "client.crt"
    # ... and cannot revoke: mosquitto would let the certificate in; nothing is changed.
    before = (kit / "broker" / "passwd").read_text()
    assert main(["kit", "revoke", "c001", "--kit", str(kit)]) == 2
    assert "certificate revocation list" in capsys.readouterr().err
    assert (kit / "broker" / "passwd").read_text() == before
    assert main(["kit", "add-client", "monitor-3", "--kit", str(kit)]) == 2  # one of the kit's own logins
    assert main(["kit", "add-client", "c003", "--kit", str(kit), "--data-from", "c009"]) == 2
    assert "no such client" in capsys.readouterr().err


def test_a_client_id_with_a_trailing_newline_is_refused_before_a_file_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # re's "$" also matches before a final newline: such an id would split a line of the broker's passwd and acl.
    from coordinator.kit.accounts import FleetSpec
    from coordinator.kit.writer import generate_fleet_kit

    with pytest.raises(ConfigError, match="client id"):
        FleetSpec("lab", ("c000", "c001\n"), ("127.0.0.1",), 100_000, port=free_port())
    kit = generate_fleet_kit(FleetSpec("lab", ("c000",), ("127.0.0.1",), 100_000, port=free_port()), tmp_path / "k")
    before = (kit.root / "broker" / "passwd").read_text()
    assert main(["kit", "add-client", "c002\n", "--kit", str(kit.root)]) == 2
    assert "use 1-64 letters" in capsys.readouterr().err
    assert (kit.root / "broker" / "passwd").read_text() == before and not (kit.root / "clients" / "c002\n").exists()


def test_a_folder_that_is_not_a_kit_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "bundle.json").write_text('{"clients": []}')  # a JSON object, not a kit's bundle
    assert main(["kit", "add-client", "c002", "--kit", str(tmp_path)]) == 2
    assert main(["kit", "revoke", "c002", "--kit", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("is it a fedge fleet kit") == 2


def test_an_add_client_that_fails_half_way_leaves_nothing_behind_and_can_be_run_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.kit import membership
    from coordinator.kit.accounts import FleetSpec
    from coordinator.kit.writer import generate_fleet_kit

    kit = generate_fleet_kit(FleetSpec("lab", ("c000",), ("127.0.0.1",), 100_000, port=free_port()), tmp_path / "k")
    real = membership.Kit.write_broker_files

    def fails(self: membership.Kit, passwords: dict[str, str | None]) -> None:
        raise PermissionError(13, "Permission denied", str(self.broker_dirs[-1] / "passwd"))

    monkeypatch.setattr(membership.Kit, "write_broker_files", fails)
    assert main(["kit", "add-client", "c001", "--kit", str(kit.root)]) == 2
    assert "Permission denied" in capsys.readouterr().err
    assert not (kit.root / "clients" / "c001").exists()  # no half-made bundle that would block the retry
    monkeypatch.setattr(membership.Kit, "write_broker_files", real)
    assert main(["kit", "add-client", "c001", "--kit", str(kit.root)]) == 0
    assert "c001" in json.loads((kit.root / "coordinator" / "bundle.json").read_text())["clients"]


def test_a_kit_this_user_cannot_write_is_refused_before_anything_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.kit.accounts import FleetSpec
    from coordinator.kit.writer import generate_fleet_kit

    kit = generate_fleet_kit(FleetSpec("lab", ("c000",), ("127.0.0.1",), 100_000, port=free_port()), tmp_path / "k")
    broker = kit.root / "broker"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != broker and real_access(p, mode))  # as if not root
    assert main(["kit", "add-client", "c001", "--kit", str(kit.root)]) == 2
    assert "nothing was changed" in capsys.readouterr().err
    assert not (kit.root / "clients" / "c001").exists()
    assert main(["kit", "revoke", "c000", "--kit", str(kit.root)]) == 2
    assert "c000" in (broker / "passwd").read_text()


def test_kit_changes_take_turns_and_a_damaged_roster_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two `fedge kit` commands on one kit at once would each rewrite the bundle and broker files from what they read:
    the second waits for the first's lock, so neither drops the other's device."""
    import fcntl

    from coordinator.kit.accounts import FleetSpec
    from coordinator.kit.membership import LOCK_FILE
    from coordinator.kit.writer import generate_fleet_kit

    kit = generate_fleet_kit(FleetSpec("lab", ("c000",), ("127.0.0.1",), 100_000, port=free_port()), tmp_path / "k")
    held = os.open(kit.root / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # another command is under way
    done: list[str] = []
    worker = threading.Thread(target=lambda: done.append(add_client(kit.root, "c001").client))
    worker.start()
    time.sleep(0.5)
    assert not done and "c001" not in json.loads((kit.root / "coordinator" / "bundle.json").read_text())["clients"]
    os.close(held)  # the other command finishes
    worker.join(30)
    assert done == ["c001"]
    assert main(["kit", "add-client", "c002", "--kit", str(kit.root)]) == 0
    clients = json.loads((kit.root / "coordinator" / "bundle.json").read_text())["clients"]
    assert clients == ["c000", "c001", "c002"]
    (kit.root / ROSTER_FILE).write_text('{"run": "lab", "events": {"edited": "by hand"}}')
    assert main(["kit", "add-client", "c003", "--kit", str(kit.root)]) == 2
    err = capsys.readouterr().err
    assert "'events' must be a list" in err and "Nothing was changed" in err and "Traceback" not in err
    assert "c003" not in json.loads((kit.root / "coordinator" / "bundle.json").read_text())["clients"]
    assert not (kit.root / "clients" / "c003").exists()


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a kit and its bytes, but the lock that each fedge kit command takes."""
    from coordinator.kit.membership import LOCK_FILE

    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE
    }


def test_while_the_embedded_broker_serves_the_kit_add_client_and_revoke_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """amqtt (the embedded broker of `fedge sim --transport mqtt`) reads the kit's users and ACL once, at start, and has
    no reload: a device added under it could not log in, a revoked one would stay connected. So while it serves the
    kit, both commands say so and change nothing; once it is gone (or its marker is a dead process's), they work, and
    a broker started anew from the kit lets the added device in."""
    from coordinator.kit.accounts import FleetSpec
    from coordinator.kit.broker_files import EMBEDDED_BROKER_FILE
    from coordinator.kit.writer import generate_fleet_kit
    from fedge_io.mqtt import MqttLink
    from sim.brokers import embedded_broker

    port = free_port()
    kit = generate_fleet_kit(FleetSpec("lab", ("c000", "c001"), ("127.0.0.1",), 100_000, port=port), tmp_path / "k")
    marker = kit.broker_dir / EMBEDDED_BROKER_FILE
    with embedded_broker(port, fleet=kit.broker_dir):
        before = _files(kit.root)
        assert json.loads(marker.read_text())["pid"] == os.getpid()
        assert main(["kit", "add-client", "c002", "--kit", str(kit.root)]) == 2
        assert main(["kit", "revoke", "c001", "--kit", str(kit.root), "--reason", "lost"]) == 2
        err = capsys.readouterr().err
        assert err.count(f"the broker of this kit is the embedded one (amqtt, in process {os.getpid()}") == 2, err
        assert "it would not let it log in" in err and "refuse its login or close its connection" in err
        assert "run the fleet over the kit's mosquitto" in err and "Traceback" not in err
        assert _files(kit.root) == before  # nothing written: no bundle, no login, no roster entry
    assert not marker.exists()  # the broker is gone: the kit can change again
    assert main(["kit", "add-client", "c002", "--kit", str(kit.root)]) == 0
    assert "to do: no mosquitto started with" in capsys.readouterr().out
    with embedded_broker(port, fleet=kit.broker_dir) as url:  # started anew, it reads the new login
        device = load_bundle(kit.root / "clients" / "c002", broker=url)
        with MqttLink(device.address, device.username).start(10) as link:
            assert link.connections == 1
    marker.write_text(json.dumps({"pid": 2**22 + 1}))  # above Linux's pid_max: a process that is gone
    assert main(["kit", "revoke", "c001", "--kit", str(kit.root), "--reason", "lost"]) == 0
    assert "c001" not in json.loads((kit.root / "coordinator" / "bundle.json").read_text())["clients"]
