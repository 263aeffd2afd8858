"""An edge client served over MQTT: announce, receive tasks and broadcasts, compute, upload; survive reconnects.

The client subscribes to its own task topic and the run's broadcast topic, then publishes a retained hello on its
status topic (with a last will that says "offline"). For each task it runs :meth:`EdgeClient.handle` — the same
client half as the in-process simulator — and publishes the update. A task that needs its round's broadcast waits
for it (the two travel on different topics, so they may arrive in either order). Its :class:`EdgeClient` object, and
with it the client's own state (FD/DS-FL local models), lives as long as the process, across reconnects.

The client says what it does at INFO: each task received, each epoch (:mod:`edge_client.progress`), the time of
each part, and why a task is dropped. It reads ahead of the task it is about to compute: once a newer coordinator
session has spoken (a coordinator restarted or resumed under the same run name), the older session's queued tasks are
dropped rather than computed for a coordinator that is gone. A task past its deadline (the Unix time the coordinator
stamps in it, :data:`fedge.wire.protocol.DEADLINE`) is skipped, and training stops between epochs once either happens:
the coordinator would refuse the reply as late. With no task for a while, it warns with the topic it listens on.

Messages larger than the link's packet limit travel as chunks both ways (:mod:`fedge.wire.chunking`): the client
reassembles what arrives on each of its two topics within a byte budget, and :meth:`MqttLink.send` chunks its
update. With chunking off, an update the broker would refuse is answered with an error message saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import secrets
import threading
import time
from collections import deque

import torch

from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo
from edge_client.progress import ObservedBackend, TaskAbandoned
from edge_client.secure import SecureRounds, stage_of
from edge_client.state import ClientStateFiles
from fedge.errors import CodecError, ConfigError
from fedge.privacy.shares import NoiseFloor
from fedge.registry import ALGORITHMS
from fedge.secagg.remote import SECAGG
from fedge.wire import chunking
from fedge.wire.fields import printable
from fedge.wire.message import BROADCAST, TASK, Message, decode, encode
from fedge.wire.protocol import (
    BROADCAST_ROUND,
    CANCELLED,
    COMPUTE_CPU_S,
    COMPUTE_S,
    INSTANCE,
    REFUSED,
    SESSION,
    STATE_ROUND,
    BrokerAddress,
    ClientStatus,
    Topics,
    encode_status,
    error_message,
    task_deadline,
)
from fedge_io.mqtt import Inbound, MqttLink, PacketLimit, PacketTooLarge, Will

log = logging.getLogger(__name__)

FAULT_EXIT_CODE = 70  # what a client started with fail_at_round exits with (tests look for it)
_KEEP_BROADCASTS = 4  # rounds of broadcasts kept while their tasks may still come
_KEEP_REPLIES = 2  # rounds of encoded replies kept for resends (the current round's, and the one before)
MAX_INBOUND_BYTES = 256 << 20
"""The largest chunked message a client reassembles per topic (its task topic, the broadcast): 20x the largest
model fedge has (Reuters, 20.8 MB); a coordinator's chunks beyond it are dropped with a logged reason."""
REASSEMBLY_TIMEOUT_S = 600.0  # a chunked message still incomplete after this long is dropped (its round is over)
IDLE_WARNING_S = 300.0  # default: warn when no task for this client arrived for this long (then after 2x, 4x ...)
_KEEP_RETIRED = 16  # coordinator sessions remembered as over, so that their late tasks are dropped too


