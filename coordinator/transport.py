"""The interface between the round engine and whatever carries its messages (in-process calls or MQTT)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fedge.algorithms.base import RoundPlan
from fedge.ledger import LedgerEntry
from fedge.messages import Message
from fedge.types import ClientId

ReplyCheck = Callable[[ClientId, Message], None]
"""Raises fedge.errors.CodecError when a reply must be rejected."""


@dataclass(frozen=True)
class Rejection:
    """A message the coordinator refused, and why."""

    client: str
    reason: str


@dataclass
class Exchange:
    """What came back from one round's communication."""

    replies: dict[ClientId, Message] = field(default_factory=dict)
    entries: list[LedgerEntry] = field(default_factory=list)
    dropped: list[ClientId] = field(default_factory=list)  # sampled, but no valid reply before the deadline
    rejected: list[Rejection] = field(default_factory=list)


class Transport(Protocol):
    """Delivers a round's plan to clients and collects their replies."""

    def available_clients(self) -> Sequence[ClientId]:
        """Clients that can be sampled now, sorted."""
        ...

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        """Send the broadcast and tasks of ``plan``; return the valid replies, with every message counted."""
        ...
