"""Which worker runs which client, for the executors with several workers (processes, Ray)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from fedge.types import ClientId
from sim.executors.core import ClientJob, ClientResult


class Assignment:
    """Which worker runs which client: a client with state stays where its state is; the others balance the load.

    The load of a client is its last measured compute time (unknown ones count as the median), and free clients go,
    longest first, to the least loaded worker (LPT). Where a client runs never changes its result, only the speed.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.owner: dict[ClientId, int] = {}
        self.cost: dict[ClientId, float] = {}

    def plan(self, jobs: Sequence[ClientJob]) -> list[list[int]]:
        """Job indices per worker, each list in the round's order."""
        typical = statistics.median(self.cost.values()) if self.cost else 1.0
        load = [0.0] * self.workers
        plan: list[list[int]] = [[] for _ in range(self.workers)]
        free = []
        for i, job in enumerate(jobs):
            owner = self.owner.get(job.client_id)
            if owner is None:
                free.append(i)
            else:
                plan[owner].append(i)
                load[owner] += self.cost.get(job.client_id, typical)
        free.sort(key=lambda i: (-self.cost.get(jobs[i].client_id, typical), jobs[i].client_id))
        for i in free:
            w = min(range(self.workers), key=lambda w: (load[w], w))
            plan[w].append(i)
            load[w] += self.cost.get(jobs[i].client_id, typical)
        return [sorted(p) for p in plan]

    def observe(self, worker: int, result: ClientResult, stateful: bool) -> None:
        if result.error is None and math.isfinite(result.compute_s):
            self.cost[result.client_id] = result.compute_s
        if stateful:
            self.owner[result.client_id] = worker

    def place(self, clients: Iterable[ClientId]) -> dict[ClientId, int]:
        """Pin ``clients`` (given state from outside) to the workers holding the fewest pinned clients."""
        counts = [0] * self.workers
        for w in self.owner.values():
            counts[w] += 1
        placed = {}
        for client in sorted(clients):
            if client not in self.owner:
                self.owner[client] = min(range(self.workers), key=lambda w: (counts[w], w))
                counts[self.owner[client]] += 1
            placed[client] = self.owner[client]
        return placed

    def forget_worker(self, worker: int) -> list[ClientId]:
        """Unpin the clients whose state lived in ``worker``; returns them, sorted."""
        lost = sorted(c for c, w in self.owner.items() if w == worker)
        for c in lost:
            del self.owner[c]
        return lost
