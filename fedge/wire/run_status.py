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
MAX_HISTORY = 200  # rounds whose outcome one status carries (the latest): ~14 kB of JSON
_MAX_COUNT = 10**7
# The note of the coordinator's last will: the broker publishes it (retained, in place of the last status) when the
# coordinator's connection ends without a DISCONNECT, i.e. without a clean exit. A clean exit publishes "finished"
# or "stopped" itself and disconnects, which discards the will.
GONE_NOTE = "coordinator gone: its connection to the broker ended without a clean exit (killed, crashed or cut off)"


@dataclass(frozen=True)
class RoundOutcome:
    """One completed round, as the fleet view remembers it."""

    round: int
    aggregated: bool
    sampled: int
    replied: int
    dropped: int
    accuracy: float = -1.0  # in [0, 1]; -1: not evaluated that round
    wire_bytes: int = 0  # the round's own
    wall_s: float = 0.0
    ended: float = 0.0  # Unix time the coordinator recorded it (0: a round of an earlier session, resumed)
    epsilon: float = -1.0  # a DP run's spent epsilon after the round; -1: not a DP run


@dataclass(frozen=True)
class ClientRow:
    """One client of the run, as the fleet view shows it: what it is, and what it did in the run's rounds."""

    client: str
    runtime: str = ""
    device: str = ""
    samples: int = 0
    sampled: int = 0  # rounds it was sampled in
    replied: int = 0  # rounds whose reply was accepted
    dropped: int = 0  # rounds it was dropped from
    last_drop: str = ""  # the latest drop's reason
    last_seen: float = 0.0  # Unix time of its latest hello or accepted reply (0: never)
    step_s: float = -1.0  # its latest reported step time (seconds); -1: none
    wire_bytes: int = 0  # MQTT wire bytes of its tasks, copies of broadcasts and replies in the run's ledger


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
    about: str = ""  # the run's algorithm, dataset, model and settings that matter, in one line
    started: float = 0.0  # Unix time this coordinator session started (elapsed time; 0: unknown)
    epsilon: float = -1.0  # a DP run's spent epsilon so far; -1: not a DP run
    # FedBuff (--aggregation fedbuff; buffer_size 0: a synchronous run): ``round`` is the server step being filled
    version: int = 0  # server steps taken: the global model's version
    buffer_fill: int = 0  # updates buffered towards the next step
    buffer_size: int = 0  # K: updates per step
    in_flight: int = 0  # tasks out (clients training), at most --concurrency
    staleness_mean: float = -1.0  # of the buffered updates, in server steps; -1: none buffered
    staleness_max: int = -1
    history: tuple[RoundOutcome, ...] = ()  # the latest MAX_HISTORY completed rounds, oldest first
    clients: tuple[ClientRow, ...] = ()  # every client that said hello (MAX_LISTED at most)

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
    "started": (float, 0, 1e11),
    "epsilon": (float, -1, 1e9),
    "version": (int, 0, _MAX_COUNT),
    "buffer_fill": (int, 0, _MAX_COUNT),
    "buffer_size": (int, 0, _MAX_COUNT),
    "in_flight": (int, 0, _MAX_COUNT),
    "staleness_mean": (float, -1, _MAX_COUNT),
    "staleness_max": (int, -1, _MAX_COUNT),
}
# Each row of the two tables travels as a JSON list in field order; its bounds, per field.
_ROW_BOUNDS: dict[str, tuple[float, float]] = {
    "round": (1, _MAX_COUNT),
    "sampled": (0, _MAX_COUNT),
    "replied": (0, _MAX_COUNT),
    "dropped": (0, _MAX_COUNT),
    "accuracy": (-1, 1),
    "wire_bytes": (0, 2**62),
    "wall_s": (0, 1e9),
    "ended": (0, 1e11),
    "epsilon": (-1, 1e9),
    "samples": (0, 2**40),
    "last_seen": (0, 1e11),
    "step_s": (-1, 1e9),
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
        about=status.about[: wire.MAX_STRING],
        history=json.dumps([_row(o) for o in status.history[-MAX_HISTORY:]]),
        clients=json.dumps([_row(c) for c in status.clients[:MAX_LISTED]]),
    )
    return encode(Message(RUN_STATUS, 0, run=status.run, params=params))


def _row(obj: RoundOutcome | ClientRow) -> list[Any]:
    return [int(v) if isinstance(v, bool) else v for v in dataclasses.astuple(obj)]


def _rows(params: Any, name: str, cls: type[Any]) -> tuple[Any, ...]:
    """The table ``name`` as ``cls`` rows: each a list of its fields' values, in order, within their bounds."""
    fields = dataclasses.fields(cls)
    rows = []
    for raw in _json_list(params, name):
        if not isinstance(raw, list) or len(raw) != len(fields):
            raise CodecError(f"field {name!r} must hold rows of {len(fields)} values")
        values: dict[str, Any] = {}
        for f, value in zip(fields, raw, strict=True):
            values[f.name] = _cell(name, f.name, f.type, value)
        rows.append(cls(**values))
    return tuple(rows)


def _cell(table: str, name: str, hint: Any, value: Any) -> Any:
    where = f"{table}.{name}"
    if hint in (bool, "bool"):
        if value not in (0, 1) or isinstance(value, float):
            raise CodecError(f"field {where!r} must be 0 or 1")
        return bool(value)
    if hint in (str, "str"):
        limit = MAX_ID if name == "client" else wire.MAX_STRING
        if not isinstance(value, str) or len(value) > limit or (name == "client" and not value):
            raise CodecError(f"field {where!r} must be a string of at most {limit} characters")
        return value
    lo, hi = _ROW_BOUNDS[name]
    number = hint in (int, "int")
    if isinstance(value, bool) or not isinstance(value, int if number else (int, float)):
        raise CodecError(f"field {where!r} must be a{'n integer' if number else ' number'}")
    if not lo <= value <= hi:  # exact for any int (math.isfinite overflows on huge ones); False for NaN and inf
        raise CodecError(f"field {where!r} must be within [{lo:g}, {hi:g}]")
    return int(value) if number else float(value)


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
        absent = "-1" if name.startswith("staleness") else "0"  # from a coordinator without FedBuff fields
        values[name] = wire.parse_value(name, p.get(name, absent), kind, wire.bounded(lo, hi))
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
        about=str(wire.parse_value("about", p.get("about", ""), str)),
        history=_rows(p, "history", RoundOutcome),
        clients=_rows(p, "clients", ClientRow),
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
