"""One round's exchange over MQTT: tasks out, replies in, until every sampled client is accounted for.

Per round (:meth:`MqttRound.run`): publish the broadcast once on ``fedge/<run>/broadcast`` (the broker fans it out),
publish each task on ``fedge/<run>/task/<client>``, then collect what arrives on ``fedge/<run>/update/+`` until every
sampled client has answered, reported an error, or stayed offline (its last will) for ``rejoin_grace`` seconds, or the
round's deadline passes. A client that comes back within the round gets its task (and its own copy of the broadcast)
again. Every message that arrives is counted in the ledger and judged by the one reply policy of
:mod:`coordinator.replies`; a bad one is rejected with a reason, never raised. Chunked replies are collected by the
round's :class:`coordinator.mqtt_chunks.ChunkBook`.

The connection, presence and inbox belong to the transport (:class:`coordinator.mqtt.MqttTransport`), which opens one
:class:`MqttRound` per :meth:`~coordinator.mqtt.MqttTransport.exchange` and hands it the status changes and updates
that arrive while it runs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from coordinator.mqtt_chunks import ChunkBook, Tally, reassembler
from coordinator.presence import Presence, StatusChange
from coordinator.replies import RoundContext, file_reply, judge_reply
from coordinator.status_board import StatusBoard
from coordinator.transport import Exchange, ReplyCheck
from fedge.accounting.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.accounting.records import ClientTiming, Drop
from fedge.algorithms.base import RoundPlan
from fedge.errors import CodecError
from fedge.types import ClientId
from fedge.wire import chunking
from fedge.wire.fields import printable
from fedge.wire.message import Message, decode, encode
from fedge.wire.protocol import (
    BROADCAST_ROUND,
    COMPUTE_CPU_S,
    COMPUTE_S,
    DEADLINE,
    SESSION,
    Topics,
    delivery_wire_bytes,
)
from fedge_io.mqtt import Inbound, MqttLink

log = logging.getLogger(__name__)

Pump = Callable[[float], "Inbound | None"]
"""Wait up to so many seconds for the next update, handling status and $SYS messages meanwhile."""


class Host(Protocol):
    """What a round uses of its transport (:class:`coordinator.mqtt.MqttTransport`), read when the round opens."""

    link: MqttLink
    topics: Topics
    presence: Presence
    board: StatusBoard
    session: str
    qos: int
    round_timeout: float
    rejoin_grace: float
    max_reconnects: int
    max_payload: int


class MqttRound:
    """The bookkeeping and exchange loop of one round over the broker."""

    def __init__(self, host: Host, plan: RoundPlan, check: ReplyCheck) -> None:
        self.link = host.link
        self.topics = host.topics
        self.presence = host.presence
        self.board = host.board
        self.session = host.session
        self.qos = host.qos
        self.round_timeout = host.round_timeout
        self.rejoin_grace = host.rejoin_grace
        self.max_reconnects = host.max_reconnects
        self.plan = plan  # for a latecomer's task (RoundPlan.late_task)
        self.out = Exchange()
        self.ctx = RoundContext(
            next(iter(plan.tasks.values())).round,
            frozenset(plan.tasks),
            check,
            known=self.presence.knows,
            declared=self.presence.declared_size,
            max_payload=host.max_payload,
            session=self.session,
        )
        self.started = time.monotonic()
        self.chunks = ChunkBook(
            self.ctx,
            self.out,
            reassembler(host.max_payload, max(len(plan.tasks), plan.cohort), self.round_timeout),
            deadline=self.started + self.round_timeout,
        )
        self.tasks: dict[ClientId, bytes] = {}  # encoded tasks, kept for resends
        self.broadcast: bytes | None = None
        self.deadline_at = ""  # the wall-clock deadline stamped in every task
        self.sent_at: dict[ClientId, float] = {}
        self.offline: dict[ClientId, tuple[float, str]] = {}  # client -> (since, last will's reason)
        self.reconnects: dict[ClientId, int] = {}  # client -> its reconnects during the round
        # client -> (when, why) its latest reply to this round was refused as invalid: not waited for past the grace
        self.refused_replies: dict[ClientId, tuple[float, str]] = {}

    @property
    def rnd(self) -> int:
        return self.ctx.rnd

    def run(self, pump: Pump) -> Exchange:
        """Send the round's broadcast and tasks, collect the replies through ``pump``, and say who dropped and why."""
        plan, ctx, out, rnd = self.plan, self.ctx, self.out, self.rnd
        if plan.broadcast is not None:
            stamped = replace(plan.broadcast, transport={SESSION: self.session})
            self.broadcast = encode(stamped)
            topic = self.topics.broadcast
            sizes = self.link.send(topic, self.broadcast, qos=self.qos)
            wire = wire_bytes(topic, sizes, subscribers=len(self.presence.online()), qos=self.qos)
            out.entries.append(
                LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, sum(sizes), len(plan.tasks), wire)
            )
        # The wall-clock deadline travels in each task, so a client that gets it late (queued while it was away or
        # busy) skips work whose reply would be refused as late. Monotonic time is what this side waits on.
        self.deadline_at = f"{time.time() + self.round_timeout:.3f}"
        for client, task in sorted(plan.tasks.items()):
            self._send_task(client, self._stamped(task), resend=False)
            status = self.presence.clients.get(client)
            if status is not None and not status.online:  # it left between sampling and now
                self.offline[client] = (self.started, status.reason or "left")

        deadline = self.started + self.round_timeout
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
            gone = {c for c, (since, _) in self.offline.items() if now - max(since, back) >= self.rejoin_grace}
            # A client whose reply was refused (a bug, or an insider) is not waited for until the deadline: a
            # client sends one reply a round, and its stored copy after a reconnect is the same bytes. It may still
            # send a valid one within the grace, and is then counted as any other reply.
            gone |= {c for c, (at, _) in self.refused_replies.items() if now - at >= self.rejoin_grace}
            if len(out.replies) + len(gone | set(ctx.failed)) >= len(self.tasks) or now >= deadline:
                break
            item = pump(min(deadline - now, 0.2))
            if item is not None:
                self.on_update(item)

        elapsed = time.monotonic() - self.started
        self.chunks.end(time.monotonic())
        incomplete = self.chunks.incomplete
        for client in sorted(self.tasks):
            if client in out.replies:
                continue
            why = ctx.failed.get(client) or f"silent past the {self.round_timeout:g} s deadline"
            if client in self.refused_replies and client not in ctx.failed:
                why = printable(f"its reply was refused: {self.refused_replies[client][1]}")
            if client in incomplete and client not in ctx.failed:
                why = f"{incomplete[client]} by the {self.round_timeout:g} s deadline"
            after = elapsed
            if client in self.offline and client not in ctx.failed:
                since, will = self.offline[client]
                after = since - self.started
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

    # --- tasks ------------------------------------------------------------------------------------------------

    def _stamped(self, task: Message) -> Message:
        """``task`` with this session and the round's deadline (and the broadcast to wait for), kept for resends."""
        meta = {SESSION: self.session, DEADLINE: self.deadline_at}
        if self.broadcast is not None:  # tell the client to wait for the broadcast, which travels apart
            meta[BROADCAST_ROUND] = str(self.rnd)
        task = replace(task, transport=meta)
        self.tasks[task.client] = encode(task)
        return task

    def _take_latecomer(self, client: ClientId) -> None:
        """An admitted client that came online after sampling: its task, while the round is in its first half and has
        fewer clients than its cohort (it has time to answer, and the round's quorum may need it)."""
        plan = self.plan
        if plan.late_task is None or len(self.tasks) >= plan.cohort:
            return
        if time.monotonic() - self.started > self.round_timeout / 2:
            return
        task = self._stamped(plan.late_task(client))
        self.ctx.sampled = self.ctx.sampled | {client}
        self.out.added.append(client)
        log.info("round %d: client %s came online early in the round; sending it a task", self.rnd, client)
        self._send_task(client, task, resend=True)  # with its own copy of the broadcast it missed
        self.board.update(sampled=sorted(self.tasks))

    def _send_task(self, client: ClientId, task: Message, *, resend: bool) -> None:
        topic = self.topics.task(client)
        out = self.out
        if resend and self.broadcast is not None:
            # The client missed the shared broadcast while away: send it its own copy on its task topic.
            sizes = self.link.send(topic, self.broadcast, qos=self.qos)
            wire = wire_bytes(topic, sizes, subscribers=1, qos=self.qos)
            copy = decode(self.broadcast, check_finite=False)
            out.entries.append(LedgerEntry.of(copy, "down", client, sum(sizes), 1, wire))
        payload = self.tasks[client]
        sizes = self.link.send(topic, payload, qos=self.qos)
        self.sent_at[client] = time.monotonic()
        subscribers = 1 if self.presence.is_online(client) else 0
        wire = wire_bytes(topic, sizes, subscribers=subscribers, qos=self.qos)
        out.entries.append(LedgerEntry.of(task, "down", client, sum(sizes), 1, wire))

    # --- what arrives -------------------------------------------------------------------------------------------

    def on_status(self, client: ClientId, change: StatusChange) -> None:
        """A status message that changed something, during this round: a latecomer's task, a sampled client's task
        again after it reconnected, or the start of its grace once it went offline."""
        if change.came_online and client not in self.tasks:
            self._take_latecomer(client)
            return
        if client not in self.tasks or client in self.out.replies:
            return
        if change.came_online:  # a real reconnect; a hello on a live connection resends nothing
            if client in self.ctx.failed:
                return
            self.offline.pop(client, None)
            count = self.reconnects[client] = self.reconnects.get(client, 0) + 1
            if count > self.max_reconnects:  # each resend costs a task and a broadcast: a flapping login stops here
                why = f"reconnected {count} times during the round (limit {self.max_reconnects})"
                self.ctx.failed[client] = why
                log.warning("round %d: client %s dropped: %s", self.rnd, client, why)
                return
            # Back during its round: it lost its task with the old connection (clean session), so resend it.
            log.info("round %d: client %s is back; sending its task again", self.rnd, client)
            self._send_task(client, decode(self.tasks[client]), resend=True)
        elif not change.status.online:
            self.offline.setdefault(client, (time.monotonic(), change.status.reason or "left"))

    def on_update(self, item: Inbound) -> None:
        """A message on an update topic: a whole reply, or a chunk of one."""
        try:
            _, client = self.topics.parse(item.topic)
        except CodecError as exc:
            log.warning("round %d: ignoring a message on an unexpected topic: %s", self.rnd, exc)
            return
        assert client is not None  # update topics always name a client
        wire = delivery_wire_bytes(item.topic, len(item.payload), subscribers=1, qos=item.qos)
        if chunking.is_chunk(item.payload):
            whole = self.chunks.add(client, item, wire)
            if whole is not None:  # its last chunk: the message is judged whole
                self._on_reply(client, whole[0], item.received_at, whole[1])
            return
        self._on_reply(client, item.payload, item.received_at, Tally(len(item.payload), wire))

    def _on_reply(self, client: ClientId, payload: bytes, received_at: float, counted: Tally) -> None:
        """A whole message (one PUBLISH or reassembled chunks): judged, counted, kept if valid."""
        judged = judge_reply(payload, client, self.ctx)
        msg = judged.message
        said = msg.transport if msg is not None else {}  # the compute times the client reports
        round_trip = received_at - self.sent_at.get(client, self.started)
        timing = ClientTiming(
            client, round_trip, reported_seconds(said.get(COMPUTE_S)), reported_seconds(said.get(COMPUTE_CPU_S))
        )
        file_reply(
            self.out,
            self.rnd,
            client,
            judged,
            timing,
            payload_bytes=counted.payload_bytes,
            wire_bytes=counted.wire_bytes,
            final=False,  # a refused client may still send a valid reply before the deadline
        )
        if judged.rejection is not None:
            refused = judged.rejection.category == "invalid" and msg is not None and msg.round == self.rnd
            if refused and client in self.tasks and client not in self.out.replies:
                self.refused_replies[client] = (time.monotonic(), judged.rejection.reason)
            return
        self.refused_replies.pop(client, None)
        self.board.update(replied=sorted(self.out.replies))
        self.offline.pop(client, None)  # e.g. its connection dropped after it published
        self.chunks.incomplete.pop(client, None)  # an earlier attempt that was given up does not matter any more


def wire_bytes(topic: str, sizes: list[int], *, subscribers: int, qos: int) -> int:
    """Wire bytes of one message sent as PUBLISH packets of these payload sizes (one size: not chunked)."""
    return sum(delivery_wire_bytes(topic, size, subscribers=subscribers, qos=qos) for size in sizes)


def reported_seconds(raw: str | None) -> float:
    """A client-reported duration; NaN when missing or not a finite, non-negative number."""
    try:
        value = float(raw[:40]) if raw is not None else math.nan
    except ValueError:
        return math.nan
    return value if math.isfinite(value) and value >= 0 else math.nan
