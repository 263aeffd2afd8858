"""The coordinator's status board on a real mosquitto: phase changes go out at once, other changes at most once per
interval, and a status too big for the packet limit goes out without its lists (counts kept), never not at all."""

from __future__ import annotations

import socket
import time

from mqtt_support import mosquitto_url  # noqa: F401 - a fixture

from coordinator.status_board import StatusBoard
from fedge.wire.protocol import BrokerAddress, Topics
from fedge.wire.run_status import RunStatus, decode_run_status, encode_run_status, gone_status, is_gone
from fedge_io.mqtt import MqttLink, Will

T = Topics("board")


def received(link: MqttLink, wait: float = 1.0) -> list[RunStatus]:
    got = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        item = link.get(0.1)
        if item is not None and item.payload:
            got.append(decode_run_status(item.payload, "board"))
    return got


def test_phase_changes_go_out_at_once_and_the_rest_is_throttled(mosquitto_url: str) -> None:  # noqa: F811
    address = BrokerAddress.parse(mosquitto_url)
    with (
        MqttLink(address, "monitor", subscriptions=[(T.run_status, 1)]).start(10) as monitor,
        MqttLink(address, "coordinator").start(10) as link,
    ):
        board = StatusBoard(link, T.run_status, "board", "s1", min_interval=60.0)
        board.update(phase="training", round=1, sampled=("c0", "c1"))
        for client in ("c0", "c1"):  # replies within the interval: held back
            board.update(replied=(client,))
        assert [(s.phase, s.replied) for s in received(monitor)] == [("training", ())]
        board.update(phase="aggregating", replied=("c0", "c1"))  # a phase change carries everything pending
        (closed,) = received(monitor)
        assert (closed.phase, closed.replied, closed.sampled) == ("aggregating", ("c0", "c1"), ("c0", "c1"))
        assert board.published == 2 and board.wire_bytes > 0


def test_a_status_over_the_packet_limit_goes_out_without_its_lists(mosquitto_url: str) -> None:  # noqa: F811
    address = BrokerAddress.parse(mosquitto_url)
    fleet = tuple(f"device-{i:04d}" for i in range(200))  # ~3 kB of ids per list
    with (
        MqttLink(address, "monitor", subscriptions=[(T.run_status, 1)]).start(10) as monitor,
        MqttLink(address, "coordinator", max_packet_size=1024).start(10) as link,
    ):
        board = StatusBoard(link, T.run_status, "board", "s1")
        board.update(phase="training", round=3, online=fleet, sampled=fleet[:50])
        (shown,) = received(monitor)
        assert (shown.phase, shown.round, shown.counts) == ("training", 3, (200, 50, 0, 0))
        assert shown.online == () and shown.sampled == ()


def test_after_its_link_broke_the_board_replaces_the_last_will_with_the_status(mosquitto_url: str) -> None:  # noqa: F811
    """The broker publishes the coordinator's will ("gone") when the link breaks; once the link is back, the board
    publishes the live status again instead of leaving the run shown as gone."""
    address = BrokerAddress.parse(mosquitto_url)
    will = Will(T.run_status, encode_run_status(gone_status("board", "s1", rounds=5)))
    coordinator = MqttLink(address, "coordinator", backoff=(0.1, 0.5))
    coordinator.set_will(will)
    with MqttLink(address, "monitor", subscriptions=[(T.run_status, 1)]).start(10) as monitor, coordinator.start(10):
        board = StatusBoard(coordinator, T.run_status, "board", "s1")
        board.update(phase="training", round=2, rounds=5)
        assert [s.phase for s in received(monitor)] == ["training"]
        assert not board.relink()  # the first connection replaced nothing
        sock = coordinator._client.socket()  # cut the link under paho, without a DISCONNECT
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 10
        while coordinator.connections < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coordinator.connections == 2 and board.relink()
        shown = received(monitor)
        assert [is_gone(s) for s in shown] == [True, False], shown
        assert (shown[-1].phase, shown[-1].round) == ("training", 2)


class _Recorder:
    """A link that keeps what is published (no broker: the board's own decision is under test)."""

    connections = 1

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        self.sent.append(payload)


def test_a_status_over_the_monitors_size_limit_goes_out_without_its_lists_and_tables() -> None:
    from fedge.wire.run_status import MAX_STATUS_BYTES, ClientRow

    ids = tuple(f"c{i:0127d}" for i in range(500))  # long ids, and reasons whose JSON escapes take 6 bytes a char
    rows = tuple(ClientRow(c, last_drop="é" * 200) for c in ids)
    link = _Recorder()
    board = StatusBoard(link, T.run_status, "board", "s1")  # type: ignore[arg-type]
    board.update(
        phase="training", round=2, online=ids, sampled=ids, dropped=[(c, "é" * 256) for c in ids], clients=rows
    )
    (payload,) = link.sent
    assert len(payload) <= MAX_STATUS_BYTES
    shown = decode_run_status(payload, "board")  # every monitor can read it
    assert (shown.round, shown.counts) == (2, (500, 500, 0, 500)) and shown.clients == () and shown.online == ()
