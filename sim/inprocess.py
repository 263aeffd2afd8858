"""The in-process transport: every message is really encoded and decoded, so its payload bytes are real."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.transport import Exchange, Rejection, ReplyCheck
from edge_client.client import EdgeClient
from fedge.algorithms.base import RoundPlan
from fedge.errors import CodecError, ConfigError
from fedge.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.messages import Message, decode, encode
from fedge.types import ClientId


class InProcessTransport:
    """Calls :class:`EdgeClient` objects directly, one after the other."""

    def __init__(self, clients: Sequence[EdgeClient]) -> None:
        self.clients = {c.client_id: c for c in clients}

    def available_clients(self) -> Sequence[ClientId]:
        return sorted(self.clients)

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        out = Exchange()
        broadcast: Message | None = None
        if plan.broadcast is not None:
            blob = encode(plan.broadcast)
            broadcast = decode(blob)
            out.entries.append(LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, len(blob), len(plan.tasks)))
        for client_id, task in sorted(plan.tasks.items()):
            task_blob = encode(task)
            out.entries.append(LedgerEntry.of(task, "down", client_id, len(task_blob), 1))
            try:
                reply = self.clients[client_id].handle(decode(task_blob), broadcast)
            except (CodecError, ConfigError) as exc:  # a client that cannot do its task drops out of the round
                out.rejected.append(Rejection(client_id, f"client failed: {exc}"))
                out.dropped.append(client_id)
                continue
            reply_blob = encode(reply)
            out.entries.append(LedgerEntry.of(reply, "up", client_id, len(reply_blob), 1))
            try:
                received = decode(reply_blob)
                check(client_id, received)
            except CodecError as exc:
                out.rejected.append(Rejection(client_id, str(exc)))
                out.dropped.append(client_id)
                continue
            out.replies[client_id] = received
        return out
