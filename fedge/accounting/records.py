"""What a round produced, typed: the record the round engine writes and reports, plots and summaries read.

One :class:`RoundRecord` per round, written as one line of ``metrics.jsonl`` (:meth:`RoundRecord.to_json`) in the flat
format fedge has always written, and read back with :meth:`RoundRecord.from_json` (which also reads run directories
written by earlier versions).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fedge.accounting.ledger import ACCOUNTING_MODELS, LedgerEntry, RoundBytes
from fedge.types import ClientId

LEVELS = ("tensor", "payload", "wire")


@dataclass(frozen=True)
class Rejection:
    """A message the coordinator refused: who sent it, the category (``unparseable``, ``late``, ...) and why."""

    client: str
    category: str
    detail: str = ""

    @property
    def reason(self) -> str:
        return f"{self.category}: {self.detail}" if self.detail else self.category


@dataclass(frozen=True)
class Drop:
    """A sampled client without a valid reply in its round, why, and how many seconds into the round."""

    client: ClientId
    reason: str
    after_s: float = math.nan


@dataclass(frozen=True)
class AggregationRecord:
    """What a strategy's aggregation of one round adds to the round's record when it runs a protocol of its own with
    the clients (secure aggregation, :mod:`fedge.algorithms.secure_aggregation`): the protocol's messages, the clients
    whose replies it left out of the aggregate (and why), and why it kept the global state ("" when it aggregated)."""

    entries: tuple[LedgerEntry, ...] = ()
    drops: tuple[Drop, ...] = ()
    abandoned: str = ""


@dataclass(frozen=True)
class ClientTiming:
    """One reply's timing: from sending the task to receiving the update, and the client's own compute time."""

    client: ClientId
    round_trip_s: float
    compute_s: float = math.nan  # wall seconds the client says its step took (NaN: not reported)
    cpu_s: float = math.nan


@dataclass(frozen=True)
class ByteCounts:
    """Bytes of one round at each level and accounting model, and cumulated over the run so far.

    ``tensor`` and ``payload`` are keyed by accounting model (``multicast``, ``unicast``); ``wire`` is one number:
    what the broker really moved.
    """

    tensor: Mapping[str, int]
    payload: Mapping[str, int]
    wire: int
    cum_tensor: Mapping[str, int]
    cum_payload: Mapping[str, int]
    cum_wire: int
    tensor_up: int
    tensor_down: Mapping[str, int]

    @classmethod
    def of(cls, rb: RoundBytes, previous: ByteCounts | None, initial: Mapping[str, int]) -> ByteCounts:
        """This round's bytes from the ledger; cumulative from ``previous`` (or the one-time ``initial`` cost)."""
        tensor: dict[str, int] = {a: rb.total("tensor", a) for a in ACCOUNTING_MODELS}
        payload: dict[str, int] = {a: rb.total("payload", a) for a in ACCOUNTING_MODELS}
        wire = rb.total("wire")
        base_tensor = previous.cum_tensor if previous else {a: initial.get(a, 0) for a in ACCOUNTING_MODELS}
        base_payload = previous.cum_payload if previous else dict.fromkeys(ACCOUNTING_MODELS, 0)
        return cls(
            tensor=tensor,
            payload=payload,
            wire=wire,
            cum_tensor={a: base_tensor[a] + tensor[a] for a in ACCOUNTING_MODELS},
            cum_payload={a: base_payload[a] + payload[a] for a in ACCOUNTING_MODELS},
            cum_wire=(previous.cum_wire if previous else 0) + wire,
            tensor_up=rb.up_tensor,
            tensor_down={"multicast": rb.down_tensor_multicast, "unicast": rb.down_tensor_unicast},
        )

    def flat(self) -> dict[str, int]:
        """The metrics.jsonl keys: ``tensor_bytes_multicast``, ``cum_wire_bytes``, ``tensor_bytes_up``, ..."""
        out: dict[str, int] = {}
        for a in ACCOUNTING_MODELS:
            out[f"tensor_bytes_{a}"] = self.tensor[a]
            out[f"cum_tensor_bytes_{a}"] = self.cum_tensor[a]
            out[f"payload_bytes_{a}"] = self.payload[a]
            out[f"cum_payload_bytes_{a}"] = self.cum_payload[a]
        out["wire_bytes"], out["cum_wire_bytes"] = self.wire, self.cum_wire
        out["tensor_bytes_up"] = self.tensor_up
        for a in ACCOUNTING_MODELS:
            out[f"tensor_bytes_down_{a}"] = self.tensor_down[a]
        return out

    @classmethod
    def from_flat(cls, raw: Mapping[str, Any]) -> ByteCounts:
        def num(key: str) -> int:
            return int(raw.get(key) or 0)

        return cls(
            tensor={a: num(f"tensor_bytes_{a}") for a in ACCOUNTING_MODELS},
            payload={a: num(f"payload_bytes_{a}") for a in ACCOUNTING_MODELS},
            wire=num("wire_bytes"),
            cum_tensor={a: num(f"cum_tensor_bytes_{a}") for a in ACCOUNTING_MODELS},
            cum_payload={a: num(f"cum_payload_bytes_{a}") for a in ACCOUNTING_MODELS},
            cum_wire=num("cum_wire_bytes"),
            tensor_up=num("tensor_bytes_up"),
            tensor_down={a: num(f"tensor_bytes_down_{a}") for a in ACCOUNTING_MODELS},
        )


