"""Chunked messages: split and reassembly, deadlines, byte budgets, hostile headers, payload size for a packet limit."""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import struct

import pytest
import torch

from fedge.errors import CodecError, ConfigError
from fedge.wire.chunking import (
    ENTRY_OVERHEAD,
    HEADER_BYTES,
    MAGIC,
    MAX_CHUNKS,
    Reassembler,
    is_chunk,
    largest_payload,
    parse_header,
    split,
)
from fedge.wire.message import UPDATE, Message, decode, encode
from fedge.wire.protocol import publish_packet_bytes

LIMIT = 100  # chunk payloads of at most 100 bytes: 68 of header, 32 of slice
SLICE = LIMIT - HEADER_BYTES


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _header(msg_id: int = 1, index: int = 0, count: int = 1, total: int = 10, slice_bytes: int = 10) -> bytes:
    return struct.pack(">8sQIIQI32s", MAGIC, msg_id, index, count, total, slice_bytes, bytes(32))


def test_header_is_68_bytes() -> None:
    assert HEADER_BYTES == 8 + 8 + 4 + 4 + 8 + 4 + 32


@pytest.mark.parametrize("size", [1, LIMIT - 1, LIMIT, LIMIT + 1, 4 * SLICE - 1, 4 * SLICE, 4 * SLICE + 1, 1000])
def test_split_and_reassemble_is_the_identity_around_the_boundary(size: int) -> None:
    payload = _payload(size)
    chunks = split(payload, LIMIT, message_id=7)
    assert [len(c) for c in chunks] == chunk_sizes(size, LIMIT)
    assert all(len(c) <= LIMIT for c in chunks)
    if size <= LIMIT:
        assert chunks == [payload] and not is_chunk(payload)
        return
    assert len(chunks) == -(-size // SLICE) and all(is_chunk(c) for c in chunks)
    assert sum(chunk_sizes(size, LIMIT)) - size == HEADER_BYTES * len(chunks)  # the payload-level overhead
    r = Reassembler()
    verdicts = [r.add("c001", c, now=0.0) for c in chunks]
    assert [v.status for v in verdicts] == ["partial"] * (len(chunks) - 1) + ["complete"]
    assert verdicts[-1].payload == payload and verdicts[-1].message_id == 7
    assert (r.pending, r.held_bytes) == (0, 0)


def chunk_sizes(total: int, max_chunk_bytes: int) -> list[int]:
    """What split's chunks must measure, written out from the format: a header and a full slice each, the last
    one the rest."""
    if total <= max_chunk_bytes:
        return [total]
    slice_bytes = max_chunk_bytes - HEADER_BYTES
    count = -(-total // slice_bytes)
    return [HEADER_BYTES + slice_bytes] * (count - 1) + [HEADER_BYTES + total - (count - 1) * slice_bytes]


def test_hand_computed_chunk_sizes() -> None:
    assert [len(c) for c in split(_payload(100), 100, message_id=1)] == [100]
    assert [len(c) for c in split(_payload(101), 100, message_id=1)] == [100, 100, 100, 68 + 5]  # 32 + 32 + 32 + 5
    with pytest.raises(ConfigError, match="no room after the 68-byte header"):
        split(_payload(101), HEADER_BYTES, message_id=1)


def test_out_of_order_arrival_reassembles() -> None:
    payload = _payload(777, seed=1)
    chunks = split(payload, LIMIT, message_id=3)
    random.Random(2).shuffle(chunks)
    r = Reassembler()
    verdicts = [r.add("c001", c, now=float(i)) for i, c in enumerate(chunks)]
    assert verdicts[-1].status == "complete" and verdicts[-1].payload == payload
    assert {v.status for v in verdicts[:-1]} == {"partial"}


def test_interleaved_messages_of_two_senders_with_the_same_id() -> None:
    a, b = _payload(300, 1), _payload(250, 2)
    r = Reassembler()
    done = {}
    for ca, cb in itertools.zip_longest(split(a, LIMIT, 1), split(b, LIMIT, 1)):
        for sender, chunk in (("a", ca), ("b", cb)):
            if chunk is not None and (v := r.add(sender, chunk, now=0.0)).status == "complete":
                done[sender] = v.payload
    assert done == {"a": a, "b": b}


def test_a_real_message_survives_chunking() -> None:
    msg = Message(UPDATE, 3, run="lab", client="c001", params={"n": "5"}, tensors={"w": torch.randn(100, 10)})
    blob = encode(msg)
    r = Reassembler()
    verdicts = [r.add("c001", c, now=0.0) for c in split(blob, 1024, message_id=99)]
    back = decode(verdicts[-1].payload or b"")
    assert torch.equal(back.tensors["w"], msg.tensors["w"]) and back.params == {"n": "5"}


def test_lost_chunk_leaves_the_message_incomplete_until_its_deadline() -> None:
    chunks = split(_payload(200), LIMIT, message_id=5)  # 7 chunks
    r = Reassembler(timeout_s=30.0)
    for c in chunks[:3] + chunks[4:]:
        assert r.add("c002", c, now=10.0).status == "partial"
    assert r.pending == 1 and r.held_bytes == 200 + 7 + ENTRY_OVERHEAD
    assert r.expire(now=39.9) == []
    (dropped,) = r.expire(now=40.0)
    assert (dropped.sender, dropped.message_id, dropped.received, dropped.count) == ("c002", 5, 6, 7)
    assert "deadline" in dropped.reason
    assert (r.pending, r.held_bytes) == (0, 0)


def test_late_chunks_of_a_dropped_message_do_not_start_it_again() -> None:
    chunks = split(_payload(200), LIMIT, message_id=5)
    r = Reassembler(timeout_s=30.0)
    r.add("c002", chunks[0], now=0.0)
    assert len(r.expire(now=31.0)) == 1
    late = r.add("c002", chunks[1], now=32.0)
    assert late.status == "rejected" and "already dropped (deadline passed)" in late.reason and r.pending == 0


def test_a_reused_id_with_other_content_is_a_new_message() -> None:
    first, second = _payload(150, 1), _payload(150, 2)  # e.g. a restarted sender counting ids from 0 again
    r = Reassembler()
    assert [r.add("c001", c, now=0.0).status for c in split(first, LIMIT, 0)][-1] == "complete"
    assert [r.add("c001", c, now=1.0).payload for c in split(second, LIMIT, 0)][-1] == second


def test_deadlines_expire_in_order() -> None:
    r = Reassembler(timeout_s=100.0)
    for i, deadline in enumerate([30.0, 10.0, 20.0]):
        r.add(f"c{i}", split(_payload(200, i), LIMIT, message_id=i)[0], now=0.0, deadline=deadline)
    assert [d.sender for d in r.expire(now=15.0)] == ["c1"]
    assert [d.sender for d in r.expire(now=25.0)] == ["c2"] and r.pending == 1


def test_a_given_deadline_overrides_the_timeout() -> None:
    chunks = split(_payload(200), LIMIT, message_id=5)
    r = Reassembler(timeout_s=600.0)
    r.add("c002", chunks[0], now=0.0, deadline=5.0)
    assert r.expire(now=4.0) == [] and len(r.expire(now=5.0)) == 1


def test_expired_messages_are_reported_even_when_add_purged_them() -> None:
    chunks = split(_payload(200), LIMIT, message_id=5)
    r = Reassembler(timeout_s=1.0)
    r.add("c002", chunks[0], now=0.0)
    assert r.add("c003", chunks[0], now=2.0).status == "partial"  # purges c002's message first
    assert [d.sender for d in r.expire(now=2.0)] == ["c002"]


def test_hash_mismatch_is_rejected_and_frees_the_memory() -> None:
    chunks = split(_payload(200), LIMIT, message_id=5)
    bad = bytearray(chunks[2])
    bad[-1] ^= 0xFF
    chunks[2] = bytes(bad)
    r = Reassembler()
    verdicts = [r.add("c001", c, now=0.0) for c in chunks]
    assert verdicts[-1].status == "rejected" and "SHA-256" in verdicts[-1].reason
    assert (r.pending, r.held_bytes) == (0, 0)


def test_duplicates_are_reported_not_rejected() -> None:
    payload = _payload(100 + 1)
    chunks = split(payload, LIMIT, message_id=5)
    r = Reassembler()
    assert r.add("c001", chunks[0], now=0.0).status == "partial"
    assert r.add("c001", chunks[0], now=0.0).status == "duplicate"  # QoS 1 redelivery
    for c in chunks[1:]:
        last = r.add("c001", c, now=0.0)
    assert last.status == "complete" and last.payload == payload
    late = r.add("c001", chunks[1], now=1.0)
    assert late.status == "duplicate" and "already delivered" in late.reason and r.pending == 0


def test_a_chunk_that_disagrees_with_its_message_is_rejected() -> None:
    first = split(_payload(200, 1), LIMIT, message_id=5)
    other = split(_payload(300, 2), LIMIT, message_id=5)  # same id, another total and hash
    r = Reassembler()
    r.add("c001", first[0], now=0.0)
    v = r.add("c001", other[1], now=0.0)
    assert v.status == "rejected" and "disagrees" in v.reason
    assert r.pending == 1  # the first message is still being collected


def test_per_sender_budget_evicts_the_senders_oldest_message() -> None:
    charge = 200 + 7 + ENTRY_OVERHEAD  # a 200-byte message in 7 chunks
    r = Reassembler(max_sender_bytes=charge + 100, max_bytes=10 * charge)
    old = split(_payload(200, 1), LIMIT, message_id=1)
    new = split(_payload(200, 2), LIMIT, message_id=2)
    r.add("c001", old[0], now=0.0)
    r.add("c009", old[0], now=0.0)  # another sender is not touched
    assert r.add("c001", new[0], now=0.0).status == "partial"
    (dropped,) = r.expire(now=0.0)
    assert (dropped.sender, dropped.message_id) == ("c001", 1) and "evicted" in dropped.reason
    assert r.sender_bytes("c001") == charge and r.sender_bytes("c009") == charge
    too_big = split(_payload(1000), LIMIT, message_id=3)[0]
    v = r.add("c001", too_big, now=0.0)
    assert v.status == "rejected" and "per-sender" in v.reason


def test_total_budget_refuses_new_messages_without_evicting_others() -> None:
    charge = 200 + 7 + ENTRY_OVERHEAD
    r = Reassembler(max_sender_bytes=charge, max_bytes=2 * charge)
    first = split(_payload(200), LIMIT, message_id=1)[0]
    assert r.add("a", first, now=0.0).status == "partial"
    assert r.add("b", first, now=0.0).status == "partial"
    v = r.add("c", first, now=0.0)
    assert v.status == "rejected" and "exhausted" in v.reason
    assert r.held_bytes == 2 * charge <= r.max_bytes and r.expire(now=0.0) == []


@pytest.mark.parametrize(
    ("chunk", "reason"),
    [
        (b"", "shorter than"),
        (_header()[:-1], "shorter than"),
        (b"X" * HEADER_BYTES + bytes(10), "bad magic"),
        (_header(count=0) + bytes(10), "count 0"),
        (_header(count=2**32 - 1, total=2**32) + bytes(10), "count"),
        (_header(count=MAX_CHUNKS + 1, total=2**30, slice_bytes=1) + bytes(1), "count"),
        (_header(index=2**32 - 1) + bytes(10), "index"),  # -1 as an unsigned 32-bit field
        (_header(index=1, count=1) + bytes(10), "index 1"),
        (_header(total=0, slice_bytes=0) + b"", "length 0"),
        (_header(total=2**63) + bytes(10), "message length"),
        (_header(total=10, slice_bytes=0) + bytes(10), "slice length 0"),
        (_header(count=3, total=10, slice_bytes=5) + bytes(5), "do not fit"),  # 10 bytes in slices of 5 is 2 chunks
        (_header(count=2, total=10, slice_bytes=20) + bytes(10), "do not fit"),
        (_header() + bytes(9), "carries 9 bytes, expected 10"),
        (_header(index=1, count=2, total=15, slice_bytes=10) + bytes(10), "carries 10 bytes, expected 5"),
    ],
)
def test_hostile_headers_are_rejected_with_a_reason(chunk: bytes, reason: str) -> None:
    r = Reassembler(max_bytes=1 << 20, max_sender_bytes=1 << 20)
    v = r.add("evil", chunk, now=0.0)
    assert v.status == "rejected" and reason in v.reason
    assert (r.pending, r.held_bytes) == (0, 0)
    with pytest.raises(CodecError, match=re.escape(reason)):
        parse_header(chunk)


def test_a_large_declared_total_is_refused_before_any_allocation() -> None:
    r = Reassembler(max_bytes=1 << 20, max_sender_bytes=1 << 20)
    header = struct.pack(">8sQIIQI32s", MAGIC, 1, 1, 1024, 1 << 30, 1 << 20, bytes(32))  # 1 GiB in 1,024 chunks
    v = r.add("evil", header + bytes(1 << 20), now=0.0)  # a well-formed chunk of it
    assert v.status == "rejected" and "per-sender" in v.reason and r.held_bytes == 0


def test_split_refuses_what_it_cannot_send() -> None:
    with pytest.raises(CodecError, match="mistaken for a chunk"):
        split(MAGIC + b"data", LIMIT, message_id=1)
    with pytest.raises(ConfigError, match="message id must fit in 64 bits"):
        split(_payload(10), LIMIT, message_id=-1)
    with pytest.raises(ConfigError, match="leave no room after the 68-byte header"):
        split(_payload(200), HEADER_BYTES, message_id=1)
    with pytest.raises(ConfigError, match="max_sender_bytes <= max_bytes"):
        Reassembler(max_bytes=10, max_sender_bytes=20)


def test_chunks_carry_the_hash_of_the_whole_message() -> None:
    payload = _payload(150)
    headers = [parse_header(c) for c in split(payload, LIMIT, message_id=4)]
    assert {h.digest for h in headers} == {hashlib.sha256(payload).digest()}
    assert [h.index for h in headers] == list(range(5)) and {h.count for h in headers} == {5}


# --- payload size for a packet limit ------------------------------------------------------------------------------

TOPIC = "fedge/lab/update/c001"  # 21 bytes


def test_largest_payload_hand_computed() -> None:
    # EMQX's default 1 MB: remaining length 1,048,572 (3 varint bytes) - topic (2 + 21) - packet id (2)
    assert largest_payload(TOPIC, 1 << 20) == 1_048_547
    assert publish_packet_bytes(TOPIC, 1_048_547) == 1 << 20
    assert largest_payload(TOPIC, 1 << 20, properties_bytes=1) == 1_048_546  # MQTT 5: empty property list
    # 130 bytes: 1 + 1 + 128 does not fit (128 needs 2 varint bytes), so remaining 127 in 129 bytes
    assert largest_payload(TOPIC, 130) == 127 - 25
    assert largest_payload(TOPIC, 130, qos=0) == 127 - 23


@pytest.mark.parametrize("qos", [0, 1])
def test_largest_payload_is_the_largest_that_fits(qos: int) -> None:
    for limit in [*range(30, 300), *range(16_370, 16_400), *range(2_097_140, 2_097_160)]:
        p = largest_payload(TOPIC, limit, qos=qos)
        assert publish_packet_bytes(TOPIC, p, qos) <= limit < publish_packet_bytes(TOPIC, p + 1, qos), limit
    biggest = largest_payload(TOPIC, 1 << 40, qos=qos)  # MQTT's own limit: a remaining length of 2^28 - 1
    assert publish_packet_bytes(TOPIC, biggest, qos) == 1 + 4 + 268_435_455


def test_largest_payload_refuses_a_limit_below_the_topic() -> None:
    with pytest.raises(ConfigError, match="limit of 27 bytes leaves no room for a payload"):
        largest_payload(TOPIC, 27)
