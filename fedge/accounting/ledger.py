"""The byte ledger: every message a run exchanges, counted at three levels, per round, direction and client.

Levels (DESIGN.md): tensor bytes (numel x itemsize, what the papers count), payload bytes (the encoded message) and
wire bytes (MQTT packets including headers, topic, acknowledgements and broker fan-out; only known over MQTT).

Accounting models for a downlink message delivered to ``recipients`` clients:
- multicast (DS-FL Tables I-II): it is counted once;
- unicast (what a broker really sends): it is counted once per recipient.
Uplink messages count the same under both.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

from fedge.wire.message import Message
from fedge.wire.protocol import RAW_BYTES

Direction = Literal["up", "down"]
Accounting = Literal["multicast", "unicast"]
ACCOUNTING_MODELS: tuple[Accounting, ...] = ("multicast", "unicast")
BROADCAST_CLIENT = "*"


@dataclass(frozen=True)
class LedgerEntry:
    """One message: a client's upload, a per-client task, or a broadcast to ``recipients`` clients."""

    round: int
    direction: Direction
    client: str  # sender (up), recipient (down), or "*" for a broadcast
    kind: str
    recipients: int
    tensor_bytes: int
    payload_bytes: int
    wire_bytes: int = 0  # MQTT packets for all copies; 0 when the transport has no wire
    uncompressed_bytes: int = -1  # tensor bytes had the tensors travelled as float32; -1: as tensor_bytes

    def __post_init__(self) -> None:
        if self.uncompressed_bytes < 0:
            object.__setattr__(self, "uncompressed_bytes", self.tensor_bytes)

    @classmethod
    def of(
        cls,
        message: Message,
        direction: Direction,
        client: str,
        payload_bytes: int,
        recipients: int,
        wire_bytes: int = 0,
    ) -> LedgerEntry:
        """The entry for ``message`` as sent: its tensor bytes, its encoded size and what the wire carried."""
        return cls(
            round=message.round,
            direction=direction,
            client=client,
            kind=message.kind,
            recipients=recipients,
            tensor_bytes=message.tensor_bytes,
            payload_bytes=payload_bytes,
            wire_bytes=wire_bytes,
            uncompressed_bytes=uncompressed_bytes(message),
        )

    def counted(self, level: str, accounting: Accounting) -> int:
        """Bytes at ``level`` ("tensor", "payload" or "wire") under an accounting model."""
        value: int = getattr(self, f"{level}_bytes")
        if level == "wire":
            return value  # measured on the wire, already per real copy
        copies = self.recipients if (self.direction == "down" and accounting == "unicast") else 1
        return value * copies


def uncompressed_bytes(message: Message) -> int:
    """The float32 size a coded message declares (:data:`fedge.wire.protocol.RAW_BYTES`), else its tensor bytes.

    A peer's declaration only fills this informative column, bounded; every other count is measured."""
    raw = message.params.get(RAW_BYTES, "")
    if raw.isdigit() and len(raw) <= 15:
        return int(raw)
    return message.tensor_bytes


@dataclass(frozen=True)
class RoundBytes:
    """Totals of one round at every level and accounting model."""

    round: int
    up_tensor: int
    down_tensor_multicast: int
    down_tensor_unicast: int
    up_payload: int
    down_payload_multicast: int
    down_payload_unicast: int
    up_wire: int
    down_wire: int

    def total(self, level: str = "tensor", accounting: Accounting = "multicast") -> int:
        if level == "wire":
            return self.up_wire + self.down_wire
        down = getattr(self, f"down_{level}_{accounting}")
        return int(getattr(self, f"up_{level}") + down)


def summarize_round(rnd: int, entries: Iterable[LedgerEntry]) -> RoundBytes:
    """Aggregate the entries of one round."""
    sums = dict.fromkeys(f.name for f in fields(RoundBytes) if f.name != "round")
    totals = {k: 0 for k in sums}
    for e in entries:
        if e.round != rnd:
            continue
        if e.direction == "up":
            totals["up_tensor"] += e.tensor_bytes
            totals["up_payload"] += e.payload_bytes
            totals["up_wire"] += e.wire_bytes
        else:
            for level in ("tensor", "payload"):
                for acc in ACCOUNTING_MODELS:
                    totals[f"down_{level}_{acc}"] += e.counted(level, acc)
            totals["down_wire"] += e.wire_bytes
    return RoundBytes(round=rnd, **totals)


class ByteLedger:
    """Append-only record of a run's messages; writes itself as CSV."""

    def __init__(self) -> None:
        self._entries: list[LedgerEntry] = []

    def record(self, entry: LedgerEntry) -> None:
        self._entries.append(entry)

    def extend(self, entries: Iterable[LedgerEntry]) -> None:
        self._entries.extend(entries)

    @property
    def entries(self) -> Sequence[LedgerEntry]:
        return tuple(self._entries)

    def round_bytes(self, rnd: int) -> RoundBytes:
        return summarize_round(rnd, self._entries)

    def write_csv(self, path: str | Path) -> None:
        names = [f.name for f in fields(LedgerEntry)]
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=names)
            writer.writeheader()
            for e in self._entries:
                writer.writerow(asdict(e))


def read_ledger_csv(path: str | Path) -> list[LedgerEntry]:
    """Load a ledger written by :meth:`ByteLedger.write_csv`."""
    out = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            out.append(
                LedgerEntry(
                    round=int(row["round"]),
                    direction="up" if row["direction"] == "up" else "down",
                    client=row["client"],
                    kind=row["kind"],
                    recipients=int(row["recipients"]),
                    tensor_bytes=int(row["tensor_bytes"]),
                    payload_bytes=int(row["payload_bytes"]),
                    wire_bytes=int(row.get("wire_bytes") or 0),
                    uncompressed_bytes=int(row.get("uncompressed_bytes") or row["tensor_bytes"]),
                )
            )
    return out
