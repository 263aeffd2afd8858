"""The round's communication graph: who shares secrets with whom, from a public seed every party holds.

SecAgg+ (Bell et al. 2020, Sections 3-4) replaces SecAgg's complete graph (Bonawitz et al. 2017) by a sparse random
graph of degree k = O(log N): a client masks against and secret-shares with its k neighbours only, so its work and
bytes grow with log N instead of N. The graph here is the Harary graph H_{k,N} (every node joined to its k // 2
nearest nodes on each side of a ring, plus the node opposite when k is odd) laid on a random ring order of the
clients. Why this graph rather than a random-pairing regular graph: it is exactly k-regular (one node has degree
k + 1 when N and k are both odd), k-connected, built in O(N k) with no retries, and under a uniformly random ring
order each client's neighbourhood is a uniformly random set of other clients, which is what the analysis needs.

The ring order sorts clients by SHA-256(seed || id), not by a numpy generator: the graph must come out identical on
every device of a round, and hashlib is stable across platforms and library versions where numpy's generator
methods are not promised to be. The graph is public (the seed travels in the clear), so nothing here is secret.

Defaults: k = min(N - 1, 2 ceil(log2 N) + 1) (so small cohorts get the complete graph) and threshold
t = floor(k / 2) + 1 > k / 2, which Bell et al. require against a server that lies about who dropped: two disjoint
groups of neighbours can never both reach t. With t > k / 2 a secret is recoverable only while more than half of
its holders survive, so the dropout rate such a graph tolerates is well below 1/2; :func:`recovery_risk` estimates
the chance that a round is abandoned, so a configuration can be checked before it runs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fedge.secagg.errors import SecAggConfigError

if TYPE_CHECKING:
    from fedge.types import ClientId  # annotations only: fedge.types imports torch

Graph = dict[str, tuple[str, ...]]
"""Each client's neighbours, sorted."""


def default_degree(n: int) -> int:
    """SecAgg+'s degree for ``n`` clients: min(n - 1, 2 ceil(log2 n) + 1)."""
    if n < 2:
        raise SecAggConfigError(f"secure aggregation needs at least 2 clients, got {n}")
    return min(n - 1, 2 * math.ceil(math.log2(n)) + 1)


def default_threshold(degree: int) -> int:
    """floor(degree / 2) + 1: a strict majority of a client's neighbours."""
    if degree < 1:
        raise SecAggConfigError(f"the degree must be >= 1, got {degree}")
    return degree // 2 + 1


def ring_order(ids: Sequence[ClientId], seed: bytes) -> list[ClientId]:
    """``ids`` in the seed's random ring order: sorted by SHA-256(seed || 0 || id)."""
    if len(set(ids)) != len(ids):
        raise SecAggConfigError("client ids must be distinct")
    return sorted(ids, key=lambda c: hashlib.sha256(seed + b"\x00" + c.encode("utf-8")).digest())


def neighbour_graph(ids: Sequence[ClientId], seed: bytes, degree: int | None = None) -> Graph:
    """The Harary graph H_{degree,N} over ``ids`` in the seed's ring order; ``degree`` defaults to
    :func:`default_degree`. Symmetric: v is a neighbour of u exactly when u is one of v."""
    n = len(ids)
    k = default_degree(n) if degree is None else degree
    if not 1 <= k <= n - 1:
        raise SecAggConfigError(f"the degree must lie in [1, {n - 1}] for {n} clients, got {k}")
    order = ring_order(ids, seed)
    adjacent: list[set[int]] = [set() for _ in range(n)]

    def join(i: int, j: int) -> None:
        adjacent[i % n].add(j % n)
        adjacent[j % n].add(i % n)

    for i in range(n):
        for offset in range(1, k // 2 + 1):  # k // 2 < n / 2, so i - offset and i + offset differ
            join(i, i + offset)
    if k % 2:
        if n % 2 == 0:
            for i in range(n // 2):  # the node opposite
                join(i, i + n // 2)
        else:
            for i in range((n + 1) // 2):  # near-opposite; node 0 is joined twice: degree k + 1
                join(i, i + (n + 1) // 2)
    return {order[i]: tuple(sorted(order[j] for j in adjacent[i])) for i in range(n)}


def recovery_risk(n: int, degree: int, threshold: int, dropout: float) -> float:
    """An upper bound on the chance a round of ``n`` clients is abandoned when each drops independently with
    probability ``dropout`` before unmasking: n P[Binomial(degree, 1 - dropout) < threshold] (a union bound over
    the n secrets the server may need, each held by ``degree`` neighbours)."""
    if not 0 <= dropout <= 1:
        raise SecAggConfigError(f"dropout must lie in [0, 1], got {dropout}")
    if not 1 <= threshold <= degree:
        raise SecAggConfigError(f"the threshold must lie in [1, {degree}], got {threshold}")
    p = 1.0 - dropout
    below = sum(math.comb(degree, i) * p**i * (1 - p) ** (degree - i) for i in range(threshold))
    return min(1.0, n * below)
