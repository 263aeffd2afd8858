"""The run's live status: what the coordinator publishes, retained, on ``fedge/<run>/run-status`` for monitors.

One small metadata-only safetensors message (kind ``run_status``), replaced at every phase change: the round and its
phase, the round's deadline, which clients are online, sampled, replied and dropped (with reasons), the last
evaluated accuracy and the bytes so far. Whoever reads it (``fedge status``) treats it like anything a peer sends:
a size limit before parsing, every field bounded, lists capped, and one :class:`~fedge.errors.CodecError` naming
the field for anything else. Lists longer than :data:`MAX_LISTED` are cut; the counts stay exact.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

from fedge.errors import CodecError
from fedge.wire import fields as wire
from fedge.wire.message import Message, decode, encode

RUN_STATUS = "run_status"  # the message kind
Phase = Literal["joining", "training", "aggregating", "done", "finished", "stopped"]
PHASES: tuple[str, ...] = get_args(Phase)
MAX_LISTED = 500  # client ids per list in one message: a 10,000-device fleet still fits in a small message
MAX_ID = 128  # characters of a client id (fedge.wire.protocol.check_name's bound)
MAX_STATUS_BYTES = 1 << 20  # a monitor refuses a bigger message unread; 4 full lists of 500 ids fit
_MAX_COUNT = 10**7
# The note of the coordinator's last will: the broker publishes it (retained, in place of the last status) when the
# coordinator's connection ends without a DISCONNECT, i.e. without a clean exit. A clean exit publishes "finished"
# or "stopped" itself and disconnects, which discards the will.
GONE_NOTE = "coordinator gone: its connection to the broker ended without a clean exit (killed, crashed or cut off)"


@dataclass(frozen=True)
class RunStatus:
    """A snapshot of a coordinator run. Times are Unix seconds (the monitor's clock may be another machine's)."""

    run: str
    session: str  # the coordinator session: a resumed or new run under the same name has another
    phase: Phase
    round: int = 0  # the round of ``phase`` (0 before round 1)
    rounds: int = 0  # the run's planned rounds
    updated: float = 0.0  # when this snapshot was published
    deadline: float = 0.0  # while ``training``: when the round stops waiting for replies (0: none)
    needed: int = 0  # while ``joining``: clients the run waits for
    online: tuple[str, ...] = ()
    sampled: tuple[str, ...] = ()  # this round's
    replied: tuple[str, ...] = ()  # valid replies of this round so far
    dropped: tuple[tuple[str, str], ...] = ()  # (client, reason) of this round
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # online, sampled, replied, dropped: exact, lists may be cut
    accuracy: float = -1.0  # the last evaluated accuracy in [0, 1]; -1: none yet
    accuracy_round: int = 0
    skipped: int = 0  # rounds skipped so far (below the quorum)
    wire_bytes: int = 0  # cumulative MQTT wire bytes of the completed rounds (the ledger's)
    tensor_bytes: int = 0  # cumulative tensor bytes of the completed rounds (multicast accounting)
    note: str = ""  # why a run stopped, or what it waits for

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise CodecError(
                f"run status phase must be one of {', '.join(PHASES)}, got {wire.printable(self.phase, 40)!r}"
            )


def run_status(
    run: str,
    session: str,
    phase: Phase,
    *,
    online: tuple[str, ...] = (),
    sampled: tuple[str, ...] = (),
    replied: tuple[str, ...] = (),
    dropped: tuple[tuple[str, str], ...] = (),
    **fields: Any,
) -> RunStatus:
    """A :class:`RunStatus` whose lists are cut to :data:`MAX_LISTED` and whose counts are the lists' true sizes."""
    counts = (len(online), len(sampled), len(replied), len(dropped))
    cut = slice(0, MAX_LISTED)
    return RunStatus(
        run,
        session,
        phase,
        online=online[cut],
        sampled=sampled[cut],
        replied=replied[cut],
        dropped=tuple((c, r[: wire.MAX_STRING]) for c, r in dropped[cut]),
        counts=counts,
        **fields,
    )


def gone_status(run: str, session: str, rounds: int) -> RunStatus:
    """The coordinator's last will: a ``stopped`` status with :data:`GONE_NOTE`. It is fixed when the coordinator
    connects, so it cannot know the round; ``updated`` 0 says it carries no time of its own."""
    return run_status(run, session, "stopped", rounds=rounds, note=GONE_NOTE)


def is_gone(status: RunStatus) -> bool:
    """Whether ``status`` is a coordinator's last will (see :func:`gone_status`)."""
    return status.phase == "stopped" and status.note == GONE_NOTE


