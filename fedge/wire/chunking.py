"""Messages larger than a broker's packet limit, sent as chunks and reassembled with bounded memory.

A payload that fits in ``max_chunk_bytes`` travels as it is. A larger one travels as ``count`` chunks, each one
PUBLISH of :data:`HEADER_BYTES` of header plus a slice of the payload. The header (big-endian) holds:

  ======== ===== =====================================================================
  magic    8     ``b"FEDGECK"`` + version byte 1
  msg_id   8     the sender's id of the message (unique per sender while it is in flight)
  index    4     0 .. count-1
  count    4     1 .. MAX_CHUNKS
  total    8     length of the whole payload
  slice    4     slice length of every chunk but the last (the last holds the rest)
  sha256   32    SHA-256 of the whole payload
  ======== ===== =====================================================================

A safetensors message starts with its header length as a little-endian u64, at most 1 GiB; read that way the magic
is >= 2^56, so a chunk is never mistaken for a whole message and :func:`is_chunk` tells them apart. Every header is
checked on its own (the slice length and count agree with the total, the chunk's length is the one its index
implies) and against the chunks of the same message already held. A :class:`Reassembler` keeps messages per
(sender, message id), returns the payload once every chunk is in and the hash matches, drops messages still
incomplete after their deadline, and reserves a message's whole size from its byte budgets (per sender and in total)
before it allocates anything. Every outcome is a :class:`Verdict` a transport can count; nothing here raises for a
peer's bytes. Time is passed in (``now``, seconds on any monotonic clock); there are no sockets here.

Chunks must not be retained messages (a broker keeps only the last one per topic); fedge's retained status
messages are small and never chunked.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from fedge.errors import CodecError, ConfigError
from fedge.wire import protocol

MAGIC = b"FEDGECK\x01"
_HEADER = struct.Struct(">8sQIIQI32s")
HEADER_BYTES = _HEADER.size  # 68
"""Bytes of every chunk's header: what chunking adds to the payload per chunk."""

MAX_CHUNKS = 1 << 20
MAX_MESSAGE_BYTES = 1 << 30  # as fedge.wire.message.MAX_PAYLOAD_BYTES
ENTRY_OVERHEAD = 1024
"""Bytes a pending message is charged for its bookkeeping, on top of its payload and one byte per chunk."""

Status = Literal["partial", "complete", "duplicate", "rejected"]
Cause = Literal["", "header", "closed", "budget", "mismatch", "hash"]
"""Why a chunk was rejected: a bad header, a message already closed, a byte budget, a chunk disagreeing with its
message's earlier chunks, or a reassembled message whose hash differs; empty unless rejected."""


@dataclass(frozen=True)
class ChunkHeader:
    """The parsed header of one chunk."""

    message_id: int
    index: int
    count: int
    total: int
    slice_bytes: int
    digest: bytes

    @property
    def expected_length(self) -> int:
        """Slice bytes this chunk must carry: ``slice_bytes``, or the rest for the last chunk."""
        return self.slice_bytes if self.index < self.count - 1 else self.total - (self.count - 1) * self.slice_bytes


# --- sizes ------------------------------------------------------------------------------------------------------


def largest_payload(topic: str, max_packet_size: int, *, qos: int = 1, properties_bytes: int = 0) -> int:
    """The largest payload whose PUBLISH on ``topic`` is at most ``max_packet_size`` bytes, the whole packet.

    ``max_packet_size`` is a configured limit or the broker's MQTT 5 CONNACK Maximum Packet Size (which counts the
    whole packet, fixed header included). ``properties_bytes`` is what MQTT 5 adds to a PUBLISH: 1 for an empty
    property list, more for properties the sender sets; 0 for MQTT 3.1.1. Sizes follow
    :func:`fedge.wire.protocol.publish_packet_bytes`. ConfigError when not even one byte of payload fits.
    """
    if properties_bytes < 0:
        raise ConfigError(f"properties_bytes must be >= 0, got {properties_bytes}")
    protocol.publish_packet_bytes(topic, 0, qos)  # checks the QoS
    # The remaining length holds the topic (2-byte length + UTF-8), the packet id (QoS > 0), properties, payload.
    overhead = 2 + len(topic.encode()) + (2 if qos else 0) + properties_bytes
    limit = min(max_packet_size, 1 + 4 + protocol.MAX_REMAINING_LENGTH)
    best = -1
    for varint in (1, 2, 3, 4):  # a packet is 1 + varint + remaining bytes: try each size of the varint
        remaining = limit - 1 - varint
        if 0 <= remaining <= protocol.MAX_REMAINING_LENGTH and protocol.varint_size(remaining) <= varint:
            best = max(best, remaining - overhead)
    if best < 1:
        raise ConfigError(f"a packet limit of {max_packet_size} bytes leaves no room for a payload on {topic!r}")
    if protocol.publish_packet_bytes(topic, best + properties_bytes, qos) > max_packet_size:  # pragma: no cover
        raise AssertionError("largest_payload disagrees with fedge.wire.protocol.publish_packet_bytes")
    return best


