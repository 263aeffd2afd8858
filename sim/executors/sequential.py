"""The reference executor: every client in this process, one after another."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from fedge.errors import ConfigError
from fedge.types import ClientId
from sim.executors.core import (
    ClientBuilder,
    ClientFactory,
    ClientJob,
    ClientResult,
    ExecutorBase,
    SimClient,
    check_threads,
    check_unique,
)
from sim.executors.host import ClientHost


class SequentialExecutor(ExecutorBase):
    """Every client in this process, one after the other, with ``threads_per_worker`` intra-op threads (the
    reference; the thread count is restored after each round, so the coordinator's own work keeps its threads)."""

    name = "sequential"
    workers = 1

    def __init__(
        self,
        factory: ClientFactory | None = None,
        *,
        clients: Mapping[ClientId, SimClient] | Iterable[SimClient] | None = None,
        threads_per_worker: int = 1,
    ) -> None:
        if factory is None and clients is None:
            raise ConfigError("the sequential executor needs clients or a client factory")
        check_threads(threads_per_worker)
        self.threads = threads_per_worker
        built = dict(clients.items()) if isinstance(clients, Mapping) else {c.client_id: c for c in clients or ()}
        self._factory = factory
        self._builder: ClientBuilder | None = None
        self._host = ClientHost(self._build, built)
        self._batch = 0

    def _build(self, client_id: ClientId) -> SimClient:
        """A client not given at construction, from the factory (called on first need: given clients need none)."""
        if self._factory is None:
            raise ConfigError(f"{client_id!r} is not a client of this executor")
        if self._builder is None:
            self._builder = self._factory()
        return self._builder(client_id)

    def load_states(self, states: Mapping[ClientId, bytes]) -> None:
        for client_id, blob in states.items():
            self._host.load_state(client_id, blob)

    def drain_lost_state(self) -> list[ClientId]:
        return []  # nothing is ever lost in this process

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        check_unique(jobs)
        self._batch += 1
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            # id() of a blob is a fine key within one batch: every job holds a reference to it until the batch ends.
            return [self._host.run(job, (self._batch, id(job.broadcast)))[0] for job in jobs]
        finally:
            torch.set_num_threads(previous)

    def stream(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        """One client at a time: each result is handed over before the next client runs."""
        check_unique(jobs)
        self._batch += 1
        batch = self._batch
        for job in jobs:
            previous = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                result = self._host.run(job, (batch, id(job.broadcast)))[0]
            finally:
                torch.set_num_threads(previous)
            yield result
