"""The MQTT transport: the coordinator's side of a deployment, behind the same interface as the in-process one.

This module holds the connection and what lives as long as it: who is online and admitted (:mod:`coordinator.presence`),
the wait for the cohort before round 1 and after an outage, the run's retained status (:mod:`coordinator.status_board`),
the broker's byte counters (:mod:`coordinator.broker_counters`), and the inbox, where status and $SYS messages are
handled and update messages handed to the round under way. Each round (:meth:`MqttTransport.exchange`) is one
:class:`coordinator.mqtt_round.MqttRound`: its tasks, replies, drops and ledger; its chunked replies are collected by
:mod:`coordinator.mqtt_chunks`.

Wire bytes of each ledger entry are computed with the MQTT 3.1.1 formulas of :mod:`fedge.wire.protocol`: the
publisher's PUBLISH and PUBACK plus one PUBLISH and PUBACK per copy the broker delivers (per online client for a
broadcast, one for a task, one for an update to this coordinator). Messages larger than the link's packet limit travel
as chunks (:mod:`fedge.wire.chunking`) both ways.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

from coordinator.broker_counters import SYS_FILTERS, SYS_TOPICS, BrokerCounters, SysCounterReader
from coordinator.mqtt_round import MqttRound
from coordinator.presence import Admit, Presence, StatusChange
from coordinator.status_board import StatusBoard
from coordinator.transport import Exchange, ReplyCheck
from fedge.algorithms.base import RoundPlan
from fedge.errors import CodecError, TransportError
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.message import Message, encode
from fedge.wire.protocol import (
    CANCELLED,
    INSTANCE,
    REFUSED,
    SESSION,
    BrokerAddress,
    ClientStatus,
    Topics,
    encode_status,
)
from fedge.wire.run_status import encode_run_status, gone_status
from fedge_io.mqtt import Inbound, MqttLink, PacketLimit, Will

if TYPE_CHECKING:
    from coordinator.kit.roster import Roster

log = logging.getLogger(__name__)

MAX_PAYLOAD_SLACK = 64 * 1024
"""Bytes of metadata a legitimate update may carry beyond its tensors (header, fields, transport timings)."""

SETTLE_S = 2.0
"""Seconds after connecting by which the retained hellos of the clients already waiting have arrived."""


class StatusListener(Protocol):
    """What hears the clients' status changes while replies are awaited: one round (:class:`MqttRound`), or FedBuff's
    exchange, which outlives a round (:mod:`coordinator.mqtt_fedbuff`)."""

    def on_status(self, client: ClientId, change: StatusChange) -> None: ...


class MqttTransport:
    """:class:`coordinator.transport.Transport` over an MQTT broker."""

    def __init__(
        self,
        address: BrokerAddress,
        run: str,
        *,
        round_timeout: float = 300.0,
        admit: Admit | None = None,
        rejoin_grace: float = 5.0,
        broker_counters: bool = False,
        connect_timeout: float = 30.0,
        qos: int = 1,
        max_packet_size: PacketLimit = "auto",
        max_reconnects: int = 3,
    ) -> None:
        """``max_packet_size``: the largest MQTT packet to publish (see :class:`fedge_io.mqtt.MqttLink`); larger
        messages travel as chunks. ``max_reconnects``: how often a sampled client may reconnect during its round
        (each time it gets its task and the broadcast again) before it is dropped for the round."""
        if round_timeout <= 0:
            raise TransportError(f"round timeout must be > 0 s, got {round_timeout}")
        if qos != 1:
            raise TransportError("only QoS 1 is supported: tasks and updates must arrive, and QoS 2 costs 3 acks")
        self.address = address
        self.topics = Topics(run)
        self.round_timeout = round_timeout
        self.rejoin_grace = rejoin_grace  # how long a client gone offline mid-round may take to come back
        self.max_reconnects = max_reconnects
        # The cohort floor: fewer available clients than this, and a round waits (up to its timeout) for more before
        # it samples, rather than sampling a round that cannot be aggregated.
        self.min_available = 1
        self.roster: Roster | None = None  # a fleet kit's client list, followed while the run goes on
        self._wanted = 0  # clients the run waited for before round 1: after our own reconnect, wait for them again
        self._seen_connections = 0  # our link's connections when we last looked: more means we reconnected
        # Tells clients which coordinator run a task belongs to: runs under one name restart at round 1.
        self.session = uuid.uuid4().hex[:12]
        self.presence = Presence(admit)
        self.qos = qos
        self.connect_timeout = connect_timeout
        self.sys = SysCounterReader()
        self.max_payload = 0  # bytes; set from the strategy's reply tensors by :meth:`exchange`
        # Messages on update topics while no round is open (before round 1, between rounds): counted, never kept.
        self.outside_rounds = {"messages": 0, "bytes": 0}
        self.reassembly_peak = 0  # the most bytes chunked replies held at once, in any round
        self._opened_at = 0.0
        subs = [(self.topics.all_statuses, 1), (self.topics.all_updates, 1)]
        if broker_counters:
            subs += [(f, 0) for f in SYS_FILTERS]  # QoS 0: acks for $SYS would blur the count they report
        # A fleet kit's user name is the client id the broker binds to the credential.
        self.link = MqttLink(
            address,
            address.username or f"fedge-{run}-coordinator",
            subscriptions=subs,
            max_packet_size=max_packet_size,
            clean_session=False,  # updates published while our link is down wait at the broker (QoS 1)
        )
        # The live fleet view (fedge status): retained on fedge/<run>/run-status, updated at every phase change.
        self.board = StatusBoard(self.link, self.topics.run_status, run, self.session)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def open(self) -> MqttTransport:
        # Dies this process without a clean exit (kill -9, a crash, a cut link), the broker replaces the retained
        # status with this one, so `fedge status` says the coordinator is gone instead of showing a live round.
        gone = gone_status(self.topics.run, self.session, self.board.status.rounds)
        self.link.set_will(Will(self.topics.run_status, encode_run_status(gone), qos=1, retain=True))
        self.link.start(self.connect_timeout)
        self._opened_at = time.monotonic()
        log.info("coordinator connected to %s, run %r", self.address, self.topics.run)
        return self

    def close(self) -> None:
        self.link.close(final=[self.board.final_message()])  # the last status must reach the broker before we go

    def __enter__(self) -> MqttTransport:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- clients ----------------------------------------------------------------------------------------------

    def available_clients(self) -> Sequence[ClientId]:
        """Online clients that were admitted, after handling every status message that has arrived.

        When none is available, or our own link to the broker is down or came back (a broker restart, a network
        outage on our side), the clients are reconnecting too, on their own back-off: wait up to the round deadline
        for as many as the run started with, instead of sampling the few that are back first (or none, and skipping
        every round at once). The broker's last wills may arrive just before our link notices the outage."""
        ready = self._available()
        reconnected = self.link.connections > self._seen_connections or not self.link.connected
        enough = self._wanted if reconnected or not ready else max(1, self.min_available)
        if len(ready) >= enough:
            return ready
        log.info(
            "%d of %d clients available (broker link %s): waiting up to %g s for the others to come back",
            len(ready),
            self._wanted,
            "back" if self.link.connected else "down",
            self.round_timeout,
        )
        deadline = time.monotonic() + self.round_timeout
        self.board.update(note=f"waiting for clients to come back: {len(ready)} of {self._wanted}")
        while len(ready) < enough and time.monotonic() < deadline:
            self._pump(0.2)
            ready = self._available()
            self.board.tick()
        self.board.update(note="")
        self._seen_connections = self.link.connections
        log.info("%d of %d clients back: %s", len(ready), self._wanted, ", ".join(ready) or "-")
        return ready

    def _available(self) -> list[ClientId]:
        self._drain()
        self._follow_roster(None)  # a client revoked while nothing arrived: its last will may never come
        return self.presence.available()

    def wait_for_clients(
        self,
        n: int,
        timeout: float,
        *,
        abort: Callable[[], str | None] | None = None,
        among: Collection[ClientId] | None = None,
    ) -> list[ClientId]:
        """Block until ``n`` clients are available; TransportError after ``timeout`` s or when ``abort`` says why.

        ``among``: the clients the run was provisioned for (a fleet kit's, or the config's partition). Once fewer
        than ``n`` of them (and of the other admitted clients) can still join, because refusals took the rest or
        ``n`` exceeds them from the start, the wait stops at once instead of at the timeout. However the wait
        fails, every client online at the time is told why (a ``cancelled`` notice) and stops waiting.
        """
        try:
            return self._wait_for_clients(n, timeout, abort, among)
        except TransportError as exc:
            self.cancel(str(exc))
            raise

    def cancel(self, reason: str) -> None:
        """Tell every online client that this run will not start, and why: each stops instead of waiting on."""
        self._drain()
        notice = {"reason": reason[:1000], "at": f"{time.time():.3f}"}
        for client in self.presence.online():
            instance = printable(self.presence.clients[client].extra.get(INSTANCE, ""), 64)  # the process it told
            params = {**notice, **({INSTANCE: instance} if instance else {})}
            msg = Message(CANCELLED, 0, self.topics.run, client, params, transport={SESSION: self.session})
            try:
                self.link.send(self.topics.task(client), encode(msg), qos=self.qos)
            except TransportError as exc:  # telling is a courtesy: the run stops either way
                log.warning("could not tell %s the run will not start: %s", client, exc)

    def _wait_for_clients(
        self,
        n: int,
        timeout: float,
        abort: Callable[[], str | None] | None,
        among: Collection[ClientId] | None,
    ) -> list[ClientId]:
        deadline = time.monotonic() + timeout
        settled = self._opened_at + SETTLE_S  # the retained hellos of clients already waiting have arrived by then
        last = -1
        self._wanted = n
        while True:
            ready = self._available()
            self._seen_connections = self.link.connections
            if len(ready) != last:
                log.info("%d of %d clients ready: %s", len(ready), n, ", ".join(ready) or "-")
                last = len(ready)
                self.board.update(phase="joining", needed=n, online=self.presence.online())
            self.board.tick()
            if len(ready) >= n:
                return ready
            reason = abort() if abort is not None else None
            if reason:
                raise TransportError(f"stopped waiting for clients: {reason}")
            if among is not None:
                out = {c: why for c, why in self.presence.refused.items() if c in among}
                others = [c for c in ready if c not in among]  # admitted without being provisioned (no kit)
                if len(among) + len(others) < n:  # the cause, whatever was refused: once the waiting ones are known
                    if time.monotonic() >= settled:
                        raise TransportError(
                            f"{n} clients cannot join run {self.topics.run!r}: only {len(among)} were provisioned "
                            f"({', '.join(sorted(among)) or 'none'}); lower --min-clients to {len(among)} or less, "
                            "or provision more clients"
                        )
                # Once the waiting clients' retained hellos are in too (settled), so that cancel() tells them all:
                # a refused hello can be read before the hello of a client that waits, which would never hear.
                elif out and len(among) - len(out) + len(others) < n and time.monotonic() >= settled:
                    refusals = "; ".join(f"{c} refused: {why}" for c, why in sorted(out.items()))
                    raise TransportError(
                        f"{n} clients cannot join run {self.topics.run!r}: of the {len(among)} provisioned, "
                        f"{len(out)} were refused ({refusals}); fix those devices' data or runtime and restart them, "
                        "or lower --min-clients"
                    )
            if time.monotonic() > deadline:
                refused = "".join(f"; {c} refused: {why}" for c, why in sorted(self.presence.refused.items()))
                raise TransportError(
                    f"only {len(ready)} of {n} clients joined run {self.topics.run!r} on {self.address} within "
                    f"{timeout:.0f} s ({', '.join(ready) or 'none'}){refused}; start more with `fedge client --broker "
                    f"{self.address} --run {self.topics.run} --client-id ID --data FILE`, or lower --min-clients"
                )
            self._pump(0.2)

    # --- one round --------------------------------------------------------------------------------------------

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        """One round over the broker (:class:`coordinator.mqtt_round.MqttRound`), fed what arrives meanwhile."""
        if not plan.tasks:
            return Exchange()
        self._drain()
        state = MqttRound(self, plan, check)
        try:
            return state.run(lambda timeout: self._pump(timeout, state=state))
        finally:
            self.reassembly_peak = max(self.reassembly_peak, state.chunks.peak)

    # --- the inbox ----------------------------------------------------------------------------------------------

    def pump(self, timeout: float, listener: StatusListener) -> Inbound | None:
        """The next message on an update topic within ``timeout`` s (None: none came), status changes handed to
        ``listener`` meanwhile: how FedBuff's exchange reads the clients' replies across server steps."""
        return self._pump(timeout, state=listener)

    def next_update(self, timeout: float) -> Inbound | None:
        """The next message on an update topic within ``timeout`` s, handling status and $SYS messages meanwhile:
        how secure aggregation's stages (:mod:`coordinator.secagg_stages`) read the clients' answers."""
        return self._pump(timeout, updates=True)

    def _pump(self, timeout: float, *, state: StatusListener | None = None, updates: bool = False) -> Inbound | None:
        """Handle one inbound message: status and $SYS here; an update is returned (or kept for the next round)."""
        self.board.relink()
        self._follow_roster(state)
        item = self.link.get(timeout)
        if item is None:
            return None
        if item.topic in SYS_TOPICS:
            self.sys.on_message(item.topic, item.payload, item.qos, item.received_at)
            return None
        try:
            channel, client = self.topics.parse(item.topic)
        except CodecError as exc:
            log.warning("ignoring a message on an unexpected topic: %s", exc)
            return None
        if channel == "status" and client is not None:
            self._on_status(client, item, state)
            return None
        if channel == "update":
            if state is not None or updates:
                return item
            # No round is open: a late reply of the previous round or a stray message. Counted apart from every
            # round's ledger (so nothing sent before round 1 is charged to round 1) and dropped unread.
            self.outside_rounds["messages"] += 1
            self.outside_rounds["bytes"] += len(item.payload)
        return None

    def _drain(self) -> None:
        """Handle everything already received, without waiting."""
        while not self.link.inbox.empty():
            self._pump(0)

    def _on_status(self, client: ClientId, item: Inbound, state: StatusListener | None) -> None:
        change = self.presence.update(client, item.payload)
        if change is None:
            return
        if change.refused:
            self._tell_refused(client, change.refused)
        if change.came_online or change.went_offline:
            self.board.update(online=self.presence.online())
        if state is not None:  # a latecomer's task, a task resent after a reconnect, a grace started
            state.on_status(client, change)

    def _follow_roster(self, state: StatusListener | None) -> None:
        """A client revoked from the kit (``fedge kit revoke``) is refused for the rest of the run and, being cut
        off at the broker, is gone from a round under way at once (as a last will would say, with the reason)."""
        if self.roster is None:
            return
        for client in self.roster.reload():
            why = self.presence.banned[client] = self.roster.why_revoked(client)
            gone = encode_status(ClientStatus(client=client, state="offline", reason=why), self.topics.run)
            self._on_status(client, Inbound(self.topics.status(client), gone, False, 1, time.monotonic()), state)

    def _tell_refused(self, client: ClientId, why: str) -> None:
        """Tell a refused client why, on its task topic (only the coordinator may publish there): it stops with
        the reason instead of waiting for tasks that never come."""
        notice = Message(REFUSED, 0, self.topics.run, client, {"reason": why[:500]}, transport={SESSION: self.session})
        try:
            self.link.send(self.topics.task(client), encode(notice), qos=self.qos)
        except TransportError as exc:  # telling is a courtesy: the refusal stands either way
            log.warning("could not tell %s it was refused: %s", client, exc)

    def broker_counters(self, timeout: float = 6.0, settle: float = 0.3) -> BrokerCounters | None:
        """The broker's byte counters as of now: waits for its next $SYS update; None if it publishes none."""
        time.sleep(settle)  # let the last acknowledgements reach the broker
        self._drain()
        if not self.sys.values and time.monotonic() - self._opened_at > 2.0:
            return None  # brokers that have counters send their retained values as soon as we subscribe
        asked = time.monotonic()
        deadline = asked + timeout
        while self.sys.fresh_at <= asked and time.monotonic() < deadline:
            self._pump(0.1)
        if self.sys.fresh_at <= asked:
            return None
        return self.sys.snapshot()