@dataclass(frozen=True)
class RoundRecord:
    """Everything one round produced."""

    round: int
    sampled: tuple[ClientId, ...]
    replied: tuple[ClientId, ...]
    aggregated: bool  # False: below the quorum (or see ``abandoned``), the global state was kept
    quorum: int
    bytes: ByteCounts
    drops: tuple[Drop, ...] = ()
    rejections: tuple[Rejection, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)  # the algorithm's own (mean_local_loss, entropy, ...)
    accuracy: float | None = None  # None: not evaluated this round
    per_class_accuracy: tuple[float | None, ...] | None = None
    forgetting: float | None = None  # FedNTD eq. 5
    timings: tuple[ClientTiming, ...] = ()
    wall_s: float = 0.0
    exchange_s: float = 0.0
    abandoned: str = ""  # why a round with a quorum of replies was not aggregated (secure aggregation gave up)

    @property
    def dropped(self) -> tuple[ClientId, ...]:
        return tuple(d.client for d in self.drops)

    def value(self, name: str) -> float | None:
        """A number of this round by its metrics.jsonl name (for plots and tables that pick series by name)."""
        raw = self.to_json().get(name)
        return float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None

    def timing_summary(self) -> dict[str, float]:
        """Means and maxima of client compute and of the rest of each reply's wait (communication)."""
        rows = [t for t in self.timings if not math.isnan(t.compute_s)]
        if not rows:
            return {}
        compute = [t.compute_s for t in rows]
        comm = [t.round_trip_s - t.compute_s for t in rows]
        out = {
            "client_compute_s": sum(compute) / len(rows),
            "client_compute_s_max": max(compute),
            "client_comm_s": sum(comm) / len(rows),
            "client_comm_s_max": max(comm),
        }
        cpu = [t.cpu_s for t in rows if not math.isnan(t.cpu_s)]  # a client may report wall time only
        if cpu:
            out["client_cpu_s"] = sum(cpu) / len(cpu)
        return out

    def to_json(self) -> dict[str, Any]:
        """The flat metrics.jsonl line."""
        out: dict[str, Any] = {
            "round": self.round,
            "sampled": list(self.sampled),
            "replied": list(self.replied),
            "dropped": list(self.dropped),
            "rejected": [{"client": r.client, "category": r.category, "reason": r.reason} for r in self.rejections],
            "aggregated": self.aggregated,
            "quorum": self.quorum,
            **dict(self.metrics),
        }
        if self.abandoned:
            out["abandoned"] = self.abandoned
        if self.drops:
            out["drop_reasons"] = {d.client: d.reason for d in self.drops}
            out["drop_after_s"] = {d.client: d.after_s for d in self.drops if not math.isnan(d.after_s)}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
            out["per_class_accuracy"] = list(self.per_class_accuracy or ())
            out["forgetting"] = self.forgetting
        out.update(self.bytes.flat())
        out.update(self.timing_summary())
        out["wall_s"] = self.wall_s
        out["exchange_s"] = self.exchange_s
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RoundRecord:
        """Read a metrics.jsonl line (this version's or an earlier one's)."""
        known = {f.name for f in fields(cls)} | set(ByteCounts.from_flat({}).flat()) | _TIMING_KEYS | _OTHER_KEYS
        reasons = raw.get("drop_reasons") or {}
        after = raw.get("drop_after_s") or {}
        drops = tuple(Drop(c, str(reasons.get(c, "")), float(after.get(c, math.nan))) for c in raw.get("dropped", []))
        rejections = tuple(_rejection(r) for r in raw.get("rejected", []))
        per_class = raw.get("per_class_accuracy")
        return cls(
            round=int(raw["round"]),
            sampled=tuple(raw.get("sampled", ())),
            replied=tuple(raw.get("replied", ())),
            aggregated=bool(raw.get("aggregated", True)),
            quorum=int(raw.get("quorum", 0)),
            bytes=ByteCounts.from_flat(raw),
            drops=drops,
            rejections=rejections,
            metrics={k: float(v) for k, v in raw.items() if k not in known and _is_number(v)},
            accuracy=raw.get("accuracy"),
            per_class_accuracy=tuple(per_class) if per_class is not None else None,
            forgetting=raw.get("forgetting"),
            wall_s=float(raw.get("wall_s", 0.0)),
            exchange_s=float(raw.get("exchange_s", 0.0)),
            abandoned=str(raw.get("abandoned", "")),
        )


_TIMING_KEYS = {
    "client_compute_s",
    "client_compute_s_max",
    "client_cpu_s",
    "client_comm_s",
    "client_comm_s_max",
    "last_reply_s",
}
_OTHER_KEYS = {"dropped", "rejected", "drop_reasons", "drop_after_s"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rejection(raw: Mapping[str, Any]) -> Rejection:
    category = str(raw.get("category", ""))
    reason = str(raw.get("reason", ""))
    if not category:  # earlier versions wrote only "category: detail"
        category, _, detail = reason.partition(": ")
        return Rejection(str(raw.get("client", "")), category, detail)
    prefix = f"{category}: "
    return Rejection(str(raw.get("client", "")), category, reason[len(prefix) :] if reason.startswith(prefix) else "")
