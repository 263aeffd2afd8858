"""The broker's $SYS byte counters against the ledger: a broker restarted between the two readings makes the
comparison "not comparable", however its counters moved: backwards, or forwards again past the first reading (the
new broker moved more bytes than the old one had), which only its uptime or a count below the ledger's shows. Hand-made
readings for each case, then a real mosquitto restarted between two readings."""

from __future__ import annotations

import time

import pytest
from mqtt_support import require_mosquitto

from coordinator.broker_counters import (
    RESTART_SLACK_S,
    SYS_FILTERS,
    SYS_TOPICS,
    BrokerCounters,
    SysCounterReader,
    compare_with_broker,
    restart_between,
)
from fedge.wire.protocol import BrokerAddress
from fedge_io.mqtt import MqttLink
from sim.brokers import free_port, mosquitto_broker


def test_a_broker_that_kept_running_is_compared() -> None:
    before = BrokerCounters(1_000, 2_000, 0, started_at=100.4)
    after = BrokerCounters(41_000, 62_000, 300, started_at=101.2)  # uptime in whole seconds: a second of jitter
    bb = compare_with_broker(95_000, before, after)
    assert bb["comparable"] is True
    assert (bb["broker_total"], bb["residual"]) == (100_000, 5_000) and bb["diff_pct"] == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("after", "ours", "why"),
    [
        (BrokerCounters(500, 900, 0, started_at=100.0), 1_000, "counters went backwards"),
        # Restarted, then moved more than the old broker had: the counters grew, the uptime did not.
        (BrokerCounters(30_000, 40_000, 0, started_at=160.0), 1_000, "started again 60 s after"),
        # The case of issue 55 (-190.91%): no uptime to tell, but fewer bytes than the rounds moved through it.
        (BrokerCounters(3_000, 5_000, 0), 10_000, "fewer than the 10000"),
    ],
)
def test_a_restarted_broker_is_not_comparable(after: BrokerCounters, ours: int, why: str) -> None:
    before = BrokerCounters(1_000, 2_000, 0, started_at=100.0 if after.started_at else None)
    bb = compare_with_broker(ours, before, after)
    assert bb["comparable"] is False and "broker restarted during the run" in bb["note"] and why in bb["note"], bb
    assert set(bb) == {"ledger_wire", "comparable", "note"}  # no negative count, no percentage


def test_the_uptime_of_either_broker_is_read() -> None:
    reader = SysCounterReader()
    for topic, payload, at in (
        ("$SYS/broker/uptime", b"1234 seconds", 2000.0),  # mosquitto
        ("$SYS/broker/bytes/received", b"10", 2000.1),
        ("$SYS/broker/bytes/sent", b"20", 2000.1),
    ):
        reader.on_message(topic, payload, 0, at)
    assert reader.snapshot() == BrokerCounters(10, 20, reader.sys_bytes, started_at=766.0)
    reader.on_message("$SYS/broker/uptime", b"12", 0, 2001.0)  # amqtt
    assert reader.started_at == 1989.0
    reader.on_message("$SYS/broker/uptime", b"soon", 0, 2002.0)  # garbage leaves the last reading alone
    assert reader.started_at == 1989.0
    assert "$SYS/broker/uptime" in SYS_FILTERS and set(SYS_TOPICS.values()) == {"received", "sent", "uptime"}


def fresh_reading(link: MqttLink, reader: SysCounterReader, timeout: float = 10.0) -> BrokerCounters:
    """The broker's next $SYS update after now (counters and uptime)."""
    asked = time.monotonic()
    deadline = asked + timeout
    while time.monotonic() < deadline:
        item = link.get(0.1)
        if item is not None and item.topic in SYS_TOPICS:
            reader.on_message(item.topic, item.payload, item.qos, item.received_at)
        snap = reader.snapshot()
        if snap is not None and reader.fresh_at > asked and snap.started_at is not None:
            return snap
    raise AssertionError(f"no fresh $SYS reading in {timeout} s: {reader.values}")


@pytest.mark.broker
def test_a_mosquitto_restarted_between_the_readings_is_not_comparable() -> None:
    """The counters of the restarted mosquitto are pushed past the first reading, so only the uptime tells."""
    require_mosquitto()
    port, reader = free_port(), SysCounterReader()
    link = MqttLink(BrokerAddress("127.0.0.1", port), "counters", subscriptions=[(f, 0) for f in SYS_FILTERS])
    try:
        with mosquitto_broker(port):
            link.start(10)
            before = fresh_reading(link, reader)
            assert restart_between(before, fresh_reading(link, reader)) is None  # the same broker, read again
            time.sleep(RESTART_SLACK_S)  # up a while longer: its start is what the uptime dates
        with mosquitto_broker(port):  # the same port: the link reconnects by itself
            assert link.wait_ready(15), "the link did not reconnect to the restarted broker"
            link.publish("load", b"x" * 2 * before.total, qos=0)
            after = fresh_reading(link, reader)
            for _ in range(10):
                if after.received > before.received and after.sent > before.sent:
                    break
                after = fresh_reading(link, reader)
    finally:
        link.close(wait=0.5)
    assert after.received > before.received and after.sent > before.sent, (before, after)  # as if it never stopped
    bb = compare_with_broker(0, before, after)  # ours = 0: the counts alone would look comparable
    assert bb["comparable"] is False and "uptime says it started again" in bb["note"], bb