class MqttEdgeClient:
    """Serves one :class:`EdgeClient` over a broker until :meth:`stop` (or SIGTERM via the CLI)."""

    def __init__(
        self,
        client: EdgeClient,
        info: ClientDataInfo,
        address: BrokerAddress,
        run: str,
        *,
        device: str = "cpu",
        runtime: str = "torch",
        fail_at_round: int | None = None,
        fail_at_stage: str | None = None,
        keepalive: int = 30,
        announce_host: bool = False,
        capabilities: tuple[str, ...] | None = None,
        max_packet_size: PacketLimit = "auto",
        idle_warning_s: float = IDLE_WARNING_S,
        state: ClientStateFiles | None = None,
        noise_floor: NoiseFloor | None = None,
    ) -> None:
        """``announce_host``: put this machine's host name and process id in the hello (off by default: anyone who
        may read statuses would learn them). ``capabilities``: the algorithms this client's runtime can run (default
        all); the coordinator refuses a client whose hello does not list the run's algorithm. ``max_packet_size``:
        the largest MQTT packet to publish (:class:`fedge_io.mqtt.MqttLink`); a larger update travels as chunks.
        ``idle_warning_s``: warn when no task arrived for this long, again after twice as long, and so on (0: never).
        ``state``: where the client's algorithm state is kept between rounds, for restarts and resumed runs.
        ``noise_floor``: under secure aggregation with DP, the least noise this client adds (its run config's).
        """
        self.client = client
        self.state = state
        self._state_round = 0  # the round the state in client.store comes from (0: none)
        self._fresh_session = False  # a new session spoke: its first task sets the local state
        self.topics = Topics(run)
        self.fail_at_round = fail_at_round
        # Fault injection for tests: with fail_at_round, vanish when that round's secure-aggregation stage opens.
        self.fail_at_stage = fail_at_stage
        # This client's own secure-aggregation party, when asked.
        self.secure = SecureRounds(client.client_id, noise_floor=noise_floor)
        self._stop = threading.Event()
        self._broadcasts: dict[tuple[str, int], Message] = {}  # by (session, round)
        self._pending: Message | None = None  # a task waiting for its broadcast
        self._session: str | None = None  # the coordinator run being served: the latest that spoke
        self._retired: dict[str, None] = {}  # sessions a newer one replaced, oldest first: their tasks are dropped
        self._backlog: deque[Message] = deque()  # messages read ahead of the task being computed, in arrival order
        self.idle_warning_s = idle_warning_s
        self._quiet_since = time.monotonic()  # the latest task's arrival, or the start
        self._next_idle_warning = idle_warning_s
        self.tasks_dropped = 0
        self._done: set[int] = set()  # rounds of this session already answered: QoS 1 may deliver twice
        # The encoded replies of this session's latest rounds: a reply lost with a dropped link is sent again after
        # the reconnect, and a task delivered again is answered with it (the coordinator keeps the first copy).
        self._replies: dict[int, bytes] = {}
        self._reconnected = threading.Event()  # set by every (re)connect; serve() then re-sends the latest reply
        self.replies_resent = 0
        self.updates_sent = 0
        self.refused: str | None = None  # the coordinator's reason, when it refused this client (serve then returns)
        self.cancelled: str | None = None  # the coordinator's reason, when the run could not start (serve returns)
        self._started_at = time.time()  # a run-cannot-start notice sent before this is an earlier process's
        # Announced in the hello and echoed in a run-cannot-start notice: the notice is this process's whatever the
        # two machines' clocks say (a notice queued for an earlier process carries that one's, or none).
        self._instance = secrets.token_hex(8)
        self._reassembly = chunking.Reassembler(
            max_bytes=2 * (MAX_INBOUND_BYTES + chunking.MAX_CHUNKS + chunking.ENTRY_OVERHEAD),
            max_sender_bytes=MAX_INBOUND_BYTES + chunking.MAX_CHUNKS + chunking.ENTRY_OVERHEAD,
            timeout_s=REASSEMBLY_TIMEOUT_S,
        )
        cid = client.client_id
        self._hello = encode_status(
            ClientStatus(
                client=cid,
                state="online",
                runtime=runtime,
                device=device,
                dataset_size=len(client.data),
                model=info.model,
                input_shape=info.input_shape,
                num_classes=info.num_classes,
                open_size=0 if client.data.open_x is None else len(client.data.open_x),
                capabilities=tuple(ALGORITHMS) if capabilities is None else capabilities,
                extra={
                    INSTANCE: self._instance,
                    "torch": torch.__version__,
                    **({"host": platform.node(), "pid": str(os.getpid())} if announce_host else {}),
                },
            ),
            run,
        )
        will = encode_status(ClientStatus(client=cid, state="offline", reason="connection lost"), run)
        self.link = MqttLink(
            address,
            address.username or f"fedge-{run}-{cid}",  # a fleet kit's user name is the client id the broker binds
            subscriptions=[(self.topics.task(cid), 1), (self.topics.broadcast, 1)],
            will=Will(self.topics.status(cid), will),
            on_ready=self._announce,  # after every (re)connect: the coordinator learns we are back
            keepalive=keepalive,
            max_packet_size=max_packet_size,
            clean_session=False,  # tasks and broadcasts published while the link is down wait at the broker
        )

    def _announce(self, link: MqttLink) -> None:
        link.publish(self.topics.status(self.client.client_id), self._hello, qos=1, retain=True)
        self._reconnected.set()

    def stop(self) -> None:
        """Ask :meth:`serve` to return (thread-safe; also what SIGTERM does)."""
        self._stop.set()

    def serve(self, connect_timeout: float = 60.0) -> None:
        """Connect, then handle messages until :meth:`stop`; leave cleanly (empty retained status)."""
        self.link.start(connect_timeout)
        log.info(
            "client %s connected to %s, serving run %r: waiting for tasks on %s",
            self.client.client_id,
            self.link.address,
            self.topics.run,
            self.topics.task(self.client.client_id),
        )
        self._quiet_since = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._reconnected.is_set():
                    self._reconnected.clear()
                    self._resend_latest()
                self._read_ahead(timeout=0.2)
                for dropped in self._reassembly.expire(time.monotonic()):
                    log.warning(
                        "dropped a chunked message on %s: %d of %d chunks (%s)",
                        dropped.sender,
                        dropped.received,
                        dropped.count,
                        dropped.reason,
                    )
                self._warn_if_idle(time.monotonic())
                while self._backlog and not self._stop.is_set():
                    msg = self._backlog.popleft()
                    if msg.kind == BROADCAST:
                        self._on_broadcast(msg)
                    elif msg.kind == TASK:
                        self._on_task(msg)
                    elif msg.kind == SECAGG and msg.client == self.client.client_id and msg.run == self.topics.run:
                        self._on_secagg(msg)
                    elif msg.kind == REFUSED and msg.client == self.client.client_id and msg.run == self.topics.run:
                        self.refused = printable(msg.params.get("reason", ""), 500) or "no reason given"
                        log.error("the coordinator of run %s refused this client: %s", msg.run, self.refused)
                        self._stop.set()
                    elif msg.kind == CANCELLED and msg.client == self.client.client_id and msg.run == self.topics.run:
                        self._on_cancelled(msg)
                    else:
                        log.warning("ignoring a %r message of round %d", printable(msg.kind, 40), msg.round)
        finally:
            # An empty retained message deletes the hello: this client left on purpose (the will is for crashes).
            self.link.close(final=[(self.topics.status(self.client.client_id), b"", True)])
            log.info("client %s stopped after %d updates", self.client.client_id, self.updates_sent)

    def _on_cancelled(self, msg: Message) -> None:
        """The coordinator gave up before round 1 (too few clients can join) and says why: stop waiting. A notice
        sent before this process started was queued for an earlier one (a persistent session) and is ignored."""
        instance = msg.params.get(INSTANCE, "")
        if instance:
            mine = instance == self._instance
        else:  # a coordinator that saw no instance in this process's hello: its clock against ours
            try:
                at = float(msg.params.get("at", "")[:40])
            except ValueError:
                at = math.nan
            mine = at >= self._started_at  # False for NaN
        if not mine:
            log.info("ignoring a notice that an earlier run could not start (meant for an earlier process)")
            return
        self.cancelled = printable(msg.params.get("reason", ""), 1000) or "no reason given"
        log.error("run %s cannot start: %s", msg.run, self.cancelled)
        self._stop.set()

    def _read_ahead(self, timeout: float) -> None:
        """Move every message that has arrived (waiting up to ``timeout`` s for the first) into the backlog, noting
        each coordinator session that speaks: a task queued behind a newer session's message is then known to be
        stale before it is computed."""
        item = self.link.get(timeout)
        while item is not None:
            payload = self._whole(item)
            if payload is not None:
                try:
                    msg = decode(payload)
                except CodecError as exc:
                    log.warning("ignoring an unreadable message on %s: %s", item.topic, exc)
                else:
                    self._note_session(msg)
                    self._backlog.append(msg)
            item = self.link.get(0)

    def _note_session(self, msg: Message) -> None:
        """A task or broadcast of this run from a session not heard before makes it the one served: the session
        served until then is over (its queued tasks are dropped) and the client's local state starts fresh."""
        if msg.kind not in (TASK, BROADCAST) or msg.run != self.topics.run:
            return
        if msg.kind == TASK and msg.client != self.client.client_id:
            return
        session = msg.transport.get(SESSION, "")
        if session == self._session or session in self._retired:
            return
        if self._session is not None:  # a new coordinator run: the old local state belongs to the old run
            log.info(
                "round %d %s of a new coordinator session %s: session %s is over (its queued tasks are dropped)",
                msg.round,
                msg.kind,
                printable(session, 40),
                printable(self._session, 40),
            )
            self._retired[self._session] = None
            self.secure.forget()  # a restarted coordinator restarts the round: new keys, never the old ones
            while len(self._retired) > _KEEP_RETIRED:  # dicts keep insertion order: forget the oldest
                del self._retired[next(iter(self._retired))]
            if self._pending is not None:
                self._drop(self._pending, "its coordinator session is over")
                self._pending = None
        self._session = session
        self._done.clear()
        self._replies.clear()
        # The local state is set when this session's first task starts (_enter_session), not now: a task of the old
        # session may still be computing, and writes its state when it ends.
        self._fresh_session = True

    def _drop(self, task: Message, reason: str) -> None:
        log.info("round %d: task dropped: %s", task.round, reason)
        self.tasks_dropped += 1

    def _abandon_reason(self, task: Message) -> str | None:
        """Why computing ``task`` (further) is pointless, or None: a newer session spoke, or its deadline passed."""
        self._read_ahead(0)
        session = task.transport.get(SESSION, "")
        if session in self._retired:
            return (
                f"it belongs to coordinator session {printable(session, 40)}, over since session "
                f"{printable(self._session or '', 40)} spoke"
            )
        deadline = task_deadline(task)
        late = time.time() - deadline if deadline is not None else -1.0
        if late >= 0:
            return (
                f"its deadline passed {late:.0f} s ago, so the coordinator would refuse the reply as late (if every "
                "task is dropped so, check that this device's clock agrees with the coordinator's)"
            )
        return None

    def _warn_if_idle(self, now: float) -> None:
        quiet = now - self._quiet_since
        if self.idle_warning_s <= 0 or quiet < self._next_idle_warning:
            return
        log.warning(
            "no task for client %s of run %r in %.0f s (listening on %s and %s at %s): is a coordinator running with "
            "--run %s on this broker? (one that does not sample this client sends it no task either)",
            self.client.client_id,
            self.topics.run,
            quiet,
            self.topics.task(self.client.client_id),
            self.topics.broadcast,
            self.link.address,
            self.topics.run,
        )
        self._next_idle_warning *= 2

    def _whole(self, item: Inbound) -> bytes | None:
        """The message ``item`` is, or completes; None while chunks are missing or when one is refused."""
        if not chunking.is_chunk(item.payload):
            return item.payload
        verdict = self._reassembly.add(item.topic, item.payload, time.monotonic())
        if verdict.status == "rejected":
            log.warning("ignoring a chunk on %s: %s", item.topic, verdict.reason)
        return verdict.payload

    def _on_broadcast(self, msg: Message) -> None:
        if msg.run != self.topics.run:
            log.warning("ignoring a broadcast of run %r (serving %r)", msg.run, self.topics.run)
            return
        self._note_session(msg)
        session = msg.transport.get(SESSION, "")
        if session in self._retired:
            log.info("round %d: ignoring a broadcast of the earlier coordinator session %s", msg.round, session)
            return
        key = (session, msg.round)
        self._broadcasts[key] = msg
        while len(self._broadcasts) > _KEEP_BROADCASTS:  # dicts keep insertion order: drop the oldest
            del self._broadcasts[next(iter(self._broadcasts))]
        pending = self._pending
        if pending is not None and _wanted_broadcast(pending) == key:
            self._pending = None
            self._run_task(pending, msg)

    def _on_task(self, task: Message) -> None:
        cid = self.client.client_id
        if task.client != cid or task.run != self.topics.run:
            log.warning("ignoring a task for client %r of run %r", task.client, task.run)
            return
        self._quiet_since, self._next_idle_warning = time.monotonic(), self.idle_warning_s
        log.info("round %d: task received: %s", task.round, self._describe(task))
        self._note_session(task)
        if task.transport.get(SESSION, "") in self._retired:
            self._drop(
                task,
                f"it belongs to coordinator session {task.transport.get(SESSION)}, over since session "
                f"{self._session} spoke",
            )
            return
        if self._fresh_session:
            self._fresh_session = False
            self._enter_session(task.round, task.transport.get(SESSION, ""))
        if task.round in self._done:
            stored = self._replies.get(task.round)
            if stored is None:
                log.info("round %d: task delivered again; already answered", task.round)
                return
            log.info("round %d: task delivered again; sending the stored reply", task.round)
            self._publish_stored(task.round, stored)
            return
        if self.fail_at_round is not None and self.fail_at_stage is None and task.round >= self.fail_at_round:
            log.error("round %d: fault injection: exiting hard in the middle of the task", task.round)
            os._exit(FAULT_EXIT_CODE)  # no DISCONNECT, no cleanup: the broker publishes our last will
        wanted = _wanted_broadcast(task)
        if wanted is None:
            self._run_task(task, None)
            return
        broadcast = self._broadcasts.get(wanted)
        if broadcast is None:
            if self._pending is not None:
                self._drop(self._pending, f"round {task.round}'s task came before its broadcast")
            self._pending = task  # the broadcast is on its way on the other topic
            log.info("round %d: waiting for the round's broadcast", task.round)
            return
        self._run_task(task, broadcast)

    def _enter_session(self, rnd: int, session: str) -> None:
        """A coordinator session this process has not served: its first task is round ``rnd``. Round 1 is a new run
        (fresh state); a later round comes from a resumed coordinator, or this process restarted: the state is the
        newest one written before that round (:mod:`edge_client.state`)."""
        self.client.store.clear()
        self._state_round = 0
        if self.state is None:
            log.info("round %d of coordinator session %s: fresh local state", rnd, printable(session, 40))
            return
        if rnd <= 1:
            self.state.clear()
            return
        restored = self.state.restore(before=rnd)
        if restored is None:
            log.info("round %d of coordinator session %s: no saved client state before it", rnd, session)
            return
        self._state_round, tensors = restored
        self.client.store.update(tensors)
        log.info("round %d of coordinator session %s: client state of round %d restored", rnd, session, restored[0])

    def _describe(self, task: Message) -> str:
        """The task's algorithm, epochs, samples and time left, for its log line (the peer's text made printable)."""
        p = task.params
        deadline = task_deadline(task)
        due = f", due in {deadline - time.time():.0f} s" if deadline is not None else ""
        return (
            f"{printable(p.get('algorithm', '?'), 40)}, {printable(p.get('epochs', '?'), 12)} local epoch(s) on "
            f"{len(self.client.data)} samples{due}"
        )

    def _run_task(self, task: Message, broadcast: Message | None) -> None:
        reason = self._abandon_reason(task)
        if reason is not None:
            self._drop(task, reason)
            return
        observed = ObservedBackend(self.client.backend, task.round, check=lambda: self._abandon_reason(task))
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            update = self.client.handle(task, broadcast, observed)
        except TaskAbandoned as exc:
            log.info("round %d: task abandoned %.1f s into it: %s", task.round, time.perf_counter() - started, exc)
            self.tasks_dropped += 1
            return
        except (CodecError, ConfigError, ValueError) as exc:  # a task this client cannot do: say why, stay up
            log.error("round %d: cannot do the task: %s", task.round, exc)
            self._send(task, error_message(task, str(exc)))
            return
        log.info(
            "round %d: update computed in %.1f s (training %.1f s over %d epoch(s), inference %.1f s)",
            task.round,
            time.perf_counter() - started,
            observed.train_s,
            observed.epochs,
            observed.infer_s,
        )
        if task.transport.get(SESSION, "") in self._retired:  # a newer session spoke while this one was computed
            self._drop(task, "its coordinator session ended while it was computed")
            return
        timing = {
            COMPUTE_S: repr(time.perf_counter() - started),
            COMPUTE_CPU_S: repr(time.process_time() - cpu_started),
            SESSION: task.transport.get(SESSION, ""),  # a resumed coordinator refuses replies to its predecessor
        }
        if self.client.store:  # an algorithm whose clients keep state: the coordinator spots one that lost it
            timing[STATE_ROUND] = str(self._state_round)
        try:  # under secure aggregation the update stays here: the reply carries the report and fresh keys
            secure = self.secure.reply(task, broadcast, update)
        except CodecError as exc:
            log.error("round %d: cannot do the task: %s", task.round, exc)
            self._send(task, error_message(task, str(exc)))
            return
        if secure is not None:
            update = secure
        # The state after this round, on disk before the reply leaves: what was answered is what a restart resumes.
        if self.state is not None and self.client.store:  # stateless algorithms write nothing
            self.state.save(task.round, self.client.store)
        self._state_round = task.round
        if self._send(task, dataclasses.replace(update, transport=timing)):
            self.updates_sent += 1

    def _on_secagg(self, msg: Message) -> None:
        """A secure-aggregation stage message of the round in flight: answered by this client's party."""
        session = msg.transport.get(SESSION, "")
        if session in self._retired:
            log.info("round %d: ignoring a secure-aggregation message of an earlier coordinator session", msg.round)
            return
        stage = stage_of(msg)
        if self.fail_at_stage is not None and self.fail_at_stage == stage and msg.round >= (self.fail_at_round or 0):
            log.error("round %d: fault injection: exiting hard at secure-aggregation stage %s", msg.round, stage)
            os._exit(FAULT_EXIT_CODE)
        answer = self.secure.answer(msg)
        if answer is not None:
            self._send(msg, dataclasses.replace(answer, transport={SESSION: session}))

    def _send(self, task: Message, reply: Message) -> bool:
        """Publish ``reply`` to ``task``; False when it could not go out and an error message went instead."""
        self._done.add(task.round)
        started = time.perf_counter()
        payload = encode(reply)
        topic = self.topics.update(self.client.client_id)
        try:
            sizes = self.link.send(topic, payload, qos=1)
        except PacketTooLarge as exc:  # chunking is off and the broker would refuse it: tell the coordinator why
            log.error("round %d: cannot send the %s: %s", task.round, reply.kind, exc)
            self.link.publish(topic, encode(error_message(task, str(exc))), qos=1)
            return False
        chunks = f" in {len(sizes)} chunks" if len(sizes) > 1 else ""
        log.info(
            "round %d: sent %s (%d bytes%s; encoded and queued in %.2f s)",
            task.round,
            reply.kind,
            len(payload),
            chunks,
            time.perf_counter() - started,
        )
        self._replies[task.round] = payload
        while len(self._replies) > _KEEP_REPLIES:  # dicts keep insertion order: drop the oldest
            del self._replies[next(iter(self._replies))]
        return True

    def _resend_latest(self) -> None:
        """After a reconnect: send the latest round's reply again, in case the old link lost it. The coordinator
        deduplicates by round and session (a second copy is counted as a duplicate), and refuses it as late when its
        round is over."""
        if self._replies:
            rnd = next(reversed(self._replies))
            log.info("round %d: reconnected; sending the reply again", rnd)
            self._publish_stored(rnd, self._replies[rnd])

    def _publish_stored(self, rnd: int, payload: bytes) -> None:
        try:
            self.link.send(self.topics.update(self.client.client_id), payload, qos=1)
        except PacketTooLarge as exc:  # the packet limit changed with the broker: the coordinator asks again
            log.error("round %d: cannot send the stored reply again: %s", rnd, exc)
            return
        self.replies_resent += 1


def _wanted_broadcast(task: Message) -> tuple[str, int] | None:
    """(session, round) of the broadcast a task needs, or None."""
    wanted = task.transport.get(BROADCAST_ROUND)
    if wanted is None or not wanted.isdigit() or len(wanted) > 10:
        return None
    return task.transport.get(SESSION, ""), int(wanted)
