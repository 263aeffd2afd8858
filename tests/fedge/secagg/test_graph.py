"""The neighbour graph: SecAgg+ defaults, regularity, symmetry, determinism from the public seed."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from fedge.secagg.errors import SecAggConfigError
from fedge.secagg.graph import default_degree, default_threshold, neighbour_graph, recovery_risk


def _ids(n: int) -> list[str]:
    return [f"c{i:04d}" for i in range(n)]


def test_defaults() -> None:
    assert [default_degree(n) for n in (2, 3, 10, 11, 100, 1000)] == [1, 2, 9, 9, 15, 21]
    assert [default_threshold(k) for k in (1, 2, 9, 15, 21)] == [1, 2, 5, 8, 11]
    with pytest.raises(SecAggConfigError):
        default_degree(1)


@pytest.mark.parametrize(("n", "k"), [(10, None), (100, None), (1000, None), (101, 15), (12, 5), (7, 6), (2, 1)])
def test_regular_symmetric_and_simple(n: int, k: int | None) -> None:
    graph = neighbour_graph(_ids(n), b"\x01" * 32, k)
    degree = default_degree(n) if k is None else k
    assert set(graph) == set(_ids(n))
    for u, peers in graph.items():
        assert u not in peers and len(set(peers)) == len(peers) and list(peers) == sorted(peers)
        assert all(u in graph[v] for v in peers)
    degrees = Counter(len(p) for p in graph.values())
    if n * degree % 2 == 0:
        assert degrees == {degree: n}
    else:  # n and k odd: exactly one node has one more
        assert degrees == {degree: n - 1, degree + 1: 1}


def test_small_cohorts_get_the_complete_graph() -> None:
    graph = neighbour_graph(_ids(10), b"\x02" * 32)
    assert all(len(p) == 9 for p in graph.values())


def test_deterministic_from_the_seed_and_ids_only() -> None:
    ids = _ids(200)
    a = neighbour_graph(ids, b"\x03" * 32)
    assert a == neighbour_graph(list(reversed(ids)), b"\x03" * 32)
    assert a != neighbour_graph(ids, b"\x04" * 32)


def test_neighbourhoods_are_spread_over_the_cohort() -> None:
    # A random ring order, not the id order: neighbours of c0000 are not mostly c0001, c0002, ...
    graph = neighbour_graph(_ids(1000), b"\x05" * 32)
    assert max(int(v[1:]) for v in graph["c0000"]) > 100


def test_recovery_risk() -> None:
    assert recovery_risk(1, 1, 1, 0.5) == pytest.approx(0.5)
    # 3 holders, 2 needed, each survives with 0.9: P(fewer than 2) = 0.1^3 + 3 * 0.9 * 0.1^2 = 0.028.
    assert recovery_risk(1, 3, 2, 0.1) == pytest.approx(0.028)
    # SecAgg+'s defaults at N = 1000 tolerate 10% dropouts, not 30% (t > k/2 needs more than half to survive).
    k = default_degree(1000)
    assert recovery_risk(1000, k, default_threshold(k), 0.1) < 0.01
    assert recovery_risk(1000, k, default_threshold(k), 0.3) == 1.0
    assert math.isclose(recovery_risk(10, 9, 5, 0.0), 0.0)


def test_refuses_bad_degrees() -> None:
    with pytest.raises(SecAggConfigError, match="degree"):
        neighbour_graph(_ids(5), bytes(32), 5)
    with pytest.raises(SecAggConfigError, match="distinct"):
        neighbour_graph(["a", "a", "b"], bytes(32))
