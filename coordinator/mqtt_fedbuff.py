"""FedBuff over MQTT (``fedge coordinator --aggregation fedbuff``): buffered asynchronous aggregation on the real clock,
with the server half the simulator runs (:mod:`coordinator.fedbuff`; Nguyen et al., AISTATS 2022, Algorithm 1).

Up to ``--concurrency`` clients hold a task at once. Each task names the model version it trains on: version ``v``'s
global model is one broadcast (published when the first task of ``v`` goes out; a client that was not online then,
or reconnected since, gets its own copy on its task topic, as a synchronous round's latecomer does), and its tasks
carry round ``v + 1``. A reply is judged as a synchronous round judges one (:func:`coordinator.replies.judge_reply`
with the strategy's check at the task's round), turned into its move against the version it trained on, and buffered
with that version; one more than ``--max-staleness`` steps old is dropped. The K-th buffered update ends the exchange
of a "round", which is one server step (:class:`coordinator.fedbuff.BufferedEngine`); free slots are refilled at once
by sampling idle online clients that have not trained on the current version (each dispatch group with its own seed,
as in the simulator, so that with K = concurrency = the cohort and no stragglers the steps are FedAvg's rounds). A
task silent past ``--round-timeout``, or whose client stays offline past ``--rejoin-grace``, frees its slot (a drop).

Nothing accepted is lost to a kill: with every buffered update the journal is committed again
(:meth:`coordinator.resume.RunJournal.checkpoint`) with the buffer (the moves and their versions), the version counter
and the step's record so far (its ledger entries, drops, rejections, timings). A resumed coordinator is a new session:
the tasks out when it died are void (their clients drop them, and their late replies are counted and refused), and the
clients that trained on the current version without being buffered may be dispatched again.

The ledger counts every message: each step's record holds what was sent and received while it filled, a reply that
arrives for an earlier version's task included.

A reply larger than the link's packet limit arrives as chunks (:mod:`fedge.wire.chunking`): each task out has its own
:class:`coordinator.mqtt_chunks.ChunkBook` (its reply judged chunk by chunk against the task, memory bounded by one
largest update, complete by the task's deadline), and the whole message is then judged like a one-packet reply, its
ledger entry counting every chunk. Chunks still incomplete when the task ends are given up and named in its drop.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from coordinator.engine import _Played, sample_clients
from coordinator.fedbuff import BufferedEngine, BufferedFedAvg, BufferState
from coordinator.mqtt import MqttTransport
from coordinator.mqtt_chunks import ChunkBook, Tally, reassembler
from coordinator.mqtt_round import reported_seconds, wire_bytes
from coordinator.presence import StatusChange
from coordinator.replies import RoundContext, file_reply, judge_reply
from coordinator.transport import Exchange, ReplyCheck
from fedge.accounting.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.accounting.records import ClientTiming, Drop, Rejection
from fedge.aggregation.fedbuff import BufferedUpdate
from fedge.algorithms.base import CheckedReply, UpdateReport
from fedge.config import RunConfig
from fedge.errors import CodecError, JournalError, TransportError
from fedge.types import ClientId, StateDict
from fedge.wire import chunking
from fedge.wire.message import UPDATE, Message, decode, encode
from fedge.wire.protocol import BROADCAST_ROUND, COMPUTE_CPU_S, COMPUTE_S, DEADLINE, SESSION, delivery_wire_bytes
from fedge_io.mqtt import Inbound

log = logging.getLogger(__name__)


@dataclass
class Task:
    """A task out: its client trains on ``version`` (the task's round is ``version + 1``)."""

    client: ClientId
    version: int
    ctx: RoundContext  # judges its reply, at the task's round
    payload: bytes  # the encoded task, for a resend after a reconnect
    sent_at: float  # time.monotonic()
    deadline: float  # time.monotonic(): silent past it, the task is dropped and its slot freed
    reconnects: int = 0
    offline_since: float | None = None


class MqttFedBuffEngine(BufferedEngine):
    """The round engine whose rounds are FedBuff's server steps, played over an MQTT broker (see the module)."""

    def __init__(
        self,
        config: RunConfig,
        strategy: BufferedFedAvg,
        transport: MqttTransport,
        test_x: torch.Tensor,
        test_y: torch.Tensor,
        *,
        initial_bytes: dict[str, int] | None = None,
    ) -> None:
        super().__init__(config, strategy, transport, test_x, test_y, initial_bytes=initial_bytes)
        self.buffered, self.mqtt = strategy, transport
        self.buffer_size = config.fedbuff_buffer_size
        self.concurrency = config.fedbuff_concurrency
        self.max_staleness = config.max_staleness
        self.tasks: dict[ClientId, Task] = {}
        self.chunks: dict[ClientId, ChunkBook] = {}  # the chunked reply being collected for each task out
        self.bases: dict[int, StateDict] = {}  # the global model of every version a task out trains on
        self.broadcasts: dict[int, bytes] = {}  # the encoded broadcast of those versions (for copies)
        self.holders: set[ClientId] = set()  # clients that received the current version's broadcast
        self.checkpoint: Callable[[], None] | None = None  # with every buffered update: RunJournal.checkpoint
        self._out: Exchange | None = None  # the record of the step being filled (status changes add to it)
        self._resumed = False
        self._idle_ctx: RoundContext | None = None  # judges what clients without a task send
        self._idle_chunks: ChunkBook | None = None  # ... and refuses their chunks

    # --- a step ------------------------------------------------------------------------------------------------

    def _exchange(self, rnd: int) -> _Played:
        """Dispatch, collect and buffer until the buffer holds K updates: server step ``rnd`` is then due."""
        started = time.perf_counter()
        st = self.buffered.buffer
        assert st.version == rnd - 1, f"server step {rnd} filled at version {st.version}"
        if not self._resumed:
            self._resumed = True
            # Tasks of a killed coordinator are void: who trained on this version without being buffered may go again.
            st.trained_on_version = {u.client for u in st.buffer if u.base_version == st.version}
        out, arrived, dispatched = _restore_partial(st)
        self._out = out
        for book in self.chunks.values():  # replies still being collected count in the step they complete in
            book.out = out
        self.bases.setdefault(st.version, {k: v.detach().clone() for k, v in self.buffered.global_weights().items()})
        stalled_since: float | None = None
        while len(st.buffer) < self.buffer_size:
            dispatched += self._dispatch(rnd, out)
            self._expire(out)
            if self.tasks:
                stalled_since = None
            else:  # nobody training: wait for a client to come (back), but not for ever
                stalled_since = stalled_since or time.monotonic()
                self._stalled(rnd, time.monotonic() - stalled_since)
            self._show(rnd, out)
            item = self.mqtt.pump(0.2, self)
            if item is not None:
                buffered = self._on_update(rnd, item, out)
                if buffered is not None:
                    arrived.append(buffered)
                    self._save(out, arrived, dispatched)
        out.replies = {
            u.client: CheckedReply(
                UpdateReport(num_examples=int(u.weight), loss=u.loss), Message(UPDATE, rnd, client=u.client)
            )
            for u in st.buffer
        }  # the record's view: one per client (the buffer may hold two updates of one client, of two versions)
        played = _Played(rnd, started, time.perf_counter(), sorted(set(arrived)), out)
        played.metrics = {
            "dispatched": float(dispatched),
            "in_flight": float(len(self.tasks)),
            "dropped_stale": float(st.dropped_stale),
        }
        st.dropped_stale, st.partial, self._out = 0, {}, None
        return played

    def _aggregate(self, played: _Played) -> _Played:
        played = super()._aggregate(played)
        st = self.buffered.buffer  # stepped: the buffer is empty
        self.mqtt.board.update(
            version=st.version,
            buffer_fill=len(st.buffer),
            in_flight=len(self.tasks),
            sampled=sorted(self.tasks),
            replied=sorted(played.exchange.replies),  # the step's
            staleness_mean=-1.0,
            staleness_max=-1,
        )
        return played

    def _step(self) -> int:
        """The server step being filled: what the messages sent or received now are counted in."""
        return self.buffered.buffer.version + 1

    def _stalled(self, rnd: int, waited: float) -> None:
        """TransportError once no client could take a task of step ``rnd`` for a round timeout."""
        if waited < self.mqtt.round_timeout:
            return
        st = self.buffered.buffer
        online = self.mqtt.presence.available()
        raise TransportError(
            f"server step {rnd}: no client could take a task for {waited:.0f} s (the round timeout): {len(online)} "
            f"online, {len(st.trained_on_version)} of them trained on version {st.version} already, and the buffer "
            f"holds {len(st.buffer)} of the {self.buffer_size} updates the step needs (see the drops in "
            "metrics.jsonl); start more clients, or lower --buffer-size"
        )

    # --- tasks -------------------------------------------------------------------------------------------------

    def _dispatch(self, rnd: int, out: Exchange) -> int:
        """Fill the free slots with idle online clients (not training, not trained on this version), sampled by
        (seed, dispatch group): the version's broadcast once, then a task each. How many were dispatched."""
        st, mqtt = self.buffered.buffer, self.mqtt
        free = self.concurrency - len(self.tasks)
        if free <= 0:
            return 0
        idle = [c for c in mqtt.presence.available() if c not in self.tasks and c not in st.trained_on_version]
        if not idle:
            return 0
        st.groups += 1  # group 1 samples as a synchronous run's round 1 does
        chosen = sample_clients(idle, free, self.config.seed, st.groups)
        plan = self.strategy.configure(rnd, chosen)
        if st.version not in self.broadcasts and plan.broadcast is not None:
            stamped = replace(plan.broadcast, transport={SESSION: mqtt.session})
            payload = encode(stamped)
            topic = mqtt.topics.broadcast
            online = mqtt.presence.online()
            sizes = mqtt.link.send(topic, payload, qos=mqtt.qos)
            wire = wire_bytes(topic, sizes, subscribers=len(online), qos=mqtt.qos)
            # Every online client receives it and any of them may train on it: counted once per client that holds it.
            out.entries.append(LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, sum(sizes), len(online), wire))
            self.broadcasts[st.version], self.holders = payload, set(online)
        deadline_at = f"{time.time() + mqtt.round_timeout:.3f}"
        for client in chosen:
            meta = {SESSION: mqtt.session, DEADLINE: deadline_at}
            if st.version in self.broadcasts:
                meta[BROADCAST_ROUND] = str(rnd)
            task = replace(plan.tasks[client], transport=meta)
            if client not in self.holders and st.version in self.broadcasts:
                self._send_copy(client, st.version, out)
            now = time.monotonic()
            ctx = RoundContext(
                rnd,
                frozenset({client}),
                self._check_at(rnd),
                known=mqtt.presence.knows,
                declared=mqtt.presence.declared_size,
                max_payload=mqtt.max_payload,
                session=mqtt.session,
            )
            self.tasks[client] = Task(client, st.version, ctx, encode(task), now, now + mqtt.round_timeout)
            self.chunks[client] = ChunkBook(
                ctx, out, reassembler(mqtt.max_payload, 1, mqtt.round_timeout), deadline=now + mqtt.round_timeout
            )
            self._send_task(self.tasks[client], out)
            st.seq += 1
            st.trained_on_version.add(client)
        log.info("version %d: tasks to %s (%d training)", st.version, ", ".join(chosen), len(self.tasks))
        return len(chosen)

    def _send_copy(self, client: ClientId, version: int, out: Exchange) -> None:
        """``version``'s broadcast on ``client``'s task topic: it missed the shared one."""
        mqtt = self.mqtt
        topic = mqtt.topics.task(client)
        payload = self.broadcasts[version]
        sizes = mqtt.link.send(topic, payload, qos=mqtt.qos)
        copy = decode(payload, check_finite=False)
        entry = LedgerEntry.of(
            copy, "down", client, sum(sizes), 1, wire_bytes(topic, sizes, subscribers=1, qos=mqtt.qos)
        )
        out.entries.append(replace(entry, round=self._step()))  # an older version's copy counts in this step
        if version == self.buffered.buffer.version:
            self.holders.add(client)

    def _send_task(self, task: Task, out: Exchange) -> None:
        mqtt = self.mqtt
        topic = mqtt.topics.task(task.client)
        sizes = mqtt.link.send(topic, task.payload, qos=mqtt.qos)
        msg = decode(task.payload, check_finite=False)
        subscribers = 1 if mqtt.presence.is_online(task.client) else 0
        wire = wire_bytes(topic, sizes, subscribers=subscribers, qos=mqtt.qos)
        entry = LedgerEntry.of(msg, "down", task.client, sum(sizes), 1, wire)
        out.entries.append(replace(entry, round=self._step()))  # a resent older task counts in this step

    def _expire(self, out: Exchange) -> None:
        """Drop the tasks silent past the round timeout, or whose client stayed offline past the rejoin grace."""
        now = time.monotonic()
        link = self.mqtt.link
        # As in a round, the grace runs only while our own link is up, from its latest (re)connection: last wills
        # that arrive around a broker outage say only that the clients are reconnecting too.
        back = link.connected_at if link.connected else now
        for task in list(self.tasks.values()):
            since = task.offline_since
            if since is not None and now - max(since, back) >= self.mqtt.rejoin_grace:
                # Its task is void: once back online it may train on this version after all.
                self._drop(task, f"went offline {since - task.sent_at:.1f} s into its task", out, again=True)
            elif now >= task.deadline:
                self._drop(task, f"silent past the {self.mqtt.round_timeout:g} s round timeout", out)

    def _drop(self, task: Task, why: str, out: Exchange, *, again: bool = False) -> None:
        """Free ``task``'s slot; ``again``: its client may be dispatched at the current version once more."""
        del self.tasks[task.client]
        if again and task.version == self.buffered.buffer.version:
            self.buffered.buffer.trained_on_version.discard(task.client)
        incomplete = self._close_chunks(task.client)
        if incomplete:
            why = f"{why} ({incomplete})"
        out.drops.append(Drop(task.client, why, round(time.monotonic() - task.sent_at, 3)))
        log.warning("version %d: client %s dropped: %s", task.version, task.client, why)
        self._forget_bases()

    def _close_chunks(self, client: ClientId) -> str:
        """The task of ``client`` ended: its chunks still being collected are given up (counted as ``incomplete``).
        Why its reply never completed, or ""."""
        book = self.chunks.pop(client, None)
        if book is None:
            return ""
        book.end(time.monotonic())
        self.mqtt.reassembly_peak = max(self.mqtt.reassembly_peak, book.peak)
        return book.incomplete.get(client, "")

    def _forget_bases(self) -> None:
        keep = {t.version for t in self.tasks.values()} | {self.buffered.buffer.version}
        for version in [v for v in self.bases if v not in keep]:
            del self.bases[version]
        for version in [v for v in self.broadcasts if v not in keep]:
            del self.broadcasts[version]

    # --- what arrives ------------------------------------------------------------------------------------------

    def on_status(self, client: ClientId, change: StatusChange) -> None:
        """A client that reconnected lost what was queued for its old connection: its task again, with its
        version's broadcast; one that went offline has the rejoin grace to come back."""
        if change.came_online:
            self.holders.discard(client)
        task = self.tasks.get(client)
        out = self._out
        if task is None or out is None:
            return
        if change.came_online:
            task.offline_since = None
            task.reconnects += 1
            if task.reconnects > self.mqtt.max_reconnects:
                self._drop(task, f"reconnected {task.reconnects} times during its task", out)
                return
            log.info("version %d: client %s is back; sending its task again", task.version, client)
            if task.version in self.broadcasts:
                self._send_copy(client, task.version, out)
            self._send_task(task, out)
        elif not change.status.online:
            task.offline_since = task.offline_since or time.monotonic()

    def _on_update(self, rnd: int, item: Inbound, out: Exchange) -> ClientId | None:
        """A message on an update topic: counted in step ``rnd``'s ledger, judged against its client's task, and
        buffered (or dropped as too stale). The client whose update was buffered or dropped for its age, or None."""
        mqtt, st = self.mqtt, self.buffered.buffer
        try:
            _, client = mqtt.topics.parse(item.topic)
        except CodecError as exc:
            log.warning("ignoring a message on an unexpected topic: %s", exc)
            return None
        assert client is not None  # update topics always name a client
        wire = delivery_wire_bytes(item.topic, len(item.payload), subscribers=1, qos=item.qos)
        task = self.tasks.get(client)
        ctx = task.ctx if task is not None else self._no_task_context(rnd)
        counted = Tally(len(item.payload), wire)
        payload = item.payload
        if chunking.is_chunk(payload):
            book = self.chunks.get(client) if task is not None else None
            whole = (book or self._idle_chunk_book(rnd, out)).add(client, item, wire)
            if whole is None:  # more to come, or refused (counted and rejected by the book)
                return None
            payload, counted = whole
        judged = judge_reply(payload, client, ctx)
        said = judged.message.transport if judged.message is not None else {}
        round_trip = item.received_at - (task.sent_at if task else item.received_at)
        timing = ClientTiming(
            client, round_trip, reported_seconds(said.get(COMPUTE_S)), reported_seconds(said.get(COMPUTE_CPU_S))
        )
        file_reply(
            out, rnd, client, judged, timing, payload_bytes=counted.payload_bytes, wire_bytes=counted.wire_bytes,
            final=False,
        )  # fmt: skip
        if task is None:
            return None
        if judged.checked is None:
            assert judged.rejection is not None
            answered = judged.message is not None and judged.message.round == task.ctx.rnd
            if client in task.ctx.failed:  # it said it cannot do the task
                self._drop(task, task.ctx.failed[client], out)
            elif answered and judged.rejection.category == "invalid":
                self._drop(task, f"its reply was refused: {judged.rejection.reason}", out)
            return None
        reply = out.replies.pop(client)  # the record's replies are the buffer's, set when the step is due
        del self.tasks[client]
        self._close_chunks(client)
        base = self.bases[task.version]
        age = st.version - task.version
        if self.max_staleness is not None and age > self.max_staleness:
            st.dropped_stale += 1
            st.dropped_stale_total += 1
            why = f"stale: trained on version {task.version}, {age} steps old > --max-staleness {self.max_staleness}"
            log.info("client %s: %s", client, why)
            out.drops.append(Drop(client, why, round(time.monotonic() - task.sent_at, 3)))
        else:
            delta = {k: reply.update.tensors[k] - v for k, v in base.items()}
            weight = self.buffered.averaging_weight(reply)
            st.buffer.append(BufferedUpdate(client, task.version, weight, delta, reply.report.loss))
            log.info("version %d: update of %s buffered (trained on version %d, %d/%d)", st.version, client,
                     task.version, len(st.buffer), self.buffer_size)  # fmt: skip
        self._forget_bases()
        return client

    def _check_at(self, rnd: int) -> ReplyCheck:
        """The strategy's check of a reply to a task of round ``rnd`` (the round it names, whatever the step now); its
        update bound measures the move from the version the task sent, as the buffer will (and as the simulator,
        which checks at dispatch, does), not from the model the steps since have moved to."""

        def check(client: ClientId, reply: Message) -> CheckedReply:
            base = self.bases.get(rnd - 1, self.buffered.global_weights())
            return self.buffered.accept_from(base, rnd, client, reply)

        return check

    def _no_task_context(self, rnd: int) -> RoundContext:
        """Judges a message from a client without a task: refused (late, for another session, not sampled). One per
        step, so that a flooding client's log lines are capped (its log budget)."""
        if self._idle_ctx is None or self._idle_ctx.rnd != rnd:
            mqtt = self.mqtt
            self._idle_ctx = RoundContext(
                rnd,
                frozenset(),
                self._check_at(rnd),
                known=mqtt.presence.knows,
                max_payload=mqtt.max_payload,
                session=mqtt.session,
            )
        return self._idle_ctx

    def _idle_chunk_book(self, rnd: int, out: Exchange) -> ChunkBook:
        """Refuses the chunks of clients without a task out (its context samples nobody), each message once."""
        ctx = self._no_task_context(rnd)
        if self._idle_chunks is None or self._idle_chunks.ctx is not ctx:
            mqtt = self.mqtt
            deadline = time.monotonic() + mqtt.round_timeout
            self._idle_chunks = ChunkBook(ctx, out, reassembler(mqtt.max_payload, 1, mqtt.round_timeout), deadline)
        self._idle_chunks.out = out
        return self._idle_chunks

    # --- journal and view --------------------------------------------------------------------------------------

    def _save(self, out: Exchange, arrived: list[ClientId], dispatched: int) -> None:
        """The step's record so far into the buffer state, and the journal committed with it."""
        self.buffered.buffer.partial = {
            "entries": [dataclasses.asdict(e) for e in out.entries],
            "drops": [dataclasses.asdict(d) for d in out.drops],
            "rejections": [dataclasses.asdict(r) for r in out.rejections],
            "timings": [dataclasses.asdict(t) for t in out.timings],
            "arrived": list(arrived),
            "dispatched": dispatched,
        }
        if self.checkpoint is not None:
            self.checkpoint()

    def _show(self, rnd: int, out: Exchange) -> None:
        """The fleet view (fedge status): the step being filled, the version, the buffer and its staleness."""
        st = self.buffered.buffer
        ages = [st.version - u.base_version for u in st.buffer]
        self.mqtt.board.update(
            phase="training",
            round=rnd,
            online=self.mqtt.presence.online(),
            sampled=sorted(self.tasks),
            replied=[u.client for u in st.buffer],
            dropped=[(d.client, d.reason) for d in out.drops],
            version=st.version,
            buffer_fill=len(st.buffer),
            buffer_size=self.buffer_size,
            in_flight=len(self.tasks),
            staleness_mean=statistics.fmean(ages) if ages else -1.0,
            staleness_max=max(ages) if ages else -1,
        )


def _restore_partial(st: BufferState) -> tuple[Exchange, list[ClientId], int]:
    """The step's record so far as a killed coordinator journaled it (empty for a fresh step)."""
    p: Mapping[str, Any] = st.partial
    if not p:
        return Exchange(), [], 0
    try:
        out = Exchange(
            entries=[LedgerEntry(**e) for e in p["entries"]],
            drops=[Drop(**d) for d in p["drops"]],
            rejections=[Rejection(**r) for r in p["rejections"]],
            timings=[ClientTiming(**t) for t in p["timings"]],
        )
        return out, [str(c) for c in p["arrived"]], int(p["dispatched"])
    except (KeyError, TypeError, ValueError) as exc:
        raise JournalError(f"the journal's FedBuff step record is malformed ({type(exc).__name__}: {exc})") from None
