"""What TLS and passwords cost a fedge run: round-trip time and wire bytes over TLS vs plain MQTT, same run.

    .venv/bin/python benchmarks/tls_overhead.py [--repeats 15] [--small-repeats 60] [--json out.json]

Set-up: three private mosquittos on 127.0.0.1, started in this run, each with one coordinator link and one client
link (fedge's :class:`fedge_io.mqtt.MqttLink`, MQTT 3.1.1, QoS 1) in this process:
  1. plain: anonymous, no TLS (what fedge did before fleet kits);
  2. password: a fleet kit without TLS (passwords, ACL, client ids bound to user names);
  3. TLS: a fleet kit with TLS 1.2+ (mosquitto and Python negotiate TLS 1.3 here), passwords and ACL.
A round trip is a task the coordinator publishes to the client and the update the client publishes back with the
same payload: a 2.3 MB model (the DS-FL MNIST CNN's 584,458 float32 values) and a 40 kB message (FD/DS-FL logits).
Repetitions go round-robin over the three brokers, so load from elsewhere on the machine hits all of them alike.

Wire bytes are the TCP payload bytes of both connections (Linux ``TCP_INFO``: bytes acknowledged + bytes received,
so TLS records, handshakes and acknowledgements included), next to the MQTT 3.1.1 packet bytes fedge's ledger counts.
Connect time is TCP + TLS handshake + CONNECT/CONNACK + SUBSCRIBE/SUBACK. Ratios are against "plain".
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator.kit.accounts import FleetSpec
from coordinator.kit.writer import generate_fleet_kit
from fedge.wire.protocol import PUBACK_BYTES, BrokerAddress, Topics, publish_packet_bytes
from fedge_io.credentials import load_bundle
from fedge_io.mqtt import MqttLink
from sim.brokers import fleet_mosquitto, free_port, mosquitto_broker

RUN = "bench"
CLIENT = "c001"
T = Topics(RUN)
SIZES = {"2.3 MB": 584_458 * 4 + 400, "40 kB": 40_000}  # + a safetensors header's worth of bytes


def tcp_bytes(sock: socket.socket) -> int:
    """TCP payload bytes this socket sent (and saw acknowledged) plus those it received.

    ``struct tcp_info`` (linux/include/uapi/linux/tcp.h): ``tcpi_bytes_acked`` and ``tcpi_bytes_received`` are the
    u64 fields at offsets 120 and 128 (Linux >= 4.2).
    """
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    acked, received = struct.unpack_from("QQ", info, 120)
    return int(acked + received)


@dataclass
class Setup:
    """One broker with a coordinator link and an echoing client link."""

    name: str
    coordinator: MqttLink
    client: MqttLink
    rtt: dict[str, list[float]] = field(default_factory=dict)
    wire: dict[str, int] = field(default_factory=dict)
    connect_s: list[float] = field(default_factory=list)

    def sockets(self) -> list[socket.socket]:
        # MqttLink keeps its paho client private; a benchmark may look at the socket under it.
        socks = [link._client.socket() for link in (self.coordinator, self.client)]
        assert all(isinstance(s, socket.socket) for s in socks), "a link is not connected"
        return socks  # type: ignore[return-value]

    def wire_bytes(self) -> int:
        return sum(tcp_bytes(s) for s in self.sockets())

    def round_trip(self, payload: bytes, timeout: float = 30.0) -> float:
        started = time.perf_counter()
        self.coordinator.publish(T.task(CLIENT), payload)
        got = self.coordinator.get(timeout)
        assert got is not None and len(got.payload) == len(payload), f"{self.name}: no echo within {timeout} s"
        return time.perf_counter() - started


def echo(link: MqttLink, stop: threading.Event) -> None:
    """The client: answer every task with an update carrying the same bytes."""
    while not stop.is_set():
        got = link.get(0.05)
        if got is not None:
            link.publish(T.update(CLIENT), got.payload)


@contextmanager
def setups(tmp: Path, stop: threading.Event) -> Iterator[list[Setup]]:
    """The three brokers and their links, all connected."""
    largest = max(SIZES.values())
    with ExitStack() as stack:
        plain_url = stack.enter_context(mosquitto_broker())
        addresses: dict[str, tuple[BrokerAddress, str, BrokerAddress, str]] = {
            "plain": (BrokerAddress.parse(plain_url), "coord", BrokerAddress.parse(plain_url), "client")
        }
        for name, tls in (("password", False), ("TLS", True)):
            spec = FleetSpec(
                RUN, (CLIENT,), ("127.0.0.1",), largest, port=free_port(), bind_address="127.0.0.1", tls=tls
            )
            kit = generate_fleet_kit(spec, tmp / name)
            url = stack.enter_context(fleet_mosquitto(kit.broker_dir))
            server = load_bundle(kit.coordinator_dir, broker=url)
            device = load_bundle(kit.client_dirs[CLIENT], broker=url)
            addresses[name] = (server.address, server.username, device.address, device.username)
        made = []
        for name, (coord_address, coord_id, client_address, client_id) in addresses.items():
            connect_s = []
            for _ in range(5):  # a fresh client link, before the real one holds its client id
                started = time.perf_counter()
                probe = MqttLink(client_address, client_id, subscriptions=[(T.task(CLIENT), 1)]).start(10)
                connect_s.append(time.perf_counter() - started)
                probe.close(wait=0.2)
            coordinator = MqttLink(coord_address, coord_id, subscriptions=[(T.all_updates, 1)]).start(10)
            stack.callback(coordinator.close)
            client = MqttLink(client_address, client_id, subscriptions=[(T.task(CLIENT), 1)]).start(10)
            stack.callback(client.close)
            threading.Thread(target=echo, args=(client, stop), daemon=True).start()
            made.append(Setup(name, coordinator, client, connect_s=connect_s))
        try:
            yield made
        finally:
            stop.set()


def measure(args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(0)
    payloads = {label: rng.bytes(n) for label, n in SIZES.items()}
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="fedge-tls-bench-") as tmp, setups(Path(tmp), stop) as all_setups:
        for label, payload in payloads.items():
            repeats = args.repeats if len(payload) > 1_000_000 else args.small_repeats
            for s in all_setups:  # one warm-up round trip each: first-use allocations, TLS session state
                s.round_trip(payload)
            before = {s.name: s.wire_bytes() for s in all_setups}
            for _ in range(repeats):
                for s in all_setups:
                    s.rtt.setdefault(label, []).append(s.round_trip(payload))
            time.sleep(0.3)  # let the last acknowledgements be acknowledged in turn
            for s in all_setups:
                s.wire[label] = (s.wire_bytes() - before[s.name]) // repeats
        # the echo's last PUBACKs go out after the links have answered; stop before closing
        stop.set()
        # Four PUBLISH + PUBACK hops: task coordinator -> broker -> client, update client -> broker -> coordinator.
        mqtt = {label: 4 * (publish_packet_bytes(T.task(CLIENT), n) + PUBACK_BYTES) for label, n in SIZES.items()}
        return {
            "sizes": SIZES,
            "mqtt_bytes_per_round_trip": mqtt,
            "setups": {
                s.name: {
                    "rtt_ms_median": {k: statistics.median(v) * 1e3 for k, v in s.rtt.items()},
                    "rtt_ms_p90": {k: float(np.percentile(v, 90)) * 1e3 for k, v in s.rtt.items()},
                    "wire_bytes_per_round_trip": s.wire,
                    "connect_ms_median": statistics.median(s.connect_s) * 1e3,
                }
                for s in all_setups
            },
        }


def report(result: dict[str, object]) -> None:
    setups = result["setups"]
    assert isinstance(setups, dict)
    mqtt = result["mqtt_bytes_per_round_trip"]
    assert isinstance(mqtt, dict)
    base = setups["plain"]
    print("per round trip (task out, same-size update back), QoS 1, median over repetitions")
    print(
        f"{'payload':>8} {'setup':>9} {'rtt ms':>8} {'p90 ms':>8} {'x plain':>8} {'wire bytes':>12} {'x plain':>8}"
        f" {'x MQTT':>8}"
    )
    for label in SIZES:
        for name, s in setups.items():
            rtt, p90 = s["rtt_ms_median"][label], s["rtt_ms_p90"][label]
            wire = s["wire_bytes_per_round_trip"][label]
            rtt_ratio, wire_ratio = rtt / base["rtt_ms_median"][label], wire / base["wire_bytes_per_round_trip"][label]
            print(
                f"{label:>8} {name:>9} {rtt:8.2f} {p90:8.2f} {rtt_ratio:8.3f}"
                f" {wire:12,d} {wire_ratio:8.4f} {wire / mqtt[label]:8.4f}"
            )
    print(
        "connect + subscribe, median ms: " + ", ".join(f"{n} {s['connect_ms_median']:.1f}" for n, s in setups.items())
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15, help="round trips of the 2.3 MB message per setup")
    p.add_argument("--small-repeats", type=int, default=60, help="round trips of the 40 kB message per setup")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    args = p.parse_args()
    started = time.perf_counter()
    result = measure(args)
    report(result)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
