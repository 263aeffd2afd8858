"""The interface between the round engine and whatever carries its messages (in-process calls or MQTT)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fedge.accounting.ledger import LedgerEntry
from fedge.accounting.records import ClientTiming, Drop, Rejection
from fedge.algorithms.base import CheckedReply, RoundPlan
from fedge.types import ClientId
from fedge.wire.message import Message

ReplyCheck = Callable[[ClientId, Message], CheckedReply]
"""The strategy's rules for a reply of this round (:meth:`fedge.algorithms.base.Strategy.accept`): its report and the
update to aggregate; raises fedge.errors.CodecError when it must be rejected."""


@dataclass
class Exchange:
    """Everything one round's communication produced: the valid replies, every message counted, every client that
    dropped out and every message refused, with reasons, and the replies' timings."""

    replies: dict[ClientId, CheckedReply] = field(default_factory=dict)  # accepted: as the strategy aggregates them
    entries: list[LedgerEntry] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)  # sampled, but no valid reply before the deadline
    rejections: list[Rejection] = field(default_factory=list)
    timings: list[ClientTiming] = field(default_factory=list)
    added: list[ClientId] = field(default_factory=list)  # latecomers given a task in the round (RoundPlan.late_task)

    @property
    def dropped(self) -> list[ClientId]:
        return [d.client for d in self.drops]


class Transport(Protocol):
    """Delivers a round's plan to clients and collects their replies."""

    def available_clients(self) -> Sequence[ClientId]:
        """Clients that can be sampled now, sorted."""
        ...

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        """Send the broadcast and tasks of ``plan``; return what came back, with every message counted."""
        ...
