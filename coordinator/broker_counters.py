"""The broker's own byte counters ($SYS), read to check the ledger's wire bytes against what the broker moved.

mosquitto publishes ``$SYS/broker/bytes/{received,sent}``, amqtt's BrokerSysPlugin ``$SYS/broker/load/bytes/...``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedge.wire.protocol import publish_packet_bytes

SYS_FILTERS = ("$SYS/broker/bytes/+", "$SYS/broker/load/bytes/+")
SYS_TOPICS = {
    "$SYS/broker/bytes/received": "received",
    "$SYS/broker/bytes/sent": "sent",
    "$SYS/broker/load/bytes/received": "received",
    "$SYS/broker/load/bytes/sent": "sent",
}


@dataclass(frozen=True)
class BrokerCounters:
    """The broker's own byte totals at one moment, and the $SYS bytes this coordinator had received by then."""

    received: int
    sent: int
    sys_bytes: int  # wire bytes of the $SYS messages themselves (they count in the broker's "sent")

    @property
    def total(self) -> int:
        return self.received + self.sent


class SysCounterReader:
    """Keeps the latest $SYS byte counters seen on the link."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.fresh_at = 0.0  # when the latest "sent" counter arrived
        self.sys_bytes = 0

    def on_message(self, topic: str, payload: bytes, qos: int, received_at: float) -> None:
        self.sys_bytes += publish_packet_bytes(topic, len(payload), qos)
        try:
            value = int(float(payload[:32].decode()))
        except (UnicodeDecodeError, ValueError, OverflowError):
            return
        key = SYS_TOPICS[topic]
        self.values[key] = value
        if key == "sent":
            self.fresh_at = received_at

    def snapshot(self) -> BrokerCounters | None:
        if "received" not in self.values or "sent" not in self.values:
            return None
        return BrokerCounters(self.values["received"], self.values["sent"], self.sys_bytes)


def compare_with_broker(ours: int, before: BrokerCounters, after: BrokerCounters) -> dict[str, Any]:
    """How far the ledger's wire bytes are from the broker's own counters over the same rounds.

    Counters that went backwards mean the broker restarted in between: the two counts are then not comparable, and
    the result says so instead of reporting a negative byte count.
    """
    received, sent = after.received - before.received, after.sent - before.sent
    if received < 0 or sent < 0:
        return {
            "ledger_wire": ours,
            "comparable": False,
            "note": "broker restarted during the run: its counters started again from zero, not comparable",
        }
    total = received + sent
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
