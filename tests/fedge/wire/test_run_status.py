"""The run status a coordinator publishes for monitors: exact round trip, lists cut with exact counts, and a monitor's
parser that refuses what a hostile publisher could send."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fedge.errors import CodecError
from fedge.wire.message import Message, decode, encode
from fedge.wire.run_status import (
    MAX_LISTED,
    MAX_STATUS_BYTES,
    RUN_STATUS,
    decode_run_status,
    encode_run_status,
    run_status,
)


def sample() -> bytes:
    status = run_status(
        "lab",
        "abc123",
        "training",
        round=3,
        rounds=10,
        updated=1_800_000_000.5,
        deadline=1_800_000_300.0,
        online=("c000", "c001", "c002"),
        sampled=("c000", "c002"),
        replied=("c002",),
        dropped=(("c001", "silent past the 300 s deadline"),),
        accuracy=0.75,
        accuracy_round=2,
        skipped=1,
        wire_bytes=123_456,
        tensor_bytes=100_000,
        note="",
    )
    return encode_run_status(status)


def test_a_status_survives_the_wire_exactly() -> None:
    status = decode_run_status(sample(), "lab")
    assert (status.phase, status.round, status.rounds, status.deadline) == ("training", 3, 10, 1_800_000_300.0)
    assert status.online == ("c000", "c001", "c002") and status.replied == ("c002",)
    assert status.dropped == (("c001", "silent past the 300 s deadline"),)
    assert status.counts == (3, 2, 1, 1) and (status.accuracy, status.accuracy_round) == (0.75, 2)
    assert (status.skipped, status.wire_bytes, status.tensor_bytes) == (1, 123_456, 100_000)
    assert len(sample()) < 2048  # small: a few hundred bytes of metadata


def test_long_lists_are_cut_but_counted() -> None:
    many = tuple(f"c{i:05d}" for i in range(MAX_LISTED + 7))
    status = decode_run_status(encode_run_status(run_status("lab", "s", "joining", online=many, needed=600)))
    assert len(status.online) == MAX_LISTED and status.counts[0] == MAX_LISTED + 7


def _forged(**params: str) -> bytes:
    good = decode(sample())
    return encode(Message(RUN_STATUS, 0, run="lab", params={**good.params, **params}))


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"phase": "hacked"}, "phase"),
        ({"round": "-1"}, "round"),
        ({"round": "1" * 30}, "round"),
        ({"accuracy": "nan"}, "accuracy"),
        ({"accuracy": "1.5"}, "accuracy"),
        ({"deadline": "1e999"}, "deadline"),
        ({"online": "not json"}, "online"),
        ({"online": json.dumps({"a": 1})}, "online"),
        ({"online": json.dumps(["x" * 129])}, "online"),
        ({"online": json.dumps([1, 2])}, "online"),
        ({"sampled": json.dumps([f"c{i}" for i in range(MAX_LISTED + 1)])}, "sampled"),
        ({"dropped": json.dumps([["c1"]])}, "dropped"),
        ({"dropped": json.dumps([["c1", "r" * 300]])}, "dropped"),
        ({"counts": "1,2,3"}, "counts"),
        ({"note": "n" * 300}, "note"),
        ({"about": "a" * 300}, "about"),
        ({"epsilon": "-2"}, "epsilon"),
        # The view's tables: rows of the right length, each value of its type and within its bounds.
        ({"history": json.dumps([[1, 1, 2, 2, 0]])}, "history"),
        ({"history": json.dumps([[0, 1, 2, 2, 0, 0.5, 10, 1.0, 0.0, -1.0]])}, "history.round"),
        ({"history": json.dumps([[1, 2, 2, 2, 0, 0.5, 10, 1.0, 0.0, -1.0]])}, "history.aggregated"),
        ({"history": json.dumps([[1, 1, 2, 2, 0, 1.5, 10, 1.0, 0.0, -1.0]])}, "history.accuracy"),
        ({"history": json.dumps([[1, 1, 2, 2, 0, 0.5, -10, 1.0, 0.0, -1.0]])}, "history.wire_bytes"),
        ({"history": json.dumps([[1, 1, 2.5, 2, 0, 0.5, 10, 1.0, 0.0, -1.0]])}, "history.sampled"),
        ({"history": json.dumps([[1, 1, 2, 2, 0, "0.5", 10, 1.0, 0.0, -1.0]])}, "history.accuracy"),
        ({"history": "[[1, 1, 2, 2, 0, NaN, 10, 1.0, 0.0, -1.0]]"}, "history.accuracy"),
        # An integer too large for a float is refused like any other out of bounds, not an OverflowError.
        ({"history": json.dumps([[1, 1, 10**400, 2, 0, 0.5, 10, 1.0, 0.0, -1.0]])}, "history.sampled"),
        ({"history": json.dumps([[1, 1, 2, 2, 0, 0.5, 10, 10**400, 0.0, -1.0]])}, "history.wall_s"),
        ({"clients": json.dumps([["c1", "torch", "cpu", 1, 1, 1, 0, "", 0.0, -1.0, 10**400]])}, "clients.wire_bytes"),
        ({"clients": json.dumps([["x" * 129, "torch", "cpu", 1, 1, 1, 0, "", 0.0, -1.0, 0]])}, "clients.client"),
        ({"clients": json.dumps([["", "torch", "cpu", 1, 1, 1, 0, "", 0.0, -1.0, 0]])}, "clients.client"),
        ({"clients": json.dumps([["c1", "t" * 300, "cpu", 1, 1, 1, 0, "", 0.0, -1.0, 0]])}, "clients.runtime"),
        ({"clients": json.dumps([["c1", "torch", "cpu", 1, 1, 1, 0, "", 0.0, -2.0, 0]])}, "clients.step_s"),
        ({"clients": json.dumps([["c1", "torch", "cpu", True, 1, 1, 0, "", 0.0, -1.0, 0]])}, "clients.samples"),
        ({"clients": json.dumps({"c1": []})}, "clients"),
    ],
)
def test_a_monitor_refuses_malformed_fields(params: dict[str, str], error: str) -> None:
    with pytest.raises(CodecError, match=error):
        decode_run_status(_forged(**params), "lab")


def test_a_monitor_refuses_other_messages() -> None:
    with pytest.raises(CodecError, match="run 'lab'"):
        decode_run_status(sample(), "other")
    with pytest.raises(CodecError, match="expected a 'run_status'"):
        decode_run_status(encode(Message("task", 1, run="lab")), "lab")
    with pytest.raises(CodecError, match="no tensors"):
        decode_run_status(encode(Message(RUN_STATUS, 0, run="lab", tensors={"x": torch.zeros(3)})), "lab")
    with pytest.raises(CodecError, match="over the"):
        decode_run_status(b"\0" * (MAX_STATUS_BYTES + 1), "lab")
    with pytest.raises(CodecError):
        decode_run_status(b"garbage!", "lab")


def test_the_last_will_is_a_run_status_every_monitor_parses_and_keeps_the_last_news() -> None:
    from fedge.wire.run_status import GONE_NOTE, after, gone_status, is_gone

    will = decode_run_status(encode_run_status(gone_status("lab", "abc123", rounds=10)), "lab")  # bounded parser
    assert is_gone(will) and will.phase == "stopped" and will.note == GONE_NOTE
    assert (will.round, will.rounds, will.updated) == (0, 10, 0.0)
    live = decode_run_status(sample(), "lab")
    assert not is_gone(live)
    shown = after(live, will)  # a monitor that saw round 3: the will keeps what it knew, marked gone
    assert is_gone(shown) and shown.deadline == 0.0
    assert (shown.round, shown.online, shown.dropped, shown.updated) == (3, live.online, live.dropped, live.updated)
    assert after(None, will) == will  # a monitor started after the death: the will alone
    other = run_status("lab", "a-newer-session", "joining")
    assert after(live, other) == other and after(shown, live) == live  # any other status replaces the view
    assert after(dataclasses.replace(live, session="older"), will) == will  # another session's news is not kept
    # A stopped status with another note is a clean stop, not a will.
    assert not is_gone(run_status("lab", "abc123", "stopped", note="interrupted"))
