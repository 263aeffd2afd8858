"""The in-process transport: every message is really encoded and decoded, so its payload bytes are real."""

from __future__ import annotations

import time
from collections.abc import Sequence

from coordinator.replies import RoundContext, file_reply, judge_reply
from coordinator.transport import Exchange, ReplyCheck
from edge_client.client import EdgeClient
from fedge.accounting.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.accounting.records import ClientTiming
from fedge.algorithms.base import RoundPlan
from fedge.errors import CodecError, ConfigError
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.message import Message, decode, encode
from fedge.wire.protocol import error_message


class InProcessTransport:
    """Calls :class:`EdgeClient` objects directly, one after the other."""

    def __init__(self, clients: Sequence[EdgeClient]) -> None:
        self.clients = {c.client_id: c for c in clients}

    def available_clients(self) -> Sequence[ClientId]:
        return sorted(self.clients)

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        out = Exchange()
        if not plan.tasks:
            return out
        rnd = next(iter(plan.tasks.values())).round
        ctx = RoundContext(
            rnd,
            frozenset(plan.tasks),
            check,
            known=lambda c: c in self.clients,
            declared=lambda c: len(self.clients[c].data),
        )
        broadcast: Message | None = None
        if plan.broadcast is not None:
            blob = encode(plan.broadcast)
            broadcast = decode(blob)
            out.entries.append(LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, len(blob), len(plan.tasks)))
        for client_id, task in sorted(plan.tasks.items()):
            task_blob = encode(task)
            out.entries.append(LedgerEntry.of(task, "down", client_id, len(task_blob), 1))
            started = time.perf_counter()
            received = decode(task_blob)
            try:
                reply = self.clients[client_id].handle(received, broadcast)
            except (CodecError, ConfigError, ValueError) as exc:  # a client that cannot do its task says why
                reply = error_message(received, printable(str(exc)))
            compute = time.perf_counter() - started
            reply_blob = encode(reply)
            timing = ClientTiming(client_id, time.perf_counter() - started, compute, compute)
            judged = judge_reply(reply_blob, client_id, ctx)
            file_reply(out, rnd, client_id, judged, timing, payload_bytes=len(reply_blob))
        return out
