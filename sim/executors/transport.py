"""The transport that hands a round's client steps to an executor, and keeps a copy of the clients' stores."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from coordinator.replies import RoundContext, file_reply, judge_reply
from coordinator.transport import Exchange, ReplyCheck
from fedge.accounting.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.accounting.records import ClientTiming
from fedge.algorithms.base import RoundPlan
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.message import encode
from fedge.wire.protocol import error_message
from sim.executors.core import ClientExecutor, ClientJob, decode_state, encode_state

log = logging.getLogger(__name__)


class ExecutorTransport:
    """:class:`sim.inprocess.InProcessTransport` with the client steps handed to an executor: the same messages
    encoded, the same ledger entries in the same order, the same judging of replies.

    ``keep_stores``: keep a copy of every client's store here (:attr:`stores`, one dict per client, updated in place
    after each of its steps), for the run journal (pass ``stores=transport.stores``). What is in the copy before the
    first round (a resumed run's journal) is given to the workers, and so is a client's last state when a worker
    that held it died. Off, the clients' state lives only in the workers (memory for large FD/DS-FL runs).
    """

    def __init__(
        self,
        executor: ClientExecutor,
        clients: Iterable[ClientId],
        *,
        keep_stores: bool = True,
        declared: Mapping[ClientId, int] | None = None,
    ) -> None:
        self.executor = executor
        self.declared = dict(declared or {})  # each client's data size: the most num_examples it may report
        self._clients = sorted(clients)
        self._known = frozenset(self._clients)
        self.keep_stores = keep_stores
        self.stores: dict[ClientId, dict[str, torch.Tensor]] = {c: {} for c in self._clients} if keep_stores else {}
        self._changed: set[ClientId] = set()
        self._started = False

    def pop_changed(self) -> set[ClientId]:
        """The clients whose store copy changed since the last call (what the journal must write again)."""
        changed, self._changed = self._changed, set()
        return changed

    def available_clients(self) -> Sequence[ClientId]:
        return self._clients

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        out = Exchange()
        if not plan.tasks:
            return out
        self._restore_states()
        rnd = next(iter(plan.tasks.values())).round
        ctx = RoundContext(
            rnd, frozenset(plan.tasks), check, known=lambda c: c in self._known, declared=self.declared.get
        )
        blob = None
        if plan.broadcast is not None:
            blob = encode(plan.broadcast)
            out.entries.append(LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, len(blob), len(plan.tasks)))
        ordered = sorted(plan.tasks.items())
        jobs = [ClientJob(client_id, encode(task), blob, self.keep_stores) for client_id, task in ordered]
        # One result at a time: a 1,000-client round would otherwise hold every client's returned store at once.
        for (client_id, task), job, result in zip(ordered, jobs, self.executor.stream(jobs), strict=True):
            out.entries.append(LedgerEntry.of(task, "down", client_id, len(job.task), 1))
            if result.state is not None and client_id in self.stores:
                store = self.stores[client_id]
                store.clear()
                store.update(decode_state(result.state))
                self._changed.add(client_id)
            reply_blob = result.reply
            if reply_blob is None:  # crashed or lost: recorded like a client that reported its failure
                reply_blob = encode(error_message(task, printable(result.error or "no reply")))
            timing = ClientTiming(client_id, result.compute_s, result.compute_s, result.cpu_s)
            judged = judge_reply(reply_blob, client_id, ctx)
            file_reply(out, rnd, client_id, judged, timing, payload_bytes=len(reply_blob))
        return out

    def _restore_states(self) -> None:
        """Before the first round, the copies a journal restored; later, those of clients a dead worker held."""
        lost = self.executor.drain_lost_state()
        if not self.keep_stores:
            return
        wanted = self._clients if not self._started else lost
        self._started = True
        states = {c: encode_state(self.stores[c]) for c in wanted if self.stores.get(c)}
        if states:
            log.info("giving %d client(s) their stored state: %s", len(states), sorted(states)[:10])
            self.executor.load_states(states)
