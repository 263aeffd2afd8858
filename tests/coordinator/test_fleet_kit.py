"""The fleet kit, and the broker enforcing it: a real mosquitto started from the kit's generated configuration, and
the embedded amqtt broker given the kit's users and ACL. Every refusal is asserted on the broker's own answer (the
CONNACK or SUBACK code) or on a message never reaching a legitimate subscriber that got a later one."""

from __future__ import annotations

import base64
import json
import queue
import re
import socket
import stat
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest

from coordinator.kit.accounts import FleetSpec, admit_provisioned, fleet_username
from coordinator.kit.broker_files import mosquitto_password_line
from coordinator.kit.writer import FleetKit, generate_fleet_kit
from fedge.errors import ConfigError, TransportError
from fedge.wire.protocol import BrokerAddress, ClientStatus, Topics
from fedge_io.broker_security import tls_context
from fedge_io.credentials import load_bundle
from fedge_io.mqtt import MqttLink, Will
from sim.brokers import embedded_broker, find_mosquitto, fleet_mosquitto, free_port, wait_for_port

pytestmark = [
    pytest.mark.broker,
    pytest.mark.filterwarnings("ignore:`BrokerSysPlugin`:DeprecationWarning"),  # amqtt 0.12.1 about psutil
]

RUN = "lab"
CLIENTS = ("c001", "c002")
T = Topics(RUN)
MAX_MESSAGE = 50_000


def make_kit(root: Path, **overrides: object) -> FleetKit:
    settings: dict[str, object] = {
        "run": RUN,
        "clients": CLIENTS,
        "broker_hosts": ("127.0.0.1", "localhost"),
        "max_message_bytes": MAX_MESSAGE,
        "port": free_port(),
        "bind_address": "127.0.0.1",
        "sys_interval": 1,
    }
    settings.update(overrides)
    return generate_fleet_kit(FleetSpec(**settings), root / "kit")  # type: ignore[arg-type]


def require_mosquitto() -> None:
    try:
        find_mosquitto()
    except TransportError as exc:
        pytest.skip(str(exc))


class Probe:
    """A bare paho client (MQTT 3.1.1, as fedge speaks) recording the broker's own answers: CONNACK and SUBACK
    reason codes, the messages it delivers, and whether it dropped the connection."""

    def __init__(self, address: BrokerAddress, client_id: str, *, will: tuple[str, bytes] | None = None) -> None:
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=paho.MQTTv311,
            reconnect_on_failure=False,  # report the broker's answer; never retry behind the test's back
        )
        if address.username is not None:
            self.client.username_pw_set(address.username, address.password)
        if address.tls:
            self.client.tls_set_context(tls_context(address))
        if will is not None:
            self.client.will_set(will[0], will[1], qos=1, retain=False)
        self._connack: queue.Queue[str] = queue.Queue()
        self._subacks: dict[int, list[str]] = {}
        self._suback_event = threading.Condition()
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.seen: list[tuple[str, bytes]] = []
        self.disconnected = threading.Event()
        self.client.on_connect = lambda c, u, f, reason, p: self._connack.put(str(reason))
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload)))
        self.client.on_disconnect = lambda c, u, f, reason, p: self.disconnected.set()
        self.client.connect(address.host, address.port, keepalive=30)
        self.client.loop_start()
        self.connack = self._connack.get(timeout=5)  # "Success", "Not authorized", ...

    def _on_subscribe(self, client: paho.Client, userdata: object, mid: int, reasons: list[Any], props: object) -> None:
        with self._suback_event:
            self._subacks[mid] = [str(r) for r in reasons]
            self._suback_event.notify_all()

    def subscribe(self, *filters: str) -> list[str]:
        """The SUBACK's reason per filter: "Granted QoS 1" or "Unspecified error" (0x80)."""
        _, mid = self.client.subscribe([(f, 1) for f in filters])
        assert mid is not None
        with self._suback_event:
            assert self._suback_event.wait_for(lambda: mid in self._subacks, timeout=5), "no SUBACK"
            return self._subacks[mid]

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the broker's PUBACK (MQTT 3.1.1 acknowledges even what its ACL drops)."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(5)
        assert info.is_published(), f"no PUBACK for {topic}"

    def wait_for(self, topic: str, payload: bytes, timeout: float = 5.0) -> None:
        """Block until (topic, payload) arrives; everything received before it is kept in ``seen``."""
        while True:
            got = self.messages.get(timeout=timeout)
            self.seen.append(got)
            if got == (topic, payload):
                return

    def drain(self, wait: float = 0.3) -> list[tuple[str, bytes]]:
        """What else arrives within ``wait`` seconds, added to ``seen``."""
        try:
            while True:
                self.seen.append(self.messages.get(timeout=wait))
        except queue.Empty:
            return self.seen

    def drop(self) -> None:
        """Close the TCP connection without DISCONNECT, so the broker publishes the last will."""
        sock = self.client.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)
        self.disconnected.wait(5)
        self.client.loop_stop()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@dataclass
