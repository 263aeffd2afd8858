"""Shamir sharing over GF(2^521 - 1): a hand-computed case, any t of n, t - 1 is not enough, hostile shares."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from fedge.secagg.errors import ShareError
from fedge.secagg.shamir import (
    PRIME,
    SHARE_BYTES,
    Share,
    combine,
    interpolate_at,
    interpolate_at_zero,
    share_from_bytes,
    share_value_to_bytes,
    split,
)

SECRET = bytes(range(32))
Seeded = Callable[[int], Callable[[int], bytes]]


def test_hand_computed_line() -> None:
    # f(x) = 7 + 3x: the one random coefficient is 3. Shares f(1) = 10, f(2) = 13, f(3) = 16.
    shares = split(b"\x07", 2, 3, rand_bytes=lambda n: (3).to_bytes(n, "big"))
    assert [(s.x, s.y) for s in shares] == [(1, 10), (2, 13), (3, 16)]
    # Lagrange at 0 from x = 2, 3: 13 * 3 / (3 - 2) + 16 * 2 / (2 - 3) = 39 - 32 = 7.
    assert combine([Share(2, 13), Share(3, 16)], 2, secret_len=1) == b"\x07"


def test_any_t_of_n_reconstruct(seeded: Seeded) -> None:
    shares = split(SECRET, 3, 6, rand_bytes=seeded(0))
    for subset in itertools.combinations(shares, 3):
        assert combine(list(subset), 3) == SECRET
    assert combine(shares, 3) == SECRET  # more than t: the first t are used


def test_shares_at_given_points(seeded: Seeded) -> None:
    shares = split(SECRET, 2, [5, 9, 42], rand_bytes=seeded(1))
    assert [s.x for s in shares] == [5, 9, 42]
    assert combine(shares[1:], 2) == SECRET


def test_t_minus_one_shares_do_not_give_the_secret(seeded: Seeded) -> None:
    shares = split(SECRET, 4, 7, rand_bytes=seeded(2))
    with pytest.raises(ShareError, match="cannot reconstruct"):
        combine(shares[:3], 4)
    # Interpolating through t - 1 points anyway yields some other field element.
    assert interpolate_at_zero(shares[:3]) != int.from_bytes(SECRET, "big")


def test_fresh_randomness_gives_fresh_shares(seeded: Seeded) -> None:
    a = split(SECRET, 3, 5, rand_bytes=seeded(3))
    b = split(SECRET, 3, 5, rand_bytes=seeded(4))
    assert all(x.y != y.y for x, y in zip(a, b, strict=True))


def test_refuses_repeated_points_and_bad_thresholds(seeded: Seeded) -> None:
    with pytest.raises(ShareError, match="distinct"):
        split(SECRET, 2, [1, 2, 2])
    with pytest.raises(ShareError, match="threshold"):
        split(SECRET, 4, 3)
    with pytest.raises(ShareError, match="outside"):
        split(SECRET, 1, [0, 1])
    shares = split(SECRET, 2, 3, rand_bytes=seeded(5))
    with pytest.raises(ShareError, match="repeated"):
        combine([shares[0], shares[0]], 2)


def test_refuses_values_outside_the_field() -> None:
    with pytest.raises(ShareError, match="outside the field"):
        Share(1, PRIME)
    with pytest.raises(ShareError, match="outside"):
        Share(0, 5)
    with pytest.raises(ShareError, match="outside the field"):
        share_from_bytes(1, b"\xff" * SHARE_BYTES)
    with pytest.raises(ShareError, match="66 bytes"):
        share_from_bytes(1, b"\x00" * 3)


def test_a_garbled_share_is_caught_by_the_width_check(seeded: Seeded) -> None:
    shares = split(SECRET, 3, 5, rand_bytes=seeded(6))
    garbled = Share(shares[0].x, int.from_bytes(seeded(60)(SHARE_BYTES), "big") % PRIME)
    with pytest.raises(ShareError, match="corrupt"):
        combine([garbled, *shares[1:3]], 3)


def test_a_shifted_share_shifts_the_secret_by_its_lagrange_weight() -> None:
    # Why the protocol checks a rebuilt key against its public key: a deliberate shift passes the width check.
    shares = split(b"\x00" * 32, 3, 3, rand_bytes=lambda n: (5).to_bytes(n, "big"))
    shifted = [Share(shares[0].x, shares[0].y + 1), *shares[1:]]
    # The weight of x = 1 among {1, 2, 3} at 0 is 2 * 3 / ((2 - 1) (3 - 1)) = 3.
    assert combine(shifted, 3) == (3).to_bytes(32, "big")


def test_a_share_shifted_to_move_the_secret_by_one_is_refused_given_one_more_share(seeded: Seeded) -> None:
    # The attack on a self-mask seed (no public key to check it by): shift one's share by the inverse of its Lagrange
    # weight, so the rebuilt seed is off by exactly 1 and still fits in 32 bytes; the masks then expand from a wrong
    # seed and the sum is garbage. With exactly t shares nothing can tell; one more honest share exposes it.
    shares = split(SECRET, 3, 5, rand_bytes=seeded(8))
    weight = 2 * 3 * pow((2 - 1) * (3 - 1), -1, PRIME) % PRIME  # of x = 1 among {1, 2, 3} at 0
    shifted = Share(shares[0].x, (shares[0].y + pow(weight, -1, PRIME)) % PRIME)
    moved = (int.from_bytes(SECRET, "big") + 1).to_bytes(32, "big")
    assert combine([shifted, *shares[1:3]], 3) == moved  # t shares: undetectable
    for extra in shares[3:]:
        with pytest.raises(ShareError, match=f"share at x = {extra.x} is off the polynomial"):
            combine([shifted, *shares[1:3], extra], 3)
    assert combine(shares, 3) == SECRET  # honest extra shares are all on it


def test_evaluation_matches_a_direct_polynomial() -> None:
    # f(x) = 7 + 5x + 3x^2: the batch-inverted Lagrange form gives f at 0 and at points beyond the shares.
    f = [7, 5, 3]
    shares = [Share(x, sum(c * x**k for k, c in enumerate(f)) % PRIME) for x in (2, 5, 9)]
    for at in (0, 1, 4, 5, 100, PRIME - 1):  # 5: one of the shares' own points
        assert interpolate_at(shares, at) == sum(c * pow(at, k, PRIME) for k, c in enumerate(f)) % PRIME


def test_share_bytes_round_trip(seeded: Seeded) -> None:
    share = split(SECRET, 2, 2, rand_bytes=seeded(7))[1]
    raw = share_value_to_bytes(share)
    assert len(raw) == SHARE_BYTES
    assert share_from_bytes(share.x, raw) == share
    assert "y=<" in repr(share) and str(share.y) not in repr(share)
