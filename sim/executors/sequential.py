"""The reference executor: every client in this process, one after another."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from sim.executors.core import ClientJob, ClientResult, check_unique
from sim.executors.host import LocalExecutor


class SequentialExecutor(LocalExecutor):
    """Every client in this process, one after the other, with ``threads_per_worker`` intra-op threads (the
    reference; the thread count is restored after each round, so the coordinator's own work keeps its threads)."""

    name = "sequential"

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
