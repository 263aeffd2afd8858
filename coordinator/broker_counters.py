"""The broker's own byte counters ($SYS), read to check the ledger's wire bytes against what the broker moved.

mosquitto publishes ``$SYS/broker/bytes/{received,sent}``, amqtt's BrokerSysPlugin ``$SYS/broker/load/bytes/...``;
both publish ``$SYS/broker/uptime`` (mosquitto ``"1234 seconds"``, amqtt ``"1234"``), which tells a broker that kept
running from one that restarted between two readings: a restart starts the counters again from zero, and once the
new broker has moved more bytes than the old one had, the counters alone no longer show it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedge.wire.protocol import publish_packet_bytes

UPTIME = "$SYS/broker/uptime"
SYS_FILTERS = ("$SYS/broker/bytes/+", "$SYS/broker/load/bytes/+", UPTIME)
SYS_TOPICS = {
    "$SYS/broker/bytes/received": "received",
    "$SYS/broker/bytes/sent": "sent",
    "$SYS/broker/load/bytes/received": "received",
    "$SYS/broker/load/bytes/sent": "sent",
    UPTIME: "uptime",
}
RESTART_SLACK_S = 3.0
"""How far two estimates of a running broker's start time (arrival minus uptime) may differ: the uptime is in whole
seconds and arrives with some delay. A broker that restarted moves it by at least the time it had been up."""


@dataclass(frozen=True)
class BrokerCounters:
    """The broker's own byte totals at one moment, and the $SYS bytes this coordinator had received by then."""

    received: int
    sent: int
    sys_bytes: int  # wire bytes of the $SYS messages themselves (they count in the broker's "sent")
    started_at: float | None = None  # the broker's start, time.monotonic() seconds (from its uptime); None: unknown

    @property
    def total(self) -> int:
        return self.received + self.sent


class SysCounterReader:
    """Keeps the latest $SYS byte counters seen on the link."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.fresh_at = 0.0  # when the latest "sent" counter arrived
        self.sys_bytes = 0
        self.started_at: float | None = None  # the broker's start as of its latest uptime

    def on_message(self, topic: str, payload: bytes, qos: int, received_at: float) -> None:
        self.sys_bytes += publish_packet_bytes(topic, len(payload), qos)
        try:
            value = int(float(payload[:32].decode().split()[0]))  # "1234", or mosquitto's "1234 seconds"
        except (UnicodeDecodeError, ValueError, OverflowError, IndexError):
            return
        key = SYS_TOPICS[topic]
        if key == "uptime":
            self.started_at = received_at - value
            return
        self.values[key] = value
        if key == "sent":
            self.fresh_at = received_at

    def snapshot(self) -> BrokerCounters | None:
        if "received" not in self.values or "sent" not in self.values:
            return None
        return BrokerCounters(self.values["received"], self.values["sent"], self.sys_bytes, self.started_at)


def restart_between(before: BrokerCounters, after: BrokerCounters) -> str | None:
    """Why the broker restarted between the two readings (its counters went backwards, or its uptime says it started
    again), or None when nothing says so."""
    if after.received < before.received or after.sent < before.sent:
        return "its byte counters went backwards"
    if before.started_at is not None and after.started_at is not None:
        later = after.started_at - before.started_at
        if later > RESTART_SLACK_S:
            return f"its uptime says it started again {later:.0f} s after it first had"
    return None


def compare_with_broker(ours: int, before: BrokerCounters, after: BrokerCounters) -> dict[str, Any]:
    """How far the ledger's wire bytes are from the broker's own counters over the same rounds.

    A broker that restarted in between started its counters again from zero: the two counts are then not comparable,
    and the result says so (with why it is known) instead of a difference. Known by :func:`restart_between`, or by a
    broker that counted fewer bytes than the ledger, which a broker that saw every byte of the rounds (and more: its
    own $SYS messages, connects, pings) cannot have.
    """
    received, sent = after.received - before.received, after.sent - before.sent
    total = received + sent
    why = restart_between(before, after)
    if why is None and total < ours:
        why = f"it counted {total} bytes, fewer than the {ours} the rounds moved through it"
    if why is not None:
        return {
            "ledger_wire": ours,
            "comparable": False,
            "note": f"broker restarted during the run ({why}): its counters started again from zero, not comparable",
        }
    residual = total - ours
    return {
        "broker_received": received,
        "broker_sent": sent,
        "broker_total": total,
        "ledger_wire": ours,
        "sys_topic_bytes": after.sys_bytes - before.sys_bytes,  # the $SYS messages to this coordinator
        "residual": residual,
        "diff_pct": 100.0 * residual / total if total else math.nan,
        "comparable": True,
    }
