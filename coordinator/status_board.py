"""The coordinator's side of the live fleet view: one retained :class:`fedge.wire.run_status.RunStatus` on the broker.

The transport and the run loop tell the board what changed (:meth:`StatusBoard.update`); a phase change is published
at once, anything else (a reply, a hello) at most once per ``min_interval`` seconds, from the same thread, so a
flood of hellos cannot turn into a flood of status messages. The message is retained, so a monitor that connects
at any time gets the latest one at once. Its bytes are counted apart from the rounds' ledger (``wire_bytes``), so
the comparison with the broker's own counters stays honest.

A status too large for the broker's packet limit (a small ``--fleet-max-packet-size`` and a large fleet) is sent
without its client lists and tables (the counts stay), never chunked: a retained message must be one packet. So is one
larger than a monitor reads (:data:`fedge.wire.run_status.MAX_STATUS_BYTES`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from fedge.errors import TransportError
from fedge.wire.protocol import publish_packet_bytes
from fedge.wire.run_status import MAX_STATUS_BYTES, RunStatus, encode_run_status, run_status
from fedge_io.mqtt import MqttLink, PacketTooLarge

log = logging.getLogger(__name__)

_LISTS = ("online", "sampled", "replied", "dropped")


class StatusBoard:
    """The latest run status, published retained on ``topic`` whenever it changes (throttled between phases)."""

    def __init__(
        self,
        link: MqttLink,
        topic: str,
        run: str,
        session: str,
        *,
        min_interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.topic = topic
        self.min_interval = min_interval
        self.clock = clock
        self.status = run_status(run, session, "joining")
        self._lists: dict[str, Any] = dict.fromkeys(_LISTS, ())
        self._dirty = False
        self._sent_at = -float("inf")  # time.monotonic() of the latest publish
        self._connections = 0  # the link's connections when tick() last looked
        self.published = 0
        self.wire_bytes = 0  # PUBLISH + PUBACK of every status this board sent (the broker also counts them)

    def update(self, **changes: Any) -> None:
        """Change fields of the status (``phase``, ``round``, ``online``, ...): published at once when the phase or
        round changes, else within ``min_interval`` by :meth:`tick` or the next update."""
        lists = {k: tuple(changes.pop(k)) for k in _LISTS if k in changes}
        phase_change = any(k in changes and changes[k] != getattr(self.status, k) for k in ("phase", "round"))
        self._lists.update(lists)
        fields = {f.name: getattr(self.status, f.name) for f in dataclasses.fields(RunStatus)}
        fields.update(changes)
        for k in (*_LISTS, "counts"):
            fields.pop(k)
        self.status = run_status(**fields, **self._lists)
        self._dirty = True
        if phase_change:
            self.publish()
        else:
            self.tick()

    def tick(self) -> None:
        """Publish pending changes once ``min_interval`` has passed since the last publish (see :meth:`relink`)."""
        if self.relink():
            return
        if self._dirty and time.monotonic() - self._sent_at >= self.min_interval:
            self.publish()

    def relink(self) -> bool:
        """Publish the status at once when our link has reconnected since the last look (whether it was published):
        the broker published our last will ("coordinator gone") when the link broke."""
        if self.link.connections <= self._connections:
            return False
        self._connections = self.link.connections
        if self._connections == 1:  # the first connection: nothing was replaced
            return False
        self.publish()
        return True

    def final_message(self) -> tuple[str, bytes, bool]:
        """(topic, payload, retain) of the current status, for the link to send before it disconnects."""
        payload = _encoded(dataclasses.replace(self.status, updated=round(self.clock(), 3)))
        self.wire_bytes += publish_packet_bytes(self.topic, len(payload), 1) + 4
        return self.topic, payload, True

    def publish(self) -> None:
        """Publish the current status now (retained, QoS 1); a broker that is away gets it after the reconnect."""
        status = dataclasses.replace(self.status, updated=round(self.clock(), 3))
        payload = _encoded(status)
        try:
            try:
                self.link.publish(self.topic, payload, retain=True)
            except PacketTooLarge:
                payload = encode_run_status(_bare(status))
                self.link.publish(self.topic, payload, retain=True)
        except TransportError as exc:  # the view is a convenience: it never stops a run
            log.warning("run status not published: %s", exc)
            return
        self.wire_bytes += publish_packet_bytes(self.topic, len(payload), 1) + 4  # + PUBACK
        self.published += 1
        self._dirty = False
        self._sent_at = time.monotonic()


def _bare(status: RunStatus) -> RunStatus:
    """``status`` without its client lists and tables (the counts stay)."""
    return dataclasses.replace(status, online=(), sampled=(), replied=(), dropped=(), history=(), clients=())


def _encoded(status: RunStatus) -> bytes:
    """``status`` encoded; without its lists and tables when it would exceed what every monitor reads (long ids and
    reasons of a large fleet): monitors refuse a larger one unread."""
    payload = encode_run_status(status)
    return payload if len(payload) <= MAX_STATUS_BYTES else encode_run_status(_bare(status))
