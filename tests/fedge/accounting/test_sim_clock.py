"""The simulated round: two clients with known bytes, speeds and links, computed by hand."""

import pytest

from fedge.accounting.ledger import LedgerEntry
from fedge.accounting.sim_clock import client_time, round_time, time_to
from fedge.profiles import ClientProfile, Link, generate_profiles, parse_profiles

LINK = Link(up_bps=1e6, down_bps=10e6, latency_s=0.05)


def _entries(rnd: int = 3) -> list[LedgerEntry]:
    def e(direction: str, client: str, payload: int) -> LedgerEntry:
        return LedgerEntry(rnd, direction, client, "x", 2 if client == "*" else 1, payload, payload)  # type: ignore[arg-type]

    return [
        e("down", "*", 1_000_000),  # the broadcast reaches both
        e("down", "a", 1_000),
        e("down", "b", 1_000),
        e("up", "a", 500_000),
        e("up", "b", 250_000),
        LedgerEntry(rnd + 1, "up", "a", "x", 1, 9_999_999, 9_999_999),  # another round's: not counted
    ]


def test_a_hand_computed_round():
    profiles = {"a": ClientProfile(0.001, LINK), "b": ClientProfile(0.01, Link(2e6, 10e6, 0.1))}
    samples = {"a": 100, "b": 50}
    t = round_time(3, _entries(), ["a", "b"], profiles, samples, local_epochs=2)
    a, b = t.clients
    # a: 8 * 1,001,000 B / 10 Mbit/s + 100 x 2 x 1 ms + 8 * 500,000 B / 1 Mbit/s + 3 messages x 50 ms
    assert (a.down_s, a.compute_s, a.up_s, a.latency_s) == pytest.approx((0.8008, 0.2, 4.0, 0.15), abs=1e-12)
    assert a.total_s == pytest.approx(5.1508, abs=1e-12)
    # b: 0.8008 + 50 x 2 x 10 ms + 8 * 250,000 B / 2 Mbit/s + 3 x 100 ms
    assert b.total_s == pytest.approx(0.8008 + 1.0 + 1.0 + 0.3, abs=1e-12)
    assert t.seconds == pytest.approx(5.1508, abs=1e-12)  # the slowest reply: a's upload
    assert t.late == ()


def test_only_replies_count_and_a_deadline_drops_the_late():
    profiles = {"a": ClientProfile(0.001, LINK), "b": ClientProfile(0.01, LINK)}
    samples = {"a": 100, "b": 50}
    only_b = round_time(3, _entries(), ["b"], profiles, samples, local_epochs=2)
    assert only_b.seconds == pytest.approx(0.8008 + 1.0 + 2.0 + 0.15, abs=1e-12)
    late = round_time(3, _entries(), ["a", "b"], profiles, samples, local_epochs=2, deadline_s=5.0, wait_s=2.0)
    assert late.late == ("a",) and late.seconds == 7.0  # waited 2 s for an available client, then the deadline


def test_a_slow_tail_sets_the_round():
    clients = [f"c{i}" for i in range(10)]
    entries = [LedgerEntry(1, "up", c, "x", 1, 1000, 1000) for c in clients]
    samples = dict.fromkeys(clients, 100)
    uniform = generate_profiles(parse_profiles("uniform"), clients, LINK, 0.001, seed=0)
    tail = generate_profiles(parse_profiles("tail:fraction=0.1,slowdown=10"), clients, LINK, 0.001, seed=0)
    fast = round_time(1, entries, clients, uniform, samples, local_epochs=1)
    slow = round_time(1, entries, clients, tail, samples, local_epochs=1)
    assert fast.seconds == pytest.approx(0.008 + 0.1 + 0.05)
    assert slow.seconds == pytest.approx(0.008 + 1.0 + 0.05)  # one client 10x slower: the round waits for it
    assert client_time("c0", entries, uniform["c0"], 100, 1).compute_s == pytest.approx(0.1)


def test_time_to_is_the_clock_at_the_first_round_that_reaches_the_accuracy():
    assert time_to([0.3, 0.85, 0.8, 0.92], [10.0, 20.0, 30.0, 40.0], 0.8) == 20.0
    assert time_to([0.3, 0.85], [10.0, 20.0], 0.9) is None
    with pytest.raises(ValueError, match="2 accuracies but 1"):
        time_to([0.1, 0.2], [1.0], 0.5)