def _slice_bytes(max_chunk_bytes: int) -> int:
    if max_chunk_bytes <= HEADER_BYTES:
        raise ConfigError(
            f"chunks of at most {max_chunk_bytes} bytes leave no room after the {HEADER_BYTES}-byte header"
        )
    return max_chunk_bytes - HEADER_BYTES


def is_chunk(payload: bytes) -> bool:
    """Whether ``payload`` is a chunk (else a whole message)."""
    return payload[: len(MAGIC)] == MAGIC


# --- split ------------------------------------------------------------------------------------------------------


def split(payload: bytes, max_chunk_bytes: int, message_id: int) -> list[bytes]:
    """``payload`` as it travels: itself when it fits in ``max_chunk_bytes``, else chunks of at most that size.

    ``max_chunk_bytes`` is a configured payload limit or :func:`largest_payload` of the topic. ``message_id`` should
    be drawn at random (64 bits, from the transport's own generator) so that a restarted sender does not reuse the id
    of a message still being reassembled.
    """
    if not 0 <= message_id < 1 << 64:
        raise ConfigError(f"message id must fit in 64 bits, got {message_id}")
    if len(payload) <= max_chunk_bytes:
        if is_chunk(payload):
            raise CodecError("a payload that starts with the chunk magic would be mistaken for a chunk")
        return [payload]
    if len(payload) > MAX_MESSAGE_BYTES:
        raise CodecError(f"payload of {len(payload)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    slice_bytes = _slice_bytes(max_chunk_bytes)
    count = -(-len(payload) // slice_bytes)
    if count > MAX_CHUNKS:
        raise ConfigError(f"{count} chunks exceed the limit of {MAX_CHUNKS}; allow larger chunks")
    digest = hashlib.sha256(payload).digest()
    view = memoryview(payload)
    return [
        _HEADER.pack(MAGIC, message_id, i, count, len(payload), slice_bytes, digest)
        + view[i * slice_bytes : (i + 1) * slice_bytes]
        for i in range(count)
    ]


def parse_header(chunk: bytes) -> ChunkHeader:
    """The header of ``chunk``, checked on its own; CodecError with the reason otherwise."""
    if len(chunk) < HEADER_BYTES:
        raise CodecError(f"a chunk of {len(chunk)} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, message_id, index, count, total, slice_bytes, digest = _HEADER.unpack_from(chunk)
    if magic != MAGIC:
        raise CodecError("not a chunk of this version (bad magic)")
    if not 1 <= count <= MAX_CHUNKS:
        raise CodecError(f"chunk count {count} is outside 1..{MAX_CHUNKS}")
    if index >= count:
        raise CodecError(f"chunk index {index} is outside 0..{count - 1}")
    if not 1 <= total <= MAX_MESSAGE_BYTES:
        raise CodecError(f"message length {total} is outside 1..{MAX_MESSAGE_BYTES}")
    if not 1 <= slice_bytes <= total or -(-total // slice_bytes) != count:
        raise CodecError(f"slice length {slice_bytes} and count {count} do not fit a message of {total} bytes")
    header = ChunkHeader(message_id, index, count, total, slice_bytes, digest)
    if len(chunk) - HEADER_BYTES != header.expected_length:
        raise CodecError(
            f"chunk {index} of {count} carries {len(chunk) - HEADER_BYTES} bytes, expected {header.expected_length}"
        )
    return header


# --- reassembly -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What became of one chunk: ``partial`` (kept, more to come), ``complete`` (``payload`` is the whole message),
    ``duplicate`` (already held or already delivered; QoS 1 may redeliver) or ``rejected`` (``reason`` says why)."""

    status: Status
    sender: str
    message_id: int | None = None
    payload: bytes | None = None
    reason: str = ""
    cause: Cause = ""


@dataclass(frozen=True)
class Dropped:
    """A message given up before it was complete: expired at its deadline, or evicted for a newer one."""

    sender: str
    message_id: int
    received: int  # chunks that arrived
    count: int
    reason: str


_Key = tuple[str, int]  # (sender, message id)


@dataclass
class _Pending:
    header: ChunkHeader
    deadline: float
    buffer: bytearray
    seen: bytearray  # one byte per chunk: 1 once it arrived
    received: int = 0

    @property
    def charge(self) -> int:
        return _charge(self.header)


def _charge(header: ChunkHeader) -> int:
    return header.total + header.count + ENTRY_OVERHEAD


@dataclass
class Reassembler:
    """Collects chunks per (sender, message id) within byte budgets and deadlines.

    ``max_bytes`` bounds the memory of all pending messages, ``max_sender_bytes`` that of one sender's (a new
    message from a sender over its budget evicts that sender's oldest pending messages; one that does not fit even
    then, or does not fit the total budget, is rejected). A pending message is dropped at ``now >= deadline``, its
    first chunk's time plus ``timeout_s`` unless :meth:`add` is given a deadline (the round's). Messages delivered,
    dropped or failed are remembered (by sender, id and hash) for ``timeout_s``, at most ``max_closed`` of them, so
    their late or redelivered chunks do not start a message that can never complete.
    """

    max_bytes: int = 256 << 20
    max_sender_bytes: int = 64 << 20
    timeout_s: float = 600.0
    max_closed: int = 4096
    _pending: dict[_Key, _Pending] = field(default_factory=dict, init=False, repr=False)
    _by_sender: dict[str, dict[_Key, None]] = field(default_factory=dict, init=False, repr=False)  # oldest first
    _sender_held: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _deadlines: list[tuple[float, int, _Key]] = field(default_factory=list, init=False, repr=False)  # a heap
    _closed: OrderedDict[tuple[str, int, bytes], tuple[float, str]] = field(
        default_factory=OrderedDict, init=False, repr=False
    )
    _dropped: list[Dropped] = field(default_factory=list, init=False, repr=False)
    _sequence: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)  # heap tie-breaks
    _held: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_sender_bytes <= self.max_bytes:
            raise ConfigError("reassembly budgets need 0 < max_sender_bytes <= max_bytes")
        if not self.timeout_s > 0 or self.max_closed < 0:
            raise ConfigError("reassembly timeout must be > 0 and max_closed >= 0")

    @property
    def held_bytes(self) -> int:
        """Bytes charged to pending messages (reserved in full at each message's first chunk)."""
        return self._held

    @property
    def pending(self) -> int:
        """Messages waiting for chunks."""
        return len(self._pending)

    def sender_bytes(self, sender: str) -> int:
        """Bytes charged to ``sender``'s pending messages."""
        return self._sender_held.get(sender, 0)

    def add(self, sender: str, chunk: bytes, now: float, *, deadline: float | None = None) -> Verdict:
        """Take one chunk from ``sender`` (the transport's name for its origin, e.g. the topic's client id).

        ``deadline`` (absolute, same clock as ``now``) applies when the chunk starts a message.
        """
        self._expire(now)
        try:
            header = parse_header(chunk)
        except CodecError as exc:
            return Verdict("rejected", sender, reason=str(exc), cause="header")
        key = (sender, header.message_id)
        closed = self._closed.get((sender, header.message_id, header.digest))
        if closed is not None:
            if closed[1] == "delivered":
                return Verdict("duplicate", sender, header.message_id, reason="message already delivered")
            return Verdict("rejected", sender, header.message_id, reason=f"message already {closed[1]}", cause="closed")
        entry = self._pending.get(key)
        if entry is None:
            refusal = self._admit(sender, header, now)
            if refusal:
                return Verdict("rejected", sender, header.message_id, reason=refusal, cause="budget")
            # The size was bounded by the budgets just now: allocating it is safe.
            expires = now + self.timeout_s if deadline is None else deadline
            entry = _Pending(header, expires, bytearray(header.total), bytearray(header.count))
            self._hold(key, entry)
        elif header != ChunkHeader(header.message_id, header.index, *_shape(entry.header)):
            reason = "chunk disagrees with earlier chunks"
            return Verdict("rejected", sender, header.message_id, reason=reason, cause="mismatch")
        if entry.seen[header.index]:
            return Verdict("duplicate", sender, header.message_id, reason=f"chunk {header.index} already held")
        start = header.index * header.slice_bytes
        entry.buffer[start : start + header.expected_length] = memoryview(chunk)[HEADER_BYTES:]
        entry.seen[header.index] = 1
        entry.received += 1
        if entry.received < header.count:
            return Verdict("partial", sender, header.message_id)
        self._release(key)
        if hashlib.sha256(entry.buffer).digest() != header.digest:
            self._close(key, header.digest, now, "rejected (SHA-256 mismatch)")
            reason = "SHA-256 of the reassembled message differs"
            return Verdict("rejected", sender, header.message_id, reason=reason, cause="hash")
        self._close(key, header.digest, now, "delivered")
        return Verdict("complete", sender, header.message_id, payload=bytes(entry.buffer))

    def expire(self, now: float) -> list[Dropped]:
        """Drop messages past their deadline; return them with those evicted since the last call."""
        self._expire(now)
        dropped, self._dropped = self._dropped, []
        return dropped

    def drop_all(self, now: float, reason: str) -> list[Dropped]:
        """Drop every pending message (e.g. when its round is over); return them with any dropped before."""
        for key in list(self._pending):
            self._drop(key, now, reason)
        return self.expire(now)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            when, _, key = heapq.heappop(self._deadlines)
            entry = self._pending.get(key)
            if entry is not None and entry.deadline == when:  # else delivered or dropped already
                self._drop(key, now, "deadline passed")
        horizon = now - self.timeout_s  # closed messages are remembered for one timeout
        while self._closed and next(iter(self._closed.values()))[0] < horizon:
            self._closed.popitem(last=False)

    def _admit(self, sender: str, header: ChunkHeader, now: float) -> str:
        """Empty if a new message of this size fits (evicting the sender's oldest if needed), else why not."""
        need = _charge(header)
        if need > self.max_sender_bytes:
            return f"message of {header.total} bytes exceeds the per-sender reassembly budget ({self.max_sender_bytes})"
        mine = iter(self._by_sender.get(sender, {}))  # oldest first
        used, victims = self.sender_bytes(sender), []
        while used + need > self.max_sender_bytes:
            victims.append(next(mine))  # need <= max_sender_bytes, so this ends before `mine` runs out
            used -= self._pending[victims[-1]].charge
        freed = sum(self._pending[k].charge for k in victims)
        if self._held - freed + need > self.max_bytes:
            return f"reassembly budget of {self.max_bytes} bytes is exhausted ({self._held} held)"
        for victim in victims:
            self._drop(victim, now, "evicted by a newer message of the same sender")
        return ""

    def _hold(self, key: _Key, entry: _Pending) -> None:
        self._pending[key] = entry
        self._by_sender.setdefault(key[0], {})[key] = None
        self._sender_held[key[0]] = self._sender_held.get(key[0], 0) + entry.charge
        self._held += entry.charge
        heapq.heappush(self._deadlines, (entry.deadline, next(self._sequence), key))

    def _release(self, key: _Key) -> _Pending:
        entry = self._pending.pop(key)
        sender = key[0]
        del self._by_sender[sender][key]
        self._sender_held[sender] -= entry.charge
        if not self._by_sender[sender]:
            del self._by_sender[sender], self._sender_held[sender]
        self._held -= entry.charge
        return entry

    def _drop(self, key: _Key, now: float, reason: str) -> None:
        entry = self._release(key)
        self._dropped.append(Dropped(key[0], key[1], entry.received, entry.header.count, reason))
        self._close(key, entry.header.digest, now, f"dropped ({reason})")

    def _close(self, key: _Key, digest: bytes, now: float, outcome: str) -> None:
        self._closed[(key[0], key[1], digest)] = (now, outcome)
        while len(self._closed) > self.max_closed:
            self._closed.popitem(last=False)


def _shape(header: ChunkHeader) -> tuple[int, int, int, bytes]:
    """The fields every chunk of one message shares."""
    return header.count, header.total, header.slice_bytes, header.digest
