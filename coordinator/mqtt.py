"""The MQTT transport: the coordinator's side of a deployment, behind the same interface as the in-process one.

Per round (:meth:`MqttTransport.exchange`): publish the broadcast once on ``fedge/<run>/broadcast`` (the broker fans
it out), publish each task on ``fedge/<run>/task/<client>``, then collect what arrives on ``fedge/<run>/update/+``
until every sampled client has answered, reported an error, or stayed offline (its last will) for ``rejoin_grace``
seconds, or the round's deadline passes. A client that comes back within the round gets its task (and its own copy of
the broadcast) again. Every message that arrives is counted in the ledger; every bad one is rejected with a logged
reason, never raised.

Wire bytes of each ledger entry are computed with the MQTT 3.1.1 formulas of :mod:`fedge.protocol`: the publisher's
PUBLISH and PUBACK plus one PUBLISH and PUBACK per copy the broker delivers (per online client for a broadcast, one
for a task, one for an update to this coordinator). With a broker that publishes byte counters in ``$SYS``
(mosquitto, amqtt), :meth:`broker_counters` reads them so a run can report how close the two counts are.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from common.mqtt import Inbound, MqttLink
from coordinator.transport import Exchange, Rejection, ReplyCheck
from fedge.algorithms.base import RoundPlan
from fedge.errors import CodecError, TransportError
from fedge.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.messages import Message, decode, encode
from fedge.protocol import (
    BROADCAST_ROUND_PARAM,
    COMPUTE_CPU_S_PARAM,
    COMPUTE_S_PARAM,
    ERROR,
    SESSION_PARAM,
    BrokerAddress,
    ClientStatus,
    Topics,
    decode_status,
    delivery_wire_bytes,
    publish_packet_bytes,
)
from fedge.types import ClientId

log = logging.getLogger(__name__)

Admit = Callable[[ClientStatus], "str | None"]
"""Why a client that said hello cannot take part (wrong model, no open set, ...), or None to admit it."""

# Broker byte counters: mosquitto publishes the first pair, amqtt's BrokerSysPlugin the second.
SYS_FILTERS = ("$SYS/broker/bytes/+", "$SYS/broker/load/bytes/+")
_SYS_TOPICS = {
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


@dataclass
class _Round:
    """Bookkeeping of the round being exchanged."""

    rnd: int
    started: float
    tasks: dict[ClientId, bytes]  # encoded tasks, kept for resends
    broadcast: bytes | None
    sent_at: dict[ClientId, float] = field(default_factory=dict)
    failed: dict[ClientId, str] = field(default_factory=dict)  # client -> the error it reported instead of an update
    offline: dict[ClientId, tuple[float, str]] = field(default_factory=dict)  # client -> (since, last will's reason)
    timing: dict[ClientId, tuple[float, float, float]] = field(default_factory=dict)  # (rtt, compute, cpu) seconds


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
    ) -> None:
        if round_timeout <= 0:
            raise TransportError(f"round timeout must be > 0 s, got {round_timeout}")
        if qos != 1:
            raise TransportError("only QoS 1 is supported: tasks and updates must arrive, and QoS 2 costs 3 acks")
        self.address = address
        self.topics = Topics(run)
        self.round_timeout = round_timeout
        self.rejoin_grace = rejoin_grace  # how long a client gone offline mid-round may take to come back
        # Tells clients which coordinator run a task belongs to: runs under one name restart at round 1.
        self.session = uuid.uuid4().hex[:12]
        self.admit = admit
        self.qos = qos
        self.connect_timeout = connect_timeout
        self.clients: dict[ClientId, ClientStatus] = {}  # latest status of every client that ever said hello
        self.refused: dict[ClientId, str] = {}  # clients online but not admitted, and why
        self.round_metrics: dict[int, dict[str, Any]] = {}  # timings and drop reasons, merged into metrics.jsonl
        self.drops: list[dict[str, Any]] = []  # {round, client, reason, after_s} for the summary
        self.rejection_counts: Counter[str] = Counter()  # rejected messages by category
        self._backlog: list[Inbound] = []  # updates that arrived between rounds
        self._sys: dict[str, int] = {}
        self._sys_fresh_at = 0.0  # when the latest "sent" counter arrived
        self._sys_bytes = 0
        self._opened_at = 0.0
        subs = [(self.topics.all_statuses, 1), (self.topics.all_updates, 1)]
        if broker_counters:
            subs += [(f, 0) for f in SYS_FILTERS]  # QoS 0: acks for $SYS would blur the count they report
        self.link = MqttLink(address, f"fedge-{run}-coordinator", subscriptions=subs)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def open(self) -> MqttTransport:
        self.link.start(self.connect_timeout)
        self._opened_at = time.monotonic()
        log.info("coordinator connected to %s, run %r", self.address, self.topics.run)
        return self

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> MqttTransport:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- clients ----------------------------------------------------------------------------------------------

    def online(self) -> list[ClientId]:
        """Clients whose latest status is their hello."""
        return sorted(c for c, s in self.clients.items() if s.online)

    def available_clients(self) -> Sequence[ClientId]:
        """Online clients that were admitted, after handling every status message that has arrived."""
        self._drain()
        return [c for c in self.online() if c not in self.refused]

    def wait_for_clients(
        self, n: int, timeout: float, *, abort: Callable[[], str | None] | None = None
    ) -> list[ClientId]:
        """Block until ``n`` clients are available; TransportError after ``timeout`` s or when ``abort`` says why."""
        deadline = time.monotonic() + timeout
        last = -1
        while True:
            ready = list(self.available_clients())
            if len(ready) != last:
                log.info("%d of %d clients ready: %s", len(ready), n, ", ".join(ready) or "-")
                last = len(ready)
            if len(ready) >= n:
                return ready
            reason = abort() if abort is not None else None
            if reason:
                raise TransportError(f"stopped waiting for clients: {reason}")
            if time.monotonic() > deadline:
                refused = "".join(f"; {c} refused: {why}" for c, why in sorted(self.refused.items()))
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
        state = _Round(rnd, time.monotonic(), {}, None)
        recipients = len(plan.tasks)
        if plan.broadcast is not None:
            stamped = replace(plan.broadcast, params={**plan.broadcast.params, SESSION_PARAM: self.session})
            state.broadcast = encode(stamped)
            topic = self.topics.broadcast
            self.link.publish(topic, state.broadcast, qos=self.qos)
            wire = delivery_wire_bytes(topic, len(state.broadcast), subscribers=len(self.online()), qos=self.qos)
            out.entries.append(
                LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, len(state.broadcast), recipients, wire)
            )
        for client, task in sorted(plan.tasks.items()):
            extra = {SESSION_PARAM: self.session}
            if plan.broadcast is not None:  # tell the client to wait for the broadcast, which travels apart
                extra[BROADCAST_ROUND_PARAM] = str(rnd)
            task = replace(task, params={**task.params, **extra})
            state.tasks[client] = encode(task)
            self._send_task(state, client, task, out, resend=False)
            status = self.clients.get(client)
            if status is not None and not status.online:  # it left between sampling and now
                state.offline[client] = (state.started, status.reason or "left")

        for early in self._take_backlog():
            self._on_update(early, state, plan, check, out)
        deadline = state.started + self.round_timeout
        while True:
            now = time.monotonic()
            gone = {c for c, (since, _) in state.offline.items() if now - since >= self.rejoin_grace}
            if len(out.replies) + len(gone | set(state.failed)) >= len(plan.tasks) or now >= deadline:
                break
            item = self._pump(min(deadline - now, 0.2), state=state, out=out)
            if item is not None:
                self._on_update(item, state, plan, check, out)

        elapsed = time.monotonic() - state.started
        reasons: dict[str, str] = {}
        for client in sorted(plan.tasks):
            if client in out.replies:
                continue
            why = state.failed.get(client) or f"silent past the {self.round_timeout:g} s deadline"
            after = elapsed
            if client in state.offline:
                since, will = state.offline[client]
                after = since - state.started
                why = f"went offline {after:.1f} s into the round ({will})"
            reasons[client] = why
            out.dropped.append(client)
            self.drops.append({"round": rnd, "client": client, "reason": why, "after_s": round(after, 3)})
            log.warning("round %d: client %s dropped: %s", rnd, client, why)
        self.round_metrics[rnd] = _timing_metrics(state, reasons)
        return out

    def _send_task(self, state: _Round, client: ClientId, task: Message, out: Exchange, *, resend: bool) -> None:
        topic = self.topics.task(client)
        if resend and state.broadcast is not None:
            # The client missed the shared broadcast while away: send it its own copy on its task topic.
            self.link.publish(topic, state.broadcast, qos=self.qos)
            wire = delivery_wire_bytes(topic, len(state.broadcast), subscribers=1, qos=self.qos)
            out.entries.append(
                LedgerEntry(
                    state.rnd,
                    "down",
                    client,
                    "broadcast",
                    1,
                    _tensor_bytes(state.broadcast),
                    len(state.broadcast),
                    wire,
                )
            )
        payload = state.tasks[client]
        self.link.publish(topic, payload, qos=self.qos)
        state.sent_at[client] = time.monotonic()
        subscribers = 1 if self._is_online(client) else 0
        wire = delivery_wire_bytes(topic, len(payload), subscribers=subscribers, qos=self.qos)
        out.entries.append(LedgerEntry.of(task, "down", client, len(payload), 1, wire))

    def _on_update(self, item: Inbound, state: _Round, plan: RoundPlan, check: ReplyCheck, out: Exchange) -> None:
        rnd = state.rnd
        try:
            _, client = self.topics.parse(item.topic)
        except CodecError as exc:
            log.warning("round %d: ignoring a message on %s: %s", rnd, item.topic, exc)
            return
        assert client is not None  # update topics always name a client
        msg: Message | None = None
        try:
            msg = decode(item.payload, check_finite=False)
        except CodecError as exc:
            verdict: tuple[str, str] | None = ("unparseable", str(exc))
        else:
            verdict = self._judge(msg, client, state, plan, check, out)
        out.entries.append(
            LedgerEntry(
                round=rnd,
                direction="up",
                client=client,
                kind=msg.kind if msg is not None else "invalid",
                recipients=1,
                tensor_bytes=msg.tensor_bytes if msg is not None else 0,
                payload_bytes=len(item.payload),
                wire_bytes=delivery_wire_bytes(item.topic, len(item.payload), subscribers=1, qos=item.qos),
            )
        )
        if verdict is None:
            assert msg is not None
            out.replies[client] = msg
            sent = state.sent_at.get(client, state.started)
            state.timing[client] = (
                item.received_at - sent,
                _seconds(msg.params.get(COMPUTE_S_PARAM)),
                _seconds(msg.params.get(COMPUTE_CPU_S_PARAM)),
            )
            return
        category, detail = verdict
        self.rejection_counts[category] += 1
        out.rejected.append(Rejection(client, f"{category}: {detail}"))
        log.warning("round %d: rejected a message from %s: %s: %s", rnd, client, category, detail)

    def _judge(
        self, msg: Message, client: ClientId, state: _Round, plan: RoundPlan, check: ReplyCheck, out: Exchange
    ) -> tuple[str, str] | None:
        """(category, detail) of why ``msg``, from the update topic of ``client``, is rejected; None to accept it."""
        rnd = state.rnd
        if client not in self.clients:
            return "unknown client", f"{client!r} never said hello"
        if msg.client != client:
            return "wrong sender", f"sent on {client!r}'s topic but names client {msg.client!r}"
        if msg.round < rnd:
            return "late", f"a reply for round {msg.round} arrived after that round's deadline"
        if msg.round > rnd:
            return "wrong round", f"round {msg.round}, the current round is {rnd}"
        if client not in plan.tasks:
            return "not sampled", f"{client!r} has no task in round {rnd}"
        if client in out.replies:
            return "duplicate", f"{client!r} already replied in round {rnd}"
        if msg.kind == ERROR:
            state.failed.setdefault(client, f"client failed: {msg.param('error', '?')}")
            return "client failed", msg.param("error", "?")
        if client in state.failed:
            return "duplicate", f"{client!r} already reported a failure in round {rnd}"
        bad = [name for name, t in msg.tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            return "non-finite", f"tensor(s) {bad} hold NaN or infinite values"
        try:
            check(client, msg)  # kind, run, shapes, dtypes, extra tensors: the strategy's rules
        except (CodecError, ValueError, KeyError, TypeError) as exc:  # whatever a hostile message trips over
            return "invalid", str(exc)
        state.offline.pop(client, None)  # e.g. its connection dropped after it published
        return None

    # --- the inbox ----------------------------------------------------------------------------------------------

    def _pump(self, timeout: float, *, state: _Round | None = None, out: Exchange | None = None) -> Inbound | None:
        """Handle one inbound message: status and $SYS here; an update is returned (or kept for the next round)."""
        item = self.link.get(timeout)
        if item is None:
            return None
        if item.topic in _SYS_TOPICS:
            self._on_sys(item)
            return None
        try:
            channel, client = self.topics.parse(item.topic)
        except CodecError as exc:
            log.warning("ignoring a message on %s: %s", item.topic, exc)
            return None
        if channel == "status" and client is not None:
            self._on_status(client, item, state, out)
            return None
        if channel == "update":
            if state is None:
                self._backlog.append(item)
                return None
            return item
        return None

    def _drain(self) -> None:
        """Handle everything already received, without waiting."""
        while not self.link.inbox.empty():
            self._pump(0)

    def _take_backlog(self) -> list[Inbound]:
        items, self._backlog = self._backlog, []
        return items

    def _on_status(self, client: ClientId, item: Inbound, state: _Round | None, out: Exchange | None) -> None:
        if not item.payload:  # an empty retained message: the client left cleanly
            status = ClientStatus(client=client, state="offline", reason="left")
        else:
            try:
                status = decode_status(item.payload)
            except CodecError as exc:
                log.warning("ignoring a bad status message on %s: %s", item.topic, exc)
                return
            if status.client != client:
                log.warning("ignoring a status for %r on %s", status.client, item.topic)
                return
        was_online = self._is_online(client)
        self.clients[client] = status
        if status.online:
            why = self.admit(status) if self.admit is not None else None
            if why:
                if self.refused.get(client) != why:
                    log.warning("client %s cannot take part: %s", client, why)
                self.refused[client] = why
                return
            self.refused.pop(client, None)
            if not was_online:
                log.info(
                    "client %s online (%s on %s, %d samples)",
                    client,
                    status.runtime,
                    status.device,
                    status.dataset_size,
                )
            if state is not None and out is not None and client in state.tasks and client not in out.replies:
                if client in state.failed:
                    return
                # Back during its round: it lost its task with the old connection (clean session), so resend it.
                log.info("round %d: client %s is back; sending its task again", state.rnd, client)
                state.offline.pop(client, None)
                self._send_task(state, client, decode(state.tasks[client]), out, resend=True)
        else:
            if was_online:
                log.warning("client %s offline (%s)", client, status.reason or "no reason")
            if state is not None and client in state.tasks and out is not None and client not in out.replies:
                state.offline.setdefault(client, (time.monotonic(), status.reason or "left"))

    def _is_online(self, client: ClientId) -> bool:
        status = self.clients.get(client)
        return status is not None and status.online

    def _on_sys(self, item: Inbound) -> None:
        self._sys_bytes += publish_packet_bytes(item.topic, len(item.payload), item.qos)
        try:
            value = int(float(item.payload.decode()))
        except (UnicodeDecodeError, ValueError):
            return
        key = _SYS_TOPICS[item.topic]
        self._sys[key] = value
        if key == "sent":
            self._sys_fresh_at = item.received_at

    def broker_counters(self, timeout: float = 6.0, settle: float = 0.3) -> BrokerCounters | None:
        """The broker's byte counters as of now: waits for its next $SYS update; None if it publishes none."""
        time.sleep(settle)  # let the last acknowledgements reach the broker
        self._drain()
        if not self._sys and time.monotonic() - self._opened_at > 2.0:
            return None  # brokers that have counters send their retained values as soon as we subscribe
        asked = time.monotonic()
        deadline = asked + timeout
        while self._sys_fresh_at <= asked and time.monotonic() < deadline:
            self._pump(0.1)
        if self._sys_fresh_at <= asked or "received" not in self._sys:
            return None
        return BrokerCounters(self._sys["received"], self._sys["sent"], self._sys_bytes)