def after(previous: RunStatus | None, status: RunStatus) -> RunStatus:
    """What a monitor shows once ``status`` arrives after ``previous``: the status itself, except that the last will
    of the session ``previous`` belongs to keeps what ``previous`` knew (round, clients, accuracy, bytes, the time of
    the coordinator's last news) and only marks the coordinator gone."""
    if previous is None or not is_gone(status) or previous.session != status.session or is_gone(previous):
        return status
    return dataclasses.replace(previous, phase="stopped", deadline=0.0, note=status.note)


_NUMBERS: dict[str, tuple[type, float, float]] = {
    "round": (int, 0, _MAX_COUNT),
    "rounds": (int, 0, _MAX_COUNT),
    "updated": (float, 0, 1e11),
    "deadline": (float, 0, 1e11),
    "needed": (int, 0, _MAX_COUNT),
    "accuracy": (float, -1, 1),
    "accuracy_round": (int, 0, _MAX_COUNT),
    "skipped": (int, 0, _MAX_COUNT),
    "wire_bytes": (int, 0, 2**62),
    "tensor_bytes": (int, 0, 2**62),
}


def encode_run_status(status: RunStatus) -> bytes:
    """The status as a metadata-only message; lists as JSON arrays of strings."""
    params = {name: wire.format_value(getattr(status, name)) for name in _NUMBERS}
    params.update(
        session=status.session,
        phase=status.phase,
        note=status.note[: wire.MAX_STRING],
        online=json.dumps(list(status.online)),
        sampled=json.dumps(list(status.sampled)),
        replied=json.dumps(list(status.replied)),
        dropped=json.dumps([list(d) for d in status.dropped]),
        counts=",".join(str(c) for c in status.counts),
    )
    return encode(Message(RUN_STATUS, 0, run=status.run, params=params))


def decode_run_status(payload: bytes, run: str | None = None) -> RunStatus:
    """Parse a run status a peer published; CodecError for anything that is not a bounded one (of ``run``)."""
    if len(payload) > MAX_STATUS_BYTES:
        raise CodecError(f"a run status of {len(payload)} bytes is over the {MAX_STATUS_BYTES}-byte limit")
    msg = decode(payload)
    if msg.kind != RUN_STATUS:
        raise CodecError(f"expected a {RUN_STATUS!r} message, got {wire.printable(msg.kind, 40)!r}")
    if msg.tensors:
        raise CodecError("a run status carries no tensors")
    if run is not None and msg.run != run:
        raise CodecError(f"a run status of run {wire.printable(msg.run, 40)!r}, expected {run!r}")
    p = msg.params
    values: dict[str, Any] = {}
    for name, (kind, lo, hi) in _NUMBERS.items():
        values[name] = wire.parse_value(name, p.get(name, "0"), kind, wire.bounded(lo, hi))
    counts = wire.parse_value("counts", p.get("counts", "0,0,0,0"), tuple[int, ...], wire.bounded(0, _MAX_COUNT))
    if len(counts) != 4:
        raise CodecError(f"field 'counts' must hold 4 numbers, got {len(counts)}")
    pairs = _json_list(p, "dropped")
    if not all(isinstance(d, list) and len(d) == 2 for d in pairs):
        raise CodecError("field 'dropped' must be a list of [client, reason] pairs")
    return RunStatus(
        run=msg.run,
        session=str(wire.parse_value("session", p.get("session", ""), str)),
        phase=str(wire.parse_value("phase", p.get("phase", ""), str)),  # type: ignore[arg-type]  # __post_init__
        online=_ids(_json_list(p, "online"), "online"),
        sampled=_ids(_json_list(p, "sampled"), "sampled"),
        replied=_ids(_json_list(p, "replied"), "replied"),
        dropped=tuple(
            zip(_ids([d[0] for d in pairs], "dropped"), _texts([d[1] for d in pairs], "dropped"), strict=True)
        ),
        counts=(counts[0], counts[1], counts[2], counts[3]),
        note=str(wire.parse_value("note", p.get("note", ""), str)),
        **values,
    )


def _json_list(params: Any, name: str) -> list[Any]:
    raw = params.get(name, "[]")
    try:
        value = json.loads(raw)
    except ValueError:
        raise CodecError(f"field {name!r} is not a JSON list") from None
    if not isinstance(value, list):
        raise CodecError(f"field {name!r} is not a JSON list")
    if len(value) > MAX_LISTED:
        raise CodecError(f"field {name!r} lists {len(value)} entries, at most {MAX_LISTED} allowed")
    return value


def _ids(items: list[Any], name: str) -> tuple[str, ...]:
    if not all(isinstance(c, str) and 0 < len(c) <= MAX_ID for c in items):
        raise CodecError(f"field {name!r} must list client ids of 1-{MAX_ID} characters")
    return tuple(items)


def _texts(items: list[Any], name: str) -> tuple[str, ...]:
    if not all(isinstance(t, str) and len(t) <= wire.MAX_STRING for t in items):
        raise CodecError(f"field {name!r} must hold reasons of at most {wire.MAX_STRING} characters")
    return tuple(items)
