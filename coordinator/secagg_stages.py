"""Secure aggregation's stages over MQTT: the coordinator's half of :class:`fedge.secagg.remote.StageChannel`.

After a round's exchange (the replies carry each client's report and public keys: stage 0), the server's side
(:func:`fedge.secagg.driver.serve_round`) hands each later stage's messages here. Each goes, framed as a ``secagg``
message (:func:`fedge.secagg.remote.to_message`) stamped with the coordinator's session, on the client's own task
topic; the answers come back on the clients' update topics, the same topics and ACL as every round's task and update.

A stage ends when every recipient answered, or went offline (its last will) and stayed away ``rejoin_grace``
seconds, or at the stage's deadline (``stage_timeout`` seconds). What arrives is hostile until checked: a message on
a topic of a client that was not sent this stage's message, a second answer, a frame larger than the stage allows
(:func:`fedge.secagg.remote.max_frame_bytes`, judged before a byte of it is parsed), another session's, round's or
kind's, or one that does not parse, is refused with a logged reason and counted; so is a protocol message that does
not answer the stage (an earlier stage's answer, which a client sends again after a reconnect), but its sender is
still waited for; chunked answers are reassembled
within one largest frame per recipient. Every message either way gets a ledger entry with its MQTT wire bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from coordinator.mqtt import MqttTransport
from fedge.accounting.ledger import LedgerEntry
from fedge.errors import CodecError
from fedge.secagg.config import RoundConfig
from fedge.secagg.messages import SecAggMessage
from fedge.secagg.protocol import Stage
from fedge.secagg.remote import ANSWER_OF_STAGE, check_frame, from_message, max_frame_bytes, to_message
from fedge.types import ClientId
from fedge.wire import chunking
from fedge.wire.fields import printable
from fedge.wire.message import decode, encode
from fedge.wire.protocol import SESSION, delivery_wire_bytes
from fedge_io.log_budget import LogBudget
from fedge_io.mqtt import Inbound

log = logging.getLogger(__name__)


class MqttStages:
    """:class:`fedge.secagg.remote.StageChannel` over the coordinator's :class:`MqttTransport`."""

    def __init__(self, transport: MqttTransport, *, stage_timeout: float) -> None:
        if stage_timeout <= 0:
            raise ValueError(f"a stage's deadline must be > 0 s, got {stage_timeout}")
        self.transport = transport
        self.stage_timeout = stage_timeout
        self._entries: list[LedgerEntry] = []
        self._gone: dict[ClientId, str] = {}  # why each client stopped answering this round
        self._partial: dict[tuple[str, int], tuple[int, int]] = {}  # (client, message id) -> chunk bytes, wire so far
        self._log_budget = LogBudget(log)  # a client flooding a stage with refused messages: its lines capped

    def take_record(self, rnd: int) -> tuple[list[LedgerEntry], dict[ClientId, str]]:
        entries, gone = [e for e in self._entries if e.round == rnd], self._gone
        self._entries, self._gone, self._log_budget = [], {}, LogBudget(log)
        return entries, gone

    def stage(
        self,
        rnd: int,
        config: RoundConfig,
        stage: Stage,
        messages: Mapping[ClientId, SecAggMessage],
        params: Mapping[ClientId, Mapping[str, str]],
    ) -> list[SecAggMessage]:
        t = self.transport
        run, session, qos = t.topics.run, t.session, t.qos
        for client, message in sorted(messages.items()):
            frame = to_message(message, run=run, params=params.get(client, {}))
            frame = dataclasses.replace(frame, transport={SESSION: session})
            payload = encode(frame)
            topic = t.topics.task(client)
            sizes = t.link.send(topic, payload, qos=qos)
            online = 1 if t.presence.is_online(client) else 0
            wire = sum(delivery_wire_bytes(topic, s, subscribers=online, qos=qos) for s in sizes)
            self._entries.append(
                LedgerEntry(rnd, "down", client, message.KIND, 1, frame.tensor_bytes, sum(sizes), wire)
            )
        limit = max_frame_bytes(config, stage)
        waiting = set(messages)
        answers: dict[ClientId, SecAggMessage] = {}
        offline: dict[ClientId, float] = {}
        reassembly = chunking.Reassembler(
            max_bytes=(limit + chunking.ENTRY_OVERHEAD) * max(len(messages), 1),
            max_sender_bytes=limit + chunking.ENTRY_OVERHEAD,
            timeout_s=self.stage_timeout,
        )
        t.board.update(note=f"secure aggregation: stage {stage}")  # the phase stays "aggregating"
        started = time.monotonic()
        deadline = started + self.stage_timeout
        while waiting:
            now = time.monotonic()
            for c in waiting:
                if t.presence.is_online(c):
                    offline.pop(c, None)
                else:
                    offline.setdefault(c, now)
            gone = {c for c, since in offline.items() if now - since >= t.rejoin_grace}
            if gone >= waiting or now >= deadline:
                break
            item = t.next_update(min(deadline - now, 0.2))
            if item is None:
                continue
            answer = self._take(item, rnd, stage, limit, waiting, reassembly)
            if answer is not None:
                answers[answer.client] = answer
                waiting.discard(answer.client)
        t.board.update(note="")
        for d in reassembly.drop_all(time.monotonic(), "the stage ended"):
            size, wire = self._partial.pop((d.sender, d.message_id), (0, 0))
            self._entries.append(LedgerEntry(rnd, "up", d.sender, "incomplete", 1, 0, size, wire, uncompressed_bytes=0))
        self._partial.clear()
        for c in sorted(waiting):
            if c in offline:
                why = f"went offline {offline[c] - started:.1f} s into stage {stage!r}"
            else:
                why = f"silent past the {self.stage_timeout:g} s deadline of stage {stage!r}"
            self._gone.setdefault(c, why)
            log.warning("round %d: secure aggregation: client %s dropped: %s", rnd, c, why)
        log.info(
            "round %d: secure aggregation stage %r: %d of %d answered in %.1f s",
            rnd,
            stage,
            len(answers),
            len(messages),
            time.monotonic() - started,
        )
        return [answers[c] for c in sorted(answers)]

    def _take(
        self,
        item: Inbound,
        rnd: int,
        stage: Stage,
        limit: int,
        waiting: set[ClientId],
        reassembly: chunking.Reassembler,
    ) -> SecAggMessage | None:
        """The protocol message ``item`` is (or completes) when it is a valid answer of a client still waited for;
        otherwise None, counted, and the refusal logged."""
        t = self.transport
        try:
            _, sender = t.topics.parse(item.topic)
        except CodecError:
            return None
        client = sender or ""
        wire = delivery_wire_bytes(item.topic, len(item.payload), subscribers=1, qos=item.qos)
        size = len(item.payload)
        if client not in waiting:  # not asked, or answered already: counted, never parsed
            self._refuse(rnd, client, "invalid", size, wire, f"a message outside its turn in stage {stage!r}")
            return None
        payload: bytes | None = item.payload
        if chunking.is_chunk(item.payload):
            verdict = reassembly.add(client, item.payload, time.monotonic())
            if verdict.status in ("rejected", "duplicate") or verdict.message_id is None:
                self._refuse(rnd, client, "invalid", size, wire, f"chunk: {verdict.reason}")
                return None
            key = (client, verdict.message_id)
            held = self._partial.get(key, (0, 0))
            self._partial[key] = (held[0] + size, held[1] + wire)
            payload = verdict.payload
            if payload is None:  # more chunks to come: the message's entry counts them all once it is whole
                return None
            size, wire = self._partial.pop(key)
        assert payload is not None
        if len(payload) > limit:
            self._refuse(rnd, client, "oversize", size, wire, f"{len(payload)} bytes, stage {stage!r} allows {limit}")
            return None
        try:
            frame = decode(payload)
            check_frame(frame, run=t.topics.run, client=client, rnd=rnd)
            if frame.transport.get(SESSION) != t.session:
                raise CodecError("it answers another coordinator session")
            message = from_message(frame)
            if ANSWER_OF_STAGE.get(stage) != message.KIND:  # e.g. the previous stage's answer again: still waited for
                raise CodecError(f"a {message.KIND} message does not answer stage {stage!r}")
        except Exception as exc:  # any defect of hostile bytes, whatever the library raised (as coordinator.replies)
            self._refuse(rnd, client, "invalid", size, wire, str(exc) or type(exc).__name__)
            return None
        self._entries.append(LedgerEntry(rnd, "up", client, message.KIND, 1, frame.tensor_bytes, size, wire))
        return message

    def _refuse(self, rnd: int, client: str, kind: str, size: int, wire: int, why: str) -> None:
        self._entries.append(LedgerEntry(rnd, "up", client, kind, 1, 0, size, wire, uncompressed_bytes=0))
        who = printable(client, 64)
        self._log_budget.warn(
            who, "round %d: secure aggregation: refused a message from %s: %s", rnd, who, printable(why)
        )