def _tensor_bytes(payload: bytes) -> int:
    return decode(payload, check_finite=False).tensor_bytes


def _seconds(raw: str | None) -> float:
    """A client-reported duration; NaN when missing or not a finite, non-negative number."""
    try:
        value = float(raw) if raw is not None else math.nan
    except ValueError:
        return math.nan
    return value if math.isfinite(value) and value >= 0 else math.nan


def _timing_metrics(state: _Round, reasons: dict[str, str]) -> dict[str, Any]:
    """Per-round means and maxima of client compute and of everything else a reply waited for (communication)."""
    out: dict[str, Any] = {"drop_reasons": reasons} if reasons else {}
    rows = [t for t in state.timing.values() if t[1] == t[1]]  # skip replies without timing (NaN)
    if rows:
        compute = [r[1] for r in rows]
        comm = [r[0] - r[1] for r in rows]
        out.update(
            client_compute_s=sum(compute) / len(rows),
            client_compute_s_max=max(compute),
            client_cpu_s=sum(r[2] for r in rows) / len(rows),
            client_comm_s=sum(comm) / len(rows),
            client_comm_s_max=max(comm),
            last_reply_s=max(
                r[0] + state.sent_at.get(c, state.started) - state.started for c, r in state.timing.items()
            ),
        )
    return out
