"""One round's incoming chunks over MQTT: judged, collected, counted, and given up when the round ends.

Messages larger than the link's packet limit travel as chunks (:mod:`fedge.wire.chunking`). Incoming chunks are
judged by the reply policy before any memory is spent on them (:func:`coordinator.replies.judge_chunk`: known and
sampled sender, declared size within the run's largest update), then collected by one
:class:`~fedge.wire.chunking.Reassembler` per round, whose budgets are one largest update per sampled client. A ledger
entry counts all of a message's chunks, headers included, at payload and wire level. What is still incomplete when
the round ends is dropped, counted as an ``incomplete`` ledger entry, and named in that client's drop reason.

The round itself (:mod:`coordinator.mqtt_round`) judges a message once it is whole.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from coordinator.replies import RoundContext, judge_chunk, reject
from coordinator.transport import Exchange
from fedge.accounting.ledger import LedgerEntry
from fedge.types import ClientId
from fedge.wire import chunking
from fedge.wire.fields import printable
from fedge_io.mqtt import Inbound

log = logging.getLogger(__name__)

ROUND_ENDED = "the round ended"
"""The reason given to the chunked messages still incomplete when their round ends."""
MAX_REFUSED_MEMO = 4096
"""Refused chunked messages remembered per round, so that their further chunks are counted without a rejection each."""


@dataclass
class Tally:
    """Bytes of the chunks of one incoming message so far, for its ledger entry."""

    payload_bytes: int = 0
    wire_bytes: int = 0


def reassembler(max_payload: int, sampled: int, round_timeout: float) -> chunking.Reassembler:
    """A round's reassembly, its memory bounded by one largest legitimate update (``max_payload`` bytes) per sampled
    client; the module's defaults when no largest update is known (a bare transport)."""
    if not max_payload:
        return chunking.Reassembler(timeout_s=round_timeout)
    # A message is charged its size, one byte per chunk (a chunk holds at least one byte) and a fixed overhead.
    per_sender = 2 * max_payload + chunking.ENTRY_OVERHEAD
    return chunking.Reassembler(
        max_bytes=per_sender * max(sampled, 1), max_sender_bytes=per_sender, timeout_s=round_timeout
    )


@dataclass
class ChunkBook:
    """The chunk bookkeeping of the round being exchanged: its ledger entries and rejections go to ``out``."""

    ctx: RoundContext
    out: Exchange
    reassembly: chunking.Reassembler
    deadline: float  # monotonic time at which the round ends: no message is collected past it
    partial: dict[tuple[str, int], Tally] = field(default_factory=dict)  # (client, message id) being reassembled
    refused: dict[tuple[str, int], None] = field(default_factory=dict)  # chunked messages refused, oldest first
    incomplete: dict[ClientId, str] = field(default_factory=dict)  # client -> why its chunked reply never completed
    peak: int = 0  # the most bytes held at once in this round

    def add(self, client: ClientId, item: Inbound, wire: int) -> tuple[bytes, Tally] | None:
        """One chunk: judged by the reply policy, then collected. Returns its message, whole, and the bytes of all its
        chunks once it is complete (for the caller to judge as a reply); None otherwise."""
        ctx, out = self.ctx, self.out
        size = len(item.payload)
        header, refusal = judge_chunk(item.payload, client, ctx)
        key = (client, header.message_id) if header is not None else None
        if key is not None and key in self.refused:  # more of a message already refused: counted, not judged again
            out.entries.append(chunk_entry(ctx.rnd, client, "invalid", size, wire))
            return None
        if refusal is not None:
            out.rejections.append(reject(ctx, client, *refusal))
            if key is not None:
                self._remember_refused(key)
            out.entries.append(chunk_entry(ctx.rnd, client, "invalid", size, wire))
            return None
        assert key is not None  # a chunk whose header does not parse is always refused
        now = time.monotonic()
        verdict = self.reassembly.add(client, item.payload, now, deadline=self.deadline)
        self.peak = max(self.peak, self.reassembly.held_bytes)
        self.dropped(self.reassembly.expire(now))  # messages this one evicted
        if verdict.status in ("partial", "complete"):
            counted = self.partial.setdefault(key, Tally())
            counted.payload_bytes += size
            counted.wire_bytes += wire
            if verdict.payload is not None:  # complete
                return verdict.payload, self.partial.pop(key)
            return None
        # Not part of a message: a duplicate, or refused (budget, a message already closed, disagreeing chunks, or
        # the last chunk of a message whose hash differs, which takes the message's bytes along).
        counted = self.partial.pop(key, Tally()) if verdict.cause == "hash" else Tally()
        out.entries.append(
            chunk_entry(ctx.rnd, client, "invalid", counted.payload_bytes + size, counted.wire_bytes + wire)
        )
        category = "duplicate" if verdict.status == "duplicate" else "oversize" if verdict.cause == "budget" else ""
        out.rejections.append(reject(ctx, client, category or "unparseable", f"chunk: {verdict.reason}"))
        if key not in self.partial:  # nothing of it is being collected: its further chunks need no verdict each
            self._remember_refused(key)
        return None

    def end(self, now: float) -> None:
        """The round ended: every message still incomplete is given up."""
        self.dropped(self.reassembly.drop_all(now, ROUND_ENDED))

    def dropped(self, dropped: list[chunking.Dropped]) -> None:
        """Ledger entries for messages given up incomplete; the reason for their senders' drops."""
        for d in dropped:
            counted = self.partial.pop((d.sender, d.message_id), Tally())
            self.out.entries.append(
                chunk_entry(self.ctx.rnd, d.sender, "incomplete", counted.payload_bytes, counted.wire_bytes)
            )
            why = f"incomplete reply: {d.received} of {d.count} chunks"
            if d.reason != ROUND_ENDED:  # e.g. evicted by a newer message of the same sender
                why += f" ({d.reason})"
            self.incomplete[d.sender] = why
            log.warning("round %d: %s: %s", self.ctx.rnd, printable(d.sender, 40), why)

    def _remember_refused(self, key: tuple[str, int]) -> None:
        self.refused[key] = None
        while len(self.refused) > MAX_REFUSED_MEMO:
            del self.refused[next(iter(self.refused))]


def chunk_entry(rnd: int, client: ClientId, kind: str, payload_bytes: int, wire_bytes: int) -> LedgerEntry:
    """A ledger entry for chunk bytes that never became a judged message: refused, or incomplete at the end."""
    return LedgerEntry(rnd, "up", client, kind, 1, 0, payload_bytes, wire_bytes, uncompressed_bytes=0)
