"""The MQTT transport: the coordinator's side of a deployment, behind the same interface as the in-process one.

Per round (:meth:`MqttTransport.exchange`): publish the broadcast once on ``fedge/<run>/broadcast`` (the broker fans
it out), publish each task on ``fedge/<run>/task/<client>``, then collect what arrives on ``fedge/<run>/update/+``
until every sampled client has answered, reported an error, or stayed offline (its last will) for ``rejoin_grace``
seconds, or the round's deadline passes. A client that comes back within the round gets its task (and its own copy of
the broadcast) again. Every message that arrives is counted in the ledger and judged by the one reply policy of
:mod:`coordinator.replies`; a bad one is rejected with a reason, never raised.

Who is online and admitted lives in :mod:`coordinator.presence`, the broker's byte counters in
:mod:`coordinator.broker_counters`. Wire bytes of each ledger entry are computed with the MQTT 3.1.1 formulas of
:mod:`fedge.wire.protocol`: the publisher's PUBLISH and PUBACK plus one PUBLISH and PUBACK per copy the broker delivers
(per online client for a broadcast, one for a task, one for an update to this coordinator).

Messages larger than the link's packet limit travel as chunks (:mod:`fedge.wire.chunking`) both ways; a ledger entry
counts all of a message's chunks, headers included, at payload and wire level. Incoming chunks are judged by the
reply policy before any memory is spent on them (:func:`coordinator.replies.judge_chunk`: known and sampled sender,
declared size within the run's largest update), then collected by one :class:`~fedge.wire.chunking.Reassembler` per
round,
whose budgets are one largest update per sampled client. What is still incomplete when the round ends is dropped,
counted as an ``incomplete`` ledger entry, and named in that client's drop reason.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from coordinator.broker_counters import SYS_FILTERS, SYS_TOPICS, BrokerCounters, SysCounterReader
from coordinator.presence import Admit, Presence
from coordinator.replies import RoundContext, file_reply, judge_chunk, judge_reply, reject
from coordinator.status_board import StatusBoard
from coordinator.transport import Exchange, ReplyCheck
from fedge.accounting.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.accounting.records import ClientTiming, Drop
from fedge.algorithms.base import RoundPlan
from fedge.errors import CodecError, TransportError
from fedge.types import ClientId
from fedge.wire import chunking
from fedge.wire.fields import printable
from fedge.wire.message import Message, decode, encode
from fedge.wire.protocol import (
    BROADCAST_ROUND,
    CANCELLED,
    COMPUTE_CPU_S,
    COMPUTE_S,
    DEADLINE,
    INSTANCE,
    REFUSED,
    SESSION,
    BrokerAddress,
    ClientStatus,
    Topics,
    delivery_wire_bytes,
    encode_status,
)
from fedge.wire.run_status import encode_run_status, gone_status
from fedge_io.mqtt import Inbound, MqttLink, PacketLimit, Will

if TYPE_CHECKING:
    from coordinator.kit.roster import Roster

log = logging.getLogger(__name__)

MAX_PAYLOAD_SLACK = 64 * 1024
"""Bytes of metadata a legitimate update may carry beyond its tensors (header, fields, transport timings)."""

_ROUND_ENDED = "the round ended"
SETTLE_S = 2.0
"""Seconds after connecting by which the retained hellos of the clients already waiting have arrived."""
MAX_REFUSED_MEMO = 4096
"""Refused chunked messages remembered per round, so that their further chunks are counted without a rejection each."""


@dataclass
class _Partial:
    """Bytes of the chunks of one incoming message so far, for its ledger entry."""

    payload_bytes: int = 0
    wire_bytes: int = 0


@dataclass
class _Round:
    """Bookkeeping of the round being exchanged."""

    ctx: RoundContext
    started: float
    tasks: dict[ClientId, bytes]  # encoded tasks, kept for resends
    broadcast: bytes | None
    out: Exchange
    reassembly: chunking.Reassembler
    plan: RoundPlan | None = None  # for a latecomer's task (RoundPlan.late_task)
    deadline_at: str = ""  # the wall-clock deadline stamped in every task
    sent_at: dict[ClientId, float] = field(default_factory=dict)
    offline: dict[ClientId, tuple[float, str]] = field(default_factory=dict)  # client -> (since, last will's reason)
    partial: dict[tuple[str, int], _Partial] = field(default_factory=dict)  # (client, message id) being reassembled
    refused: dict[tuple[str, int], None] = field(default_factory=dict)  # chunked messages refused, oldest first
    incomplete: dict[ClientId, str] = field(default_factory=dict)  # client -> why its chunked reply never completed
    reconnects: dict[ClientId, int] = field(default_factory=dict)  # client -> its reconnects during the round
    # client -> (when, why) its latest reply to this round was refused as invalid: not waited for past the grace
    refused_replies: dict[ClientId, tuple[float, str]] = field(default_factory=dict)

    @property
    def rnd(self) -> int:
        return self.ctx.rnd


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
                elif out and len(among) - len(out) + len(others) < n:
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
        out = Exchange()
        if not plan.tasks:
            return out
        rnd = next(iter(plan.tasks.values())).round
        self._drain()
        ctx = RoundContext(
            rnd,
            frozenset(plan.tasks),
            check,
            known=self.presence.knows,
            declared=self.presence.declared_size,
            max_payload=self.max_payload,
            session=self.session,
        )
        state = _Round(ctx, time.monotonic(), {}, None, out, self._reassembler(max(len(plan.tasks), plan.cohort)), plan)
        if plan.broadcast is not None:
            stamped = replace(plan.broadcast, transport={SESSION: self.session})
            state.broadcast = encode(stamped)
            topic = self.topics.broadcast
            sizes = self.link.send(topic, state.broadcast, qos=self.qos)
            wire = _wire_bytes(topic, sizes, subscribers=len(self.presence.online()), qos=self.qos)
            out.entries.append(
                LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, sum(sizes), len(plan.tasks), wire)
            )
        # The wall-clock deadline travels in each task, so a client that gets it late (queued while it was away or
        # busy) skips work whose reply would be refused as late. Monotonic time is what this side waits on.
        state.deadline_at = f"{time.time() + self.round_timeout:.3f}"
        for client, task in sorted(plan.tasks.items()):
            self._send_task(state, client, self._stamped(state, task), resend=False)
            status = self.presence.clients.get(client)
            if status is not None and not status.online:  # it left between sampling and now
                state.offline[client] = (state.started, status.reason or "left")

        deadline = state.started + self.round_timeout
        self.board.update(
            phase="training",
            round=rnd,
            deadline=time.time() + self.round_timeout,
            online=self.presence.online(),
            sampled=sorted(plan.tasks),
            replied=(),
            dropped=(),
        )
        while True:
            self.board.tick()
            now = time.monotonic()
            # The grace runs only while our own link is up, from its latest (re)connection at the earliest: last
            # wills that arrive around a broker outage say only that the clients are reconnecting too.
            back = self.link.connected_at if self.link.connected else now
            gone = {c for c, (since, _) in state.offline.items() if now - max(since, back) >= self.rejoin_grace}
            # A client whose reply was refused (a bug, or an insider) is not waited for until the deadline: a
            # client sends one reply a round, and its stored copy after a reconnect is the same bytes. It may still
            # send a valid one within the grace, and is then counted as any other reply.
            gone |= {c for c, (at, _) in state.refused_replies.items() if now - at >= self.rejoin_grace}
            if len(out.replies) + len(gone | set(ctx.failed)) >= len(state.tasks) or now >= deadline:
                break
            item = self._pump(min(deadline - now, 0.2), state=state)
            if item is not None:
                self._on_update(item, state)

        elapsed = time.monotonic() - state.started
        self._dropped_chunks(state, state.reassembly.drop_all(time.monotonic(), _ROUND_ENDED))
        for client in sorted(state.tasks):
            if client in out.replies:
                continue
            why = ctx.failed.get(client) or f"silent past the {self.round_timeout:g} s deadline"
            if client in state.refused_replies and client not in ctx.failed:
                why = printable(f"its reply was refused: {state.refused_replies[client][1]}")
            if client in state.incomplete and client not in ctx.failed:
                why = f"{state.incomplete[client]} by the {self.round_timeout:g} s deadline"
            after = elapsed
            if client in state.offline and client not in ctx.failed:
                since, will = state.offline[client]
                after = since - state.started
                why = f"went offline {after:.1f} s into the round ({will})"
            out.drops.append(Drop(client, why, round(after, 3)))
            log.warning("round %d: client %s dropped: %s", rnd, client, why)
        self.board.update(
            phase="aggregating",
            deadline=0.0,
            replied=sorted(out.replies),
            dropped=[(d.client, d.reason) for d in out.drops],
        )
        return out

    def _stamped(self, state: _Round, task: Message) -> Message:
        """``task`` with this session and the round's deadline (and the broadcast to wait for), kept for resends."""
        meta = {SESSION: self.session, DEADLINE: state.deadline_at}
        if state.broadcast is not None:  # tell the client to wait for the broadcast, which travels apart
            meta[BROADCAST_ROUND] = str(state.rnd)
        task = replace(task, transport=meta)
        state.tasks[task.client] = encode(task)
        return task

    def _take_latecomer(self, state: _Round, client: ClientId) -> None:
        """An admitted client that came online after sampling: its task, while the round is in its first half and has
        fewer clients than its cohort (it has time to answer, and the round's quorum may need it)."""
        plan = state.plan
        if plan is None or plan.late_task is None or len(state.tasks) >= plan.cohort:
            return
        if time.monotonic() - state.started > self.round_timeout / 2:
            return
        task = self._stamped(state, plan.late_task(client))
        state.ctx.sampled = state.ctx.sampled | {client}
        state.out.added.append(client)
        log.info("round %d: client %s came online early in the round; sending it a task", state.rnd, client)
        self._send_task(state, client, task, resend=True)  # with its own copy of the broadcast it missed
        self.board.update(sampled=sorted(state.tasks))

    def _send_task(self, state: _Round, client: ClientId, task: Message, *, resend: bool) -> None:
        topic = self.topics.task(client)
        out = state.out
        if resend and state.broadcast is not None:
            # The client missed the shared broadcast while away: send it its own copy on its task topic.
            sizes = self.link.send(topic, state.broadcast, qos=self.qos)
            wire = _wire_bytes(topic, sizes, subscribers=1, qos=self.qos)
            copy = decode(state.broadcast, check_finite=False)
            out.entries.append(LedgerEntry.of(copy, "down", client, sum(sizes), 1, wire))
        payload = state.tasks[client]
        sizes = self.link.send(topic, payload, qos=self.qos)
        state.sent_at[client] = time.monotonic()
        subscribers = 1 if self.presence.is_online(client) else 0
        wire = _wire_bytes(topic, sizes, subscribers=subscribers, qos=self.qos)
        out.entries.append(LedgerEntry.of(task, "down", client, sum(sizes), 1, wire))

    def _reassembler(self, sampled: int) -> chunking.Reassembler:
        """This round's reassembly, its memory bounded by one largest legitimate update per sampled client."""
        if not self.max_payload:  # no largest update known (a bare transport): the module's defaults
            return chunking.Reassembler(timeout_s=self.round_timeout)
        # A message is charged its size, one byte per chunk (a chunk holds at least one byte) and a fixed overhead.
        per_sender = 2 * self.max_payload + chunking.ENTRY_OVERHEAD
        return chunking.Reassembler(
            max_bytes=per_sender * max(sampled, 1), max_sender_bytes=per_sender, timeout_s=self.round_timeout
        )

    def _on_update(self, item: Inbound, state: _Round) -> None:
        try:
            _, client = self.topics.parse(item.topic)
        except CodecError as exc:
            log.warning("round %d: ignoring a message on an unexpected topic: %s", state.rnd, exc)
            return
        assert client is not None  # update topics always name a client
        wire = delivery_wire_bytes(item.topic, len(item.payload), subscribers=1, qos=item.qos)
        if chunking.is_chunk(item.payload):
            self._on_chunk(client, item, wire, state)
            return
        self._on_reply(client, item.payload, item.received_at, _Partial(len(item.payload), wire), state)

    def _on_chunk(self, client: ClientId, item: Inbound, wire: int, state: _Round) -> None:
        """One chunk: judged by the reply policy, then collected; its message is judged whole once complete."""
        size = len(item.payload)
        header, refusal = judge_chunk(item.payload, client, state.ctx)
        key = (client, header.message_id) if header is not None else None
        if key is not None and key in state.refused:  # more of a message already refused: counted, not judged again
            state.out.entries.append(_chunk_entry(state.rnd, client, "invalid", size, wire))
            return
        if refusal is not None:
            state.out.rejections.append(reject(state.ctx, client, *refusal))
            if key is not None:
                self._remember_refused(state, key)
            state.out.entries.append(_chunk_entry(state.rnd, client, "invalid", size, wire))
            return
        assert key is not None  # a chunk whose header does not parse is always refused
        now = time.monotonic()
        verdict = state.reassembly.add(client, item.payload, now, deadline=state.started + self.round_timeout)
        self.reassembly_peak = max(self.reassembly_peak, state.reassembly.held_bytes)
        self._dropped_chunks(state, state.reassembly.expire(now))  # messages this one evicted
        if verdict.status in ("partial", "complete"):
            counted = state.partial.setdefault(key, _Partial())
            counted.payload_bytes += size
            counted.wire_bytes += wire
            if verdict.payload is not None:  # complete
                self._on_reply(client, verdict.payload, item.received_at, state.partial.pop(key), state)
            return
        # Not part of a message: a duplicate, or refused (budget, a message already closed, disagreeing chunks, or
        # the last chunk of a message whose hash differs, which takes the message's bytes along).
        counted = state.partial.pop(key, _Partial()) if verdict.cause == "hash" else _Partial()
        state.out.entries.append(
            _chunk_entry(state.rnd, client, "invalid", counted.payload_bytes + size, counted.wire_bytes + wire)
        )
        category = "duplicate" if verdict.status == "duplicate" else "oversize" if verdict.cause == "budget" else ""
        state.out.rejections.append(reject(state.ctx, client, category or "unparseable", f"chunk: {verdict.reason}"))
        if key not in state.partial:  # nothing of it is being collected: its further chunks need no verdict each
            self._remember_refused(state, key)

    def _dropped_chunks(self, state: _Round, dropped: list[chunking.Dropped]) -> None:
        """Ledger entries for messages given up incomplete; the reason for their senders' drops."""
        for d in dropped:
            counted = state.partial.pop((d.sender, d.message_id), _Partial())
            state.out.entries.append(
                _chunk_entry(state.rnd, d.sender, "incomplete", counted.payload_bytes, counted.wire_bytes)
            )
            why = f"incomplete reply: {d.received} of {d.count} chunks"
            if d.reason != _ROUND_ENDED:  # e.g. evicted by a newer message of the same sender
                why += f" ({d.reason})"
            state.incomplete[d.sender] = why
            log.warning("round %d: %s: %s", state.rnd, printable(d.sender, 40), why)

    @staticmethod
    def _remember_refused(state: _Round, key: tuple[str, int]) -> None:
        state.refused[key] = None
        while len(state.refused) > MAX_REFUSED_MEMO:
            del state.refused[next(iter(state.refused))]

    def _on_reply(self, client: ClientId, payload: bytes, received_at: float, counted: _Partial, state: _Round) -> None:
        """A whole message (one PUBLISH or reassembled chunks): judged, counted, kept if valid."""
        judged = judge_reply(payload, client, state.ctx)
        msg = judged.message
        said = msg.transport if msg is not None else {}  # the compute times the client reports
        round_trip = received_at - state.sent_at.get(client, state.started)
        timing = ClientTiming(client, round_trip, _seconds(said.get(COMPUTE_S)), _seconds(said.get(COMPUTE_CPU_S)))
        file_reply(
            state.out,
            state.rnd,
            client,
            judged,
            timing,
            payload_bytes=counted.payload_bytes,
            wire_bytes=counted.wire_bytes,
            final=False,  # a refused client may still send a valid reply before the deadline
        )
        if judged.rejection is not None:
            refused = judged.rejection.category == "invalid" and msg is not None and msg.round == state.rnd
            if refused and client in state.tasks and client not in state.out.replies:
                state.refused_replies[client] = (time.monotonic(), judged.rejection.reason)
            return
        state.refused_replies.pop(client, None)
        self.board.update(replied=sorted(state.out.replies))
        state.offline.pop(client, None)  # e.g. its connection dropped after it published
        state.incomplete.pop(client, None)  # an earlier attempt that was given up does not matter any more

    # --- the inbox ----------------------------------------------------------------------------------------------

    def next_update(self, timeout: float) -> Inbound | None:
        """The next message on an update topic within ``timeout`` s, handling status and $SYS messages meanwhile:
        how secure aggregation's stages (:mod:`coordinator.secagg_stages`) read the clients' answers."""
        return self._pump(timeout, updates=True)

    def _pump(self, timeout: float, *, state: _Round | None = None, updates: bool = False) -> Inbound | None:
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

    def _on_status(self, client: ClientId, item: Inbound, state: _Round | None) -> None:
        change = self.presence.update(client, item.payload)
        if change is not None and change.refused:
            self._tell_refused(client, change.refused)
        if change is not None and (change.came_online or change.went_offline):
            self.board.update(online=self.presence.online())
        if change is not None and change.came_online and state is not None and client not in state.tasks:
            self._take_latecomer(state, client)
            return
        if change is None or state is None or client not in state.tasks or client in state.out.replies:
            return
        if change.came_online:  # a real reconnect; a hello on a live connection resends nothing
            if client in state.ctx.failed:
                return
            state.offline.pop(client, None)
            count = state.reconnects[client] = state.reconnects.get(client, 0) + 1
            if count > self.max_reconnects:  # each resend costs a task and a broadcast: a flapping login stops here
                why = f"reconnected {count} times during the round (limit {self.max_reconnects})"
                state.ctx.failed[client] = why
                log.warning("round %d: client %s dropped: %s", state.rnd, client, why)
                return
            # Back during its round: it lost its task with the old connection (clean session), so resend it.
            log.info("round %d: client %s is back; sending its task again", state.rnd, client)
            self._send_task(state, client, decode(state.tasks[client]), resend=True)
        elif not change.status.online:
            state.offline.setdefault(client, (time.monotonic(), change.status.reason or "left"))

    def _follow_roster(self, state: _Round | None) -> None:
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


def _wire_bytes(topic: str, sizes: list[int], *, subscribers: int, qos: int) -> int:
    """Wire bytes of one message sent as PUBLISH packets of these payload sizes (one size: not chunked)."""
    return sum(delivery_wire_bytes(topic, size, subscribers=subscribers, qos=qos) for size in sizes)


def _chunk_entry(rnd: int, client: ClientId, kind: str, payload_bytes: int, wire_bytes: int) -> LedgerEntry:
    """A ledger entry for chunk bytes that never became a judged message: refused, or incomplete at the end."""
    return LedgerEntry(rnd, "up", client, kind, 1, 0, payload_bytes, wire_bytes, uncompressed_bytes=0)


def _seconds(raw: str | None) -> float:
    """A client-reported duration; NaN when missing or not a finite, non-negative number."""
    try:
        value = float(raw[:40]) if raw is not None else math.nan
    except ValueError:
        return math.nan
    return value if math.isfinite(value) and value >= 0 else math.nan