class Fleet:
    """A running broker secured by a fleet kit, and the bundles to reach it."""

    kind: str
    url: str
    kit: FleetKit
    probes: list[Probe] = field(default_factory=list)

    def address(self, who: str | None) -> BrokerAddress:
        folder = self.kit.coordinator_dir if who is None else self.kit.client_dirs[who]
        return load_bundle(folder, broker=self.url).address

    def probe(self, who: str | None, *, client_id: str | None = None, **kwargs: object) -> Probe:
        """Connect as ``who`` (a client id, None: the coordinator), by default with its own MQTT client id."""
        made = Probe(self.address(who), client_id or fleet_username(RUN, who), **kwargs)  # type: ignore[arg-type]
        self.probes.append(made)
        return made


@pytest.fixture(params=["mosquitto", "embedded"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    """A broker run from a fresh fleet kit: mosquitto from the kit's mosquitto.conf, or amqtt with its users/ACL."""
    kit = make_kit(tmp_path)
    if request.param == "mosquitto":
        require_mosquitto()
        broker = fleet_mosquitto(kit.broker_dir)
    else:
        broker = embedded_broker(fleet=kit.broker_dir, sys_interval=1)
    with broker as url:
        state = Fleet(request.param, url, kit)
        yield state
        for probe in state.probes:
            probe.close()


# --- the kit's files -----------------------------------------------------------------------------------------------


def test_kit_layout_secrets_and_modes(tmp_path: Path) -> None:
    kit = make_kit(tmp_path, client_certificates=True)
    root = kit.root
    private = [root / "broker/passwd", root / "broker/amqtt-passwd", root / "broker/server.key", root / "ca/ca.key"]
    for who in ("coordinator", "monitor", "clients/c001", "clients/c002"):
        private += [root / who / "password", root / who / "client.key"]
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for folder in (
        root,
        root / "broker",
        root / "ca",
        root / "clients",
        root / "clients/c001",
        root / "coordinator",
        root / "monitor",
    ):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    who = ("coordinator", "monitor", "clients/c001", "clients/c002")
    passwords = {(root / w / "password").read_text().strip() for w in who}
    assert len(passwords) == 4 and all(len(p) >= 43 for p in passwords)  # 32 random bytes each, all different
    public = [p for p in root.rglob("*") if p.is_file() and p not in private and p.name != "password"]
    for path in public:  # no secret in a configuration, ACL, bundle or certificate
        assert not any(secret in path.read_text() for secret in passwords), path

    bundle = json.loads((root / "clients/c002/bundle.json").read_text())
    assert bundle == {
        "format": 1,
        "role": "client",
        "run": RUN,
        "client_id": "c002",
        "username": "fedge-lab-c002",
        "broker": f"mqtts://127.0.0.1:{kit.spec.port}",
        "password_file": "password",
        "ca_file": "ca.crt",
        "verify_hostname": True,
        "cert_file": "client.crt",
        "key_file": "client.key",
        "signed_programs": False,  # fedge provision --signed-programs: the device loads only programs the CA signed
    }
    coordinator = load_bundle(kit.coordinator_dir)
    assert coordinator.role == "coordinator" and coordinator.clients == CLIENTS
    assert coordinator.username == "fedge-lab-coordinator" and coordinator.address.password in passwords
    assert "password" not in repr(coordinator) and coordinator.address.password not in repr(coordinator)


def test_acl_is_least_privilege(tmp_path: Path) -> None:
    acl = (make_kit(tmp_path).broker_dir / "acl").read_text()
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in acl.split("\n\n")[1:]}
    assert blocks["user fedge-lab-c002"] == [
        "topic write fedge/lab/update/c002",
        "topic write fedge/lab/status/c002",
        "topic read fedge/lab/task/c002",
        "topic read fedge/lab/broadcast",
    ]
    assert blocks["user fedge-lab-coordinator"] == [
        "topic write fedge/lab/task/+",
        "topic write fedge/lab/broadcast",
        "topic write fedge/lab/run-status",
        "topic read fedge/lab/update/+",
        "topic read fedge/lab/status/+",
        "topic read $SYS/broker/bytes/+",
        "topic read $SYS/broker/load/bytes/+",
        "topic read $SYS/broker/uptime",  # tells a restarted broker (its counters started again) from a running one
    ]
    # fedge status: read only, under any of the monitor bundle's names (one per viewer at once)
    monitors = [f"user fedge-lab-monitor{suffix}" for suffix in ("", *(f"-{k}" for k in range(2, 9)))]
    assert [b for b in blocks if "monitor" in b] == monitors
    assert all(blocks[m] == ["topic read fedge/lab/run-status"] for m in monitors)
    assert not any(line.startswith(("topic", "pattern")) for line in acl.split("\n\nuser")[0].splitlines())


def test_mosquitto_conf_secures_the_listener(tmp_path: Path) -> None:
    kit = make_kit(tmp_path, bind_address=None, port=8883)
    conf = kit.mosquitto_conf.read_text().splitlines()
    for line in (
        "allow_anonymous false",
        "listener 8883",
        "use_username_as_clientid true",
        "tls_version tlsv1.2",
        "require_certificate false",
        f"password_file {kit.broker_dir / 'passwd'}",
        f"acl_file {kit.broker_dir / 'acl'}",
        "persistence true",
        f"persistence_location {kit.broker_dir}/",
    ):
        assert line in conf
    # The largest legitimate packet (a 50,000-byte task on the longest topic) fits, with 10 % headroom.
    packet = 1 + 3 + 2 + len("fedge/lab/task/c001") + 2 + MAX_MESSAGE
    assert f"max_packet_size {int(packet * 1.1) + 1}" in conf
    assert kit.spec.max_packet_size >= packet


def test_password_entry_is_mosquitto_passwd_format(tmp_path: Path) -> None:
    """The same salt and iterations give the same line as mosquitto's own tool (apart from its salt, random)."""
    tool = Path(find_mosquitto()).with_name("mosquitto_passwd")
    tool = tool if tool.exists() else Path("/usr/bin/mosquitto_passwd")
    if not tool.exists():
        pytest.skip("mosquitto_passwd is not installed")
    secret = "throwaway-test-password"  # on a command line only here, in a test
    passwd = tmp_path / "passwd"
    subprocess.run([str(tool), "-c", "-b", str(passwd), "alice", secret], check=True, capture_output=True)
    line = passwd.read_text().strip()
    match = re.fullmatch(r"alice:\$7\$(\d+)\$([^$]+)\$([^$]+)", line)
    assert match, line
    salt = base64.b64decode(match[2])
    assert mosquitto_password_line("alice", secret, salt=salt, iterations=int(match[1])) == line


def test_spec_refuses_what_a_broker_or_topic_cannot_carry(tmp_path: Path) -> None:
    good = {"run": RUN, "clients": CLIENTS, "broker_hosts": ("b",), "max_message_bytes": 10}
    for bad, says in (
        ({"clients": ("c 1",)}, "client id 'c 1'"),
        ({"clients": ("coordinator",)}, "the name of the kit's coordinator login"),
        ({"clients": ("monitor",)}, "the name of the kit's monitor login"),
        ({"clients": ("monitor-8",)}, "'monitor-8' is the name of the kit's monitor login"),  # its pool of viewers
        ({"monitors": 0}, "at least one monitor login"),
        ({"clients": ("a", "a")}, "must be unique"),
        ({"clients": ()}, "at least one client id"),
        ({"run": "a/b"}, "run name 'a/b'"),
        ({"broker_hosts": ()}, "broker's host name"),
        ({"max_message_bytes": 0}, "max_message_bytes must be > 0"),
        ({"tls": False, "client_certificates": True}, "client certificates need TLS"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            FleetSpec(**{**good, **bad})  # type: ignore[arg-type]
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit/old").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        make_kit(tmp_path)


def test_coordinator_admits_only_provisioned_clients() -> None:
    admit = admit_provisioned(CLIENTS, then=lambda s: "wrong model" if s.model != "m" else None)
    assert admit(ClientStatus("c001", "online", model="m")) is None
    assert admit(ClientStatus("c001", "online", model="x")) == "wrong model"
    assert admit(ClientStatus("c999", "online", model="m")) == "not provisioned in this run's fleet kit"


# --- the broker enforcing it -----------------------------------------------------------------------------------------


def hello(link: MqttLink) -> None:
    link.publish(T.status("c001"), b"hello", retain=True)


def test_client_and_coordinator_exchange_messages_over_tls_with_passwords(fleet: Fleet) -> None:
    assert fleet.url.startswith("mqtts://")
    coordinator = load_bundle(fleet.kit.coordinator_dir, broker=fleet.url)
    client = load_bundle(fleet.kit.client_dirs["c001"], broker=fleet.url)
    with (
        MqttLink(
            coordinator.address, coordinator.username, subscriptions=[(T.all_updates, 1), (T.all_statuses, 1)]
        ).start(5) as coord,
        MqttLink(
            client.address,
            client.username,
            subscriptions=[(T.task("c001"), 1), (T.broadcast, 1)],
            will=Will(T.status("c001"), b"offline"),
            on_ready=hello,
        ).start(5) as dev,
    ):
        assert (got := coord.get(5)) is not None and (got.topic, got.payload) == (T.status("c001"), b"hello")
        coord.publish(T.task("c001"), b"task")
        coord.publish(T.broadcast, b"weights")
        received = {(m.topic, m.payload) for m in (dev.get(5), dev.get(5)) if m is not None}
        assert received == {(T.task("c001"), b"task"), (T.broadcast, b"weights")}
        dev.publish(T.update("c001"), b"update")
        assert (got := coord.get(5)) is not None and (got.topic, got.payload) == (T.update("c001"), b"update")


def test_anonymous_and_wrong_password_logins_are_refused(fleet: Fleet) -> None:
    address = fleet.address("c001")
    anonymous = replace(address, username=None, password=None)
    assert Probe(anonymous, "fedge-lab-c001").connack == "Not authorized"
    assert Probe(address.with_login(address.username or "", "not-the-password"), "fedge-lab-c001").connack == (
        "Not authorized"
    )
    other = fleet.address("c002")  # c002's user name with c001's password
    assert Probe(other.with_login(other.username or "", address.password), "fedge-lab-c002").connack == (
        "Not authorized"
    )
    assert fleet.probe("c001").connack == "Success"


def test_a_client_reads_nothing_but_its_tasks_and_the_broadcast(fleet: Fleet) -> None:
    coord = fleet.probe(None)
    assert coord.subscribe(T.all_updates, T.all_statuses) == ["Granted QoS 1"] * 2
    victim = fleet.probe("c002")
    assert victim.subscribe(T.task("c002")) == ["Granted QoS 1"]
    spy = fleet.probe("c001")
    forbidden = [f"{T.prefix}/#", T.all_updates, T.all_statuses, T.task("c002"), "$SYS/#", "fedge/#"]
    answers = spy.subscribe(*forbidden, T.task("c001"))
    if fleet.kind == "embedded":
        assert answers == ["Unspecified error"] * len(forbidden) + ["Granted QoS 1"]  # SUBACK 0x80 from its ACL
    else:
        assert answers == ["Granted QoS 1"] * (len(forbidden) + 1)  # mosquitto 2.0 checks its ACL on delivery

    coord.publish(T.task("c002"), b"secret task")
    victim.wait_for(T.task("c002"), b"secret task")
    victim.publish(T.update("c002"), b"secret update")
    victim.publish(T.status("c002"), b"hello")
    coord.wait_for(T.update("c002"), b"secret update")
    coord.wait_for(T.status("c002"), b"hello")
    coord.publish(T.task("c001"), b"own task")  # queued after the others: once it is in, they would be too
    spy.wait_for(T.task("c001"), b"own task")
    assert {topic for topic, _ in spy.drain()} == {T.task("c001")}


def test_a_client_cannot_publish_for_another_client_or_the_coordinator(fleet: Fleet) -> None:
    coord = fleet.probe(None)
    coord.subscribe(T.all_updates, T.all_statuses)
    victim = fleet.probe("c002")
    victim.subscribe(T.task("c002"), T.broadcast)
    forger = fleet.probe("c001")
    forger.publish(T.update("c002"), b"forged update")  # acknowledged (MQTT 3.1.1) and dropped
    forger.publish(T.status("c002"), b"forged offline", retain=True)
    forger.publish(T.task("c002"), b"forged task")
    forger.publish(T.broadcast, b"forged broadcast")

    victim.publish(T.update("c002"), b"real update")
    coord.wait_for(T.update("c002"), b"real update")
    coord.publish(T.task("c002"), b"real task")
    victim.wait_for(T.task("c002"), b"real task")
    assert coord.seen == [(T.update("c002"), b"real update")]
    assert victim.seen == [(T.task("c002"), b"real task")]
    late = fleet.probe(None)  # no forged retained status waits for a coordinator that subscribes later
    late.subscribe(T.all_statuses)
    assert not [m for m in late.drain() if not m[0].startswith("$SYS")]


def test_the_mqtt_client_id_is_bound_to_the_credential(fleet: Fleet) -> None:
    for taken in ("fedge-lab-c002", "fedge-lab-coordinator"):
        thief = Probe(fleet.address("c001"), taken)  # c001's own credential, someone else's client id
        if fleet.kind == "embedded":
            assert thief.connack == "Not authorized"  # FleetAuthPlugin: the client id must be the user name
        else:
            assert thief.connack == "Success"  # use_username_as_clientid: to the broker it is fedge-lab-c001
        thief.close()


def test_logins_under_another_clients_id_leave_that_client_alone(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    if fleet.kind == "embedded":
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="amqtt 0.12.1 deletes the session (subscriptions) of a CONNECT's client id before it checks "
                "the login (broker.py _initialize_client_session); documented in sim/brokers.py",
            )
        )
    victim = fleet.probe("c002")
    victim.subscribe(T.task("c002"))
    coordinator = fleet.probe(None)
    coordinator.subscribe(T.all_updates)
    c001, c002 = fleet.address("c001"), fleet.address("c002")
    for address, taken in (
        (c001, "fedge-lab-c002"),  # a valid credential with another client's id
        (c001, "fedge-lab-coordinator"),
        (c002.with_login(c002.username or "", "guess"), "fedge-lab-c002"),  # a guessed password
    ):
        Probe(address, taken).close()
    coordinator.publish(T.task("c002"), b"task")
    victim.wait_for(T.task("c002"), b"task", timeout=2)  # neither kicked out nor taken over
    victim.publish(T.update("c002"), b"update")
    coordinator.wait_for(T.update("c002"), b"update", timeout=2)
    assert not victim.disconnected.is_set() and not coordinator.disconnected.is_set()


def test_a_last_will_cannot_forge_another_clients_status(fleet: Fleet) -> None:
    coord = fleet.probe(None)
    coord.subscribe(T.all_statuses)
    forger = Probe(fleet.address("c001"), "fedge-lab-c001", will=(T.status("c002"), b"forged offline"))
    if fleet.kind == "embedded":
        assert forger.connack == "Not authorized"  # FleetAuthPlugin checks the will against the publish ACL
    else:
        assert forger.connack == "Success"  # mosquitto checks the will's topic when it would publish it
        forger.drop()
    honest = Probe(fleet.address("c001"), "fedge-lab-c001", will=(T.status("c001"), b"offline"))
    assert honest.connack == "Success"
    honest.drop()
    coord.wait_for(T.status("c001"), b"offline")
    assert [m for m in coord.seen if not m[0].startswith("$SYS")] == [(T.status("c001"), b"offline")]


def test_only_the_coordinator_reads_the_broker_counters(fleet: Fleet) -> None:
    counters = "$SYS/broker/bytes/+" if fleet.kind == "mosquitto" else "$SYS/broker/load/bytes/+"
    coord = fleet.probe(None)
    coord.subscribe(counters)
    got = coord.messages.get(timeout=3)
    assert got[0].startswith("$SYS/broker/")
    client = fleet.probe("c001")
    client.subscribe("$SYS/#", counters)
    assert client.drain(1.5) == []


def test_a_packet_over_the_size_limit_is_refused(fleet: Fleet) -> None:
    if fleet.kind == "embedded":
        pytest.skip("amqtt 0.12.1 has no packet size limit (mosquitto's max_packet_size)")
    coord = fleet.probe(None)
    coord.subscribe(T.all_updates)
    sender = fleet.probe("c001")
    sender.publish(T.update("c001"), bytes(MAX_MESSAGE))  # the largest legitimate message passes
    coord.wait_for(T.update("c001"), bytes(MAX_MESSAGE))
    sender.client.publish(T.update("c001"), bytes(2 * MAX_MESSAGE), qos=1)
    assert sender.disconnected.wait(5)  # the broker closes the sender's connection
    fleet.probe("c002").publish(T.update("c002"), b"after")
    coord.wait_for(T.update("c002"), b"after")
    assert [len(p) for _, p in coord.seen] == [MAX_MESSAGE, 5]


def test_embedded_broker_without_a_kit_stays_anonymous() -> None:
    with embedded_broker() as url:
        assert url.startswith("mqtt://")
        assert Probe(BrokerAddress.parse(url), "anyone").connack == "Success"


def test_fleet_mosquitto_reports_a_kit_it_cannot_run(tmp_path: Path) -> None:
    require_mosquitto()
    with pytest.raises(TransportError, match="cannot read"), fleet_mosquitto(tmp_path):
        pass


@pytest.mark.parametrize("kind", ["mosquitto", "embedded"])
def test_a_kit_without_tls_still_needs_passwords(kind: str, tmp_path: Path) -> None:
    """For a loopback laptop run: no TLS, but the same passwords, ACL and client-id binding."""
    kit = make_kit(tmp_path, tls=False)
    assert not (kit.root / "ca").exists() and "certfile" not in kit.mosquitto_conf.read_text()
    if kind == "mosquitto":
        require_mosquitto()
    with fleet_mosquitto(kit.broker_dir) if kind == "mosquitto" else embedded_broker(fleet=kit.broker_dir) as url:
        assert url.startswith("mqtt://")
        address = load_bundle(kit.client_dirs["c001"], broker=url).address
        assert not address.tls and address.password
        assert Probe(replace(address, username=None, password=None), "fedge-lab-c001").connack == "Not authorized"
        probe = Probe(address, "fedge-lab-c001")
        assert probe.connack == "Success"
        probe.close()


def _connection(*argv: str) -> object:
    import argparse

    from fedge_io.connection import add_connection_arguments, connection_from_args

    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    return connection_from_args(parser.parse_args(list(argv)))


def test_a_tls_bundle_refuses_a_plain_broker_url_unless_told(tmp_path: Path) -> None:
    kit = make_kit(tmp_path)
    device = str(kit.client_dirs[CLIENTS[0]])
    with pytest.raises(ConfigError, match=r"holds a CA for TLS, but --broker mqtt://127\.0\.0\.1:1883 is plain"):
        _connection("--bundle", device, "--broker", "mqtt://127.0.0.1:1883")
    allowed = _connection("--bundle", device, "--broker", "mqtt://127.0.0.1:1883", "--allow-plaintext")
    assert not allowed.address.tls  # type: ignore[attr-defined]
    assert _connection("--bundle", device).address.tls  # type: ignore[attr-defined]  # the bundle's own mqtts URL


def test_a_password_never_crosses_the_network_on_plain_mqtt_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    login = ["--username", "dev1", "--password-file", str(secret)]
    with pytest.raises(ConfigError, match=r"plain mqtt:// on another machine: the password of 'dev1'") as info:
        _connection("--broker", "mqtt://192.0.2.7:1883", *login)
    assert "s3cret" not in str(info.value)
    assert _connection("--broker", "mqtt://192.0.2.7:1883", *login, "--allow-plaintext")
    for host in ("127.0.0.1", "localhost", "[::1]"):  # the laptop's own broker: nothing leaves the machine
        assert _connection("--broker", f"mqtt://{host}:1883", *login)
    assert _connection("--broker", "mqtt://192.0.2.7:1883")  # no login, nothing to leak


def test_provision_fleet_bind_puts_the_broker_on_one_address_only(tmp_path: Path) -> None:
    """``fedge provision --fleet-bind 127.0.0.1``: the kit's mosquitto listens on loopback and nowhere else."""
    from fedge_cli.main import main

    port = free_port()
    argv = ["provision", "--out", str(tmp_path), "--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "2"]
    argv += ["--fleet-broker", "127.0.0.1", "--no-tls", "--fleet-port", str(port), "--fleet-bind", "127.0.0.1"]
    argv += ["--fleet-broker-dir", str(tmp_path / "kit" / "broker")]  # keep it here even where root's tmp is 0700
    assert main(argv) == 0
    conf = (tmp_path / "kit" / "broker" / "mosquitto.conf").read_text()
    assert f"listener {port} 127.0.0.1\n" in conf
    # The config.json the coordinator is started with carries the deployment's defaults.
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["algo"]["clip_factor"], written["min_replies"]) == (1.0, 0.5)
    with pytest.raises(ConfigError, match="bind address"):
        make_kit(tmp_path / "bad", bind_address="0.0.0.0 ; rm")
    try:
        find_mosquitto()
    except TransportError as exc:  # no mosquitto here: the configuration line is what was checked
        pytest.skip(str(exc))
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the address of the default route
    outside = probe.getsockname()[0]
    probe.close()
    with fleet_mosquitto(tmp_path / "kit" / "broker"):
        assert wait_for_port("127.0.0.1", port, 5.0)
        if outside != "127.0.0.1":
            with pytest.raises(OSError):
                socket.create_connection((outside, port), timeout=2).close()
